"""bench.kernels' `humdense` section: the non-expert ("rest") products of a decode step on humming-kernels' dense
GEMM in its batch-invariant mode, beside twinspark's fixed-schedule Triton GEMM on the same format and cuBLAS on
bf16, at 1 / 8 / 64 rows — the probe behind issue "the packed rest at memory speed" (fp8 and 4-bit products at
>= 80% of the copy rate).

Formats: fp8 e4m3 with fp32 scales per 128 x 128 block (the release's fp8 rest; humming reads the block scales
natively) and int4 with a bf16 scale per 128 weights (the 4-bit rest). humming's weights are drawn through its own
schema (`quant_tensor` of a random bf16 weight), ours through kernels/quant: the same format and bytes, so the times
compare decoders and schedules. Each candidate tile is a pinned config (one warp-K tile, no stream-K: the mode whose
bits do not depend on the row count); for the fastest tile of each shape a row alone = among 2 .. 64 rows is checked
bit for bit, and the product against the dequantized weight in fp32.

    python -m bench.kernels --only humdense --out $OUT
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.kernels_formats import L2_BYTES, weight_args, weight_copies
from bench.moe_layer import BF16, D
from bench.timing import graph_ms, log
from kernels.gpu import fp8_dense, int_moe

# (name, N, K) of the rest's decode products at TP 1 (fused where the fast path fuses them)
SHAPES = [("kda q|k|v", 3 * 8192, D), ("kda o_proj", D, 8192), ("mla q_a|kv_a", 1536 + 512, D),
          ("shared down", D, 2048), ("dense down", D, 12288)]
ROWS = (1, 8, 64)
GROUP = 128
# (block_m, block_n, warp_n, stages, ctas per SM, mma): wgmma needs four warps of >= 32 columns; the warp-level
# mma takes narrower blocks, which put more blocks on the chip for the narrow shapes (N = 4,096). Each tile is an
# NVRTC build of a few seconds per shape: a short list.
TILES = [(8, 128, 32, 8, 2, "wgmma"), (8, 128, 32, 4, 1, "wgmma"), (16, 128, 32, 4, 2, "wgmma"),
         (8, 256, 64, 8, 1, "wgmma"), (16, 64, 32, 4, 3, "mma"), (16, 128, 32, 4, 2, "mma")]


def _schema(fmt: str):
    from humming.schema import HummingWeightSchema
    if fmt == "fp8":
        return fp8_dense.schema()
    return HummingWeightSchema(b_dtype="uint4", bs_dtype="bfloat16", weight_scale_group_size=GROUP)


def _humming_weight(fmt: str, n: int, k: int) -> tuple[str, dict[str, torch.Tensor], torch.Tensor]:
    """(layer config, humming's tensors for this GPU, the dequantized weight in fp32) of one random weight."""
    from humming.transform import prepare_layer_config, transform_humming_tensors
    schema = _schema(fmt)
    w = torch.randn(n, k, device="cuda", dtype=BF16) * 0.02
    stored = schema.quant_tensor(w, schema, BF16, allow_negative_scale=True)
    dense = schema.dequant_tensors(stored).float()
    config = prepare_layer_config(shape_n=n, shape_k=k, weight_schema=schema, torch_dtype=BF16, device=w.device,
                                  tensors=dict(stored))
    return config.to_str(), transform_humming_tensors(config, dict(stored)), dense


def _kernel(layer: str, t: tuple) -> torch.Tensor:
    return int_moe.build(layer, fp8_dense.COMPUTE, int_moe.Tile(*t), torch.cuda.current_device())


def _call(kernel: torch.Tensor, tensors: dict[str, torch.Tensor], x: torch.Tensor, out: torch.Tensor
          ) -> Callable[[], object]:
    import humming
    return lambda: humming.ops.launch_kernel(configs=kernel, inputs=x, weight=tensors["weight"],
                                             weight_scale=tensors["weight_scale"], outputs=out)


def _exact(kernel: torch.Tensor, tensors: dict[str, torch.Tensor], dense: torch.Tensor, k: int, n: int) -> dict:
    """A row alone = among 2 .. 64 rows (bit for bit), and the product's normwise error against fp32."""
    x = torch.randn(64, k, device="cuda", dtype=BF16)
    full = torch.empty(64, n, device="cuda", dtype=BF16)
    _call(kernel, tensors, x, full)()
    differ = []
    for m in (1, 2, 3, 8, 17, 33, 64):
        part = torch.empty(m, n, device="cuda", dtype=BF16)
        _call(kernel, tensors, x[:m].contiguous(), part)()
        if not torch.equal(part, full[:m]):
            differ.append(m)
    want = x.float() @ dense.T
    err = ((full.float() - want).norm() / want.norm()).item()
    return {"rows_differ": differ, "normwise_error": err}


def dense_rows(bw: float) -> list[dict]:
    from kernels.gpu import gemm
    """`humdense`: every SHAPES x (fp8, int4) (a failure is a row with its error, and the rest still run)."""
    rows: list[dict] = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, n, k in SHAPES:
        for fmt in ("fp8", "int4"):
            try:
                rows += _shape_rows(bw, gen, name, n, k, fmt)
            except Exception as e:  # noqa: BLE001 - a format humming cannot take here: recorded, the rest run
                rows.append(dict(kernel="humming dense", shape=name, format=fmt, error=repr(e)[:300]))
                log(f"humdense {name} {fmt}: failed: {e!r}"[:300])
            torch.cuda.empty_cache()
    return rows


def _shape_rows(bw: float, gen: torch.Generator, name: str, n: int, k: int, fmt: str) -> list[dict]:
    """One shape and format: ours and every humming tile at ROWS, then the exactness of the tile best at 8 rows."""
    from kernels.gpu import gemm
    rows: list[dict] = []
    ours_fmt = "fp8" if fmt == "fp8" else "w4a16"  # W4A16: our 4-bit format with the same bytes per group
    copies, params, nbytes = weight_copies(ours_fmt, n, k, gen)
    ours = [weight_args(ours_fmt, t, params) for t in copies]
    hum = [_humming_weight(fmt, n, k) for _ in range(max(1, math.ceil(L2_BYTES / nbytes)))]
    layer = hum[0][0]
    best: dict[int, tuple[float, tuple]] = {}
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", dtype=BF16)
        out = torch.empty(m, n, device="cuda", dtype=BF16)
        ideal_us = nbytes / bw * 1e6
        ours_us = graph_ms([lambda w=w: gemm.matmul(x, w, m) for w in ours]) * 1e3
        row = dict(kernel="humming dense", shape=name, n=n, k=k, format=fmt, rows=m, weight_bytes=nbytes,
                   ours_us=ours_us, ours_of_copy_rate=ideal_us / ours_us, tiles=[])
        for t in TILES:
            try:
                kern = _kernel(layer, t)
                us = graph_ms([_call(kern, h[1], x, out) for h in hum]) * 1e3
            except Exception as e:  # noqa: BLE001 - an illegal tile for this shape: recorded, next one
                row["tiles"].append({"tile": t, "error": repr(e)[:160]})
                continue
            row["tiles"].append({"tile": t, "us": us, "of_copy_rate": ideal_us / us})
            if m not in best or us < best[m][0]:
                best[m] = (us, t)
        if m in best:
            row.update(best_tile=best[m][1], best_us=best[m][0], best_of_copy_rate=ideal_us / best[m][0])
            log(f"humdense {name:14s} {fmt:4s} rows={m:3d}: humming {best[m][0]:8.1f} us "
                f"({ideal_us / best[m][0]:6.1%}) tile {best[m][1]}; ours {ours_us:8.1f} us "
                f"({ideal_us / ours_us:6.1%})")
        if fmt == "fp8":
            wd = torch.randn(n, k, device="cuda", dtype=BF16)
            row["cublas_bf16_us"] = graph_ms([lambda: F.linear(x, wd)]) * 1e3
            del wd
        rows.append(row)
    # One tile for every row count is what the engine would pin: the one best at 8 rows, checked exact.
    pick = best.get(8, best.get(1, (0.0, None)))[1]
    if pick is not None:
        check = _exact(_kernel(layer, pick), hum[0][1], hum[0][2], k, n)
        rows.append(dict(kernel="humming dense exactness", shape=name, format=fmt, tile=pick, **check))
        log(f"humdense {name:14s} {fmt:4s} tile {pick}: rows differing alone vs among 64: "
            f"{check['rows_differ']}, normwise error {check['normwise_error']:.2e}")
    return rows
