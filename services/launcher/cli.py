"""`twinspark up` and `twinspark down`: one command to serve, one to stop.

`up` starts every role as its own child process (ranks 0..N-1, the scheduler, the gateway), waits for the gateway's
`/health`, prints the endpoint and supervises in the foreground (restarting children that exit, `--max-restarts`); `--detach` runs the same supervisor in the
background (its own session, log in `<state-dir>/logs/supervisor.log`) and returns once healthy. `down` stops the
run recorded in `<state-dir>/up.json`.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from services.common.env import env

from . import procs, state
from .plan import DEFAULT_COMMAND, WILDCARD_HOSTS, LaunchConfig, internal_ports_needed, make_plan
from .ports import free_ports, port_free
from .supervisor import Supervisor, format_banner, kill_leftovers, log, recorded_alive, tail

INTERNAL_TOKEN_ENV = "TWINSPARK_INTERNAL_TOKEN"  # services/common/internal_auth.py (not imported: it needs grpc)


def register(subparsers: Any) -> None:
    """Add `up` and `down` to the `twinspark` parser."""
    up = subparsers.add_parser(
        "up", help="start gateway, scheduler and N rank workers on this machine and supervise them",
        description="Start every role as its own child process on this machine — ranks 0..N-1, then the scheduler, "
                    "then the gateway — wait until GET http://HOST:PORT/health answers 200, print the endpoint, and "
                    "supervise: a child that exits is restarted with the same argv and ports (the ranks as one group, "
                    "every other role alone) up to --max-restarts times per role, after which it stops everything "
                    "(exit 1); SIGINT/SIGTERM stop everything (exit 0). "
                    "Each child's output goes to <state-dir>/logs/<name>.log. The roles' gRPC ports listen on "
                    "127.0.0.1 and require this run's internal token, made at random unless TWINSPARK_INTERNAL_TOKEN "
                    "is set, and given to the children in their environment only. Without --model a tiny checkpoint is "
                    "made on first use and cached ($TWINSPARK_CACHE_DIR or ~/.cache/twinspark, tiny-default-3).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    up.add_argument("--model", default=env("MODEL"), metavar="DIR",
                    help="checkpoint directory (env TWINSPARK_MODEL; default: the cached tiny checkpoint)")
    up.add_argument("--tp", type=int, default=env("TP", "1"), metavar="N",
                    help="tensor-parallel ranks (env TWINSPARK_TP)")
    up.add_argument("--host", default="127.0.0.1", help="address the gateway listens on")
    up.add_argument("--port", type=int, default=env("PORT", "8888"),
                    help="gateway HTTP port (env TWINSPARK_PORT; 0 = pick a free one)")
    up.add_argument("--device", choices=("cpu", "cuda"), default=env("DEVICE", "cpu"),
                    help="device of the rank workers (env TWINSPARK_DEVICE)")
    up.add_argument("--drafter", choices=("copy", "mtp", "none"), default=env("DRAFTER", "copy"),
                    help="draft method of the drafter process (copy: n-gram prompt lookup; mtp: the checkpoint's "
                         "MTP layer; none: no drafter, no drafts) (env TWINSPARK_DRAFTER)")
    up.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3"),
                    default=env("KV_CACHE_DTYPE", "auto"),
                    help="rank cache storage: auto = the compute dtype; fp8 = e4m3 + per-row scale, about half the "
                         "bytes (env TWINSPARK_KV_CACHE_DTYPE)")
    up.add_argument("--kv-host-bytes", type=int, default=None, metavar="BYTES",
                    help="per rank: host-RAM KV tier behind the pool (serve-rank's flag; env TWINSPARK_KV_HOST_BYTES)")
    up.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                    help="per rank: disk KV tier directory, kept across restarts (env TWINSPARK_KV_DISK_DIR)")
    up.add_argument("--kv-disk-bytes", type=int, default=None, metavar="BYTES",
                    help="per rank: disk KV tier size (env TWINSPARK_KV_DISK_BYTES)")
    up.add_argument("--enforce-eager", action="store_true", default=env("ENFORCE_EAGER", "0") == "1",
                    help="GPU ranks run decode rounds eagerly, without CUDA graphs (env TWINSPARK_ENFORCE_EAGER=1)")
    up.add_argument("--random-weights", default=env("RANDOM_WEIGHTS"), metavar="FORMAT",
                    help="the ranks draw random weights on the device instead of reading shards; --model gives the "
                         "config and the tokenizer (FORMAT, or EXPERTS+OTHER, from fp8, w4a16, exl3, bf16: see "
                         "serve-rank --help) (env TWINSPARK_RANDOM_WEIGHTS)")
    up.add_argument("--random-block-size", type=int, default=env("RANDOM_BLOCK_SIZE", "128"), metavar="N",
                    help="with --random-weights: fp8 block edge and w4a16 group size (env TWINSPARK_RANDOM_BLOCK_SIZE)")
    up.add_argument("--detach", action="store_true",
                    help="run the supervisor in the background; return once healthy (stop with `twinspark down`)")
    up.add_argument("--state-dir", default=None, metavar="DIR",
                    help="where up.json and logs/ go (env TWINSPARK_STATE_DIR; default $XDG_STATE_HOME/twinspark "
                         "or ~/.local/state/twinspark)")
    up.add_argument("--startup-timeout", type=float, default=600.0, metavar="S",
                    help="seconds to wait for /health to answer 200")
    up.add_argument("--stop-grace", type=float, default=10.0, metavar="S",
                    help="seconds between SIGTERM and SIGKILL when stopping the children")
    up.add_argument("--max-restarts", type=int, default=env("MAX_RESTARTS", "5"), metavar="N",
                    help="restarts allowed per role (a rank group restart counts once) over the run's life; the "
                         "next exit stops everything, except the optional drafter, which then stays down; 0 = the "
                         "first exit stops everything (env TWINSPARK_MAX_RESTARTS)")
    up.add_argument("--role-command", default=None, metavar="CMD",
                    help="command that runs a role's subcommand (serve-rank ...), shell-quoted "
                         f"(default: {shlex.join(DEFAULT_COMMAND)}; e.g. the console script .../bin/twinspark)")
    up.add_argument("--background", action="store_true", help=argparse.SUPPRESS)  # set on the detached supervisor
    up.set_defaults(func=run_up)

    down = subparsers.add_parser(
        "down", help="stop what `twinspark up` started",
        description="Stop the run recorded in <state-dir>/up.json: SIGTERM to the supervisor (which stops its "
                    "children), then SIGKILL to whatever recorded process is left; removes up.json. Exit 0, with a "
                    "message, if nothing is running.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    down.add_argument("--state-dir", default=None, metavar="DIR",
                      help="state dir of the run (env TWINSPARK_STATE_DIR; default $XDG_STATE_HOME/twinspark or "
                           "~/.local/state/twinspark)")
    down.add_argument("--timeout", type=float, default=None, metavar="S",
                      help="seconds to wait for the supervisor before SIGKILL (default: its stop grace + 15)")
    down.set_defaults(func=run_down)


def _state_dir(arg: str | None) -> Path:
    return (Path(arg).expanduser() if arg else state.default_state_dir()).resolve()


def _running(sd: Path) -> dict[str, Any] | None:
    info = state.read_up(sd)
    if info and procs.alive(int(info.get("supervisor_pid", 0)), info.get("supervisor_start")):
        return info
    return None


def _err(msg: str) -> int:
    print(f"twinspark up: {msg}", file=sys.stderr)
    return 1


# ---- up ------------------------------------------------------------------------------------------------------------
def run_up(args: argparse.Namespace) -> int:
    sd = _state_dir(args.state_dir)
    if args.tp < 1:
        return _err(f"--tp must be >= 1, got {args.tp}")
    if args.max_restarts < 0:
        return _err(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.random_weights:
        from model.quantize.select import Recipe

        try:
            Recipe.parse(args.random_weights)
        except ValueError as e:
            return _err(f"--random-weights {e}")
        if args.drafter == "mtp":
            return _err("--drafter mtp reads the MTP layer's weights from the checkpoint; with --random-weights use "
                        "--drafter copy or none")
    command = tuple(shlex.split(args.role_command)) if args.role_command else DEFAULT_COMMAND
    if not command:
        return _err("--role-command is empty")
    other = _running(sd)
    if other is not None:
        return _err(f"already running with state dir {sd}: {other.get('endpoint')} (supervisor pid "
                    f"{other.get('supervisor_pid')}); stop it with `twinspark down --state-dir {sd}`")

    if args.model:
        model = Path(args.model).expanduser().resolve()
        if not model.is_dir():
            return _err(f"--model {args.model}: no such directory")
    else:
        from .tiny_cache import cache_root, ensure_tiny_default

        t = time.monotonic()
        try:
            model, made = ensure_tiny_default(cache_root())
        except (OSError, RuntimeError) as e:
            return _err(f"cannot prepare the default tiny checkpoint: {e}")
        log(f"no --model: serving the tiny checkpoint {model} "
            + (f"(made now in {time.monotonic() - t:.1f} s)" if made else "(cached)"))

    port = args.port
    if port == 0:
        port = free_ports(1, "0.0.0.0" if args.host in WILDCARD_HOSTS else args.host.strip("[]"))[0]
    elif not port_free(args.host, port):
        return _err(f"port {port} on {args.host} is already in use (another twinspark? `twinspark down`); "
                    f"pick another with --port")

    if args.detach:
        return _up_detached(args, sd, model, port, command)
    cfg = LaunchConfig(model=str(model), state_dir=str(sd), tp=args.tp, host=args.host, port=port,
                       device=args.device, command=command, drafter=args.drafter, kv_cache_dtype=args.kv_cache_dtype,
                       enforce_eager=args.enforce_eager, kv_tiers=tuple(_tier_flags(args)),
                       random_weights=args.random_weights or "", random_block_size=args.random_block_size)
    plan = make_plan(cfg, free_ports(internal_ports_needed(cfg), exclude=(port,)))
    # In the background the foreground `up` prints the banner (from up.json); don't repeat it in the log.
    out = (lambda _banner: None) if args.background else None
    # Every role gets the run's internal token in its environment (never in an argv, which up.json and the logs
    # record): a new random one per run unless the caller set TWINSPARK_INTERNAL_TOKEN (start.sh may).
    token = os.environ.get(INTERNAL_TOKEN_ENV) or secrets.token_hex(32)
    return Supervisor(plan, stop_grace=args.stop_grace, startup_timeout=args.startup_timeout,
                      max_restarts=args.max_restarts, env={**os.environ, INTERNAL_TOKEN_ENV: token}, out=out).run()


def _tier_flags(args: argparse.Namespace) -> list[str]:
    """The KV tier flags given to `up`, passed on to every rank as they are (unset: the ranks' env defaults)."""
    out: list[str] = []
    for flag, value in (("--kv-host-bytes", args.kv_host_bytes), ("--kv-disk-dir", args.kv_disk_dir),
                        ("--kv-disk-bytes", args.kv_disk_bytes)):
        if value is not None:
            out += [flag, str(value)]
    return out


def _up_detached(args: argparse.Namespace, sd: Path, model: Path, port: int, command: tuple[str, ...]) -> int:
    logs = sd / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    sup_log = logs / "supervisor.log"
    argv = [sys.executable, "-m", "services.launcher", "up", "--model", str(model), "--tp", str(args.tp),
            "--host", args.host, "--port", str(port), "--device", args.device, "--drafter", args.drafter,
            "--kv-cache-dtype", args.kv_cache_dtype, *(["--enforce-eager"] if args.enforce_eager else []),
            *(["--random-weights", args.random_weights, "--random-block-size", str(args.random_block_size)]
              if args.random_weights else []),
            *_tier_flags(args), "--state-dir", str(sd),
            "--startup-timeout", str(args.startup_timeout), "--stop-grace", str(args.stop_grace),
            "--max-restarts", str(args.max_restarts),
            "--role-command", shlex.join(command), "--background"]
    with open(sup_log, "wb") as f:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log(f"started the supervisor in the background (pid {proc.pid}); its log: {sup_log}")
    deadline = time.monotonic() + args.startup_timeout + 30
    offset, pending = 0, b""
    try:
        while True:
            info = state.read_up(sd)
            if info and info.get("supervisor_pid") == proc.pid and info.get("status") == "up":
                time.sleep(0.05)  # let its "healthy after" line land, then show the rest of its log
                _follow(sup_log, offset, pending, flush=True)
                print(format_banner(info))
                print(f"  stop: twinspark down --state-dir {sd}", flush=True)
                return 0
            offset, pending = _follow(sup_log, offset, pending)  # show its progress lines as they come
            rc = proc.poll()
            if rc is not None:
                _follow(sup_log, offset, pending, flush=True)
                return _err(f"the supervisor exited with code {rc} before the service was healthy; "
                            f"log: {sup_log}") if rc else _err("the supervisor stopped before the service was healthy")
            if time.monotonic() > deadline:
                proc.send_signal(signal.SIGTERM)
                return _err(f"no healthy service after {args.startup_timeout + 30:g} s; stopping the supervisor; "
                            f"log: {sup_log}\n{tail(sup_log)}")
            time.sleep(0.1)
    except KeyboardInterrupt:
        log("interrupted: stopping the background supervisor")
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=args.stop_grace + 15)
        except subprocess.TimeoutExpired:
            proc.kill()
        return 130


