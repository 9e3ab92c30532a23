"""A layer's projection: one or several stored linears joined along their outputs, as the ops layer consumes it.

The model states which linears a projection reads (e.g. KDA's q|k|v|b, MLA's q_a|kv_a|indexer inputs), so the
fused path reads the layer input once per projection. How the result is stored is the loader's business:
- on the CPU every linear is dense (quantized ones dequantized by their torch reference) and a projection is one
  tensor, the torch reference's operand;
- on CUDA each linear stays in its stored format, and consecutive linears of one format are joined into one
  packed operand (`kernels/gpu/wtiles.WeightArgs`), so a projection whose linears share a format is one GEMM and a
  mixed one (fp8 q|k|v beside a dense b) is one GEMM per run of a format, written into one output.

Sharded projections are stacked over the rank's local virtual shards ([S, N, K]: column-parallel = the shard's
output rows, row-parallel = its input columns); replicated ones are [N, K].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kernels.quant import QuantizedWeight
from model.weights import WeightReader

COLUMNS, ROWS = 0, 1  # the dim a sharded projection is cut along (its outputs, or its inputs: row-parallel)


@dataclass
class Projection:
    parts: list[Any]  # in output order: dense tensors, or (on CUDA) kernels/gpu/wtiles.WeightArgs
    widths: list[int]  # output rows of each part (per shard)
    outputs: list[int]  # output rows of each linear joined here (per shard), to split the result by
    cut: int | None  # COLUMNS / ROWS: stacked over local virtual shards ([S, N, K]); None: replicated ([N, K])
    stacked: int = 1  # linears stacked along the shard dim, each with its own input (`load_stacked`)

    @property
    def sharded(self) -> bool:
        return self.cut is not None

    @property
    def n(self) -> int:
        return sum(self.widths)

    @property
    def dense(self) -> torch.Tensor:
        """The whole projection as one dense tensor (the torch reference's operand)."""
        if len(self.parts) != 1 or not isinstance(self.parts[0], torch.Tensor):
            raise TypeError("this projection is stored packed: only the fused kernels read it")
        return self.parts[0]

    @property
    def shards(self) -> int:
        first = self.parts[0]
        return (first.shape[0] if isinstance(first, torch.Tensor) else first.data.shape[0]) if self.sharded else 1


def load(reader: WeightReader, keys: list[str], dim: int | None = None) -> Projection:
    """The linears `keys` joined along their outputs. dim None: replicated; COLUMNS / ROWS: this rank's virtual
    shards cut along that dim. On CUDA quantized linears stay packed; elsewhere every linear is read dense."""
    return join(_read(reader, keys, dim), cut=dim)


def _read(reader: WeightReader, keys: list[str], dim: int | None) -> list[list[Any]]:
    """Each linear's local shards (one entry when replicated): packed on CUDA, dense elsewhere."""
    packed = reader.device.type == "cuda"
    if dim is None:
        return [[reader.full_packed(k) if packed else reader.full(k)] for k in keys]
    return [reader.split_packed(k, dim) if packed else reader.split(k, dim) for k in keys]


def load_stacked(reader: WeightReader, keys: list[str]) -> Projection:
    """Column-parallel linears of one shape that each take an input of their own (KDA's f_b and g_b), stacked along
    the shard dim: [len(keys) x S, N, K], linear i's shards after linear i-1's, so one product runs them all
    (`Forward.shard_linear` with one input per linear). Linears stored in different formats are read dense: one
    operand holds a single format."""
    stored = _read(reader, keys, COLUMNS)
    shapes = {tuple(w.shape) for linear in stored for w in linear}
    if len(shapes) != 1:
        raise ValueError(f"{', '.join(keys)}: stacked linears need one shape, not {sorted(shapes)}")
    firsts = [linear[0] for linear in stored]
    if not all(_joinable(firsts[0], w) for w in firsts[1:]):
        stored = [[w if isinstance(w, torch.Tensor) else w.dequantize(reader.dtype).to(reader.device) for w in linear]
                  for linear in stored]
    shards = [w for linear in stored for w in linear]
    if isinstance(shards[0], torch.Tensor):
        part = torch.stack(shards)
    else:
        from kernels.gpu import wtiles  # packed operands exist on CUDA only

        part = wtiles.stack_quantized(shards)
    width = shards[0].shape[0]
    return Projection([part], [width], [width], COLUMNS, stacked=len(keys))


def join(stored: list[list[Any]], *, cut: int | None) -> Projection:
    """stored[i][j]: linear i's local shard j (one entry when replicated), dense or QuantizedWeight; cut: the dim
    the shards were cut along (None: replicated)."""
    sharded = cut is not None
    parts, widths = [], []
    run: list[list[Any]] = []
    for linear in stored + [None]:  # a None ends the last run
        if run and (linear is None or not _joinable(run[0][0], linear[0])):
            part, width = _join_run(run, sharded)
            parts.append(part)
            widths.append(width)
            run = []
        if linear is not None:
            run.append(linear)
    return Projection(parts, widths, [linear[0].shape[0] for linear in stored], cut)


def _joinable(a: Any, b: Any) -> bool:
    """Whether two linears can share one operand: both dense, or one quantized format with one parameter set (EXL3
    never: each weight carries its own Hadamard sign vectors, joined by no kernel)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return a.format == b.format != "exl3" and dict(a.params) == dict(b.params)


def _join_run(run: list[list[Any]], sharded: bool) -> tuple[Any, int]:
    first = run[0][0]
    width = sum(linear[0].shape[0] for linear in run)
    if isinstance(first, torch.Tensor):
        shards = [torch.cat(ws) for ws in zip(*run)]
        return (torch.stack(shards) if sharded else shards[0]), width
    from kernels.gpu import wtiles  # packed operands exist on CUDA only

    per_linear = [wtiles.stack_quantized(list(ws)) if sharded else _one(ws[0]) for ws in run]
    return (per_linear[0] if len(per_linear) == 1 else wtiles.cat(per_linear, dim=1)), width


def _one(w: QuantizedWeight) -> Any:
    from kernels.gpu import wtiles

    return wtiles.quantized(w.format, w.tensors, dict(w.params))
