"""A private NVIDIA MPS daemon for ranks that share a GPU (`twinspark up --mps`).

Two CUDA processes on one GPU time-slice their contexts: one runs while the other waits out a slice of about a
millisecond or two. The ranks of a tensor-parallel group meet at every collective, so each exchange would wait a
slice, hundreds of times an exchange's cost under MPS (docs/deploy.md, "The tensor-parallel collective"). The MPS
daemon runs the clients' kernels side by side in one context. `up` starts its own daemon, with its pipe and log
directories under the state dir so that it neither meets nor stops a daemon the machine already runs, gives the
children its pipe directory (CUDA connects every process that has it to that daemon), and quits it when the stack
stops. Why by hand: MPS is a driver service with no Python binding; its control program is the interface.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
MODES = ("auto", "on", "off")


def visible_gpu_ids(env: Mapping[str, str]) -> list[str] | None:
    """The GPUs this machine's CUDA processes see, as CUDA_VISIBLE_DEVICES names them: its entries when set, else
    `nvidia-smi -L`'s indices; None when neither says (no driver tools)."""
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    smi = shutil.which("nvidia-smi", path=env.get("PATH"))
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [str(i) for i in range(sum(1 for line in out.splitlines() if line.startswith("GPU ")))]


def visible_gpus(env: Mapping[str, str]) -> int | None:
    """How many GPUs `visible_gpu_ids` finds (None: unknown)."""
    ids = visible_gpu_ids(env)
    return None if ids is None else len(ids)


def wanted(mode: str, device: str, tp: int, gpus: int | None, env: Mapping[str, str]) -> tuple[bool, str]:
    """(start a daemon?, why) for `--mps mode`. auto: when CUDA ranks outnumber the visible GPUs (rank r runs on GPU
    r mod count, so some share one) and no daemon of the caller's is set up (CUDA_MPS_PIPE_DIRECTORY given)."""
    if mode not in MODES:
        raise ValueError(f"--mps must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off" or device != "cuda":
        return False, "off" if mode == "off" else "CPU ranks"
    if mode == "on":
        return True, "--mps on"
    if env.get(PIPE_ENV):
        return False, f"{PIPE_ENV} is set: the ranks use that daemon"
    if gpus is None:
        return False, "the GPU count is unknown (no nvidia-smi)"
    if tp <= gpus:
        return False, f"{tp} rank(s) on {gpus} GPU(s): none shares a GPU"
    return True, f"{tp} ranks share {gpus} GPU(s)"


@dataclass
class MpsDaemon:
    """One daemon, its directories under `root` (the state dir's mps/)."""

    root: Path
    control: str = CONTROL

    @property
    def env(self) -> dict[str, str]:
        """What a child needs to be a client of this daemon."""
        return {PIPE_ENV: str(self.root / "pipe"), LOG_ENV: str(self.root / "log")}

    def start(self, base_env: Mapping[str, str]) -> None:
        """Start it (quitting first one that an earlier run of this state dir left behind); RuntimeError when
        the control program is missing or fails."""
        exe = shutil.which(self.control, path=base_env.get("PATH"))
        if exe is None:
            raise RuntimeError(f"{self.control} is not on PATH (it comes with the NVIDIA driver)")
        for d in self.env.values():
            Path(d).mkdir(parents=True, exist_ok=True)
        self._quit(exe, base_env)
        proc = subprocess.run([exe, "-d"], env={**base_env, **self.env}, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"{self.control} -d failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()}")

    def stop(self, base_env: Mapping[str, str]) -> None:
        """Quit it (its clients have exited: the stack is down)."""
        exe = shutil.which(self.control, path=base_env.get("PATH"))
        if exe is not None:
            self._quit(exe, base_env)

    def _quit(self, exe: str, base_env: Mapping[str, str]) -> None:
        try:
            subprocess.run([exe], input="quit\n", env={**base_env, **self.env}, capture_output=True, text=True,
                           timeout=60)
        except (OSError, subprocess.SubprocessError):
            pass  # none running there: nothing to quit


def daemon_for(mode: str, device: str, tp: int, state_dir: Path, env: Mapping[str, str] | None = None,
               log: Callable[[str], None] = print) -> MpsDaemon | None:
    """The daemon `up` should run for these settings (not started yet), or None; says which and why through `log`.
    Raises ValueError for `--mps on` without the control program."""
    env = dict(os.environ if env is None else env)
    start, why = wanted(mode, device, tp, visible_gpus(env) if mode == "auto" and device == "cuda" else None, env)
    if not start:
        if mode == "auto" and device == "cuda" and tp > 1:
            log(f"MPS: no private daemon ({why})")
        return None
    if shutil.which(CONTROL, path=env.get("PATH")) is None:
        if mode == "on":
            raise ValueError(f"--mps on: {CONTROL} is not on PATH (it comes with the NVIDIA driver)")
        log(f"MPS: {why}, but {CONTROL} is not on PATH: the ranks time-slice the GPU, and each collective waits "
            f"out a slice (milliseconds); start MPS by hand (docs/deploy.md) or run one rank per GPU")
        return None
    log(f"MPS: {why}: starting a private daemon (pipe {state_dir / 'mps' / 'pipe'}); it stops with the stack")
    return MpsDaemon(state_dir / "mps")
