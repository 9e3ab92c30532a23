"""`python3 -m deploy.ctl start|stop [--dry-run] [--env-file F]` — what ./start.sh and ./stop.sh run."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from deploy.ctl import checks, engines, plan
from deploy.ctl.settings import SECRETS, Settings, SettingsError, load

RECORD = "deploy.json"  # what start did, under STATE_DIR: stop reads it


def resolve_launcher(s: Settings) -> tuple[str, str]:
    """The launcher and why. auto: docker when it answers here, else podman when it answers, else native (two
    machines: docker, whose checks then say what is missing)."""
    if s["LAUNCHER"] != "auto":
        return s["LAUNCHER"], "LAUNCHER=" + s["LAUNCHER"]
    docker = engines.why_not(engines.DOCKER)
    if docker is None:
        return "docker", "auto: docker answers"
    podman = engines.why_not(engine_of("podman", s))
    if podman is None:
        return "podman", f"auto: docker does not ({docker}), podman does"
    return ("docker" if s.workers else "native"), f"auto: docker does not ({docker}), nor podman ({podman})"


def engine_of(launcher: str, s: Settings) -> engines.Engine | None:
    """The container engine of a launcher; None for native."""
    if launcher == "docker":
        return engines.DOCKER
    return engines.podman(plan.native_python(s)) if launcher == "podman" else None


def _run(step: plan.Step, s: Settings, compose_env: dict[str, str]) -> None:
    assert step.argv is not None and step.machine is not None
    env = {**compose_env, **step.env}
    if step.machine.ssh is None:
        r = subprocess.run(step.argv, env={**os.environ, **env}, cwd=plan.REPO)
    else:
        # Secrets go over ssh's stdin into the remote shell's environment: never on a command line, which every
        # user of the worker can read in its process list.
        secret = [k for k in env if k in SECRETS and env[k]]
        plain = {k: v for k, v in env.items() if k not in secret}
        remote = "env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in plain.items()) + " " + shlex.join(step.argv)
        if step.cwd:
            remote = f"cd {shlex.quote(step.cwd)} && {remote}"
        if secret:
            remote = "".join(f"IFS= read -r {k}; " for k in secret) + f"export {' '.join(secret)}; {remote}"
        r = subprocess.run([*checks.SSH, step.machine.ssh, remote], text=True,
                           input="".join(env[k] + "\n" for k in secret))
    if r.returncode != 0:
        raise RuntimeError(f"{step.title}: exit code {r.returncode}")


def execute(steps: list[plan.Step], s: Settings, compose_env: dict[str, str], dry_run: bool) -> None:
    """Checks first, all of them (every problem is reported at once) unless a fatal one fails; then the rest in
    order, stopping at the first failure."""
    n = len(steps)
    problems: list[str] = []
    for i, step in enumerate(steps, 1):
        print(f"[{i}/{n}] {step.show()}", flush=True)
        if dry_run:
            continue
        if step.check is not None:
            found = step.check()
            for p in found:
                print(f"  PROBLEM: {p}", flush=True)
            problems += found
            if found and step.fatal:
                break
            continue
        if problems:
            raise RuntimeError("checks failed:\n  " + "\n  ".join(problems))
        t0 = time.monotonic()
        if step.action is not None:
            step.action()
        else:
            _run(step, s, compose_env)
        print(f"  done in {time.monotonic() - t0:.1f} s", flush=True)
    if problems:
        raise RuntimeError("checks failed:\n  " + "\n  ".join(problems))


def tracing_off_reason(s: Settings, engine: engines.Engine | None) -> str | None:
    """Why this run goes without tracing although OTEL_EXPORTER_OTLP_ENDPOINT is set, or None: natively, nothing
    listens there (this mode starts no Jaeger); with containers, the head's Jaeger image is neither here nor to be
    pulled (a machine without an image registry). Tracing is optional: the stack starts without it."""
    endpoint = s["OTEL_EXPORTER_OTLP_ENDPOINT"]
    if not endpoint:
        return None
    if engine is None:
        return None if checks.collector_reachable(endpoint) else \
            f"nothing listens at OTEL_EXPORTER_OTLP_ENDPOINT={endpoint} (native mode starts no Jaeger)"
    why = engines.image_problem(engine, s["JAEGER_IMAGE"])
    return None if why is None else f"the Jaeger image {s['JAEGER_IMAGE']} cannot be had ({why})"


def start(s: Settings, dry_run: bool) -> None:
    launcher, why = resolve_launcher(s)
    engine = engine_of(launcher, s)
    print(f"twinspark start: {launcher} launcher ({why}), {len(s.machines)} machine(s) "
          f"({', '.join(f'{m.name}: ranks {list(m.ranks)}' for m in s.machines)}), TP {s['TP']}, "
          f"model {s['MODEL'] or '(tiny demo checkpoint)'}, device {s['DEVICE']}, drafter {s['DRAFTER']}"
          f"{', env file ' + str(s.env_file) if s.env_file else ''}")
    if engine is not None:
        print(f"  {engine.name}: {engine.describe()}")
    untraced = None if dry_run else tracing_off_reason(s, engine)
    if untraced is not None:
        print(f"  {untraced}: tracing off for this run")
        s.values["OTEL_EXPORTER_OTLP_ENDPOINT"] = ""
    steps = plan.start_containers(s, engine) if engine is not None else plan.start_native(s)
    compose_env = plan.compose_env(s, engine)
    if dry_run and engine is not None:
        print("settings passed to every compose command: " + plan.show_env(compose_env))
    execute(steps, s, compose_env, dry_run)
    if dry_run:
        return
    s.state_dir.mkdir(parents=True, exist_ok=True)
    record = {"launcher": launcher, "workers": [m.ssh for m in s.workers], "tp": s["TP"],
              "endpoint": plan.endpoint(s), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (s.state_dir / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    base = plan.endpoint(s)
    print(f"\ntwinspark is up: {base}/v1  (OpenAI-compatible; model list at {base}/v1/models)")
    print(f"  health {base}/health   metrics {base}/metrics")
    if engine is not None and s["OTEL_EXPORTER_OTLP_ENDPOINT"]:
        print(f"  traces: Jaeger UI at http://{base.split('://')[1].rsplit(':', 1)[0]}:16686")
    print("  stop with ./stop.sh")


def stop(s: Settings, dry_run: bool) -> None:
    rec_path = s.state_dir / RECORD
    record = json.loads(rec_path.read_text()) if rec_path.is_file() else {}
    launcher = record.get("launcher") or resolve_launcher(s)[0]
    engine = engine_of(launcher, s)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    print(f"twinspark stop: {launcher} launcher, {len(s.machines)} machine(s)"
          f"{' (as recorded by start.sh)' if record else ''}")
    steps = plan.stop_containers(s, engine, stamp) if engine is not None else plan.stop_native(s, stamp)
    execute(steps, s, plan.compose_env(s, engine), dry_run)
    if not dry_run:
        rec_path.unlink(missing_ok=True)
        print(f"twinspark stopped; logs kept under {s.state_dir / 'logs' / stamp}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="start.sh / stop.sh",
                                 description="Start or stop twinspark on this machine and the WORKER machines, "
                                             "as deploy/.env says (defaults and every setting: deploy/.env.example).")
    ap.add_argument("command", choices=["start", "stop"])
    ap.add_argument("--dry-run", action="store_true", help="print the plan (checks, commands, probes) and exit")
    ap.add_argument("--env-file", type=Path, default=None, help="settings file (default deploy/.env when present)")
    args = ap.parse_args(argv)
    try:
        s = load(args.env_file)
        (start if args.command == "start" else stop)(s, args.dry_run)
    except (SettingsError, ValueError) as e:
        print(f"{args.command}: settings: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"{args.command} failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
