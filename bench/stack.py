"""The stack a load bench drives: a running `twinspark up` (its state dir's up.json), or one started for the bench;
plus what the benches record about it (process RSS, restarts, /health, the machine's load)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench import flags
from services.common import shared_flags as shared
from services.launcher.ports import free_ports
from services.launcher.settings import STATE_DIR


@dataclass
class Stack:
    state_dir: Path
    started_here: bool  # stop it at the end

    def up_json(self) -> dict:
        return json.loads((self.state_dir / "up.json").read_text())

    @property
    def url(self) -> str:
        return self.up_json()["endpoint"].removesuffix("/v1")

    def processes(self) -> dict[str, int]:
        """name -> pid of the supervisor and every role."""
        info = self.up_json()
        return {"supervisor": info["supervisor_pid"], **{c["name"]: c["pid"] for c in info["children"]}}

    def restarts(self) -> dict[str, int]:
        return dict(self.up_json().get("restarts", {}))

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def down(self) -> None:
        if self.started_here:
            subprocess.run([twinspark_command(), "down", "--state-dir", str(self.state_dir)], capture_output=True,
                           timeout=120)


def twinspark_command() -> str:
    """The `twinspark` command installed beside this interpreter (a bench runs the same install it imports)."""
    return str(Path(sys.executable).parent / "twinspark")


def round_stats(log: Path, start: int) -> list[str]:
    """Rank 0's round-stats lines (services/rank_worker/round_stats.py) written after byte `start` of its log: where
    the served step's time went during a timed part of a bench (GPU per round, GPU idle between rounds, host
    launch, prompt rounds apart)."""
    with log.open("rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    return [line.split(" INFO ", 1)[-1] for line in text.splitlines() if ": rounds " in line]


def attach_or_start(state_dir: str | None, *, tp: int, model: str | None, env: dict[str, str] | None = None) -> Stack:
    """The run recorded in `state_dir`, or (None) a new `twinspark up --detach` in a temporary state dir."""
    if state_dir:
        return Stack(Path(state_dir), started_here=False)
    _stop_on_sigterm()
    sd = Path(tempfile.mkdtemp(prefix="twinspark-bench-"))
    argv = [twinspark_command(), "up", "--detach", "--tp", str(tp), "--port", str(free_ports(1)[0]), "--state-dir", str(sd)]
    if model:
        argv += ["--model", model]
    stack = Stack(sd, started_here=True)
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, env={**os.environ, **(env or {})})
    except BaseException:  # stopped while it starts (SIGTERM, a time-out): the supervisor may be up already
        stack.down()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"twinspark up failed:\n{proc.stdout}\n{proc.stderr}")
    return stack


def _stop_on_sigterm() -> None:
    """Turn SIGTERM (`timeout`, a job runner's stop) into SystemExit, so the bench's `finally: stack.down()` runs: by
    default SIGTERM ends Python at once and the stack it started stays up, holding the GPU (a time-limited 45-layer
    run left 131 GiB held that way)."""
    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        try:
            signal.signal(signal.SIGTERM, stop)
        except ValueError:  # not the main thread: leave it to the caller
            pass


def rss_bytes(pid: int) -> int | None:
    """Resident memory of a process (Linux /proc), None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def machine_load() -> dict:
    """The load averages and the busiest processes on the machine (it is shared: say what else ran)."""
    one, five, fifteen = os.getloadavg()
    top = subprocess.run(["ps", "-eo", "pcpu,rss,comm", "--sort=-pcpu"], capture_output=True, text=True).stdout
    return {"loadavg_1_5_15": [round(one, 2), round(five, 2), round(fifteen, 2)], "cpus": os.cpu_count(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "top_processes": [" ".join(line.split()) for line in top.splitlines()[1:9]]}


def add_stack_args(ap: argparse.ArgumentParser) -> None:
    """The flags that choose the stack a bench drives."""
    flags.add(ap, STATE_DIR, "a running `twinspark up`'s state dir (default: start one for the bench)")
    flags.add(ap, shared.TP, "ranks of the stack started for the bench (default 2)", default="2")
    flags.add(ap, shared.MODEL, "checkpoint of the stack started for the bench (default the tiny one)")


def add_started_stack_args(ap: argparse.ArgumentParser) -> None:
    """The started stack's device, random weights and drafter (beside add_stack_args)."""
    flags.add(ap, shared.DEVICE, "the started stack's device (default cpu)")
    flags.add(ap, shared.RANDOM_WEIGHTS, "the started stack's --random-weights (e.g. exl3:2.5+fp8)")
    flags.add(ap, shared.DRAFTER, "the started stack's draft method (default: none on cuda, the stack's on cpu)",
              default=None)


def started_stack_env(args: argparse.Namespace, clients: int | None) -> dict[str, str]:
    """The started stack's settings (`twinspark up` reads them from its environment): the bench's flags, not the
    shell's. On CUDA: drafts off unless --drafter (random weights draft nothing a verify would accept), and room for
    `clients` requests to run at once (bench/whole_model.py's running_limits)."""
    env = {"TWINSPARK_DEVICE": args.device}
    if args.random_weights:
        env["TWINSPARK_RANDOM_WEIGHTS"] = args.random_weights
    drafter = args.drafter or ("none" if args.device == "cuda" else None)
    if drafter:
        env["TWINSPARK_DRAFTER"] = drafter
    if args.device == "cuda" and clients:
        from bench.whole_model import running_limits
        env.update(running_limits(clients))
    return env


def load_line(before: dict, after: dict) -> str:
    """The markdown sentence saying how busy the shared machine was."""
    return (f"Machine (shared): load {before['loadavg_1_5_15']} before, {after['loadavg_1_5_15']} after, "
            f"{before['cpus']} CPUs; busiest processes before: {'; '.join(before['top_processes'][:4])}.")
