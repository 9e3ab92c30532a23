"""One product per weight format at the model's decode shapes: twinspark's fixed-schedule GEMM on bf16, fp8, W4A16
and EXL3 weights, and exllamav3's own EXL3 kernel on the same EXL3 tensors, rows 1 / 8 / 32 / 256, in one run
(bench.kernels' `formats` section).

Each timing is the median per call of a CUDA graph that runs the product over several copies of the weight in turn
(their bytes together exceed the H200's 50 MB L2, so every call streams its weight from HBM, as a model's layers
do). The roofline is the stored bytes (values + scales) over the HBM bandwidth measured in the same run.
exllamav3's kernel is called through its LinearEXL3 module (what its models run), on the trellis, suh and svh that
twinspark's kernels read: the same bytes, so the ratio compares decoders, not files.

Also here: `formatsweep`, the decode tiles per format (what chose gemm.schedule's decode tile), `splitsweep`, the
decode schedule's K split on the model's small and large decode products (what chose its program target and the
K steps a split keeps), and `exl3inv`, whether exllamav3's kernel keeps a row's bits alone and among 2..256 rows
(the condition for the engine to call it).

    python -m bench.kernels --only formats,formatsweep,exl3inv --out $OUT
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from bench.moe_layer import BF16, moe_setup, moe_sweep, moe_w4a16
from bench.timing import graph_ms, log
# (name, N, K): KDA's fused q|k|v-like product, the MoE's gate|up and down of one expert, a dense down
SHAPES = [("4096x12288", 12288, 4096), ("moe gate|up", 2 * 2048, 4096), ("moe down", 4096, 2048),
          ("dense down", 4096, 12288)]
ROWS = (1, 8, 32, 256)
EXL3_BITS = (2.5, 3.0, 4.0)
L2_BYTES = 200 << 20  # copies of a weight until their bytes pass this (four times the L2)


def _bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values() if t.dim() > 0)


def _weights(fmt: str, n: int, k: int, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], dict]:
    """One random weight's stored tensors and parameters, drawn on the GPU."""
    from kernels.quant import exl3, fp8, w4a16
    kw = dict(std=0.02, generator=gen, device="cuda")
    if fmt == "bf16":
        return {"weight": (torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(BF16)}, {}
    if fmt == "fp8":
        return fp8.random_linear(n, k, **kw), {"block": fp8.DEFAULT_BLOCK}
    if fmt == "w4a16":
        return w4a16.random_linear(n, k, **kw), {"group": w4a16.DEFAULT_GROUP}
    bits = float(fmt.split(":")[1])
    t = exl3.random_linear(n, k, bits=bits, **kw)
    return {name: v.cuda() for name, v in t.items()}, {"codebook": "mul1"}


def weight_args(fmt: str, tensors: dict[str, torch.Tensor], params: dict):
    """What twinspark's kernels read of one weight (kernels.gpu.wtiles.WeightArgs)."""
    from kernels.gpu import wtiles
    if fmt == "bf16":
        return wtiles.dense(tensors["weight"])
    return wtiles.quantized(fmt.split(":")[0], tensors, params)


def weight_copies(fmt: str, n: int, k: int, gen: torch.Generator) -> tuple[list[dict[str, torch.Tensor]], dict, int]:
    """Random weights of one format, enough copies that their bytes pass L2_BYTES: (copies, parameters, bytes of
    one copy)."""
    first, params = _weights(fmt, n, k, gen)
    nbytes = _bytes(first)
    return [first] + [_weights(fmt, n, k, gen)[0] for _ in range(math.ceil(L2_BYTES / nbytes) - 1)], params, nbytes


def _exllamav3(tensors: dict[str, torch.Tensor], n: int, k: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """exllamav3's EXL3 linear over the same tensors (None when exllamav3 is not installed)."""
    try:
        from exllamav3.modules.quant.exl3 import LinearEXL3
    except ImportError:
        return None
    lin = LinearEXL3(None, k, n, suh=tensors["suh"], svh=tensors["svh"], trellis=tensors["trellis"],
                     mul1=tensors["mul1"], out_dtype=torch.half)
    return lambda x: lin.forward(x, {})


FORMATS = ("bf16", "fp8", "w4a16", *(f"exl3:{b}" for b in EXL3_BITS))


def format_rows(bw: float, formats: tuple[str, ...] = FORMATS) -> list[dict]:
    from kernels.gpu import gemm
    rows: list[dict] = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, n, k in SHAPES:
        for fmt in formats:
            copies, params, nbytes = weight_copies(fmt, n, k, gen)
            ours = [(lambda x, w=weight_args(fmt, t, params): gemm.matmul(x, w, x.shape[0])) for t in copies]
            peer = [_exllamav3(t, n, k) for t in copies] if fmt.startswith("exl3") else []
            for m in ROWS:
                x = torch.randn(m, k, device="cuda", dtype=BF16)
                ideal_us = nbytes / bw * 1e6
                ms = graph_ms([lambda f=f: f(x) for f in ours])
                row = dict(kernel="format_gemm", shape=name, n=n, k=k, format=fmt, rows=m, weight_bytes=nbytes,
                           us=ms * 1e3, roofline=ideal_us / (ms * 1e3))
                msg = (f"formats {name:12s} {fmt:8s} rows={m:4d}: {ms * 1e3:8.1f} us, {ideal_us / (ms * 1e3):6.1%} "
                       f"of roofline")
                if peer and peer[0] is not None:
                    xh = x.half()
                    try:
                        pms = graph_ms([lambda f=f: f(xh) for f in peer])
                        row.update(exllamav3_us=pms * 1e3, ratio=ms / pms)
                        msg += f"; exllamav3 {pms * 1e3:8.1f} us, ours / theirs {ms / pms:5.2f}"
                    except Exception as e:  # noqa: BLE001 - report and go on: the other rows still count
                        row.update(exllamav3_error=repr(e)[:200])
                        msg += f"; exllamav3 failed: {e!r}"[:160]
                log(msg)
                rows.append(row)
            del copies, ours, peer
            torch.cuda.empty_cache()
    return rows


# Decode-class GEMM candidates (block_m, block_n, block_k, warps, stages) for the formats' sweep
_SWEEP_TILES = [(bm, bn, bk, w, 4) for bm in (16, 64) for bn, bk in ((64, 128), (128, 128), (32, 128), (64, 64))
                for w in (4, 8)]
_SWEEP_SHAPES = [("4096x12288", 12288, 4096), ("dense down", 4096, 12288)]
# (name, N, K, format) of one layer's decode products at TP 1 (dense ones are the linears quantize keeps dense)
_SPLIT_SHAPES = [("router", 288, 4096, "bf16"), ("kda f_a|g_a|b", 320, 4096, "bf16"),
                 ("mla q_a", 1536, 4096, "fp8"), ("shared gate|up", 4096, 4096, "fp8"),
                 ("shared down", 4096, 2048, "fp8"), ("kda o", 4096, 8192, "fp8"), ("kda q|k|v", 24576, 4096, "fp8")]


def split_sweep(bw: float) -> list[dict]:
    """The decode GEMM's K split rule (gemm.decode_split's program target and minimum K steps per split) on the
    model's decode products at rows 1 and 8, each timed in a CUDA graph over copies past L2."""
    from kernels.gpu import gemm
    rows: list[dict] = []
    gen = torch.Generator(device="cuda").manual_seed(2)
    base = gemm.schedule(4096, 4096, gemm.RowClass.DECODE)
    for name, n, k, fmt in _SPLIT_SHAPES:
        copies, params, nbytes = weight_copies(fmt, n, k, gen)
        args = [weight_args(fmt, t, params) for t in copies]
        for m in (1, 8):
            x = torch.randn(1, m, k, device="cuda", dtype=BF16)
            out = torch.empty(1, m, n, device="cuda", dtype=BF16)
            for programs in (256, 512):
                for steps in (1, 2, 4, 8):
                    split = gemm.decode_split(n, k, base.block_n, base.block_k, programs, steps)
                    tile = gemm.Tile(base.block_m, base.block_n, base.block_k, split, base.warps, base.stages)
                    ms = graph_ms([lambda a=a: gemm._launch(x, a, out, tile) for a in args])
                    rows.append(dict(kernel="decode_split", shape=name, n=n, k=k, format=fmt, rows=m,
                                     programs=programs, min_steps=steps, split=split, us=ms * 1e3,
                                     roofline=nbytes / bw / (ms / 1e3)))
                    log(f"splitsweep {name:14s} {fmt:5s} rows={m} programs {programs} steps {steps}: split {split:3d} "
                        f"{ms * 1e3:7.1f} us {rows[-1]['roofline']:6.1%}")
        del copies, args
        torch.cuda.empty_cache()
    return rows


def format_sweep(bw: float, mm: float) -> list[dict]:
    """Decode-class tiles of the GEMM on bf16, fp8, W4A16 and EXL3 weights at 1 row, then the best five at 32 rows
    (what chose gemm.schedule's decode tile); then the grouped MoE's decode tiles (bench.kernels' moe sweep)."""
    from kernels.gpu import gemm
    rows: list[dict] = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for fmt in ("bf16", "fp8", "w4a16", "exl3:3.0"):
        for name, n, k in _SWEEP_SHAPES:
            copies, params, nbytes = weight_copies(fmt, n, k, gen)
            args = [weight_args(fmt, t, params) for t in copies]
            found: list[dict] = []
            for m in (1, 32):
                x = torch.randn(1, m, k, device="cuda", dtype=BF16)
                out = torch.empty(1, m, n, device="cuda", dtype=torch.float32)
                cands = _SWEEP_TILES if m == 1 else [tuple(r["tile"][f] for f in ("block_m", "block_n", "block_k",
                                                                                    "warps", "stages"))
                                                     for r in found[:5]]
                for bm, bn, bk, w, st in cands:
                    tile = gemm.Tile(bm, bn, bk, gemm.decode_split(n, k, bn, bk), w, st)
                    try:
                        ms = graph_ms([lambda a=a: gemm._launch(x, a, out, tile) for a in args])
                    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                        log(f"formatsweep {fmt} {name} rows={m} {tile}: {type(e).__name__}")
                        continue
                    r = dict(kernel="format_gemm_sweep", format=fmt, shape=name, rows=m, tile=tile.__dict__,
                             us=ms * 1e3, roofline=nbytes / bw / (ms / 1e3))
                    rows.append(r)
                    log(f"formatsweep {fmt} {name} rows={m} {bm}x{bn}x{bk} split {tile.split_k} w{w}: "
                        f"{ms * 1e3:7.1f} us {r['roofline']:6.1%}")
                if m == 1:
                    found = sorted((r for r in rows if r["format"] == fmt and r["shape"] == name),
                                   key=lambda r: r["us"])
                    for r in found[:5]:
                        log(f"formatsweep best {fmt} {name}: {r['us']:7.1f} us {r['roofline']:6.1%} {r['tile']}")
            del copies, args
            torch.cuda.empty_cache()
    weights = moe_setup()
    rows += moe_sweep(bw, mm, {"bf16": weights, "w4a16": moe_w4a16(weights)})
    return rows


def exllamav3_invariance() -> list[dict]:
    """Whether exllamav3's EXL3 kernel gives a row the same bits alone as among 2..256 rows (what twinspark's
    exactness rules ask of a kernel before the engine may use it)."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    out = []
    for name, n, k in SHAPES[:3]:
        for bits in (3.0, 4.0):
            t, _ = _weights(f"exl3:{bits}", n, k, gen)
            f = _exllamav3(t, n, k)
            if f is None:
                return out
            crowd = torch.randn(256, k, device="cuda", dtype=torch.half)
            alone = f(crowd[:1].contiguous())
            # 144 / 145: exllamav3 reconstructs the weight and runs a dense GEMM above 144 rows
            worst = {m: float((f(crowd[:m].contiguous())[:1] - alone).abs().max())
                     for m in (2, 8, 16, 17, 33, 144, 145, 256)}
            out.append(dict(check="exllamav3 row alone vs m rows", shape=name, bits=bits, max_abs_diff=worst))
            log(f"exllamav3 invariance {name} {bits} bpw: max |diff| by rows {worst}")
    return out


def exllamav3_forced() -> list[dict]:
    """exllamav3's EXL3 GEMM with its kernel choice pinned (`force_shape_idx`, `force_num_sms`): a row's bits alone
    vs among 2..256 rows, and the time per row count. Pinned, the kernel runs rows in slabs of its tile height over
    a K split fixed by the shape and the block count, so it may keep rows invariant where its own choice does not."""
    try:
        from exllamav3.ext import exllamav3_ext as ext
    except ImportError:
        return []
    gen = torch.Generator(device="cuda").manual_seed(3)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = []
    for name, n, k in SHAPES[:3]:
        for bits in (2.5, 3.0, 4.0):
            t, _ = _weights(f"exl3:{bits}", n, k, gen)
            trellis, suh, svh = t["trellis"], t["suh"], t["svh"]
            crowd = torch.randn(256, k, device="cuda", dtype=torch.half)
            for shape in range(1, int(ext.exl3_gemm_num_kernel_shapes()) + 1):
                def run(x: torch.Tensor, shape: int = shape) -> torch.Tensor:
                    c = torch.empty(x.shape[0], n, device="cuda", dtype=torch.float32)
                    ext.exl3_gemm(x, trellis, c, suh, torch.empty_like(x), svh, shape, False, True, sms)
                    return c
                try:
                    alone = run(crowd[:1].contiguous())
                    worst = {}
                    for m in (2, 8, 16, 17, 33, 144, 256):
                        many = run(crowd[:m].contiguous())
                        last = run(crowd[m - 1:m].contiguous())
                        worst[m] = max(float((many[:1] - alone).abs().max()), float((many[m - 1:] - last).abs().max()))
                    times = {}
                    for m in ROWS:
                        x = crowd[:m].contiguous()
                        times[m] = graph_ms([lambda x=x: run(x)]) * 1e3
                except Exception as e:  # noqa: BLE001 - a shape this size or bitrate cannot take
                    log(f"exllamav3 pinned {name} {bits} bpw shape {shape}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                row = dict(check="exllamav3 pinned shape: row alone vs m rows, time", shape=name, bits=bits,
                           kernel_shape=shape, num_sms=sms, max_abs_diff=worst, us=times)
                out.append(row)
                log(f"exllamav3 pinned {name} {bits} bpw shape {shape}: max |diff| {max(worst.values())} "
                    f"{worst}; us by rows " + ", ".join(f"{m}: {u:.1f}" for m, u in times.items()))
    return out


# Tile shapes of the CUDA EXL3 product (kernels/gpu/cuda/exl3_grouped.cu's TS_* macros) compared by `exl3builds`;
# the first is the shipped build.
EXL3_BUILDS = [(), (("TS_WARPS", 4),), (("TS_N_TILES", 1),), (("TS_N_TILES", 4),), (("TS_UNROLL", 2), ("TS_STAGES", 8)),
               (("TS_UNROLL", 2), ("TS_MIN_BLOCKS", 3)), (("TS_UNROLL", 2), ("TS_MIN_BLOCKS", 4))]
# Experts a decode step's MoE layer reads at 1 and 8 rows (decode_prefill-20261204-104936: 7, and 44-55): the MoE
# shapes are also timed as stacks of that many experts, one row each, the grid a decode step's MoE launches.
EXL3_STACKS = (7, 50)


def exl3_builds() -> list[dict]:
    """The CUDA EXL3 product alone (no rotations) at one row, per tile-shape build, on the shapes of `SHAPES` at 2.5
    and 4.0 bits, and the MoE shapes as stacks of EXL3_STACKS experts (one row each): what chose the shipped build's
    macros."""
    from kernels.gpu import exl3_cuda
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict] = []
    weights = {}
    for name, n, k in SHAPES[:3]:
        for bits in (2.5, 4.0):
            copies, params, _ = weight_copies(f"exl3:{bits}", n, k, gen)
            weights[name, bits] = [weight_args(f"exl3:{bits}", t, params) for t in copies]
    for build in EXL3_BUILDS:
        ext = exl3_cuda.extension(build)
        for (name, bits), ws in weights.items():
            a = torch.randn(1, ws[0].k, device="cuda").half()
            out = torch.empty(1, ws[0].n, device="cuda")
            ms = graph_ms([lambda w=w: ext.exl3_dense(a, w.data, out, 1, w.block_n, w.block_k // 8) for w in ws])
            rows.append(dict(kernel="exl3_build", build=dict(build), shape=name, bits=bits, us=ms * 1e3))
            log(f"exl3 build {dict(build) or 'shipped'} {name} {bits}: {ms * 1e3:.1f} us")
            if name.startswith("moe"):
                for experts in EXL3_STACKS:
                    us = _stack_us(ext, ws, experts)
                    rows.append(dict(kernel="exl3_build", build=dict(build), shape=name, bits=bits, experts=experts,
                                     us=us))
                    log(f"exl3 build {dict(build) or 'shipped'} {name} {bits} x {experts} experts: {us:.1f} us")
    return rows


# The MoE products as a TP-1 decode step launches them: 288 experts' gate|up and down split over 4 virtual shards,
# so down is K = 512 a shard (its warps hold 4 K tiles each in the shipped build: latency, not bytes, bounds it).
# Timed per build as a stack of 8 experts x 4 shards, one row each (a batch-1 step's launch).
SHARD_SHAPES = [("shard gate|up", 2 * 512, 4096), ("shard down", 4096, 512)]
SHARD_BUILDS = [(), (("TS_WARPS", 4),), (("TS_WARPS", 2),), (("TS_WARPS", 4), ("TS_N_TILES", 4)),
                (("TS_WARPS", 2), ("TS_N_TILES", 4)), (("TS_WARPS", 2), ("TS_N_TILES", 8))]


def exl3_shard_builds(bits: float = 2.5) -> list[dict]:
    """The CUDA EXL3 product alone on the MoE's shard shapes (SHARD_SHAPES), 32 shard-experts of one row in one
    launch, per tile-shape build (SHARD_BUILDS; the first is the shipped one): whether short-K products want another
    build (a build is chosen by shape, so the K order stays a function of the shape)."""
    from kernels.gpu import exl3_cuda
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = {}
    for name, n, k in SHARD_SHAPES:
        copies, params, _ = weight_copies(f"exl3:{bits}", n, k, gen)
        weights[name] = [weight_args(f"exl3:{bits}", t, params) for t in copies]
    rows: list[dict] = []
    for build in SHARD_BUILDS:
        t0 = time.perf_counter()
        ext = exl3_cuda.extension(build)
        built = time.perf_counter() - t0
        for name, ws in weights.items():
            us = _stack_us(ext, ws, 32)
            rows.append(dict(kernel="exl3_shard_build", build=dict(build), shape=name, bits=bits, stack=32, us=us))
            log(f"exl3 shard build {dict(build) or 'shipped'} {name} {bits} x 32: {us:.1f} us (built in {built:.0f} s)")
    return rows


def _stack_us(ext, ws: list, experts: int) -> float:
    """One row on each of `experts` weights in one launch (exl3_dense over a stack), microseconds; enough stacks
    in turn that their bytes pass L2_BYTES."""
    w = ws[0]
    stack_bytes = experts * w.data.numel() * w.data.element_size()
    calls = []
    for s in range(math.ceil(L2_BYTES / stack_bytes)):
        data = torch.cat([ws[(s * experts + i) % len(ws)].data for i in range(experts)])
        a = torch.randn(experts, w.k, device="cuda").half()
        out = torch.empty(experts, w.n, device="cuda")
        calls.append(lambda data=data, a=a, out=out: ext.exl3_dense(a, data, out, 1, w.block_n, w.block_k // 8))
    return graph_ms(calls) * 1e3
