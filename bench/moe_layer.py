"""GLM-5.3-Flash's MoE layer at its real shapes (288 routed experts + the shared one, top-8, hidden 4096, expert
width 2048) for the kernel benches: random experts drawn on the GPU in bf16, W4A16 or EXL3, the router and its
top-k, and the whole layer timed per row count (`moe_rows`) or per candidate tile (`moe_sweep`). bench.kernels'
moe sections, its formats sweep (bench/kernels_formats.py) and its integer sections (bench/kernels_int.py) run it."""

from __future__ import annotations

import torch

from bench.timing import bench_ms, graph_ms, log

BF16 = torch.bfloat16
D, E, TOPK, MOE_I = 4096, 288, 8, 2048


def moe_setup() -> tuple[torch.Tensor, ...]:
    """bf16 experts (gate, up, down: 288 routed + the shared one last), the router's weight and its bias."""
    gate = torch.randn(E + 1, MOE_I, D, device="cuda", dtype=BF16) * 0.02
    up = torch.randn(E + 1, MOE_I, D, device="cuda", dtype=BF16) * 0.02
    down = torch.randn(E + 1, D, MOE_I, device="cuda", dtype=BF16) * 0.02
    router = torch.randn(E, D, device="cuda", dtype=BF16) * 0.02
    bias = torch.randn(E, device="cuda") * 0.01
    return gate, up, down, router, bias


def moe_w4a16(weights: tuple) -> tuple:
    """The same MoE with W4A16 experts (the whole-model bench's format): random packed words and scales, drawn on
    the GPU as bench/random_weights draws them; router and bias unchanged."""
    from kernels.gpu import wtiles
    from kernels.quant import w4a16
    gen = torch.Generator(device="cuda").manual_seed(0)

    def stack(n: int, k: int):
        t = w4a16.random_linear((E + 1) * n, k, std=0.02, generator=gen, device="cuda")
        return wtiles.quantized("w4a16", {name: v.view(E + 1, n, -1) for name, v in t.items()},
                                {"group": w4a16.DEFAULT_GROUP})
    _, _, _, router, bias = weights
    return stack(MOE_I, D), stack(MOE_I, D), stack(D, MOE_I), router, bias


