"""./start.sh and ./stop.sh: the plan they print (one and two machines), the settings they refuse, and a real
single-machine run (native launcher: no docker engine here) with its smoke test, then a stop that keeps the logs."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx
from openai import OpenAI

from deploy.ctl import probe
from services.rank_worker.distributed import free_port

REPO = Path(__file__).resolve().parents[2]
TWO = {"WORKER": "me@spark2", "MASTER_ADDR": "192.168.100.10", "TP": "2", "DEVICE": "cuda", "LAUNCHER": "docker"}


def sh(script: str, *args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    # A clean settings environment: only what the test sets reaches deploy.ctl (plus what the OS needs).
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "PYTHONPATH", "TMPDIR")}
    return subprocess.run([str(REPO / script), *args], capture_output=True, text=True, timeout=timeout,
                          env={**base, "PYTHON3": sys.executable, **(env or {})})


def steps(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("[")]


def test_dry_run_single_machine(tmp_path):
    r = sh("start.sh", "--dry-run", env={"STATE_DIR": str(tmp_path), "LAUNCHER": "native"})
    assert r.returncode == 0, r.stderr
    assert "1 machine(s)" in r.stdout
    titles = steps(r.stdout)
    assert [t.split("] ", 1)[1].split(" ")[0] for t in titles] == ["check", "check", "check", "start", "wait", "smoke"]
    assert "-m services.cli up --detach" in r.stdout and "--tp 1" in r.stdout
    assert "Reply with OK." in r.stdout


def test_dry_run_two_machines(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    secrets = {"INTERNAL_TOKEN": "sekrit-internal-token", "API_KEY": "sekrit-key-1,sekrit-key-2"}
    r = sh("start.sh", "--dry-run", env={**TWO, **secrets, "MODEL": str(model), "STATE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "sekrit" not in out and "INTERNAL_TOKEN=***" in out and "API_KEY=***" in out  # masked
    assert "RANK_HOST=0.0.0.0" in out  # the worker's rank must be reachable from the head
    assert "docker launcher (LAUNCHER=docker), 2 machine(s) (head: ranks [0], me@spark2: ranks [1])" in out
    assert "RANK_ADDRESSES=127.0.0.1:50061,spark2:50062" in out
    assert "check me@spark2: ssh, docker compose, the checkpoint, MASTER_ADDR 192.168.100.10" in out
    assert "rsync -a --delete" in out and "docker build -f deploy/Dockerfile -t twinspark:gpu" in out
    # The worker's rank first (it waits for rank 0 at the rendezvous), then the head; traces go to the head.
    # On cuda each compose file comes with its RDMA settings.
    worker_up = out.index("docker compose -p twinspark-rank1 -f deploy/compose/worker.yml "
                          "-f deploy/compose/rdma-worker.yml up -d")
    head_up = out.index("docker compose -p twinspark -f")
    assert "head.yml -f /" in out and "rdma-head.yml" in out[head_up:]
    assert worker_up < head_up < out.index("/health") < out.index("smoke test")
    assert "OTEL_EXPORTER_OTLP_ENDPOINT=http://192.168.100.10:4317 docker compose -p twinspark-rank1" in out
    stop = sh("stop.sh", "--dry-run", env={**TWO, "MODEL": str(model), "STATE_DIR": str(tmp_path)})
    assert stop.returncode == 0, stop.stderr
    assert stop.stdout.index("-p twinspark -f") < stop.stdout.index("-p twinspark-rank1")
    assert "logs --no-color" in stop.stdout and " down" in stop.stdout


def test_dry_run_podman(tmp_path):
    """The podman launcher: podman-compose, the project's containers.conf on every command, the build's flags and
    settings, the wheels from this machine's pip, and no RDMA file on the CPU."""
    env = {"LAUNCHER": "podman", "STATE_DIR": str(tmp_path), "BASE_IMAGE": "local/debian:bookworm", "WHEELS": "host"}
    r = sh("start.sh", "--dry-run", env=env)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "podman launcher (LAUNCHER=podman)" in out
    assert "CONTAINERS_CONF=" + str(REPO / "deploy/podman/containers.conf") in out
    assert ("podman build --isolation chroot --network host --build-arg BASE_IMAGE=local/debian:bookworm "
            "-f deploy/Dockerfile.cpu -t twinspark:cpu .") in out
    assert "-m pip download -qq --dest " + str(REPO / "deploy/wheels") + " torch==2.13.0" in out
    assert out.index("pip download") < out.index("podman build") < out.index("podman run --rm")  # tiny checkpoint
    assert "podman-compose -p twinspark -f " + str(REPO / "deploy/compose/head.yml") + " --profile drafter" in out
    assert "rdma" not in out
    stop = sh("stop.sh", "--dry-run", env=env)
    assert stop.returncode == 0, stop.stderr
    assert "podman-compose -p twinspark" in stop.stdout and " down" in stop.stdout


def test_bad_settings_are_refused_by_name(tmp_path):
    for env, word in [({**TWO, "TP": "3"}, "TP=3"), ({**TWO, "MASTER_ADDR": "127.0.0.1"}, "MASTER_ADDR"),
                      ({"DRAFTER": "eagle"}, "DRAFTER"), ({"PORT": "http"}, "PORT"),
                      ({"MODEL": str(tmp_path)}, "config.json")]:
        r = sh("start.sh", "--dry-run", env={"STATE_DIR": str(tmp_path), **env})
        assert r.returncode == 2 and word in r.stderr, (env, r.stderr)
    bad = tmp_path / "bad.env"
    bad.write_text("PORTT=9000\n")
    r = sh("start.sh", "--dry-run", "--env-file", str(bad))
    assert r.returncode == 2 and "PORTT" in r.stderr


