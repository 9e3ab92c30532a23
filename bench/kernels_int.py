"""bench.kernels' sections for the integer expert formats on humming-kernels (kernels/gpu/int_moe.py), at
GLM-5.3-Flash's MoE shapes (288 routed experts + the shared one, top-8, hidden 4096, expert width 2048) with the
TP 1 layout (4 virtual shards: down is four 512-wide products per expert):

- `intmoe`: int3 and int4 beside EXL3 2.5 and bf16 in one run, at 1 / 8 / 32 / 256 rows: the whole MoE layer
  (router, routing, grouping, experts, combine) per format, and for the integer formats the gate|up and down
  products alone with the share of the copy rate their bytes are read at (issue "experts at memory speed", line 1);
- `intsweep`: humming tiles for decode and prompt rows (1 .. 8,192 rows), each compared bit for bit with the pinned
  tile's output;
- `intinv`: a row alone = among 2 .. 2,048 rows, both row classes, and graph replay = eager.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bench.moe_layer import BF16, D, E, MOE_I, TOPK, experts_touched, moe_exl3, moe_rows, moe_setup, route_rows
from bench.timing import bench_ms, graph_ms, log
from kernels.gpu import arch as gpu_arch

SHARDS = 4  # TP 1's virtual shards
PAIRS = TOPK + 1
ROWS = (1, 8, 32, 256)


def int_weights(bits: int, group: int = 128) -> tuple:
    """Random INT experts at `bits` drawn on the GPU (random codes, scales for ~0.02 per weight) and prepared for
    humming; router and bias as the other formats' (bench/moe_layer.py's draw)."""
    from kernels.gpu import int_moe, wtiles
    from kernels.quant import intn
    gen = torch.Generator(device="cuda").manual_seed(0)

    def stack(experts: int, n: int, k: int) -> wtiles.WeightArgs:
        t = intn.random_linear(experts * n, k, bits=bits, group=group, std=0.02, generator=gen, device="cuda")
        return wtiles.quantized("int", {name: v.view(experts, n, -1) for name, v in t.items()},
                                {"bits": bits, "group": group})
    gate_up = stack(E + 1, 2 * MOE_I, D)
    down = stack(SHARDS * (E + 1), D, MOE_I // SHARDS)
    return int_moe.prepare(gate_up, down, SHARDS, BF16)


def product_bytes(bits: int, group: int = 128) -> dict[str, float]:
    """Bytes one expert's gate|up and down products read (codes + bf16 scales; down over all four shards)."""
    per = lambda n, k: n * k * bits / 8 + n * (k // group) * 2  # noqa: E731
    return {"gate_up": per(2 * MOE_I, D), "down": per(D, MOE_I)}


def _routed(t: int, router: tuple, sets: int = 8) -> list[tuple]:
    out = []
    for _ in range(sets):
        x = torch.randn(t, D, device="cuda", dtype=BF16)
        out.append((x, *route_rows(x, (None, None, None, *router), t)))
    return out


def _product_calls(ie, tile, x: torch.Tensor, ids: torch.Tensor) -> tuple[Callable, Callable]:
    """The gate|up product alone and the down product alone for one routed batch, tables and inputs built once."""
    from kernels.gpu import int_moe
    from kernels.gpu.moe_groups import group_pairs
    n_pairs = ids.numel()
    tab = int_moe.tables(group_pairs(ids, ie.gate_up.experts, tile.block_m), n_pairs, ie.gate_up.experts, ie.shards)
    gu = torch.empty(n_pairs, ie.gate_up.n, dtype=BF16, device="cuda")
    h = torch.randn(ie.shards * n_pairs, ie.down.k, dtype=BF16, device="cuda")
    y = torch.empty(ie.shards * n_pairs, ie.down.n, dtype=BF16, device="cuda")
    return (lambda: int_moe._product(ie.gate_up, x, gu, tab.gate_up_rows, tab.gate_up_experts, tab.padded[:1],
                                     PAIRS, tile),
            lambda: int_moe._product(ie.down, h, y, tab.down_rows, tab.down_experts, tab.padded[1:], 1, tile))


def int_product_rows(bw: float, bits: int, ie, router: tuple, tile=None, label: str = "pinned") -> list[dict]:
    """The two products alone at each row count (CUDA graphs cycling 8 routed batches), as a share of the copy
    rate: experts touched x their bytes / copy rate over the time."""
    from kernels.gpu import int_moe
    from kernels.gpu.gemm import RowClass
    rows = []
    per = product_bytes(bits)
    for t in ROWS:
        cls = RowClass.DECODE
        use = tile or int_moe.tile(cls, gpu_arch.row(torch.device("cuda")))
        sets = _routed(t, router)
        hit = sum(experts_touched(ids) for _, ids, _ in sets) / len(sets)
        calls = [_product_calls(ie, use, x, ids) for x, ids, _ in sets]
        for i, name in enumerate(("gate_up", "down")):
            ms = graph_ms([c[i] for c in calls])
            share = hit * per[name] / bw * 1e3 / ms
            rows.append(dict(kernel="int moe product", format=f"int{bits}", product=name, tokens=t, tile=label,
                             config=use.config(), experts_touched=hit, us=ms * 1e3, of_copy_rate=share))
            log(f"int{bits} {name:7s} t={t:4d} [{label}]: {ms * 1e3:8.1f} us, {hit:5.1f} experts, "
                f"{share:6.1%} of the copy rate")
    return rows


def moe_formats(bw: float, mm: float) -> list[dict]:
    """`intmoe`: every format's whole MoE layer at ROWS (and 8,192 prompt rows), the integer products alone."""
    weights = moe_setup()
    router = weights[3:]
    rows = []
    for bits in (3, 4):
        ie = int_weights(bits)
        rows += int_product_rows(bw, bits, ie, router)
        rows += _layer_rows(bw, mm, (ie, None, None, *router), f"int{bits}", per_expert=sum(product_bytes(bits).values()))
        del ie
        torch.cuda.empty_cache()
    exl3 = moe_exl3(weights, 2.5)
    rows += _layer_rows(bw, mm, exl3, "exl3:2.5")
    del exl3
    torch.cuda.empty_cache()
    rows += _layer_rows(bw, mm, weights, "bf16")
    return rows


def _layer_rows(bw: float, mm: float, weights: tuple, fmt: str, per_expert: float | None = None) -> list[dict]:
    """moe_layer.moe_rows at this section's row counts, for any format (IntExperts in weights[0])."""
    return moe_rows(bw, mm, weights, fmt, tokens=(*ROWS, 8192), per_expert=per_expert)


def tile_sweep(bw: float, mm: float) -> list[dict]:
    """`intsweep`: int3 tiles per row class. Decode candidates at 1 / 8 / 32 / 256 rows; prompt candidates at 2,048
    and 8,192 rows (the layer's two products, eager), each MoE output compared with the pinned tile's, bit for bit."""
    from kernels.gpu import int_moe
    from kernels.gpu.gemm import RowClass
    weights = moe_setup()
    router = weights[3:]
    del weights
    ie = int_weights(3)
    rows = []
    decode = [int_moe.Tile(bm, bn, 32, st, ctas, mma) for bm, bn, st, ctas, mma in (
        (8, 256, 8, 2, "wgmma"), (8, 256, 12, 2, "wgmma"), (16, 256, 8, 2, "wgmma"), (8, 128, 8, 2, "wgmma"),
        (8, 256, 8, 1, "wgmma"), (16, 128, 4, 2, "mma"), (16, 128, 8, 2, "mma"))]
    for tile in decode:
        try:
            rows += int_product_rows(bw, 3, ie, router, tile, str(tile))
        except Exception as exc:  # a config humming refuses on this GPU
            log(f"int sweep {tile}: {type(exc).__name__}: {str(exc)[:200]}")
    prompt = [int_moe.Tile(bm, bn, 32, st, ctas, mma) for bm, bn, st, ctas, mma in (
        (64, 256, 4, 1, "wgmma"), (128, 256, 4, 1, "wgmma"), (64, 256, 6, 1, "wgmma"), (32, 256, 4, 2, "wgmma"),
        (128, 128, 4, 1, "wgmma"), (64, 128, 4, 2, "mma"))]
    pinned = int_moe.tile(RowClass.PREFILL, gpu_arch.row(torch.device("cuda")))
    for t in (2048, 8192):
        x, ids, rw = _routed(t, router, sets=1)[0]
        flops = 2 * t * PAIRS * 3 * MOE_I * D
        ref = None
        for tile in dict.fromkeys([pinned, *prompt]):
            try:
                gate_up, down = _product_calls(ie, tile, x, ids)
                ms = bench_ms(lambda: (gate_up(), down()), reps=20)
                out = torch.empty(ie.shards, t, D, device="cuda")
                _int_class(x, ids, rw, ie, tile, out)
            except Exception as exc:  # a config humming refuses on this GPU
                log(f"int sweep prompt {tile}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            same = None if ref is None else bool(torch.equal(out, ref))
            ref = out if ref is None else ref
            rows.append(dict(kernel="int moe prompt sweep", format="int3", tokens=t, tile=str(tile),
                             config=tile.config(), us=ms * 1e3, of_matmul_peak=flops / mm / (ms * 1e-3),
                             same_bits_as_pinned=same))
            log(f"int sweep prompt t={t} {tile}: {ms * 1e3:9.1f} us (both products), "
                f"{flops / mm / (ms * 1e-3):6.1%} of the bf16 matmul peak, same bits as pinned {same}")
    return rows


def _int_class(x: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor, ie, tile, out: torch.Tensor) -> None:
    """int_moe.experts for prompt rows with `tile` in place of the pinned one."""
    from kernels.gpu import int_moe
    from kernels.gpu.gemm import RowClass
    int_moe.experts(x, ids, rw, ie, 10.0, RowClass.PREFILL, out, 0, pinned=tile)


def invariance() -> list[dict]:
    """`intinv`: at the release's shapes, a row's MoE output alone = among 2 .. 2,048 rows (each row class), and a
    CUDA graph's replay = the eager call."""
    from kernels.gpu import moe
    weights = moe_setup()
    ie = int_weights(3)
    crowd = torch.randn(2048, D, device="cuda", dtype=BF16)
    layer = (ie, None, None, *weights[3:])
    out = []

    def run(x: torch.Tensor, split: int, n_real: torch.Tensor | None = None) -> torch.Tensor:
        grouping = moe.grouping(x, ie, split)  # as served: a decode step's grouping in the routing's launch
        ids, rw = route_rows(x, layer, split, n_real, grouping)
        return moe.experts(x, ids, rw, ie, None, None, 10.0, split, grouping=grouping)
    for cls, split in (("decode", 1 << 30), ("prefill", 0)):
        alone = run(crowd[:1], split)
        worst = 0.0
        for m in (2, 9, 64, 700, 2048):
            worst = max(worst, float((run(crowd[:m], split)[:, :1] - alone).abs().max()))
        out.append(dict(check="int3 moe row alone vs 2..2048 rows", rows=cls, max_abs_diff=worst))
        log(f"invariance int3 moe ({cls}): max |diff| {worst}")
    x = crowd[:8].clone()
    n_real = torch.tensor([8], dtype=torch.int32, device="cuda")
    eager = run(x, 1 << 30, n_real)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(x, 1 << 30, n_real)
    graph.replay()
    diff = float((captured - eager).abs().max())
    out.append(dict(check="int3 moe graph replay vs eager", rows="decode", max_abs_diff=diff))
    log(f"invariance int3 moe graph replay vs eager: max |diff| {diff}")
    return out
