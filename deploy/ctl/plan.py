"""What start.sh and stop.sh do, as a list of steps: printed by --dry-run, run in order otherwise.

A step is a check (Python, may report several problems), a command on a machine (here or through ssh), or a
probe of the running stack. The container launchers (docker or podman, deploy/ctl/engines.py) run
deploy/compose/worker.yml once per rank that is not on the head, on the machine that holds it, then head.yml here;
native mode runs `twinspark up` here (one machine only).
"""

from __future__ import annotations

import hashlib
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from deploy.ctl import checks, engines, probe
from deploy.ctl.engines import Engine
from deploy.ctl.settings import DEPLOY, REPO, SECRETS, Machine, Settings, serving
from services.common.flags import to_env

COMPOSE_DIR = DEPLOY / "compose"
HEAD = COMPOSE_DIR / "head.yml"
WORKER = COMPOSE_DIR / "worker.yml"
# RDMA devices and rlimits for NCCL over RoCE, on top of each file when DEVICE=cuda.
RDMA = {HEAD: COMPOSE_DIR / "rdma-head.yml", WORKER: COMPOSE_DIR / "rdma-worker.yml"}
WHEELS_DIR = DEPLOY / "wheels"
HEAD_PROJECT = "twinspark"
JAEGER_PORTS = {"jaeger otlp grpc": 4317, "jaeger otlp http": 4318, "jaeger ui": 16686}
_VAR = re.compile(r"\$\{(\w+)")
_LOOPBACK_URL = re.compile(r"//(127\.0\.0\.1|localhost|\[::1\])")


def compose_variables(*files: Path) -> list[str]:
    """Every variable the compose files interpolate, in first-use order."""
    seen: dict[str, None] = {}
    for f in files:
        for name in _VAR.findall(f.read_text()):
            seen.setdefault(name)
    return list(seen)


def rank_project(rank: int) -> str:
    return f"twinspark-rank{rank}"


@dataclass
class Step:
    title: str
    machine: Machine | None = None  # where `argv` runs
    argv: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)  # step-specific variables on top of the settings
    cwd: str = ""  # remote working directory (a worker's checkout)
    check: Callable[[], list[str]] | None = None  # a check: returns the problems it found
    action: Callable[[], None] | None = None  # a probe of the running stack (raises on failure)
    fatal: bool = False  # a check whose problem ends the run at once: nothing after it could work

    def show(self) -> str:
        if self.argv is None:
            return self.title
        cmd = shlex.join(self.argv)
        if self.env:
            cmd = "env " + show_env(self.env) + " " + cmd
        where = self.machine.name if self.machine is not None else "head"
        if self.cwd:
            cmd = f"cd {shlex.quote(self.cwd)} && {cmd}"
        return f"{self.title}\n      [{where}] $ {cmd}"


def show_env(env: dict[str, str]) -> str:
    """K=V pairs for the eye, secrets masked (a setting in SECRETS, also under its TWINSPARK_ name)."""
    def secret(k: str) -> bool:
        return k.removeprefix("TWINSPARK_") in SECRETS
    return " ".join(f"{k}={'***' if secret(k) and v else shlex.quote(v)}" for k, v in env.items())


def endpoint(s: Settings) -> str:
    host = s["HOST"]
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{s['PORT']}"


def _compose(s: Settings, engine: Engine, project: str, file: Path, m: Machine, *args: str) -> list[str]:
    files = [file, RDMA[file]] if s["DEVICE"] == "cuda" else [file]
    paths = [a for f in files for a in ("-f", str(f.relative_to(REPO)) if m.ssh is not None else str(f))]
    profiles = []
    if file == HEAD:
        if s["DRAFTER"] != "none":
            profiles += ["--profile", "drafter"]
        if s["OTEL_EXPORTER_OTLP_ENDPOINT"]:
            profiles += ["--profile", "jaeger"]
    compose = engine.compose if m.ssh is None else engine.worker_compose()
    return [*compose, "-p", project, *paths, *profiles, *args]


