"""`serve-rank --rest-fp8-kernel` on a loaded model: every projection's fp8 run that kernels/gpu/fp8_dense.py
`chooses` gets humming's copy for its decode rows (the ops then route it: ops/fused.py `project`). Runs once after
the weights are loaded and before CUDA graphs are captured or the rank warms up, so no capture compiles.

The shape the choice reads is the whole linear's, over every virtual shard: the same at every TP size, so TP = 1, 2
and 4 run one kernel per linear and keep their bits (docs/design.md §5.3). Row-parallel projections take another
input per shard and their outputs are the model's width, stacked ones an input per linear: they always stay on ours.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from model.memory_parts import children
from model.projection import COLUMNS, ROWS, Projection


def projections(root: object) -> Iterator[Projection]:
    """Every Projection `root`'s objects reach, once each."""
    seen: set[int] = set()
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, torch.Tensor):
            continue
        seen.add(id(obj))
        if isinstance(obj, Projection):
            yield obj
            continue
        todo.extend(child for _, child in children(obj))


def prepare(model: object, setting: str, virtual: int, dtype: torch.dtype) -> str:
    """Repack the chosen runs of `model`'s projections in place (`virtual`: the model's virtual shard count);
    returns a log line saying what was repacked."""
    from kernels.gpu import fp8_dense
    from kernels.gpu.wtiles import WeightArgs

    count = nbytes = 0
    for p in projections(model):
        if p.cut == ROWS or p.stacked > 1:  # an input per shard (or per stacked linear): never humming's broadcast
            continue
        for i, part in enumerate(p.parts):
            if not isinstance(part, WeightArgs) or isinstance(part, fp8_dense.Fp8Dense):
                continue
            n = part.n * (virtual if p.cut == COLUMNS else 1)
            if fp8_dense.chooses(part.fmt, (part.block_n, part.block_k), n, part.k, setting):
                p.parts[i] = fp8_dense.prepare(part, dtype)
                count += 1
                nbytes += part.data.numel()
    return f"rest fp8 kernel {setting}: {count} fp8 runs repacked for decode rows ({nbytes / 2**30:.2f} GiB more)"
