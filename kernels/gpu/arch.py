"""The GPU's facts, read once, and the row of a per-architecture tile table a kernel takes on it.

The kernels' tiles were chosen on Hopper (sm_90: 132 SMs, 227 KB of shared memory a block, warpgroup MMAs). The
reference deployment is two DGX Sparks: GB10, sm_121, 48 SMs, 99 KB a block, warp-level MMAs only, 128 GB of memory
the CPU and the GPU share. A Hopper tile that needs more shared memory than GB10 has fails to launch there
(Triton's OutOfResources), so where a Hopper choice does not fit, a kernel keeps a table with one row per
architecture (`ROWS`) and takes the row of the GPU it runs on.

Exactness (docs/design.md §5.1): a row may change a kernel's bits against another row (its tiles, its K order);
on one architecture the row is fixed for the whole process, so a row's result never depends on its company.

Without CUDA (Triton's interpreter in the tests, the meta device of bench/kernel_census.py) there is no GPU to ask:
Hopper's row, unless `assume(arch)` names another: the tests run each table's row that way, in the interpreter and
on a GPU (a GB10 row runs on a Hopper GPU too: its tiles are smaller); the runtime never calls it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

import torch

log = logging.getLogger(__name__)

HOPPER = 90
GB10 = 121
# The rows of the per-architecture tables, and the opt-in shared memory a block may take on each (bytes, from
# NVIDIA's tuning guides: what Triton compares a kernel's need with before it launches). The census
# (bench/kernel_census.py) compiles every chosen configuration for each and checks it against these.
ROWS = (HOPPER, GB10)
SHARED_PER_BLOCK = {HOPPER: 227 * 1024, GB10: 99 * 1024}

_assumed: list[int] = []


@dataclass(frozen=True)
class DeviceFacts:
    """What the runtime reads of a GPU once, at start-up."""

    name: str
    capability: int  # major x 10 + minor: 90 (H100 / H200), 121 (GB10)
    sms: int
    shared_per_block: int  # opt-in bytes a block may take
    total_memory: int  # bytes; on an integrated GPU the system's, shared with the CPU
    unified: bool  # an integrated GPU: its memory is the host's (GB10), so "free" is the whole system's

    @property
    def row(self) -> int:
        return table_row(self.capability)

    def describe(self) -> str:
        kind = "unified memory shared with the CPU" if self.unified else "device memory"
        return (f"{self.name}: sm_{self.capability}, {self.sms} SMs, {self.shared_per_block // 1024} KiB shared "
                f"memory a block, {self.total_memory / 2**30:.1f} GiB {kind}; kernel tiles: the sm_{self.row} row")


def table_row(capability: int) -> int:
    """The row a GPU of this capability takes: 12.x (GB10, and the other 99 KB Blackwells) GB10's; every other
    Hopper's, the tiles the kernels were tuned with (the census checks sm_90 and sm_121 only)."""
    return GB10 if capability // 10 == 12 else HOPPER


@lru_cache(maxsize=None)
def facts(index: int) -> DeviceFacts:
    """The facts of CUDA device `index` (read once per process)."""
    p = torch.cuda.get_device_properties(index)
    return DeviceFacts(name=p.name, capability=p.major * 10 + p.minor, sms=p.multi_processor_count,
                       shared_per_block=getattr(p, "shared_memory_per_block_optin", p.shared_memory_per_block),
                       total_memory=p.total_memory, unified=bool(p.is_integrated))


def log_facts(device: torch.device) -> DeviceFacts:
    """Read and log the facts of a CUDA device (a rank's start-up line), warning on a row the census never met."""
    got = facts(device.index if device.index is not None else torch.cuda.current_device())
    log.info("device %s", got.describe())
    if got.capability not in ROWS:
        log.warning("sm_%d is not one of the architectures whose tiles are checked (bench.kernel_census: %s): a "
                    "kernel that needs more shared memory than it has fails at its first launch", got.capability,
                    ", ".join(f"sm_{r}" for r in ROWS))
    return got


def row(device: torch.device) -> int:
    """The table row kernels on `device` take: the assumed one inside `assume`, else the GPU's own on CUDA, else
    Hopper's."""
    if _assumed:
        return _assumed[-1]
    if device.type == "cuda":
        return facts(device.index if device.index is not None else torch.cuda.current_device()).row
    return HOPPER


@contextlib.contextmanager
def assume(arch: int) -> Iterator[None]:
    """Inside the block, every kernel takes `arch`'s row (the tests of each table, the census of each
    architecture)."""
    if arch not in ROWS:
        raise ValueError(f"no tile table row for sm_{arch} (rows: {ROWS})")
    _assumed.append(arch)
    try:
        yield
    finally:
        _assumed.pop()
