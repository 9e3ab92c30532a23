"""The price of exactness: the engine's fixed-schedule products swapped for the library kernels a non-exact engine
would call, for bench.decode_prefill's `--schedule ours,library` (docs/exactness.md, "The price of exactness").

Our GEMMs and grouped experts take a tile and a K split chosen by the weight's shape and the row class, never by how
many rows share the call (docs/design.md §5.1), so a row's bits do not depend on its company. cuBLAS, cuBLASLt and
the grouped-GEMM libraries choose their algorithm (tiles, split-K, stream-K) by M: faster where they guess well, and a
row's bits then depend on the batch. `library_schedule()` patches the entry points the fused ops call
(`kernels.gpu.gemm.bmm` / `matmul`, which every projection of `ops/fused.py` goes through, `kernels.gpu.moe.experts`,
and for integer experts `kernels.gpu.int_moe.experts` / `_product`) with their library twins and puts the originals
back on exit. Bench-only: nothing under services/ can reach it, and under it nothing is row-invariant.

What each twin runs, and what differs from ours:
- dense products (bf16; fp32 in the CPU tests): `torch.nn.functional.linear` / `torch.matmul` / `torch.bmm`
  (cuBLAS). A product whose input is broadcast to every virtual shard runs as one product over the stacked weights
  ([S x N, K]), as a one-weight engine would. fp32 outputs (router, lm_head, row-parallel partials) come from
  `torch.mm(..., out_dtype=float32)` on CUDA: the fp32 accumulator itself, as ours writes it.
- fp8 products: our fp8 product is weight-only (W8A16): each weight tile is value x scale in fp32, rounded to the
  activation dtype, and the product runs in bf16 with fp32 accumulation; the activations stay bf16. cuBLASLt's fp8
  GEMM (`torch._scaled_mm`, `torch.nn.functional.scaled_mm`) multiplies fp8 by fp8, so its twin quantizes the
  activations on the fly, as fp8 engines do (DeepSeek-V3's recipe): per 1 x 128 group for 128 x 128 block-scaled
  weights (`BlockWise1x128` x `BlockWise128x128`), per row for per-channel weights (`RowWise`), scale = amax / 448
  (kernels/quant/fp8.py's rule). So the library twin also rounds every activation to e4m3 (about 2^-4 relative),
  applies the weight scales to the fp32 accumulator instead of to the tile, and runs the quantization as a few torch
  ops where an engine fuses it into one kernel (a cost counted against the library).
- dense experts: `torch._grouped_mm` (CUTLASS's grouped GEMM) over the pairs sorted by expert; gate and up as two
  grouped products, our torch twin's clamped SwiGLU, down per virtual shard, and the routing-weighted sum by
  `index_add_` (atomics: any order). Down's output is rounded to the activation dtype before the routing weight
  (ours keeps it fp32).
- fp8 experts: `torch.nn.functional.scaled_grouped_mm` with the same 1 x 128 / 128 x 128 block scaling, where this
  torch build has it for the GPU at hand.
- int experts (humming-kernels): humming's own heuristic config for the call's row count, batch invariance off
  (`humming.tune.get_heuristics_config`), in place of our pinned per-class config.
Kept ours (recorded as such, with the reason): EXL3, W4A16 and int products and EXL3 / W4A16 experts (no library
kernel reads those packings), attention (MLA's latent and expanded forms, the DSA indexer, KDA), mHC's decode-row
projection (fused into `mhc.pre`'s kernels), and the elementwise, norm, routing and combine kernels (no schedule
to swap: each row is computed alone already).

Every kind's first call is checked against ours (normwise relative difference, eager calls only): a twin that raises
or disagrees beyond its tolerance is turned off for the rest of the run and its kind recorded as kept, with why.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
FP8_GROUP = 128  # cuBLASLt's block scaling: 1 x 128 activation groups, 128 x 128 weight blocks

# The op kinds a library twin can take over, and the ones that stay ours.
DENSE = "dense products"
FP8 = "fp8 products"
DENSE_EXPERTS = "dense experts"
FP8_EXPERTS = "fp8 experts"
INT_EXPERTS = "int experts"
LIBRARY = {
    DENSE: "torch.nn.functional.linear / torch.matmul / torch.bmm (cuBLAS, its algorithm chosen by M)",
    FP8: "torch._scaled_mm RowWise / torch.nn.functional.scaled_mm BlockWise1x128 x BlockWise128x128 (cuBLASLt), "
         "activations quantized to e4m3 on the fly",
    DENSE_EXPERTS: "torch._grouped_mm (CUTLASS grouped GEMM) over the pairs sorted by expert, index_add_ combine",
    FP8_EXPERTS: "torch.nn.functional.scaled_grouped_mm, 1 x 128 / 128 x 128 block scales",
    INT_EXPERTS: "humming-kernels with its own heuristic config for the row count, batch invariance off",
}
# Products and experts whose storage no library kernel reads: ours runs, and the kind is recorded as kept.
NO_LIBRARY = "no library kernel reads this packing (kept ours)"
# What the swap never touches, and why (the results list it beside the swapped kinds).
NEVER_SWAPPED = {
    "attention": "MLA's prompt rows attend over the DSA indexer's chosen pools of compressed latent rows (no "
                 "scaled_dot_product_attention form) or, inside the selection size, in the expanded form over "
                 "per-group tiles of packed sequences sharing one key list (not SDPA's dense [B, H, L, D] "
                 "layout); decode rows use the latent form; KDA is a recurrence (fla-core): not swapped",
    "mHC decode projection": "fused with the Sinkhorn and norm row pass in mhc.pre's own kernels (its prompt rows "
                             "go through gemm.matmul and are swapped)",
    "norms, SwiGLU, routing, combine, cache writes": "elementwise or per-row kernels: no tile or K split to choose",
}
# Normwise relative difference from ours that a kind's first call may show (dense: accumulation order and
# rounding; fp8: the activations rounded to e4m3 as well).
TOLERANCE = {DENSE: 2e-2, DENSE_EXPERTS: 2e-2, FP8: 0.15, FP8_EXPERTS: 0.15, INT_EXPERTS: 2e-2}


@dataclass
class SwapRecord:
    """What the library twins did in one run: kinds they ran (and how often Python called them: CUDA graph replays
    call nothing), kinds kept ours with why, each kind's first-call difference from ours."""
    swapped: dict[str, int] = field(default_factory=dict)
    kept: dict[str, dict] = field(default_factory=dict)
    checks: dict[str, float] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)  # kind -> why its twin is off for the rest of the run
    check: bool = True  # compare each kind's first (eager) call with ours
    fp8_min_rows: int = 4  # cuBLASLt's block-scaled fp8 wants M a multiple of 4 (raised to 128 if it refuses)

    def ran(self, kind: str) -> None:
        self.swapped[kind] = self.swapped.get(kind, 0) + 1

    def keep(self, kind: str, why: str) -> None:
        entry = self.kept.setdefault(kind, {"calls": 0, "why": why})
        entry["calls"] += 1
        entry["why"] = why

    def kinds(self) -> tuple[set[str], set[str]]:
        """(kinds run by a library twin, kinds kept ours) so far."""
        return set(self.swapped), set(self.kept)

    def as_dict(self) -> dict:
        return {"swapped": {k: {"calls": n, "library": LIBRARY[k]} for k, n in sorted(self.swapped.items())},
                "kept": dict(sorted(self.kept.items())),
                "first_call_difference": dict(sorted(self.checks.items())),
                "never_swapped": NEVER_SWAPPED}


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def relative_difference(y: torch.Tensor, ref: torch.Tensor) -> float:
    """|y - ref| / |ref| (Frobenius), nan when either holds a non-finite value."""
    y, ref = y.float(), ref.float()
    if not (torch.isfinite(y).all() and torch.isfinite(ref).all()):
        return float("nan")
    return float((y - ref).norm() / ref.norm().clamp_min(1e-30))