def _rank_env(s: Settings, m: Machine, rank: int) -> dict[str, str]:
    env = {"RANK": str(rank), "RANK_PORT_OF_RANK": str(s.rank_port(rank))}
    otel = s["OTEL_EXPORTER_OTLP_ENDPOINT"]
    if m.ssh is not None and _LOOPBACK_URL.search(otel):
        # Jaeger runs on the head: a worker's loopback is the wrong machine; MASTER_ADDR reaches the head.
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = _LOOPBACK_URL.sub(f"//{s['MASTER_ADDR']}", otel)
    return env


def _rank_units(s: Settings) -> list[tuple[Machine, int]]:
    """worker.yml instances: every rank but 0, workers first (they wait for rank 0 at the rendezvous)."""
    units = [(m, r) for m in s.workers for r in m.ranks]
    return units + [(s.machines[0], r) for r in s.machines[0].ranks if r != 0]


def _head_ports(s: Settings, containers: bool) -> dict[str, int]:
    ports = {"PORT (gateway)": s.int("PORT")}
    if containers:
        ports |= {"SCHEDULER_PORT": s.int("SCHEDULER_PORT"), "MASTER_PORT": s.int("MASTER_PORT"),
                  "PEER_PORT": s.int("PEER_PORT")}
        ports |= {f"rank {r}": s.rank_port(r) for r in s.machines[0].ranks}
        if s["DRAFTER"] != "none":
            ports["DRAFTER_PORT"] = s.int("DRAFTER_PORT")
        if s["OTEL_EXPORTER_OTLP_ENDPOINT"]:
            ports |= JAEGER_PORTS
    return ports


def _checks(s: Settings, engine: Engine | None) -> list[Step]:
    """engine None: the native launcher."""
    head = s.machines[0]
    python, ports = native_python(s), _head_ports(s, engine is not None)
    steps = [Step(f"check {engine.name}, its compose command and the engine on head",
                  check=lambda: engines.problems(engine)) if engine is not None else
             python_check(python),
             Step(f"check ports on head: {', '.join(map(str, ports.values()))}",
                  check=lambda: checks.ports_problems(head, ports))]
    for m in s.workers:
        assert engine is not None  # start_native refuses workers before it asks for checks
        compose = engine.worker_compose()
        steps.append(Step(f"check {m.name}: ssh, {' '.join(compose)}, the checkpoint, MASTER_ADDR {s['MASTER_ADDR']}",
                          check=lambda m=m: checks.worker_problems(s, m, compose)))
        mine = {f"rank {r}": s.rank_port(r) for r in m.ranks}
        steps.append(Step(f"check ports on {m.name}: {', '.join(map(str, mine.values()))}",
                          check=lambda m=m, mine=mine: checks.ports_problems(m, mine)))
    for m in s.machines:
        steps.append(Step(f"check memory on {m.name} for ranks {list(m.ranks)}",
                          check=lambda m=m: checks.memory_problems(s, m)))
    return steps


def python_check(python: str) -> Step:
    return Step(f"check that {python} can run twinspark (imports it and its dependencies)",
                check=lambda: checks.python_problems(python), fatal=True)


def _finish(s: Settings) -> list[Step]:
    base = endpoint(s)
    return [
        Step(f"wait for {base}/health (up to {s['HEALTH_TIMEOUT']} s)",
             action=lambda: probe.wait_healthy(base, float(s["HEALTH_TIMEOUT"]))),
        Step(f"smoke test: greedy {probe.SMOKE_PROMPT!r} through every rank (fails on an empty or one-character reply)",
             action=lambda: _smoke(base, probe.plain_key(s["API_KEY"]))),
    ]


def _smoke(base: str, key: str | None) -> None:
    if key is None:
        print("  skipped: API_KEY lists only sha256 digests, so there is no key to send")
        return
    print(f"  reply: {probe.smoke_test(base, key)!r}")


def tiny_model_path(s: Settings) -> str:
    return str(s.state_dir / "tiny-default")


def use_tiny_model(s: Settings) -> str:
    """MODEL empty: the tiny checkpoint, whose path the compose files need (they mount MODEL; compose_env reads it
    after the steps are made)."""
    s.values["MODEL"] = tiny_model_path(s)
    return s["MODEL"]


def wheels_download(s: Settings) -> list[str]:
    """WHEELS=host: this machine's pip (the native launcher's Python) fetches what the CPU image installs, as the
    quick start here would get it: torch's CPU build, twinspark's dependencies, and setuptools to build twinspark."""
    return [native_python(s), "-m", "pip", "download", "-qq", "--dest", str(WHEELS_DIR), "torch==2.13.0", str(REPO),
            "setuptools>=68", "wheel"]


