"""Triton (GPU) fast paths of the ops in `kernels/`, each beside its torch reference twin (docs/design.md §3, §5.1).

The torch functions in `kernels/*.py` stay the CPU path and the parity oracle; the modules here run on CUDA. Every
kernel keeps the GPU exactness rules: its schedule (tiles, splits, reduction order) is a function of weight shapes
and absolute positions only, never of how many rows share the call, so a row's bits do not depend on its company.

`active(t)` says whether a tensor should take the Triton path. Under `TRITON_INTERPRET=1` (Triton's CPU
interpreter) the kernels also run on CPU tensors, which is how the CPU test suite checks their logic against the
torch twins; the model itself only switches to them on CUDA.
"""

from __future__ import annotations

import os

import torch

try:  # Triton ships with CUDA builds of torch; the CPU build may lack it, and then only the torch path exists.
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAVE_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def active(t: torch.Tensor) -> bool:
    """True when the model should run Triton kernels on tensors like `t` (CUDA with Triton installed)."""
    return HAVE_TRITON and t.is_cuda and not INTERPRET


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`, without waiting for the device's queue: a plain `.to("cuda")` copy is synchronous
    (it waits for every kernel queued before it), which would stall the host behind the round still running. The
    copy goes through pinned memory (torch's caching host allocator keeps it until the copy has run)."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