def _run(record: SwapRecord, kind: str, library: Callable[[], torch.Tensor], ours: Callable[[], torch.Tensor]
         ) -> torch.Tensor | None:
    """The library twin's result for one call of `kind`, or None when the twin is off for this kind (it raised, or
    its first call disagreed with ours): the caller then runs ours. Eager calls are guarded; a call inside a CUDA
    graph capture is not (the eager step before every capture has already met the same shapes)."""
    if kind in record.refused:
        return None
    if _capturing():
        y = library()
        record.ran(kind)
        return y
    try:
        y = library()
    except Exception as e:  # noqa: BLE001 - a library that refuses these shapes / this GPU: recorded, ours runs
        if "out of memory" in str(e).lower():
            raise
        record.refused[kind] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        return None
    if record.check and kind not in record.checks:
        diff = relative_difference(y, ours())
        record.checks[kind] = diff
        if not diff <= TOLERANCE[kind]:
            record.refused[kind] = f"first call differs from ours by {diff:.3g} (normwise, tolerance {TOLERANCE[kind]})"
            return None
    record.ran(kind)
    return y


# ----- dense products -----

def _mm(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] @ w [N, K].T by torch's own product, in out_dtype."""
    if out_dtype == x.dtype:
        return F.linear(x, w)
    if x.is_cuda and out_dtype == torch.float32 and x.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(x, w.t(), out_dtype=torch.float32)  # cuBLAS writes its fp32 accumulator
    return F.linear(x.to(out_dtype), w.to(out_dtype)) if x.device.type == "cpu" else F.linear(x, w).to(out_dtype)