def moe_exl3(weights: tuple, bits: float) -> tuple:
    """The same MoE with EXL3 experts at `bits` per weight (mul1 codebook, random trellises drawn on the GPU as
    bench/random_weights draws them); router and bias unchanged."""
    from kernels.gpu import wtiles
    from kernels.quant import exl3
    gen = torch.Generator(device="cuda").manual_seed(0)

    def stack(n: int, k: int):
        t = exl3.random_linear((E + 1) * n, k, std=0.02, bits=bits, generator=gen, device="cuda")
        trellis = t["trellis"].view(k // 16, E + 1, n // 16, -1).transpose(0, 1).contiguous()
        return wtiles.quantized("exl3", {"trellis": trellis, "suh": t["suh"].expand(E + 1, k).contiguous(),
                                         "svh": t["svh"].view(E + 1, n)}, {"codebook": "mul1"})
    _, _, _, router, bias = weights
    return stack(MOE_I, D), stack(MOE_I, D), stack(D, MOE_I), router, bias


def expert_bytes(weights: tuple) -> float:
    """Bytes one expert's three projections occupy (int4 words + fp16 scales, EXL3 trellis + sign vectors, or
    bf16)."""
    from kernels.gpu.wtiles import Fmt
    gate, up, down = weights[:3]
    if isinstance(gate, torch.Tensor):
        return 3 * MOE_I * D * 2
    if gate.fmt is Fmt.EXL3:
        return sum(w.data[0].numel() * 2 + (w.suh[0].numel() + w.svh[0].numel()) * 2 for w in (gate, up, down))
    return sum((w.data[0].numel() * w.data.element_size() + w.scale[0].numel() * w.scale.element_size())
               for w in (gate, up, down))


def route_rows(x: torch.Tensor, weights: tuple, decode_rows: int, n_real: torch.Tensor | None = None,
               grouping: object = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The router GEMM and top-k: (ids, routing weights). n_real: a device scalar inside a CUDA graph (an int would
    be copied from the host while capturing). grouping: kernels.gpu.moe.grouping's, built by the same launch."""
    from kernels.gpu import gemm, moe
    router, bias = weights[3], weights[4]
    logits = gemm.matmul(x, router, decode_rows, torch.float32)
    return moe.route(logits, bias, top_k=TOPK, norm_topk_prob=True, scaling=2.5,
                     n_real=x.shape[0] if n_real is None else n_real, grouping=grouping)


def experts_touched(ids: torch.Tensor) -> int:
    """Distinct routed experts the rows chose, + the shared one."""
    return int(torch.unique(ids[:, :TOPK]).numel()) + 1


def moe_run(x: torch.Tensor, weights: tuple, decode_rows: int, n_real: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole layer on rows `x`: (its output, the routed ids)."""
    from kernels.gpu import moe
    gate, up, down = weights[:3]
    grouping = moe.grouping(x, gate, decode_rows)  # a decode step groups its pairs in the routing's launch, as served
    ids, rw = route_rows(x, weights, decode_rows, n_real, grouping)
    return moe.experts(x, ids, rw, gate, up, down, 10.0, decode_rows, grouping=grouping)[0], ids


def routed_inputs(t: int, weights: tuple, sets: int) -> list[tuple]:
    """`sets` different batches of t rows, routed: (x, ids, weights) each. Timing cycles through them, so the
    experts read differ call to call and the weights come from HBM, as in a model's many layers, not from L2."""
    out = []
    for _ in range(sets):
        x = torch.randn(t, D, device="cuda", dtype=BF16)
        out.append((x, *route_rows(x, weights, t)))
    return out


def moe_rows(bw: float, mm: float, weights: tuple, fmt: str = "bf16", tokens: tuple[int, ...] = (1, 8, 64, 8192),
             per_expert: float | None = None) -> list[dict]:
    """The whole MoE (router GEMM, route, grouping, experts, combine): decode-class sizes (up to 256 rows) in a CUDA
    graph over 8 routed batches in turn, prompts eagerly (their launches are long enough). per_expert: one expert's
    bytes (default: from the stacks, `expert_bytes`)."""
    rows = []
    per_expert = per_expert or expert_bytes(weights)
    for t in tokens:
        decode = t <= 256
        if decode:
            xs = [torch.randn(t, D, device="cuda", dtype=BF16) for _ in range(8)]
            n_real = torch.tensor([t], dtype=torch.int32, device="cuda")
            ms = graph_ms([lambda x=x: moe_run(x, weights, t, n_real) for x in xs])
            hit = sum(experts_touched(route_rows(x, weights, t)[0]) for x in xs) / len(xs)
        else:
            x = torch.randn(t, D, device="cuda", dtype=BF16)
            ms = bench_ms(lambda: moe_run(x, weights, 0))
            hit = experts_touched(route_rows(x, weights, 0)[0])
        flops = 2 * t * (TOPK + 1) * 3 * MOE_I * D
        ideal = max(hit * per_expert / bw, flops / mm) * 1e3
        rows.append(dict(kernel="moe", format=fmt, tokens=t, experts_touched=hit, ms=ms, roofline=ideal / ms))
        log(f"moe {fmt} t={t:5d}: {ms * 1e3:8.1f} us, {hit:.0f} experts touched, {ideal / ms:6.1%} of roofline")
    return rows


# Decode-class candidates (block_m, block_n, block_k, warps, stages): more, narrower tiles put more programs and
# loads in flight for the few experts one decode row reads; block_k stays within the int4 scale group (128).
_MOE_DECODE_TILES = [(16, bn, bk, w, st) for bn, bk, w, st in (
    (16, 128, 2, 4), (32, 128, 2, 4), (32, 128, 4, 4), (32, 64, 4, 5), (64, 128, 4, 4), (64, 64, 4, 5),
    (64, 128, 4, 2), (64, 128, 8, 4), (128, 128, 4, 3), (128, 64, 4, 4))]


def moe_sweep(bw: float, mm: float, formats: dict) -> list[dict]:
    """Tiles of the grouped expert kernels, to choose `moe_schedule`'s by measurement: decode-class tiles at 1 and 8
    rows per format (in a CUDA graph, cycling routed batches; each tile's output is compared with the current
    schedule's, max |diff|: 0 means the tile changes no bits), then prompt tiles at 8,192 tokens (bf16)."""
    from kernels.gpu import gemm, moe
    from kernels.gpu.wtiles import WeightArgs, dense
    rows = []
    current = moe.moe_schedule(gemm.RowClass.DECODE)
    for fmt, weights in formats.items():
        gate, up, down = (w if isinstance(w, WeightArgs) else dense(w) for w in weights[:3])
        per_expert = expert_bytes(weights)
        for t in (1, 8):
            sets = routed_inputs(t, weights, 8)
            hit = sum(experts_touched(ids) for _, ids, _ in sets) / len(sets)
            ideal = hit * per_expert / bw * 1e3

            def run(tile, x, ids, rw):
                out = torch.empty(1, t, D, device="cuda")
                moe._experts_one_class(x, ids, rw, gate, up, down, 10.0, tile, 1, out, 0)
                return out
            ref = run(current, *sets[0])
            for cand in _MOE_DECODE_TILES:
                tile = moe.MoeTile(*cand)
                try:
                    diff = float((run(tile, *sets[0]) - ref).abs().max())
                    ms = graph_ms([lambda s=s: run(tile, *s) for s in sets])
                except Exception as exc:  # e.g. out of shared memory
                    log(f"moe sweep {fmt} t={t} {tile}: {type(exc).__name__}")
                    continue
                rows.append(dict(kernel="moe decode sweep", format=fmt, tokens=t, tile=tile.__dict__, ms=ms,
                                 roofline=ideal / ms, max_abs_diff_vs_current=diff))
                log(f"moe sweep {fmt} t={t} {tile}: {ms * 1e3:8.1f} us, {ideal / ms:6.1%} of roofline, "
                    f"max |diff| vs current {diff:.3g}")
            best = sorted((r for r in rows if r["format"] == fmt and r["tokens"] == t), key=lambda r: r["ms"])[:3]
            for r in best:
                log(f"moe sweep best {fmt} t={t}: {r['ms'] * 1e3:8.1f} us {r['roofline']:6.1%} {r['tile']}")
    gate, up, down = (dense(w) for w in formats["bf16"][:3])
    x = torch.randn(8192, D, device="cuda", dtype=BF16)
    ids, rw = route_rows(x, formats["bf16"], 0)
    flops = 2 * 8192 * (TOPK + 1) * 3 * MOE_I * D
    # The last three: the prompt tile with other orders (tile_order.py): 1 = column tiles fastest, 1 << 20 = row
    # tiles fastest (the order before grouped ordering), 32.
    for tile in (moe.MoeTile(64, 128, 64, 4, 3), moe.MoeTile(128, 128, 64, 8, 3), moe.MoeTile(64, 256, 64, 8, 3),
                 moe.MoeTile(128, 256, 64, 8, 3), moe.MoeTile(128, 128, 64, 4, 4), moe.MoeTile(64, 128, 128, 8, 3),
                 moe.MoeTile(128, 128, 64, 8, 3, 1), moe.MoeTile(128, 128, 64, 8, 3, 1 << 20),
                 moe.MoeTile(128, 128, 64, 8, 3, 32)):
        out = torch.empty(1, 8192, D, device="cuda")
        try:
            ms = bench_ms(lambda: moe._experts_one_class(x, ids, rw, gate, up, down, 10.0, tile, 1, out, 0), reps=20)
        except Exception as exc:  # e.g. out of shared memory
            log(f"moe sweep {tile}: {type(exc).__name__}")
            continue
        rows.append(dict(kernel="moe sweep", format="bf16", tokens=8192, tile=tile.__dict__, ms=ms,
                         roofline=flops / mm * 1e3 / ms))
        log(f"moe sweep t=8192 {tile}: {ms * 1e3:8.1f} us, {flops / mm * 1e3 / ms:6.1%} of the matmul roofline")
    return rows
