"""Fixed-schedule GEMM: `out[b] = x[b] @ w[b].T` with a tile schedule that depends on (N, K) and the row class only.

Why not cuBLAS: it picks kernels and split-K by the row count, so one row's bits change with how many rows share
the call (docs/reference.md §6 measured logits moving by 0.17 at real dims). Here every output element is reduced
over K in the same order whatever M is: BLOCK_K steps in ascending K inside a split, splits summed in ascending
order by the tile's last split to finish (in the same launch: no second kernel adds the splits). M only changes how
many row tiles run, and the tensor-core product of a row never reads another row, so a row's result is the same
alone or among 2,048 others.

Two row classes get two schedules (docs/design.md §5.1; TensorFold does the same): decode-class rows (decode steps and
verify windows) are few and memory-bound, so their schedule splits K to put enough programs on the chip; prompt
rows (prefill chunks) are compute-bound and use big tiles with no split. A row always belongs to one class, so
each class's arithmetic is fixed; the classes differ from each other, as a decode row and a prompt row of the
same position are allowed to (documented in docs/design.md §5.1).

EXL3 weights run the same schedules over their decoded trellis tiles, between two row-wise Hadamard rotations
(kernels/gpu/hadamard.py: every row on its own, so invariance holds through them); their decode-class rows run the
hand-written CUDA product where it is built (kernels/gpu/exl3_cuda.py), its own fixed K order.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import triton
import triton.language as tl

from kernels.gpu import arch as gpu_arch, arrivals, exl3_cuda, hadamard, pdl
from kernels.gpu.pdl import prefetch_l2, wait_for_inputs
from kernels.gpu.swiglu import clamped_swiglu, swiglu as swiglu_kernel
from kernels.gpu.tile_order import grouped_tile
from kernels.gpu.wtiles import Fmt, WeightArgs, dense, weight_tile

# Prompt products at most this wide take narrow tiles and split K into up to _NARROW_SPLITS parts (schedule()).
_NARROW_N = 64
_NARROW_SPLITS = 8
# Programs the decode schedule aims for per GEMM (about two waves on an H200's 132 SMs). A constant, not the SM
# count of the device at hand, so the schedule stays a function of the shapes.
_DECODE_PROGRAMS = 256
# K steps each split keeps at least: 4, from bench.kernels' splitsweep of one layer's decode products at rows 1 and 8:
# against 8 the small bf16 / fp8 products run faster and the large ones the same; 2 loses on q_a at 8 rows, and a
# 512-program target on every shape it changes (docs/benchmarks.md, "GEMM tiles").
_DECODE_MIN_STEPS = 4
# Pipeline stages of the decode tile per architecture (kernels/gpu/arch.py). Hopper: 4, three 36 KiB steps of K in
# flight (108 KiB of shared memory). GB10 has 99 KiB a block, so 3 (72 KiB; bench.kernel_census). Stages pipeline
# the loads, never the arithmetic: the tile, the split and so the bits are Hopper's. Not timed on a GB10 yet.
_DECODE_STAGES = {gpu_arch.HOPPER: 4, gpu_arch.GB10: 3}


class RowClass(Enum):
    DECODE = "decode"
    PREFILL = "prefill"


@dataclass(frozen=True)
class Tile:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    warps: int
    stages: int
    group_m: int = 8  # row-tile swizzle for L2 reuse; changes which program runs a tile, never its arithmetic


# Prompt rows' tile per architecture. Hopper: 128 x 256 (warpgroup MMAs), the sweeps' choice. GB10 has
# warp-level MMAs only, which keep that tile's fp32 accumulator in registers: 255 a thread and 56-100 bytes spilled
# (bench.kernel_census); 128 x 128 takes 172-190 and spills none. Not timed on a GB10 yet.
_PROMPT_TILES = {gpu_arch.HOPPER: Tile(block_m=128, block_n=256, block_k=64, split_k=1, warps=8, stages=3),
                 gpu_arch.GB10: Tile(block_m=128, block_n=128, block_k=64, split_k=1, warps=8, stages=3)}


def schedule(n: int, k: int, rows: RowClass, arch: int = gpu_arch.HOPPER) -> Tile:
    """The tile schedule for a weight of N outputs and K inputs (pure function of the shape, the row class and the
    architecture's table row, kernels/gpu/arch.py).

    Chosen by bench/kernels.py's sweeps (their figures: docs/benchmarks.md, "GEMM tiles"): prompt rows take
    128x256 tiles; decode rows are bandwidth-bound, so their K is split until about 256 programs stream the weight,
    keeping at least _DECODE_MIN_STEPS K steps per split. Decode tiles are 16 rows x 128 outputs for every format:
    of the 16 tiles swept at one row, the best for fp8 and W4A16 and close to the best for bf16 (16x32, which W4A16
    runs much slower), and faster in every format than the 64x64 tile used before. One tile for every format keeps
    a quantized product the dense product of its dequantized weight (bit for bit in the interpreter; on a GPU within
    fp32 rounding, see tests/kernels/test_gpu_gemm.py)."""
    if rows is RowClass.PREFILL:
        if n <= _NARROW_N:
            # A narrow product (mHC's 24-wide projection of the 16,384-wide streams, once per block): the 128 x
            # 256 tile made one column tile and T / 128 programs, each walking all of K — at 8,192 rows 64 programs
            # for 132 SMs, a fraction of the HBM rate (docs/benchmarks.md, "GEMM tiles"). Narrow tiles and a K
            # split fixed by the shape (never by M) spread the same bytes over the GPU.
            return Tile(block_m=64, block_n=32, block_k=128,
                        split_k=decode_split(n, k, 32, 128, programs=_NARROW_SPLITS), warps=4, stages=4)
        return _PROMPT_TILES[arch]
    block_n, block_k = 128, 128
    return Tile(block_m=16, block_n=block_n, block_k=block_k, split_k=decode_split(n, k, block_n, block_k), warps=4,
                stages=_DECODE_STAGES[arch])


def decode_split(n: int, k: int, block_n: int, block_k: int, programs: int = _DECODE_PROGRAMS,
                 min_steps: int = _DECODE_MIN_STEPS) -> int:
    """The decode schedule's K split for tiles of block_n x block_k: doubled until about `programs` programs
    stream the weight, while K divides evenly and each split keeps at least `min_steps` K steps."""
    tiles = triton.cdiv(n, block_n)
    split = 1
    while tiles * split < programs and k % (2 * split * block_k) == 0 and k // (2 * split) >= min_steps * block_k:
        split *= 2
    return split


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, count_ptr, M, N, K, k_per_split,
                 sxb, sxm, sxk, swb, swn, swk, ssb, ssn, ssk, sob, som, son, wss, wsb, wsm, sxu, limit,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 SPLIT: tl.constexpr, IEEE: tl.constexpr, FMT: tl.constexpr, SB_N: tl.constexpr,
                 SB_K: tl.constexpr, X_GROUP: tl.constexpr = 1, SWIGLU: tl.constexpr = False,
                 PF_LINES: tl.constexpr = 0, PF_STEP: tl.constexpr = 1, PDL: tl.constexpr = False):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    batch = tl.program_id(2)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = grouped_tile(pid, num_m, num_n, GROUP_M)  # GROUP_M row tiles sweep the N tiles together
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_b = w_ptr + batch * swb
    k_lo = split * k_per_split
    if PF_LINES > 0:
        # The weight is constant through a step: its first PF_LINES lines of each of this program's rows (PF_STEP
        # elements a line) may stream into L2 while the kernel before still runs (kernels/gpu/pdl.py).
        pf_k = tl.minimum(k_lo + tl.arange(0, PF_LINES) * PF_STEP, K - 1)
        prefetch_l2(w_b + tl.minimum(rn, N - 1)[:, None] * swn + pf_k[None, :] * swk)
    wait_for_inputs(PDL)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    # X_GROUP consecutive weights of the stack share one input (`bmm`'s grouped input)
    x_base = x_ptr + (batch // X_GROUP) * sxb + rm[:, None] * sxm
    s_b = s_ptr + batch * ssb
    act = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        kk = k0 + rk
        a = tl.load(x_base + kk[None, :] * sxk, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        if SWIGLU:  # x holds gate | up: the product's input is their clamped SwiGLU, element by element
            u = tl.load(x_base + sxu + kk[None, :] * sxk, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            a = clamped_swiglu(a.to(tl.float32), u.to(tl.float32), limit, act)
        b = weight_tile(w_b, s_b, rn, k0, N, K, swn, swk, ssn, ssk, FMT, BLOCK_N, BLOCK_K, SB_N, SB_K, act)
        if IEEE:  # fp32 operands: true fp32 products (tl.dot would round them to tf32)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    inside = (rm[:, None] < M) & (rn[None, :] < N)
    out = out_ptr + batch * sob + rm[:, None] * som + rn[None, :] * son
    if SPLIT == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=inside)
    else:
        # Split K: each split parks its fp32 partial, and whichever split of the tile finishes last adds all of
        # them in split order (0, 1, ...) and writes the output — the same sum whatever the arrival order, with
        # no second launch. The tile's arrival counter goes back to 0 for the next launch (or graph replay).
        part = ws_ptr + batch * wsb + rm[:, None] * wsm + rn[None, :]
        tl.store(part + split * wss, acc, mask=inside)
        tl.debug_barrier()  # every thread's partial is stored before the release below
        tile = count_ptr + batch * tl.num_programs(0) + pid
        if tl.atomic_add(tile, 1, sem="acq_rel") == SPLIT - 1:
            total = tl.load(part, mask=inside, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT):
                total += tl.load(part + s * wss, mask=inside, other=0.0, cache_modifier=".cg")
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=inside)
            tl.atomic_xchg(tile, 0)


# Formats whose rows are plain elements along K: a line of a row is `pdl.LINE_BYTES / element size` elements.
_ROW_FORMATS = (Fmt.DENSE, Fmt.FP8_BLOCK, Fmt.FP8_CHANNEL)


def prefetch_lines(w: WeightArgs, tile: Tile, per_split: int, slices: int) -> tuple[int, int]:
    """(lines of each weight row a program prefetches before its wait, elements a line) for a decode-class launch:
    the launch's prefetch budget (pdl.prefetch_bytes) spread over the `slices` (block_n rows x one split's K) its
    programs read, at most a slice's K span, a power of two (a Triton range); (0, 1) without PDL, for other formats
    or K-strided weights. Prefetching returns nothing to a program, so this never changes a bit of the product,
    only when its bytes arrive."""
    budget = pdl.prefetch_bytes()
    if not budget or w.fmt not in _ROW_FORMATS or w.data.stride(2) != 1:
        return 0, 1
    step = pdl.LINE_BYTES // w.data.element_size()
    lines = min(triton.cdiv(per_split, step), budget // (slices * tile.block_n * pdl.LINE_BYTES))
    return (1 << (lines.bit_length() - 1), step) if lines else (0, 1)


def _launch(x: torch.Tensor, w: WeightArgs, out: torch.Tensor, tile: Tile, prefetch: bool = False,
            swiglu: float | None = None) -> None:
    """x [B / G, M, K] (each input shared by G consecutive weights; [.., 2K]: gate | up with `swiglu`), w [B, N, K]
    (a stack of dense or quantized weights), out [B, M, N] (any strides); `prefetch`: warm L2 with the first lines
    of each program's weight slice before waiting for the kernel before (decode-class launches, whose weight is
    streamed once); `swiglu`: the clamp limit when the product's input is the clamped SwiGLU of x's halves."""
    b, m, k = w.data.shape[0], x.shape[1], w.k
    n = w.n
    if m == 0:
        return
    if w.max_block_k() % tile.block_k:
        raise ValueError(f"a {tile.block_k}-wide K step straddles the weight's {w.max_block_k()}-wide scale groups")
    per_split = triton.cdiv(triton.cdiv(k, tile.split_k), tile.block_k) * tile.block_k
    grid = (triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n), tile.split_k, b)
    # Budget over the weight's distinct slices (N tiles x splits x batch): programs of other row tiles prefetch the
    # same lines, and the build stays one whatever the rows (a row count never compiles another kernel).
    slices = triton.cdiv(n, tile.block_n) * tile.split_k * b
    pf_lines, pf_step = prefetch_lines(w, tile, per_split, slices) if prefetch else (0, 1)
    if tile.split_k == 1:
        ws = counts = out  # unused
        ws_strides = (0, 0, 0)
    else:
        # rows padded to 16 (and N for its strides): the workspace's strides are then multiples of 16 whatever
        # M is, so Triton builds one kernel for every row count and keeps its aligned partial-sum loads
        ws = torch.empty(tile.split_k, b, triton.cdiv(m, 16) * 16, triton.cdiv(n, 16) * 16, dtype=torch.float32,
                         device=x.device)
        counts = arrivals.counters(x.device, grid[0] * b, "split-K tiles")
        ws_strides = ws.stride()[:3]
    _gemm_kernel[grid](x, w.data, w.scale, out, ws, counts, m, n, k, per_split,
                       x.stride(0), x.stride(1), x.stride(2), *w.strides(),
                       out.stride(0), out.stride(1), out.stride(2), *ws_strides, k * x.stride(2),
                       float(swiglu or 0.0), BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                       GROUP_M=tile.group_m, SPLIT=tile.split_k, IEEE=x.dtype == torch.float32, FMT=int(w.fmt),
                       SB_N=w.block_n, SB_K=w.block_k, X_GROUP=b // x.shape[0], SWIGLU=swiglu is not None,
                       PF_LINES=pf_lines, PF_STEP=pf_step, num_warps=tile.warps, num_stages=tile.stages,
                       **pdl.options())


def reads_swiglu(w: object) -> bool:
    """Whether `bmm` takes a gate | up input for weight `w` (a dense tensor or our GEMM's WeightArgs, not EXL3: its
    rotation reads the input before the product; not a prepared operand of another kernel)."""
    return isinstance(w, torch.Tensor) or (type(w) is WeightArgs and w.fmt is not Fmt.EXL3)


def bmm(x: torch.Tensor, w: torch.Tensor | WeightArgs, decode_rows: int, out_dtype: torch.dtype | None = None,
        out: torch.Tensor | None = None, swiglu: float | None = None) -> torch.Tensor:
    """Batched `x[b] @ w[b].T`: x [B, M, K], w [B, N, K] (views with any strides, or quantized: WeightArgs)
    -> [B, M, N] in `out_dtype`, written into `out` when given (a view of a wider output: a projection whose
    linears are stored in several formats writes each run's columns in place).

    x may hold fewer inputs than w weights, [B / G, M, K]: input i then goes through weights [i G, (i + 1) G) (two
    low-rank projections of KDA, each over every local shard, as one launch). `swiglu` (a clamp limit): x is
    [B, M, 2K], gate | up, and the product's input is their clamped SwiGLU (kernels/gpu/swiglu.py's element
    formula, applied as decode-class rows' activations load: the down projection without a launch of its own;
    prompt rows run the SwiGLU kernel first). Neither changes a bit of any product: each output element is reduced
    as in a plain call.

    Rows [0, decode_rows) are decode-class, the rest prompt rows: one launch per class present, each with its own
    fixed schedule (0 = all prompt rows; >= M = all decode rows)."""
    w = w if isinstance(w, WeightArgs) else dense(w)
    b, m, k = x.shape
    n = w.n
    if w.data.shape[0] % b or w.k * (2 if swiglu is not None else 1) != k:
        raise ValueError(f"bmm: x {list(x.shape)} and a [{w.data.shape[0]}, {n}, {w.k}] weight do not fit"
                         + (" (swiglu: x is gate | up)" if swiglu is not None else ""))
    if w.fmt is Fmt.EXL3:  # y = had(had(x * suh) @ T) * svh / 128, T the trellis tiles as stored
        if swiglu is not None:
            raise ValueError("bmm: EXL3 weights take no SwiGLU input (their rotation reads the input first)")
        x = x.repeat_interleave(w.data.shape[0] // b, dim=0)  # each weight rotates its input by its own signs
        b = x.shape[0]
        u = hadamard.rotate_in(x.reshape(b * m, k).contiguous(), w.suh, rows_per_vec=m).view(b, m, k)
        acc = _by_class(u, w, decode_rows, torch.float32)
        y = hadamard.rotate_out(acc.view(b * m, n), w.svh, out_dtype or x.dtype, rows_per_vec=m).view(b, m, n)
        return y if out is None else out.copy_(y)
    return _by_class(x, w, decode_rows, out_dtype or x.dtype, out, swiglu)


def _by_class(x: torch.Tensor, w: WeightArgs, decode_rows: int, out_dtype: torch.dtype,
              out: torch.Tensor | None = None, swiglu: float | None = None) -> torch.Tensor:
    """One launch per row class present, each with its class's schedule (see `bmm`)."""
    b, m, k = w.data.shape[0], x.shape[1], w.k
    n = w.n
    if out is None:
        out = torch.empty(b, m, n, dtype=out_dtype, device=x.device)
    split = min(max(decode_rows, 0), m)
    arch = gpu_arch.row(x.device)
    if split:
        tile = schedule(n, k, RowClass.DECODE, arch)
        if exl3_cuda.covers(x, w, tile.block_m):
            out[:, :split] = exl3_cuda.dense(x[:, :split].contiguous(), w)
        else:
            _launch(x[:, :split], w, out[:, :split], tile, prefetch=True, swiglu=swiglu)
    if split < m:
        prompt = x[:, split:]
        if swiglu is not None:
            # Prompt rows take the SwiGLU kernel's launch first: they are compute-bound, so the launch it saves is
            # worth little, and the prompt tile's gate and up steps in flight together would pass GB10's 99 KiB
            # of shared memory a block (bench.kernel_census). One element formula: the input's bits are the same.
            prompt = swiglu_kernel(prompt[..., :k], prompt[..., k:], swiglu)
        _launch(prompt, w, out[:, split:], schedule(n, k, RowClass.PREFILL, arch))
    return out


def matmul(x: torch.Tensor, w: torch.Tensor | WeightArgs, decode_rows: int, out_dtype: torch.dtype | None = None
           ) -> torch.Tensor:
    """`x @ w.T` over the last dim of x ([..., K] x [N, K] -> [..., N], w dense or quantized); rows as in `bmm`."""
    w = w if isinstance(w, WeightArgs) else dense(w)
    lead = x.shape[:-1]
    out = bmm(x.reshape(-1, x.shape[-1]).unsqueeze(0), w, decode_rows, out_dtype)
    return out.reshape(*lead, w.n)