def _download_wheels(argv: list[str]) -> None:
    """Run the download unless the stamp says it ran for this pyproject.toml and command: the wheels then are what
    pip got that time (a lock of sorts: a new release of a dependency comes in with the next pyproject change)."""
    stamp = WHEELS_DIR / ".downloaded"
    key = hashlib.sha256((REPO / "pyproject.toml").read_bytes() + shlex.join(argv).encode()).hexdigest()
    if stamp.is_file() and stamp.read_text() == key:
        print("  the wheels are there for this pyproject.toml")
        return
    if subprocess.run(argv).returncode != 0:
        raise RuntimeError(f"the wheels' download failed: {shlex.join(argv)}")
    stamp.write_text(key)


def start_containers(s: Settings, engine: Engine) -> list[Step]:
    steps = _checks(s, engine)
    dockerfile = "deploy/Dockerfile" if s["DEVICE"] == "cuda" else "deploy/Dockerfile.cpu"
    if s["WHEELS"] == "host" and s["DEVICE"] != "cuda":
        argv = wheels_download(s)
        steps.append(Step(f"download the CPU image's wheels into {WHEELS_DIR} with this machine's pip, unless "
                          f"pyproject.toml is as at the last download: {shlex.join(argv)}",
                          action=lambda: _download_wheels(argv)))
    for m in s.workers:
        steps.append(Step(f"copy this checkout to {m.name}:{s['WORKER_DIR']}",
                          argv=["rsync", "-a", "--delete", "--exclude=.git", f"--exclude=/{s['STATE_DIR']}",
                                f"{REPO}/", f"{m.ssh}:{s['WORKER_DIR']}/"]))
    build_args = {"BASE_IMAGE": s["BASE_IMAGE"]} if s["BASE_IMAGE"] else {}
    for m in s.machines:
        cwd = s["WORKER_DIR"] if m.ssh else ""
        steps.append(Step(f"build the image {s['IMAGE']} on {m.name} (the layer cache keeps an unchanged checkout's "
                          "build to seconds)", machine=m, cwd=cwd,
                          argv=engine.build(dockerfile, s["IMAGE"], build_args)))
    if not s["MODEL"]:
        model = use_tiny_model(s)
        for m in s.machines:
            steps.append(Step(f"make the tiny demo checkpoint on {m.name} unless it is there", machine=m,
                              argv=["sh", "-c", f"test -f {model}/config.json || {{ mkdir -p {s.state_dir} && "
                                    f"{engine.name} run --rm -v {s.state_dir}:{s.state_dir} "
                                    f"{shlex.quote(s['IMAGE'])} twinspark make-tiny --out {model}; }}"]))
    for m, r in _rank_units(s):
        steps.append(Step(f"start rank {r} on {m.name}", machine=m, cwd=s["WORKER_DIR"] if m.ssh else "",
                          env=_rank_env(s, m, r), argv=_compose(s, engine, rank_project(r), WORKER, m, "up", "-d")))
    roles = ["gateway", "scheduler", "rank 0"] + (["drafter"] if s["DRAFTER"] != "none" else []) + \
        (["Jaeger"] if s["OTEL_EXPORTER_OTLP_ENDPOINT"] else [])
    steps.append(Step(f"start the head: {', '.join(roles)}", machine=s.machines[0],
                      argv=_compose(s, engine, HEAD_PROJECT, HEAD, s.machines[0], "up", "-d")))
    return steps + _finish(s)


def native_python(s: Settings) -> str:
    """The Python that runs `twinspark up`: PYTHON, else this checkout's .venv, else the one running start.sh."""
    if s["PYTHON"]:
        return s["PYTHON"]
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def native_state_dir(s: Settings) -> Path:
    return s.state_dir / "native"


