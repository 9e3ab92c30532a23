"""The ops layer: what the model's blocks call, resolved once per device to the torch reference or the fused kernels.

A block (model/*.py) states its math once, as calls on a `Forward` (model/forward.py: the Protocol, with every op's
signature) — the ops of one forward pass, bound to its batch and caches. Two implementations keep the same contract:
- `ops.reference.ReferenceForward`: the torch reference ops of kernels/*.py (the CPU path and the oracle of every
  fused kernel). Batch-wide tensors carry a multiple of ROW_TILE rows (kernels/linear.py says why).
- `ops.fused.FusedForward`: the fixed-schedule Triton kernels of kernels/gpu (CUDA, and Triton's CPU interpreter in
  the tests), over a device-side description of the rows (`ops.fused_rows.GpuRows`, decode-class rows first).
Both keep docs/design.md §5's exactness rules; the fused one in its GPU form (§5.1). Where the two paths take
different (documented) arithmetic — e.g. the streams' mean as a tree vs in stream order — each is fixed per path.

The ops take tensors, projections and the blocks' parameter records (model/params.py), never a block: nothing here
imports the block modules, so model/ and ops/ import each other without a circle (tests/docs/test_no_import_circles.py).

Which implementation runs is decided by the model once (`uses_fused`): the fused kernels where Triton can run on the
weights' device, the reference elsewhere. The fused modules are imported only then, so a CPU install needs no Triton.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from model.batch import Batch
    from model.cache import PagedCache
    from model.forward import Forward


def uses_fused(t: torch.Tensor) -> bool:
    """Whether a model whose weights are like `t` runs the fused kernels (CUDA with Triton)."""
    from kernels import gpu

    return gpu.active(t)


def begin(batch: "Batch", cache: "PagedCache", *, fused: bool) -> "Forward":
    """The ops of one forward over `batch` (a fused forward needs the decode-class sequences first: Batch.permuted)."""
    if fused:
        from ops.fused import FusedForward

        return FusedForward(batch, cache)
    from ops.reference import ReferenceForward

    return ReferenceForward(batch, cache)
