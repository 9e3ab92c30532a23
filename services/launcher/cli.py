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
from dataclasses import replace
from pathlib import Path
from typing import Any

from services.common import shared_flags
from services.common.flags import add_flags, from_args, to_argv

from . import mps, procs, state
from .fleet import INSTALL_HINT, fleet_info, fleet_plan, router_command
from .addresses import WILDCARD_HOSTS
from .plan import LaunchConfig, internal_ports_needed, make_plan, role_command
from .ports import free_ports, port_free
from .settings import DownSettings, UpSettings
from .supervisor import Supervisor, format_banner, kill_leftovers, log, recorded_alive, tail

INTERNAL_TOKEN_ENV = shared_flags.INTERNAL_TOKEN.env_var or ""  # what every role's --internal-token defaults from
LAUNCHER = (sys.executable, "-m", "services.launcher")  # runs `up` / `down` (a replica's own supervisor, --detach)


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
    add_flags(UpSettings, up)
    up.set_defaults(func=run_up)

    down = subparsers.add_parser(
        "down", help="stop what `twinspark up` started",
        description="Stop the run recorded in <state-dir>/up.json: SIGTERM to the supervisor (which stops its "
                    "children), then SIGKILL to whatever recorded process is left; removes up.json. Exit 0, with a "
                    "message, if nothing is running.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flags(DownSettings, down)
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
    return up(from_args(UpSettings, args))


def up(s: UpSettings) -> int:
    """Check the settings, resolve the checkpoint and the public port, then supervise here or in the background."""
    sd = _state_dir(s.state_dir)
    problem = _refused(s)
    if problem:
        return _err(problem)
    command = role_command(s)
    if not command:
        return _err("--role-command is empty")
    other = _running(sd)
    if other is not None:
        return _err(f"already running with state dir {sd}: {other.get('endpoint')} (supervisor pid "
                    f"{other.get('supervisor_pid')}); stop it with `twinspark down --state-dir {sd}`")
    try:
        # Only a router in front of remote replicas (--replicas 0) reads no checkpoint here.
        model = _checkpoint(s.model) if s.replicas > 0 else Path(s.model or "(remote replicas)")
    except ValueError as e:
        return _err(str(e))
    port = s.port
    if port == 0:
        port = free_ports(1, "0.0.0.0" if s.host in WILDCARD_HOSTS else s.host.strip("[]"))[0]
    elif not port_free(s.host, port):
        return _err(f"port {port} on {s.host} is already in use (another twinspark? `twinspark down`); "
                    f"pick another with --port")
    resolved = replace(s, model=str(model), port=port, state_dir=str(sd), role_command=shlex.join(command))
    if s.drafter == "dflash" and s.replicas > 0:
        try:
            resolved = replace(resolved, drafter_model=_dflash_drafter(s, model)[0])
        except ValueError as e:
            return _err(str(e))
    if s.detach:
        return _up_detached(resolved)
    return _supervise_routed(resolved) if s.routed else _supervise(resolved)


def _refused(s: UpSettings) -> str | None:
    """Why these settings cannot run, or None."""
    if s.tp < 1:
        return f"--tp must be >= 1, got {s.tp}"
    if s.max_restarts < 0:
        return f"--max-restarts must be >= 0, got {s.max_restarts}"
    if s.replicas < 0 or (s.replicas == 0 and not s.remote_urls):
        return f"--replicas must be >= 1 (or 0 with --replica-urls), got {s.replicas}"
    bad = [u for u in s.remote_urls if not u.startswith(("http://", "https://"))]
    if bad:
        return f"--replica-urls takes http(s) base URLs, got {', '.join(bad)}"
    if s.routed and router_command(s.router_command) is None:
        return f"--replicas {s.replicas} puts vllm-router in front, and it is not installed: {INSTALL_HINT}"
    if (s.router_policy == "kv_aware" and s.routed) or s.kv_events_endpoint:
        import importlib.util

        missing = [m for m in ("zmq", "msgpack") if importlib.util.find_spec(m) is None]
        if missing:
            return f"KV events (kv_aware) need pyzmq and msgpack, missing {', '.join(missing)}: {INSTALL_HINT}"
    if s.random_weights:
        from model.quantize.select import Recipe

        try:
            Recipe.parse(s.random_weights)
        except ValueError as e:
            return f"--random-weights {e}"
        if s.drafter in ("mtp", "dflash"):
            return (f"--drafter {s.drafter} reads the target's weights from the checkpoint; with --random-weights "
                    "use --drafter copy or none")
    return None


def _dflash_drafter(s: UpSettings, model: Path) -> tuple[str, tuple[int, ...]]:
    """--drafter dflash: the drafter's folder (absolute) and the target layers it reads; ValueError when its config
    is missing or does not fit the target."""
    from model.dflash import DFlashConfig

    folder = Path(s.drafter_model).expanduser().resolve() if s.drafter_model else model / "dflash2"
    try:
        config = DFlashConfig.from_file(folder)
    except (OSError, ValueError) as e:
        raise ValueError(f"--drafter dflash: no usable drafter in {folder} (--drafter-model): {e}") from e
    from model.config import ModelConfig

    # Checked here, once: a layer the target lacks would make every rank refuse every round's plan.
    layers = ModelConfig.from_pretrained(model).num_hidden_layers
    if max(config.target_layer_ids, default=0) >= layers:
        raise ValueError(f"--drafter dflash: {folder} reads target layers {list(config.target_layer_ids)}, "
                         f"the target has {layers}")
    return str(folder), config.target_layer_ids


def _checkpoint(model: str | None) -> Path:
    """--model as an absolute directory, or the cached tiny checkpoint (made now if missing); ValueError when
    neither is there."""
    if model:
        path = Path(model).expanduser().resolve()
        if not path.is_dir():
            raise ValueError(f"--model {model}: no such directory")
        return path
    from .tiny_cache import cache_root, ensure_tiny_default

    t = time.monotonic()
    try:
        path, made = ensure_tiny_default(cache_root())
    except (OSError, RuntimeError) as e:
        raise ValueError(f"cannot prepare the default tiny checkpoint: {e}") from e
    log(f"no --model: serving the tiny checkpoint {path} "
        + (f"(made now in {time.monotonic() - t:.1f} s)" if made else "(cached)"))
    return path


def _supervise(s: UpSettings) -> int:
    """Run the stack in the foreground until it stops (the settings resolved: model, port, state dir)."""
    assert s.model is not None and s.state_dir is not None
    # --drafter dflash: `up` has checked the drafter's config already
    cfg = LaunchConfig(s, draft_layers=_dflash_drafter(s, Path(s.model))[1] if s.drafter == "dflash" else ())
    plan = make_plan(cfg, free_ports(internal_ports_needed(cfg), exclude=(s.port,)))
    # In the background the foreground `up` prints the banner (from up.json); don't repeat it in the log.
    out = (lambda _banner: None) if s.background else None
    # Every role gets the run's internal token in its environment (never in an argv, which up.json and the logs
    # record): a new random one per run unless the caller set TWINSPARK_INTERNAL_TOKEN (start.sh may).
    token = os.environ.get(INTERNAL_TOKEN_ENV) or secrets.token_hex(32)
    env = {**os.environ, INTERNAL_TOKEN_ENV: token}
    try:
        daemon = mps.daemon_for(s.mps, s.device, s.tp, Path(s.state_dir), env, log=log)
        if daemon is not None:
            daemon.start(env)
    except (ValueError, RuntimeError) as e:
        return _err(f"MPS: {e}")
    try:
        return Supervisor(plan, stop_grace=s.stop_grace, startup_timeout=s.startup_timeout,
                          max_restarts=s.max_restarts, env={**env, **(daemon.env if daemon else {})}, out=out,
                          info={"mps_dir": str(daemon.root)} if daemon else None).run()
    finally:
        if daemon is not None:
            daemon.stop(env)
            log("MPS: the private daemon quit")


def _supervise_routed(s: UpSettings) -> int:
    """Run the replicas and vllm-router in the foreground until they stop (fleet.py)."""
    router = router_command(s.router_command)
    assert router is not None  # _refused checked
    events = s.replicas if s.router_policy == "kv_aware" else 0  # each replica's KV event port
    ports = free_ports(s.replicas + events + 1, exclude=(s.port,))
    # What kv_aware must agree on with the replicas: the ranks' block size and the model name requests carry.
    block_size = int(os.environ.get("TWINSPARK_BLOCK_SIZE") or 16)
    name = os.environ.get("TWINSPARK_SERVED_MODEL_NAME") or Path(s.model or "").name
    gpus = mps.visible_gpu_ids(os.environ) if s.device == "cuda" else None
    plan = fleet_plan(s, LAUNCHER, router, ports[:s.replicas], ports[-1], ports[s.replicas:s.replicas + events],
                      model_name=name, block_size=block_size, gpus=gpus)
    for child in plan.children:
        if "CUDA_VISIBLE_DEVICES" in child.env:
            log(f"{child.name}: GPUs {child.env['CUDA_VISIBLE_DEVICES']}")
    if gpus is not None and len(gpus) < s.replicas:
        log(f"{s.replicas} replicas on {len(gpus)} GPU(s): some share a GPU, each with its own copy of the weights")
    out = (lambda _banner: None) if s.background else None
    # A replica's supervisor needs its own stop grace and a little more to stop its children before it is
    # SIGKILLed; each makes its own internal token unless TWINSPARK_INTERNAL_TOKEN is set.
    return Supervisor(plan, stop_grace=s.stop_grace + 10, startup_timeout=s.startup_timeout + 30,
                      max_restarts=s.max_restarts, out=out, info=fleet_info(plan, s)).run()


def _up_detached(s: UpSettings) -> int:
    """Start the supervisor in its own session with these (resolved) settings; return once it is healthy."""
    assert s.state_dir is not None
    sd = Path(s.state_dir)
    logs = sd / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    sup_log = logs / "supervisor.log"
    argv = [sys.executable, "-m", "services.launcher", "up", *to_argv(replace(s, detach=False, background=True))]
    with open(sup_log, "wb") as f:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log(f"started the supervisor in the background (pid {proc.pid}); its log: {sup_log}")
    deadline = time.monotonic() + s.startup_timeout + (90 if s.routed else 30)
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
                return _err(f"no healthy service after {s.startup_timeout + 30:g} s; stopping the supervisor; "
                            f"log: {sup_log}\n{tail(sup_log)}")
            time.sleep(0.1)
    except KeyboardInterrupt:
        log("interrupted: stopping the background supervisor")
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=s.stop_grace + 15)
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
    return down(from_args(DownSettings, args))