def native_env(s: Settings) -> dict[str, str]:
    """The environment of `twinspark up` and of the roles it starts, whose flags default from TWINSPARK_*: every
    serving setting of this deployment, defaults included (a TWINSPARK_* variable of the shell that runs start.sh
    must not override what .env says), as to_env writes them."""
    env = to_env(serving(s), defaults=True)
    env["TWINSPARK_STARTUP_TIMEOUT"] = s["HEALTH_TIMEOUT"]  # the scheduler waits as long for the ranks to load
    if s["OTEL_EXPORTER_OTLP_ENDPOINT"]:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = s["OTEL_EXPORTER_OTLP_ENDPOINT"]
    return env


def start_native(s: Settings) -> list[Step]:
    if s.workers:
        raise ValueError("two machines need LAUNCHER=docker or podman (native mode runs every role on this machine)")
    argv = [native_python(s), "-m", "services.cli", "up", "--detach", "--tp", s["TP"], "--host", s["HOST"],
            "--port", s["PORT"], "--device", s["DEVICE"], "--drafter", s["DRAFTER"],
            "--kv-cache-dtype", s["KV_CACHE_DTYPE"], "--max-restarts", s["MAX_RESTARTS"],
            "--startup-timeout", s["HEALTH_TIMEOUT"],
            "--state-dir", str(native_state_dir(s))]
    if s["MODEL"]:
        argv[4:4] = ["--model", s["MODEL"]]
    steps = _checks(s, None)
    steps.append(Step("start every role here with `twinspark up` (the tiny checkpoint when MODEL is empty)",
                      machine=s.machines[0], env=native_env(s), argv=argv))
    return steps + _finish(s)


def compose_env(s: Settings, engine: Engine | None) -> dict[str, str]:
    """The settings the compose files read, and the engine's own, passed in the environment of every command."""
    names = compose_variables(HEAD, WORKER)
    return {**{k: s.values[k] for k in names if k in s.values}, **(engine.env if engine is not None else {})}


def stop_containers(s: Settings, engine: Engine, stamp: str) -> list[Step]:
    """Keep each project's logs (compose `down` deletes them with the containers), then take it down: the head
    first, so no new request reaches ranks that are going away."""
    if not s["MODEL"]:
        use_tiny_model(s)
    units = [(s.machines[0], HEAD_PROJECT, HEAD, {})] + [
        (m, rank_project(r), WORKER, _rank_env(s, m, r)) for m, r in _rank_units(s)]
    steps = [Step(f"warn if requests are running ({endpoint(s)}/metrics)",
                  action=lambda: _warn_running(endpoint(s)))]
    for m, project, file, env in units:
        cwd = s["WORKER_DIR"] if m.ssh else ""
        logs = f"{s['STATE_DIR']}/logs/{stamp}" if m.ssh else str(s.state_dir / "logs" / stamp)
        logs_cmd = shlex.join(_compose(s, engine, project, file, m, "logs", "--no-color", "--timestamps"))
        steps.append(Step(f"keep the logs of {project} on {m.name} in {logs}/{project}.log", machine=m, cwd=cwd,
                          env=env, argv=["sh", "-c", f"mkdir -p {shlex.quote(logs)} && {logs_cmd} > "
                                         f"{shlex.quote(logs + '/' + project + '.log')}"]))
        steps.append(Step(f"stop {project} on {m.name}", machine=m, cwd=cwd, env=env,
                          argv=_compose(s, engine, project, file, m, "down")))
    return steps


def stop_native(s: Settings, stamp: str) -> list[Step]:
    state = native_state_dir(s)
    kept = s.state_dir / "logs" / stamp
    return [
        python_check(native_python(s)),
        Step(f"warn if requests are running ({endpoint(s)}/metrics)", action=lambda: _warn_running(endpoint(s))),
        Step("stop every role with `twinspark down`", machine=s.machines[0],
             argv=[native_python(s), "-m", "services.cli", "down", "--state-dir", str(state)]),
        Step(f"keep the logs in {kept}", action=lambda: _keep(state / "logs", kept)),
    ]


def _warn_running(base: str) -> None:
    n = probe.running_requests(base)
    if n is None:
        print(f"  {base}/metrics does not answer (already stopped?)")
    elif n:
        print(f"  WARNING: {n} request(s) are running; their clients get an error now")
    else:
        print("  no request is running")


def _keep(logs: Path, kept: Path) -> None:
    if not logs.is_dir():
        print(f"  no logs at {logs}")
        return
    kept.parent.mkdir(parents=True, exist_ok=True)
    logs.rename(kept)