def _bmm(x: torch.Tensor, w_t: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x [B, M, K] @ w_t [B, K, N] by torch's batched product, in out_dtype (fp32 from 16-bit operands: the fp32
    accumulator where this torch's bmm can write it, else the 16-bit result widened)."""
    if out_dtype == x.dtype:
        return torch.bmm(x, w_t)
    if x.device.type == "cpu":
        return torch.bmm(x.to(out_dtype), w_t.to(out_dtype))
    if out_dtype == torch.float32 and _BMM_FP32_OUT[0]:
        try:
            return torch.bmm(x, w_t, out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):  # refused before any launch
            _BMM_FP32_OUT[0] = False
    return torch.bmm(x, w_t).to(out_dtype)


_BMM_FP32_OUT = [True]  # whether torch.bmm takes out_dtype here (found out on the first call that needs it)


def dense_product(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x [B, M, K] through w [B, N, K] -> [B, M, N] by cuBLAS: one product for one weight; x broadcast to a stack of
    weights (virtual shards, MLA's per-head W_kv) as one product over the stacked weights; else a batched one."""
    b, m, k = x.shape
    n = w.shape[1]
    if b == 1:
        return _mm(x[0], w[0], out_dtype).unsqueeze(0)
    if x.stride(0) == 0 and w.is_contiguous():
        return _mm(x[0], w.reshape(b * n, k), out_dtype).view(m, b, n).transpose(0, 1).contiguous()
    return _bmm(x, w.transpose(1, 2), out_dtype)


# ----- fp8 products -----

def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scale [M, 1]): each row over its amax / 448 (1 for an all-zero row)."""
    amax = x.abs().amax(dim=1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (x.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def quantize_groups(x: torch.Tensor, group: int = FP8_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scale [M, K / group]): each 1 x group block over its own amax / 448."""
    m, k = x.shape
    xg = x.float().view(m, k // group, group)
    amax = xg.abs().amax(dim=2, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (xg / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3).view(m, k), scale.view(m, k // group)


def _fp8_out(x: torch.Tensor) -> torch.dtype:
    """The output dtype asked of an fp8 product: bf16 for bf16 rows (cuBLASLt's row-wise kernels write 16-bit
    outputs only), fp32 for the CPU tests' fp32 rows."""
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32


def fp8_channel_product(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype
                        ) -> torch.Tensor:
    """x [M, K] through e4m3 w [N, K] with per-channel scales [N, 1] -> [M, N]: rows quantized per row, then
    `torch._scaled_mm` with RowWise scales."""
    xq, sa = quantize_rows(x)
    sb = scale.reshape(1, -1).float().contiguous()
    return torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=sb, out_dtype=_fp8_out(x)).to(out_dtype)


def fp8_block_product(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
                      min_rows: int = 4) -> torch.Tensor:
    """x [M, K] through e4m3 w [N, K] with 128 x 128 block scales [N / 128, K / 128] -> [M, N]: rows quantized per
    1 x 128 group, then cuBLASLt's block-scaled GEMM (`scaled_mm` BlockWise1x128 x BlockWise128x128; rows padded to
    a multiple of `min_rows`, the scales laid out as it reads them: the activations' outer-dim-major, the weight's K
    blocks padded to a multiple of 4). Off CUDA (the tests) the same math runs as one RowWise `_scaled_mm` per K
    block, summed in fp32: torch has no CPU kernel for block scales."""
    m, k = x.shape
    kb = k // FP8_GROUP
    if x.is_cuda:
        rows = -(-max(m, 1) // min_rows) * min_rows
        xp = F.pad(x, (0, 0, 0, rows - m)) if rows != m else x
        xq, sa = quantize_groups(xp)
        sb = torch.zeros(scale.shape[0], -(-kb // 4) * 4, dtype=torch.float32, device=x.device)
        sb[:, :kb] = scale.float()
        y = F.scaled_mm(xq, w.t(), sa.t().contiguous().t(), F.ScalingType.BlockWise1x128, sb.t(),
                        F.ScalingType.BlockWise128x128, output_dtype=_fp8_out(x))
        return y[:m].to(out_dtype)
    xq, sa = quantize_groups(x)
    n = w.shape[0]
    acc = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    for j in range(kb):
        cols = slice(j * FP8_GROUP, (j + 1) * FP8_GROUP)
        sb = scale[:, j].float().repeat_interleave(FP8_GROUP)[:n].reshape(1, n).contiguous()
        acc += torch._scaled_mm(xq[:, cols], w[:, cols].t(), scale_a=sa[:, j:j + 1].contiguous(), scale_b=sb,
                                out_dtype=torch.float32)
    return acc.to(out_dtype)


def fp8_product(x: torch.Tensor, wa, out_dtype: torch.dtype, min_rows: int = 4) -> torch.Tensor:
    """x [B, M, K] through an fp8 WeightArgs stack [B, N, K] -> [B, M, N], one library product per batch entry."""
    from kernels.gpu.wtiles import Fmt
    outs = []
    for i in range(x.shape[0]):
        xi = x[i].contiguous()
        if wa.fmt is Fmt.FP8_CHANNEL:
            outs.append(fp8_channel_product(xi, wa.data[i], wa.scale[i], out_dtype))
        else:
            outs.append(fp8_block_product(xi, wa.data[i], wa.scale[i], out_dtype, min_rows))
    return torch.stack(outs)


def _fp8_block_ok(wa) -> bool:
    """Whether cuBLASLt's block scaling reads this weight: 128 x 128 blocks and K whole 128-wide groups."""
    return (wa.block_n, wa.block_k) == (FP8_GROUP, FP8_GROUP) and wa.k % FP8_GROUP == 0


def _kept_kind(fmt, what: str) -> str:
    """A format's kind name in the record: "exl3 products", "w4a16 experts", ..."""
    return f"{_FORMAT_NAMES.get(fmt.name, fmt.name.lower())} {what}"


_FORMAT_NAMES = {"DENSE": "dense", "FP8_BLOCK": "fp8", "FP8_CHANNEL": "fp8", "INT4": "w4a16", "INT": "int",
                 "EXL3": "exl3"}


def _bmm_twin(original: Callable, record: SwapRecord) -> Callable:
    """kernels.gpu.gemm.bmm's library twin (same signature)."""
    from kernels.gpu.wtiles import Fmt, WeightArgs

    def bmm(x: torch.Tensor, w, decode_rows: int, out_dtype: torch.dtype | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
        dtype = out_dtype or x.dtype
        fmt = w.fmt if isinstance(w, WeightArgs) else Fmt.DENSE
        if fmt is Fmt.DENSE:
            data = w.data if isinstance(w, WeightArgs) else w
            data = data if data.dim() == 3 else data.unsqueeze(0)
            data = data if data.dtype == x.dtype else data.to(x.dtype)  # ours reads weight tiles in x's dtype too
            kind, library = DENSE, (lambda: dense_product(x, data, dtype))
        elif fmt is Fmt.FP8_CHANNEL or (fmt is Fmt.FP8_BLOCK and _fp8_block_ok(w)):
            kind, library = FP8, (lambda: _fp8_retrying(x, w, dtype, record))
        else:
            record.keep(_kept_kind(fmt, "products"),
                        "cuBLASLt's block scaling takes 128 x 128 blocks only" if fmt is Fmt.FP8_BLOCK else NO_LIBRARY)
            return original(x, w, decode_rows, out_dtype, out=out)
        y = _run(record, kind, library, lambda: original(x, w, decode_rows, out_dtype))
        if y is None:
            record.keep(kind, record.refused[kind])
            return original(x, w, decode_rows, out_dtype, out=out)
        return y if out is None else out.copy_(y)
    return bmm


def _fp8_retrying(x: torch.Tensor, w, dtype: torch.dtype, record: SwapRecord) -> torch.Tensor:
    """fp8_product; when cuBLASLt refuses a block-scaled call of few rows (eager), once more with rows padded to
    128, which then holds for the rest of the run."""
    try:
        return fp8_product(x, w, dtype, record.fp8_min_rows)
    except RuntimeError:
        if _capturing() or record.fp8_min_rows >= 128 or not x.is_cuda:
            raise
        record.fp8_min_rows = 128
        return fp8_product(x, w, dtype, record.fp8_min_rows)


def _matmul_twin(bmm: Callable) -> Callable:
    """kernels.gpu.gemm.matmul's twin: the same reshape around the twin bmm."""
    def matmul(x: torch.Tensor, w, decode_rows: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        y = bmm(x.reshape(-1, x.shape[-1]).unsqueeze(0), w, decode_rows, out_dtype)
        return y.reshape(*lead, y.shape[-1])
    return matmul


# ----- experts -----

@dataclass
class Pairs:
    """A MoE step's (row, expert) pairs sorted by expert, as the grouped library GEMMs read them."""
    order: torch.Tensor  # [P] pair index (row * pairs_per_row + j) in expert order
    token: torch.Tensor  # [P] the pair's row
    valid: torch.Tensor  # [P] bool: a real pair (padding rows' ids sort last)
    offs: torch.Tensor  # [E] int32: each expert's end in the sorted pairs
    weight: torch.Tensor  # [P] fp32 routing weight


def sort_pairs(ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> Pairs:
    """Sort by expert on the device (no host sync: a CUDA graph can capture it); ids >= num_experts are no pair."""
    flat = ids.reshape(-1).long().clamp(max=num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    order = torch.sort(flat, stable=True).indices
    return Pairs(order, order // ids.shape[1], flat[order] < num_experts,
                 torch.cumsum(counts[:num_experts], 0).to(torch.int32), weights.reshape(-1)[order].float())


def grouped_dense(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a [P, K] (rows sorted by expert) through w [E, N, K] -> [P, N]: `torch._grouped_mm`; rows past the last
    offset are not computed."""
    return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)


def grouped_fp8(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a [P, K] through e4m3 w [E, N, K] with 128 x 128 block scales [E, N / 128, K / 128] -> [P, N] in a's dtype:
    rows quantized per 1 x 128 group, then `scaled_grouped_mm` (CUDA), or per expert `fp8_block_product`'s CPU form
    (the tests; it reads the offsets on the host)."""
    if not a.is_cuda:
        out = torch.zeros(a.shape[0], w.shape[1], dtype=a.dtype)
        start = 0
        for e, end in enumerate(offs.tolist()):
            if end > start:
                out[start:end] = fp8_block_product(a[start:end], w[e], scale[e], a.dtype)
            start = end
        return out
    k = a.shape[1]
    kb = k // FP8_GROUP
    aq, sa = quantize_groups(a)
    e, n = w.shape[0], w.shape[1]
    l4 = -(-kb // 4) * 4
    # the weight scales as the grouped kernel reads them: [E, K blocks padded to 4, N blocks], K-block-major
    sb = torch.empty_strided((e, l4, n // FP8_GROUP), (l4 * (n // FP8_GROUP), 1, l4), dtype=torch.float32,
                             device=a.device).zero_()
    sb[:, :kb].copy_(scale.float().transpose(1, 2))
    return F.scaled_grouped_mm(aq, w.transpose(1, 2), sa.t().contiguous().t(), F.ScalingType.BlockWise1x128, sb,
                               F.ScalingType.BlockWise128x128, offs=offs, output_dtype=_fp8_out(a)).to(a.dtype)


def library_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate, up, down, limit: float,
                    shards: int = 1) -> torch.Tensor:
    """kernels.gpu.moe.experts' math by grouped library GEMMs: x [T, D], ids / weights [T, P], gate / up
    [E, I, D] and down [shards x E, D, I / shards] (dense tensors, or fp8 block-scaled WeightArgs) -> [shards, T, D]
    fp32 partials."""
    from kernels.moe import swiglu
    from kernels.gpu.wtiles import WeightArgs

    t, d = x.shape
    stacks = [w.data if isinstance(w, WeightArgs) and w.fmt.name == "DENSE" else w for w in (gate, up, down)]
    fp8 = isinstance(stacks[0], WeightArgs)
    n_exp = stacks[0].data.shape[0] if fp8 else stacks[0].shape[0]
    pairs = sort_pairs(ids, weights, n_exp)
    xs = x[pairs.token]

    def product(a: torch.Tensor, w, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        if fp8:
            return grouped_fp8(a, w.data[lo:hi], w.scale[lo:hi], pairs.offs)
        return grouped_dense(a, w[lo:hi], pairs.offs)
    g, u = product(xs, stacks[0]), product(xs, stacks[1])
    h = swiglu(g, u, limit)
    width = h.shape[1] // shards
    out = torch.zeros(shards, t, d, dtype=torch.float32, device=x.device)
    for s in range(shards):
        y = product(h[:, s * width:(s + 1) * width].contiguous(), stacks[2], s * n_exp, (s + 1) * n_exp)
        out[s].index_add_(0, pairs.token, torch.where(pairs.valid[:, None], y.float() * pairs.weight[:, None], 0.0))
    return out


def _experts_twin(original: Callable, record: SwapRecord) -> Callable:
    """kernels.gpu.moe.experts' library twin (same signature); integer experts go on to int_moe.experts (patched
    as well), EXL3 / W4A16 / int stacks run ours."""
    from kernels.gpu.int_moe import IntExperts
    from kernels.gpu.wtiles import Fmt, WeightArgs

    def experts(x, ids, weights, gate, up, down, limit, decode_rows, shards=1, grouping=None):
        def ours() -> torch.Tensor:
            return original(x, ids, weights, gate, up, down, limit, decode_rows, shards=shards, grouping=grouping)
        if isinstance(gate, IntExperts):
            return ours()
        fmt = gate.fmt if isinstance(gate, WeightArgs) else Fmt.DENSE
        if fmt is Fmt.DENSE:
            kind = DENSE_EXPERTS
        elif fmt is Fmt.FP8_BLOCK and _fp8_block_ok(gate) and _fp8_block_ok(down):
            kind = FP8_EXPERTS
        else:
            why = {Fmt.FP8_BLOCK: "the grouped fp8 twin takes 128 x 128 blocks only",
                   Fmt.FP8_CHANNEL: "no twin wired for per-channel fp8 experts (the bench's recipes draw blocks)"}
            record.keep(_kept_kind(fmt, "experts"), why.get(fmt, NO_LIBRARY))
            return ours()
        y = _run(record, kind, lambda: library_experts(x, ids, weights, gate, up, down, limit, shards), ours)
        if y is None:
            record.keep(kind, record.refused[kind])
            return ours()
        return y
    return experts


@dataclass(frozen=True)
class HummingChoice:
    """humming's own config for one call (hashable, so the twin caches its build): `config()` as int_moe's pinned
    Tile gives it, `block_m` for the grouping."""
    block_m: int
    cfg: str  # JSON

    def config(self) -> dict:
        return json.loads(self.cfg)


@functools.lru_cache(maxsize=None)
def humming_choice(layer: str, rows: int, device: int) -> HummingChoice:
    """humming's heuristic config for `rows` rows of this layer's indexed MoE GEMM, batch invariance off."""
    from humming.tune import get_heuristics_config
    cfg = get_heuristics_config(json.loads(layer), shape_m=rows, use_batch_invariant=False, gemm_type="indexed",
                                device=device)
    return HummingChoice(int(cfg["block_shape"][0]), json.dumps(cfg, sort_keys=True))


def stream_k_locks(cfg: dict, sms: int) -> int:
    """How many int32 lock counters a launch of humming config `cfg` needs on a GPU of `sms` SMs: none without
    stream-K, else humming's launcher's floor (`check_tensor_locks`, csrc/launcher/tensor.h): the resident CTAs
    (`num_ctas_per_sm` x the config's `num_sms`, or the GPU's) in clusters, plus a tenth, times a tile's locks (one per
    output warpgroup under wgmma, else one; the warpgroup count bounds both)."""
    if not cfg.get("use_stream_k", True):  # (humming's default is on)
        return 0
    cluster = cfg.get("multi_cast_size_a", 1) * cfg.get("multi_cast_size_b", 1) * cfg.get("umma_cta_group_size", 1)
    groups = cfg.get("num_ctas_per_sm", 1) * (cfg.get("num_sms") or sms) // cluster
    (bm, bn, _), (wm, wn, _) = cfg["block_shape"], cfg["warp_shape"]
    return (groups + groups // 10) * cluster * max(1, bm // wm * (bn // wn) // 4)


@functools.lru_cache(maxsize=None)
def _locks(device: int, n: int) -> torch.Tensor:
    """Stream-K's lock counters for one device: humming refuses a stream-K launch without them (our pinned configs
    have no stream-K, so int_moe passes none). Zeroed once: every launch leaves them zero again (a tile's last slice
    resets its lock), so gate|up's and down's launches, one after the other on the stream, share them."""
    return torch.zeros(n, dtype=torch.int32, device=device)


def _int_twins(experts: Callable, product: Callable, record: SwapRecord) -> tuple[Callable, Callable]:
    """int_moe.experts' and int_moe._product's twins: humming's config for the call's rows, compiled without batch
    invariance, launched with stream-K's locks."""
    compute = json.dumps({"gemm_type": "indexed", "use_batch_invariant": False})

    @functools.lru_cache(maxsize=None)
    def build(layer: str, t: HummingChoice, device: int):
        from humming.kernel.humming import HummingKernel
        return HummingKernel.prepare_kernels(layer, compute, json.dumps([[0, 1 << 30, t.config()]]), device=device)

    def product_twin(stack, x, out, sorted_ids, expert_ids, padded, top_k, t):
        if not isinstance(t, HummingChoice):
            return product(stack, x, out, sorted_ids, expert_ids, padded, top_k, t)
        from humming.ops import launch_kernel

        from kernels.gpu import arch as gpu_arch
        device = x.device.index or 0
        sms = gpu_arch.facts(device).sms
        launch_kernel(configs=build(stack.layer, t, device), inputs=x, weight=stack.weight, weight_scale=stack.scale,
                      outputs=out, sorted_ids=sorted_ids, expert_ids=expert_ids, num_tokens_padded=padded,
                      locks=_locks(device, stream_k_locks(t.config(), sms)), top_k=top_k)

    def experts_twin(x, ids, weights, ie, limit, rows, out, row0, pinned=None, tab=None):
        def library() -> torch.Tensor:  # (groups for its own tile: the routing's tables are for ours)
            choice = humming_choice(ie.gate_up.layer, x.shape[0] * ids.shape[1], x.device.index or 0)
            experts(x, ids, weights, ie, limit, rows, out, row0, pinned=choice)
            return out[:, row0:row0 + x.shape[0]]

        def ours() -> torch.Tensor:
            ref = out.clone()
            experts(x, ids, weights, ie, limit, rows, ref, row0, tab=tab)
            return ref[:, row0:row0 + x.shape[0]]
        if _run(record, INT_EXPERTS, library, ours) is None:
            record.keep(INT_EXPERTS, record.refused[INT_EXPERTS])
            experts(x, ids, weights, ie, limit, rows, out, row0, pinned=pinned, tab=tab)
    return experts_twin, product_twin


@contextmanager
def library_schedule(record: SwapRecord | None = None) -> Iterator[SwapRecord]:
    """Within: the fused ops' products and experts run their library twins (module docstring); on exit every patched
    entry point is the original again, even after an exception. Not re-entrant."""
    from kernels.gpu import gemm, int_moe
    from kernels.gpu import moe as gpu_moe

    record = record if record is not None else SwapRecord()
    saved = [(gemm, "bmm", gemm.bmm), (gemm, "matmul", gemm.matmul), (gpu_moe, "experts", gpu_moe.experts),
             (int_moe, "experts", int_moe.experts), (int_moe, "_product", int_moe._product)]
    bmm = _bmm_twin(gemm.bmm, record)
    int_experts, int_product = _int_twins(int_moe.experts, int_moe._product, record)
    try:
        gemm.bmm, gemm.matmul = bmm, _matmul_twin(bmm)
        gpu_moe.experts = _experts_twin(gpu_moe.experts, record)
        int_moe.experts, int_moe._product = int_experts, int_product
        yield record
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)
