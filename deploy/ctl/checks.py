"""Checks before anything starts: ports free, memory enough, workers reachable. Each returns a list of problems
(empty = fine) so start.sh can report them all at once, and runs the same on this machine or, through ssh, on a
worker."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

from deploy.ctl.settings import Machine, Settings
# Standard library only (the launcher never imports torch), importable from the checkout start.sh runs in.
from services.launcher.ports import listening, port_free

SSH = ("ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5")
GIB = 1 << 30
HEADROOM = 2 * GIB  # runtime, caches and the services beside the weights

# Run on a worker with `python3 -c`: which of the given ports cannot be bound (in use).
_BUSY_PORTS_PY = ("import socket,sys\nfor p in map(int,sys.argv[1:]):\n s=socket.socket()\n"
                  " s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n try: s.bind(('',p))\n"
                  " except OSError: print(p)\n finally: s.close()")


def on(machine: Machine, argv: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess:
    """Run argv on `machine` (here, or through ssh) and capture its output."""
    if machine.ssh is not None:
        argv = [*SSH, machine.ssh, shlex.join(argv)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def busy_ports(machine: Machine, ports: list[int]) -> list[int]:
    if machine.ssh is None:
        return [p for p in ports if not port_free("", p)]
    out = on(machine, ["python3", "-c", _BUSY_PORTS_PY, *map(str, ports)])
    return [int(x) for x in out.stdout.split()]


def ports_problems(machine: Machine, ports: dict[str, int]) -> list[str]:
    busy = set(busy_ports(machine, sorted(set(ports.values()))))
    return [f"{machine.name}: port {p} ({name}) is in use" for name, p in ports.items() if p in busy]


def checkpoint_bytes(model: str) -> int:
    return sum(f.stat().st_size for f in Path(model).expanduser().glob("*.safetensors")) if model else 0


def _meminfo_available(text: str) -> int | None:
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _gpu_free(machine: Machine) -> list[int] | None:
    """Free bytes per GPU from nvidia-smi; None where it has no figure (no GPU, or unified memory like GB10)."""
    if machine.ssh is None and shutil.which("nvidia-smi") is None:
        return None
    try:
        out = on(machine, ["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"])
    except (OSError, subprocess.TimeoutExpired):
        return None
    try:
        return [int(x) * (1 << 20) for x in out.stdout.split()] if out.returncode == 0 else None
    except ValueError:
        return None  # "[N/A]" on unified-memory machines: host memory is the GPU's


def memory_problems(s: Settings, machine: Machine) -> list[str]:
    """Each rank holds 1/TP of the weights; on unified memory (Spark) or CPU that comes out of host memory."""
    share = checkpoint_bytes(s["MODEL"]) // s.int("TP")
    gpus = _gpu_free(machine) if s["DEVICE"] == "cuda" else None
    if gpus:
        short = [i for i, free in enumerate(gpus[: len(machine.ranks)]) if free < share + HEADROOM]
        return [f"{machine.name}: GPU {i} has {gpus[i] / GIB:.1f} GiB free, a rank needs about "
                f"{(share + HEADROOM) / GIB:.1f} GiB" for i in short]
    text = Path("/proc/meminfo").read_text() if machine.ssh is None else on(machine, ["cat", "/proc/meminfo"]).stdout
    avail = _meminfo_available(text)
    need = share * len(machine.ranks) + HEADROOM
    if avail is None:
        return [f"{machine.name}: cannot read MemAvailable from /proc/meminfo"]
    if avail < need:
        return [f"{machine.name}: {avail / GIB:.1f} GiB of memory available, its {len(machine.ranks)} rank(s) need "
                f"about {need / GIB:.1f} GiB"]
    return []


def worker_problems(s: Settings, machine: Machine, compose: tuple[str, ...]) -> list[str]:
    """Reachable by ssh without a password, the engine's compose command there, the model there, MASTER_ADDR
    reachable from it."""
    try:
        r = on(machine, ["true"], timeout=15)
    except subprocess.TimeoutExpired:
        return [f"{machine.name}: ssh timed out"]
    if r.returncode != 0:
        return [f"{machine.name}: ssh {machine.ssh} failed ({r.stderr.strip() or r.returncode}); set up key login "
                "(ssh-copy-id) first"]
    problems = []
    if on(machine, [*compose, "version"]).returncode != 0:
        problems.append(f"{machine.name}: `{' '.join(compose)}` does not work there")
    if s["MODEL"] and on(machine, ["test", "-f", f"{s['MODEL']}/config.json"]).returncode != 0:
        problems.append(f"{machine.name}: no checkpoint at {s['MODEL']} (copy it to the same path)")
    if on(machine, ["ping", "-c", "1", "-W", "2", s["MASTER_ADDR"]]).returncode != 0:
        problems.append(f"{machine.name}: cannot reach MASTER_ADDR {s['MASTER_ADDR']} (the head's RoCE address)")
    return problems


def collector_reachable(endpoint: str) -> bool:
    """Whether something listens at the OTLP endpoint (host:port of an http(s) URL)."""
    hostport = endpoint.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = hostport.rpartition(":")
    try:
        return listening(host or "127.0.0.1", int(port or 4317), timeout=1.0)
    except ValueError:
        return False


# What `twinspark up` / `down` import before anything runs, and what each role imports: an interpreter that finds
# this checkout's `services` but not torch (or the generated stubs of an install) passes `import services.cli` and
# fails later with a traceback.
_IMPORTS = ("import services.cli, twinspark.v1.generate_pb2; services.cli.build_parser(); "
            "import services.gateway.app, services.scheduler.server, services.rank_worker.server")
INSTALL = "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 && .venv/bin/pip install -e ."


def python_problems(python: str) -> list[str]:
    """The native launcher's Python must import twinspark and its dependencies (pip install -e . of this checkout);
    the problem names the missing module and the install command."""
    try:
        r = subprocess.run([python, "-c", _IMPORTS], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [f"head: cannot run {python}: {e}"]
    if r.returncode != 0:
        why = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit code {r.returncode}"
        return [f"head: {python} cannot run twinspark ({why}); install it in this checkout: {INSTALL} "
                "(on a GPU machine a CUDA build of torch instead: README.md), or set PYTHON to a Python that has it"]
    return []