def test_checks_stop_the_start_before_anything_runs(tmp_path):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = sh("start.sh", env={"STATE_DIR": str(tmp_path), "LAUNCHER": "native", "PYTHON": sys.executable,
                                "PORT": str(port), "OTEL_EXPORTER_OTLP_ENDPOINT": ""})
    assert r.returncode == 1
    assert f"port {port} (PORT (gateway)) is in use" in r.stdout + r.stderr
    assert "start every role" in r.stdout and not (tmp_path / "native").exists()  # listed, never run


def test_smoke_test_key_from_the_api_key_list():
    assert probe.plain_key("") == "" and probe.plain_key(" a , b") == "a"
    assert probe.plain_key("sha256:" + "0" * 64 + ",k") == "k" and probe.plain_key("sha256:" + "0" * 64) is None


def test_smoke_test_rejects_degenerate_replies():
    assert probe.degenerate("") == "the reply is empty"
    assert probe.degenerate(" \n") == "the reply is empty"
    assert "repeated" in probe.degenerate("!!!!!!!!")
    assert probe.degenerate("OK") is None and probe.degenerate("O") is None


def test_start_smoke_and_stop_on_this_machine(tmp_path, tiny_default):
    port = free_port()
    env = {"STATE_DIR": str(tmp_path), "LAUNCHER": "native", "PYTHON": sys.executable, "PORT": str(port),
           "HOST": "127.0.0.1", "MODEL": str(tiny_default), "TP": "2", "OTEL_EXPORTER_OTLP_ENDPOINT": "",
           "HEALTH_TIMEOUT": "300"}
    r = sh("start.sh", env=env, timeout=600)
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        assert "smoke test" in r.stdout and "reply: " in r.stdout
        assert f"twinspark is up: http://127.0.0.1:{port}/v1" in r.stdout
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        reply = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=4,
                                               messages=[{"role": "user", "content": "hi"}])
        message = reply.choices[0].message
        assert message.content or message.model_extra.get("reasoning_content")
    finally:
        stop = sh("stop.sh", env=env, timeout=120)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert "no request is running" in stop.stdout
    kept = [p for p in (tmp_path / "logs").iterdir() if p.is_dir()]
    assert len(kept) == 1 and (kept[0] / "gateway.log").stat().st_size > 0 and (kept[0] / "rank1.log").exists()
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
        raise AssertionError("the gateway still answers after ./stop.sh")
    except httpx.TransportError:
        pass


def test_a_fresh_clone_without_an_install_stops_at_its_first_step(tmp_path):
    """This checkout's files without its venv, run natively by a python3 that has none of the project's dependencies:
    start.sh and stop.sh stop at their first step, naming the missing module and the install command; no traceback."""
    clone = tmp_path / "clone"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, clone / name)
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    # Natively: where docker or podman answers (CI installs podman), the containers bring their own Python.
    env = {"PATH": f"{bare / 'bin'}:{os.environ['PATH']}", "HOME": str(tmp_path), "STATE_DIR": str(tmp_path / "state"),
           "LAUNCHER": "native"}
    for script in ("start.sh", "stop.sh"):
        r = subprocess.run([str(clone / script)], capture_output=True, text=True, timeout=60, env=env)
        out = r.stdout + r.stderr
        assert r.returncode == 1 and "Traceback" not in out, out
        assert steps(r.stdout)[-1].startswith("[1/") and "No module named" in out, out
        assert "pip install torch==2.13.0 && .venv/bin/pip install -e ." in out


def test_containers_start_without_jaeger_when_its_image_cannot_be_had(tmp_path):
    """LAUNCHER=podman where no image registry answers (a stand-in podman: `image inspect` finds nothing, `pull`
    fails as podman does on a short name, anything else succeeds and does nothing): start.sh says in one line that
    tracing is off and starts the head without the jaeger profile and its ports (then no /health answers here)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "podman").write_text('#!/bin/sh\ncase "$1" in\n  image) exit 125 ;;\n'
                                    '  pull) echo "Error: short-name \\"$2\\" did not resolve to an alias" >&2;'
                                    ' exit 125 ;;\nesac\n')
    (bin_dir / "podman-compose").write_text("#!/bin/sh\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    r = sh("start.sh", env={"LAUNCHER": "podman", "STATE_DIR": str(tmp_path), "PATH": f"{bin_dir}:{os.environ['PATH']}",
                            "PORT": str(free_port()), "HEALTH_TIMEOUT": "1"})
    assert r.returncode == 1 and "/health" in r.stderr, r.stdout + r.stderr
    off = [line for line in r.stdout.splitlines() if "tracing off" in line]
    assert off == ["  the Jaeger image jaegertracing/jaeger:2.11.0 cannot be had (Error: short-name "
                   '"jaegertracing/jaeger:2.11.0" did not resolve to an alias): tracing off for this run'], r.stdout
    head = next(line for line in r.stdout.splitlines() if "podman-compose -p twinspark -f" in line)
    assert "--profile drafter" in head and "--profile jaeger" not in head and "16686" not in r.stdout