def _follow(path: Path, offset: int, pending: bytes, flush: bool = False) -> tuple[int, bytes]:
    """Copy whole new lines of `path` from `offset` to stderr."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except OSError:
        return offset, pending
    data = pending + chunk
    cut = len(data) if flush else data.rfind(b"\n") + 1
    if cut:
        sys.stderr.write(data[:cut].decode("utf-8", "replace"))
        sys.stderr.flush()
    return offset + len(chunk), data[cut:]


# ---- down ----------------------------------------------------------------------------------------------------------
def run_down(args: argparse.Namespace) -> int:
    sd = _state_dir(args.state_dir)
    info = state.read_up(sd)
    if info is None:
        print(f"twinspark down: nothing is running (no {state.up_json_path(sd)})")
        return 0
    t = time.monotonic()
    sup, sup_start = int(info.get("supervisor_pid", 0)), info.get("supervisor_start")
    children = info.get("children", [])
    names = ", ".join(f"{c.get('name')} {c.get('pid')}" for c in children) or "no children"
    forced: list[str] = []
    if procs.alive(sup, sup_start):
        print(f"twinspark down: stopping {info.get('endpoint')} — supervisor pid {sup} ({names})", flush=True)
        os.kill(sup, signal.SIGTERM)
        timeout = args.timeout if args.timeout is not None else float(info.get("stop_grace", 10)) + 15
        until = time.monotonic() + timeout
        while procs.alive(sup, sup_start) and time.monotonic() < until:
            time.sleep(0.05)
        if procs.alive(sup, sup_start):
            print(f"twinspark down: the supervisor did not stop within {timeout:g} s: SIGKILL", flush=True)
            os.kill(sup, signal.SIGKILL)
            forced.append(f"supervisor {sup}")
    else:
        print(f"twinspark down: supervisor pid {sup} is not running (stale up.json); cleaning up what is left")
    forced += kill_leftovers(children)  # whatever the supervisor did not stop: SIGKILL its process group
    until = time.monotonic() + 3
    while (left := _survivors(children)) and time.monotonic() < until:
        time.sleep(0.05)
    state.remove_up(sd)
    took = time.monotonic() - t
    if forced:
        print(f"twinspark down: SIGKILLed {', '.join(forced)}")
    if left:
        print(f"twinspark down: still alive after SIGKILL: {', '.join(left)}", file=sys.stderr)
        return 1
    print(f"twinspark down: stopped supervisor {sup} and {names} in {took:.1f} s")
    return 0


def _survivors(children: list[dict[str, Any]]) -> list[str]:
    return [f"{c.get('name')} (process group {c.get('pgid', c.get('pid'))})" for c in children if recorded_alive(c)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twinspark", description="Start and stop a twinspark replica.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    register(sub)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)