def down(s: DownSettings) -> int:
    """Stop the recorded run: its supervisor first, then whatever of its children is left."""
    sd = _state_dir(s.state_dir)
    info = state.read_up(sd)
    if info is None:
        print(f"twinspark down: nothing is running (no {state.up_json_path(sd)})")
        return 0
    t = time.monotonic()
    sup, sup_start = int(info.get("supervisor_pid", 0)), info.get("supervisor_start")
    children = info.get("children", [])
    names = ", ".join(f"{c.get('name')} {c.get('pid')}" for c in children) or "no children"
    forced: list[str] = []
    hard = True  # the supervisor did not stop by itself (then its private MPS daemon, if any, is still up)
    if procs.alive(sup, sup_start):
        print(f"twinspark down: stopping {info.get('endpoint')} — supervisor pid {sup} ({names})", flush=True)
        os.kill(sup, signal.SIGTERM)
        timeout = s.timeout if s.timeout is not None else float(info.get("stop_grace", 10)) + 15
        until = time.monotonic() + timeout
        while procs.alive(sup, sup_start) and time.monotonic() < until:
            time.sleep(0.05)
        hard = procs.alive(sup, sup_start)
        if hard:
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
    if hard and info.get("mps_dir"):  # its supervisor never got to quit it
        mps.MpsDaemon(Path(info["mps_dir"])).stop(os.environ)
        print(f"twinspark down: quit the run's MPS daemon ({info['mps_dir']})", flush=True)
    # A routed run's replicas are runs of their own: stop any that outlived the run's supervisor (SIGKILLed).
    for replica in info.get("replicas", []):
        if replica.get("state_dir") and state.read_up(replica["state_dir"]) is not None:
            print(f"twinspark down: replica {replica.get('url')} is still recorded: stopping it", flush=True)
            down(replace(s, state_dir=replica["state_dir"], timeout=None))
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
