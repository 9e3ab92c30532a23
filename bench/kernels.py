"""Per-kernel speed and exactness of the Triton fast paths (kernels/gpu) at real GLM-5.3-Flash shapes, on a GPU.

For every hot kernel: time (CUDA events via triton.testing.do_bench, L2 flushed between calls) against the
bandwidth or matmul ceiling measured in the same run, and against the torch / cuBLAS op it replaces; then the
exactness checks that only real shapes expose: a row alone vs packed with up to 2,048 other rows, bit for bit.
Also a probe of fla-core's `chunk_kda` (prefill candidate): chunk-boundary and batch invariance, and parity with
the torch twin.

    python -m bench.kernels --out $OUT            # on a GPU; writes kernels-<date>.{json,md}
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from bench import roofline

BF16 = torch.bfloat16
D, E, TOPK, MOE_I = 4096, 288, 8, 2048
# (name, N, K) of the dense weights a decode step reads (fused where the fast path fuses them)
GEMMS = [("kda q|k|v", 3 * 8192, D), ("kda o_proj", D, 8192), ("mla q_a|kv_a", 1536 + 512, D),
         ("mla q_b", 16384, 1536), ("mla o_proj", D, 16384), ("dense gate|up", 2 * 12288, D),
         ("dense down", D, 12288), ("lm_head", 154880, D), ("kda f_b", 8192, 128)]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def bench_ms(fn, reps: int = 50) -> float:
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=5, rep=reps, return_mode="median"))


def gemm_rows(bw: float, mm: float) -> list[dict]:
    from kernels.gpu import gemm
    rows = []
    for name, n, k in GEMMS:
        w = torch.randn(n, k, device="cuda", dtype=BF16) * 0.02
        for m in (1, 8, 64, 8192):
            x = torch.randn(m, k, device="cuda", dtype=BF16)
            decode = m <= 64
            ours = bench_ms(lambda: gemm.matmul(x, w, m if decode else 0))
            peer = bench_ms(lambda: F.linear(x, w))
            wbytes = n * k * 2
            flops = 2 * m * n * k
            ideal = max(wbytes / bw, flops / mm) * 1e3
            tile = gemm.schedule(n, k, gemm.RowClass.DECODE if decode else gemm.RowClass.PREFILL)
            rows.append(dict(kernel="gemm", name=name, m=m, n=n, k=k, ms=ours, cublas_ms=peer,
                             roofline=ideal / ours, vs_cublas=peer / ours, tile=tile.__dict__))
            log(f"gemm {name:14s} m={m:5d}: {ours * 1e3:8.1f} us (cuBLAS {peer * 1e3:8.1f} us) "
                f"{ideal / ours:6.1%} of roofline, split {tile.split_k}")
        del w
    return rows


def gemm_sweep(bw: float, mm: float) -> list[dict]:
    """Candidate tiles per row class on three shapes, to choose `gemm.schedule`'s constants by measurement."""
    import itertools

    import triton

    from kernels.gpu import gemm
    rows = []
    for name, n, k in (GEMMS[1], GEMMS[6], GEMMS[0]):
        w = torch.randn(n, k, device="cuda", dtype=BF16) * 0.02
        for m, cands in ((1, itertools.product((16, 64), (32, 64, 128), (64, 128, 256), (3, 5))),
                         (8192, itertools.product((64, 128), (128, 256), (64,), (3, 4)))):
            x = torch.randn(m, k, device="cuda", dtype=BF16)
            out = torch.empty(1, m, n, device="cuda", dtype=BF16)
            for bm, bn, bk, st in cands:
                split = 1
                while m == 1 and triton.cdiv(n, bn) * split < 256 and k % (2 * split * bk) == 0 \
                        and k // (2 * split) >= 4 * bk:
                    split *= 2
                for warps in ((4,) if m == 1 else (4, 8)):
                    tile = gemm.Tile(bm, bn, bk, split, warps, st)
                    try:
                        ms = bench_ms(lambda: gemm._launch(x.unsqueeze(0), gemm.dense(w), out, tile), reps=20)
                    except Exception as exc:  # e.g. out of shared memory
                        log(f"sweep {name} m={m} {tile}: {type(exc).__name__}")
                        continue
                    ideal = max(n * k * 2 / bw, 2 * m * n * k / mm) * 1e3
                    rows.append(dict(kernel="gemm sweep", name=name, m=m, tile=tile.__dict__, ms=ms,
                                     roofline=ideal / ms))
            best = sorted((r for r in rows if r["name"] == name and r["m"] == m), key=lambda r: r["ms"])[:3]
            for r in best:
                log(f"sweep best {name} m={m}: {r['ms'] * 1e3:8.1f} us {r['roofline']:6.1%} {r['tile']}")
    return rows


def gemm_invariance() -> list[dict]:
    from kernels.gpu import gemm
    out = []
    for name, n, k in GEMMS[:2] + GEMMS[7:8]:
        w = torch.randn(n, k, device="cuda", dtype=BF16) * 0.02
        crowd = torch.randn(2048, k, device="cuda", dtype=BF16)
        for cls, rows in (("decode", 1 << 30), ("prefill", 0)):
            alone = gemm.matmul(crowd[:1], w, rows, torch.float32)
            worst = 0.0
            for m in (2, 7, 64, 300, 2048):
                got = gemm.matmul(crowd[:m], w, rows, torch.float32)[:1]
                worst = max(worst, float((got - alone).abs().max()))
            out.append(dict(check="gemm row alone vs 2..2048 rows", name=name, rows=cls, max_abs_diff=worst))
            log(f"invariance gemm {name} ({cls}): max |diff| {worst}")
    return out


def moe_setup():
    gate = torch.randn(E + 1, MOE_I, D, device="cuda", dtype=BF16) * 0.02
    up = torch.randn(E + 1, MOE_I, D, device="cuda", dtype=BF16) * 0.02
    down = torch.randn(E + 1, D, MOE_I, device="cuda", dtype=BF16) * 0.02
    router = torch.randn(E, D, device="cuda", dtype=BF16) * 0.02
    bias = torch.randn(E, device="cuda") * 0.01
    return gate, up, down, router, bias


def moe_w4a16(weights):
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


def moe_exl3(weights, bits: float):
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


def expert_bytes(weights) -> float:
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


def route_rows(x, weights, decode_rows, n_real=None):
    """The router GEMM and top-k: (ids, routing weights). n_real: a device scalar inside a CUDA graph (an int would
    be copied from the host while capturing)."""
    from kernels.gpu import gemm, moe
    router, bias = weights[3], weights[4]
    logits = gemm.matmul(x, router, decode_rows, torch.float32)
    return moe.route(logits, bias, top_k=TOPK, norm_topk_prob=True, scaling=2.5,
                     n_real=x.shape[0] if n_real is None else n_real)


def experts_touched(ids) -> int:
    """Distinct routed experts the rows chose, + the shared one."""
    return int(torch.unique(ids[:, :TOPK]).numel()) + 1


def moe_run(x, weights, decode_rows, n_real=None):
    from kernels.gpu import moe
    gate, up, down = weights[:3]
    ids, rw = route_rows(x, weights, decode_rows, n_real)
    return moe.experts(x, ids, rw, gate, up, down, 10.0, decode_rows)[0], ids


def routed_inputs(t: int, weights, sets: int) -> list[tuple]:
    """`sets` different batches of t rows, routed: (x, ids, weights) each. Timing cycles through them, so the
    experts read differ call to call and the weights come from HBM, as in a model's many layers, not from L2."""
    out = []
    for _ in range(sets):
        x = torch.randn(t, D, device="cuda", dtype=BF16)
        out.append((x, *route_rows(x, weights, t)))
    return out


def graph_ms(calls: list) -> float:
    """Median time per call of a CUDA graph replaying the calls in turn (how the served decode path runs them:
    without the host's launch time, which would swamp a one-row MoE)."""
    from triton.testing import do_bench_cudagraph
    turn = iter(range(1 << 62))
    return float(do_bench_cudagraph(lambda: calls[next(turn) % len(calls)](), rep=50, return_mode="median"))


def moe_rows(bw: float, mm: float, weights, fmt: str = "bf16", tokens: tuple[int, ...] = (1, 8, 64, 8192),
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


def moe_invariance(formats: dict) -> list[dict]:
    out = []
    crowd = torch.randn(2048, D, device="cuda", dtype=BF16)
    for fmt, weights in formats.items():
        for cls, rows in (("decode", 1 << 30), ("prefill", 0)):
            alone = moe_run(crowd[:1], weights, rows)[0]
            worst = 0.0
            for m in (2, 9, 64, 700, 2048):
                worst = max(worst, float((moe_run(crowd[:m], weights, rows)[0][:1] - alone).abs().max()))
            out.append(dict(check="moe row alone vs 2..2048 rows", format=fmt, rows=cls, max_abs_diff=worst))
            log(f"invariance moe {fmt} ({cls}): max |diff| {worst}")
    return out


def kda_rows(bw: float) -> list[dict]:
    """The fused KDA decode + gated norm over one TP=1 rank's heads: 4 virtual shards of 16 heads in one launch."""
    from kernels.gpu import kda
    s, hs, dk = 4, 16, 128
    h, c = s * hs, hs * dk  # heads of the rank, channels per shard
    rows = []
    for b in (1, 64):
        slots = b + 1
        state = torch.randn(slots, h, dk, dk, device="cuda") * 0.1
        conv = torch.randn(slots, 3, s * 3 * c, device="cuda", dtype=BF16)
        seqs = kda.DecodeSeqs.build(list(range(b)), [1] * b, list(range(b)), [False] * b, [-1] * b, "cuda")
        args = dict(mixed=torch.randn(s, b, 3 * c, device="cuda", dtype=BF16),
                    conv_w=torch.randn(s, 3 * c, 4, device="cuda"), conv_state=conv, chan_off=0,
                    g_raw=torch.randn(s, b, c, device="cuda", dtype=BF16), dt_bias=torch.randn(s, c, device="cuda"),
                    a_log=torch.randn(s, hs, device="cuda"), lower_bound=-5.0,
                    beta_raw=torch.randn(s, b, hs, device="cuda", dtype=BF16), state=state, head_off=0,
                    core=torch.empty(s, b, c, device="cuda", dtype=BF16))
        gate, o_norm = torch.randn(s, b, c, device="cuda", dtype=BF16), torch.ones(dk, device="cuda", dtype=BF16)

        def step():
            kda.decode(seqs, **args)
            kda.gated_norm(args["core"], gate, o_norm, 1e-5)
        ms = bench_ms(step)
        ideal = 2 * b * h * dk * dk * 4 / bw * 1e3
        rows.append(dict(kernel="kda decode", batch=b, ms=ms, roofline=ideal / ms))
        log(f"kda decode b={b}: {ms * 1e3:8.1f} us, {ideal / ms:6.1%} of the state-traffic roofline")
    return rows


MLA_H, MLA_R, MLA_BS, MLA_KP, MLA_TOPK = 64, 512, 16, 4, 2048  # heads, latent width, block size, pool, top-k


def _mla_case(b: int, ctx: int, prompt: bool) -> dict:
    """Sparse MLA inputs: b sequences of `ctx` cached positions, one decode row each, or (prompt) the rows of one
    whole `ctx`-token prompt; the selection's pools drawn at random. FLOPs: 2 x 2 x heads x latent per attended
    (row, position) pair."""
    from kernels.gpu import mla
    h, r, bs, kp = MLA_H, MLA_R, MLA_BS, MLA_KP
    t = ctx if prompt else b
    blocks = -(-ctx // bs)
    latent = torch.randn(b * blocks + 1, bs, r, device="cuda", dtype=BF16)
    tables = torch.arange(b * blocks, device="cuda", dtype=torch.int32).view(b, blocks)
    if prompt:
        pos = torch.arange(t, device="cuda", dtype=torch.int32)
        seq = torch.zeros(t, device="cuda", dtype=torch.int32)
    else:
        pos = torch.full((b,), ctx - 1, device="cuda", dtype=torch.int32)
        seq = torch.arange(b, device="cuda", dtype=torch.int32)
    n_pools, keep = ctx // kp, MLA_TOPK // kp
    scores = torch.randn(t, n_pools, device="cuda")
    sel, count = mla.select_pools(scores if n_pools > keep else None, pos, kp, keep, n_pools)
    attended = float(torch.minimum(pos.float() + 1, torch.full_like(pos.float(), MLA_TOPK + kp)).sum())
    return dict(rows=t, latent=latent, tables=tables, pos=pos, seq=seq, sel=sel, count=count,
                q=torch.randn(t, h, r, device="cuda", dtype=BF16), max_positions=keep * kp + kp,
                flops=attended * h * r * 2 * 2)


def _mla_run(c: dict, latent: torch.Tensor, scale: torch.Tensor | None, decode_rows: int, reps: int = 50
             ) -> tuple[float, torch.Tensor]:
    """(ms, output) of sparse_attention over a _mla_case's inputs and the given latent cache."""
    from kernels.gpu import mla
    out = torch.empty(c["rows"], MLA_H, MLA_R, device="cuda", dtype=BF16)
    ms = bench_ms(lambda: mla.sparse_attention(c["q"], latent, scale, c["tables"], c["pos"], c["seq"], c["sel"],
                                               c["count"], MLA_KP, 0.0625, out, decode_rows, c["max_positions"]),
                  reps=reps)
    return ms, out


def mla_rows(bw: float) -> list[dict]:
    rows = []
    for b, ctx in ((1, 512), (1, 4096), (64, 512), (1, 8192)):
        prompt = ctx == 8192  # last case: a whole 8k prompt's rows
        c = _mla_case(b, ctx, prompt)
        ms, _ = _mla_run(c, c["latent"], None, 0 if prompt else b)
        rows.append(dict(kernel="sparse mla", rows=c["rows"], context=ctx, ms=ms, tflops=c["flops"] / ms / 1e9))
        log(f"sparse mla rows={c['rows']} ctx={ctx}: {ms * 1e3:8.1f} us, {c['flops'] / ms / 1e9:7.1f} TFLOP/s")
    return rows


MLA_TILES = [dict(HB=hb, num_warps=w, num_stages=st, **({"BN": bn} if bn else {}))
             for hb, w, st, bn in ((16, 4, 2, 0), (16, 8, 2, 0), (32, 4, 2, 0), (32, 8, 2, 0), (32, 8, 3, 0),
                                   (32, 8, 2, 64), (64, 4, 2, 0), (64, 8, 2, 0), (64, 8, 1, 0), (64, 8, 2, 16),
                                   (64, 8, 2, 64), (64, 8, 3, 32), (64, 8, 4, 32), (64, 8, 3, 64))]


def mla_sweep() -> list[dict]:
    """Prompt rows' attention tile (kernels/gpu/mla.PROMPT_TILE) at a whole 8k prompt's rows (_mla_case), over a
    bf16 and an fp8 latent cache: the time of each choice and its largest difference from the current one's output
    (another tile may round differently: a choice changes the served bits, not their invariance)."""
    from kernels.gpu import mla
    c = _mla_case(1, 8192, prompt=True)
    caches = {"bf16": (c["latent"], None),
              "fp8": (c["latent"].to(torch.float8_e4m3fn), torch.ones(c["latent"].shape[:2], device="cuda"))}
    current, rows = dict(mla.PROMPT_TILE), []

    def run(tile: dict, data: torch.Tensor, scale: torch.Tensor | None) -> tuple[float, torch.Tensor]:
        mla.PROMPT_TILE = tile
        return _mla_run(c, data, scale, 0, reps=100)

    try:
        for kv, (data, scale) in caches.items():
            rows += time_tiles("mla sweep", [current] + [t for t in MLA_TILES if t != current],
                               lambda tile: run(tile, data, scale), c["flops"], kv=kv)
    finally:
        mla.PROMPT_TILE = current
    return rows


def time_tiles(kernel: str, tiles: list[dict], run: Callable[[dict], tuple[float, torch.Tensor]], flops: float,
               **fields) -> list[dict]:
    """A row per tile: `run(tile)`'s time and its output's largest difference from the first tile's (the current
    one's: another tile may round differently, which changes the served bits, not their invariance); `fields` go
    into every row. A tile past the SM's registers or shared memory does not build: its row says why."""
    rows, first = [], None
    label = " ".join([kernel, *map(str, fields.values())])
    for tile in tiles:
        try:
            ms, out = run(tile)
        except Exception as e:  # noqa: BLE001
            log(f"{label} {tile}: failed ({type(e).__name__}: {str(e)[:120]})")
            rows.append(dict(kernel=kernel, **fields, tile=tile, error=str(e)[:300]))
            continue
        first = out.clone() if first is None else first
        diff = float((out.float() - first.float()).abs().max())
        rows.append(dict(kernel=kernel, **fields, tile=tile, ms=ms, tflops=flops / ms / 1e9, max_diff=diff))
        log(f"{label} {tile}: {ms * 1e3:8.1f} us, {flops / ms / 1e9:6.1f} TFLOP/s, max |diff| {diff:.3g}")
    return rows


def dsa_score_rows() -> list[dict]:
    """The DSA indexer's scores for a prompt chunk of 8,192 rows of one sequence (32 heads x 128, k-pools of 4):
    against the 2,048 pools of an 8k prompt and against one 16,384-pool tile of a long context, scored one row a
    program (the decode rows' schedule) and SCORE_ROWS rows a program (the prompt rows'). FLOPs: 2 x heads x dim per
    (row, pool) pair; the two differ in bits (another schedule), not in value."""
    from kernels.gpu import mla
    t, nh, di, kp, bs = 8192, 32, 128, 4, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(t, nh, di, device="cuda", dtype=BF16, generator=g)
    w = torch.randn(t, nh, device="cuda", generator=g) * nh ** -0.5
    rows = []
    for n_pools in (2048, 16384):
        blocks_n = n_pools * kp // bs
        pooled = torch.randn(blocks_n, bs // kp, di, device="cuda", dtype=BF16, generator=g)
        tables = torch.arange(blocks_n, device="cuda", dtype=torch.int32).view(1, -1)
        start = n_pools * kp - t  # the chunk is the context's last t positions: every pool is visible to most rows
        pos = torch.arange(start, start + t, device="cuda", dtype=torch.int32)
        seq = torch.zeros(t, device="cuda", dtype=torch.int32)
        blocks = mla.score_blocks([start], [t], 0).to("cuda")
        flops = 2.0 * t * n_pools * nh * di
        outs = {}
        schedules = (("row a program", dict(decode_rows=t)), ("rows in blocks", dict(decode_rows=0, blocks=blocks)))
        for name, kw in schedules:
            run = lambda kw=kw: mla.index_scores(q, w, pooled, tables, pos, seq, kp, n_pools, **kw)  # noqa: E731
            outs[name] = run()
            ms = bench_ms(run)
            rows.append(dict(kernel="dsa scores", schedule=name, rows=t, pools=n_pools, ms=ms,
                             tflops=flops / ms / 1e9))
            log(f"dsa scores {t} rows x {n_pools} pools, {name}: {ms * 1e3:8.1f} us, {flops / ms / 1e9:6.1f} TFLOP/s")
        a, b = outs.values()
        finite = torch.isfinite(a)
        assert torch.equal(finite, torch.isfinite(b))
        rows[-1]["max_diff_vs_row_a_program"] = float((a[finite] - b[finite]).abs().max())
    return rows


# Each fits the H100's 227 KiB of shared memory a block (`python -m bench.ptx_stats` gives the bytes on a CPU).
EXPANDED_TILES = [dict(BM=bm, BN=bn, num_warps=w, num_stages=st)
                  for bm, bn, w, st in ((64, 64, 4, 2), (64, 64, 8, 2), (64, 32, 4, 2), (64, 32, 8, 2),
                                        (64, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 2), (128, 32, 8, 3))]


def expanded_sweep() -> list[dict]:
    """The expanded form's tile (kernels/gpu/mla_expanded.TILE) on a whole 8k prompt's rows at the release's 64
    heads of 256 + 256, and the product that expands the context's latent rows for it (which replaces the latent
    form's two per-head products). FLOPs: 2 x heads x (dn + dv) per (row, position) pair, the count
    bench.decode_prefill uses for both forms."""
    from kernels.gpu import gemm, mla_expanded
    h, dn, dv, t = MLA_H, 256, 256, 8192
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(h, t, dn, device="cuda", dtype=BF16, generator=g)
    lat = torch.randn(t, MLA_R, device="cuda", dtype=BF16, generator=g)
    w_kv = (torch.randn(h, dn + dv, MLA_R, device="cuda", generator=g) * MLA_R ** -0.5).to(BF16)
    expand = lambda: gemm.bmm(lat.unsqueeze(0).expand(h, -1, -1), w_kv, 0)  # noqa: E731
    kv = expand()
    ms_kv = bench_ms(expand)
    kv_flops = 2.0 * h * t * (dn + dv) * MLA_R
    rows = [dict(kernel="mla expand kv", rows=t, ms=ms_kv, tflops=kv_flops / ms_kv / 1e9)]
    log(f"mla expanded: context product {ms_kv * 1e3:8.1f} us, {kv_flops / ms_kv / 1e9:6.1f} TFLOP/s")
    flops = t * (t + 1) / 2 * h * 2 * (dn + dv)
    out = torch.empty(h, t, dv, device="cuda", dtype=BF16)

    def run(tile: dict) -> tuple[float, torch.Tensor]:
        bm = tile["BM"]
        tiles = torch.tensor([(i, min(bm, t - i), i, 0) for i in range(0, t, bm)][::-1], dtype=torch.int32,
                             device="cuda")
        return bench_ms(lambda: mla_expanded.attend(q, kv, out, tiles, dn ** -0.5, tile=tile), reps=100), out

    candidates = [mla_expanded.TILE] + [x for x in EXPANDED_TILES if x != mla_expanded.TILE]
    swept = time_tiles("mla expanded sweep", candidates, run, flops)
    for r in swept:
        if "ms" in r:
            r["with_kv_ms"] = r["ms"] + ms_kv
    log(f"mla expanded: with the context product, best {min(r.get('with_kv_ms', 1e9) for r in swept) * 1e3:8.1f} us")
    return rows + swept


def mhc_rows() -> list[dict]:
    from kernels.gpu import mhc
    rows = []
    fn = torch.randn(24, 4 * D, device="cuda", dtype=BF16) * 0.01
    base, scale = torch.randn(24, device="cuda"), torch.ones(3, device="cuda")
    nw = torch.ones(D, device="cuda", dtype=BF16)
    for t in (1, 64, 8192):
        s = torch.randn(t, 4, D, device="cuda", dtype=BF16)
        ms_pre = bench_ms(lambda: mhc.pre(s, fn, base, scale, nw, eps=1e-6, norm_eps=1e-5, rms_eps=1e-5, iters=20,
                                          decode_rows=t if t <= 64 else 0))
        parts = torch.randn(1, t, D, device="cuda")
        post, comb = torch.rand(t, 4, device="cuda"), torch.rand(t, 4, 4, device="cuda")
        ms_post = bench_ms(lambda: mhc.post(parts, s, post, comb))
        rows.append(dict(kernel="mhc", tokens=t, pre_ms=ms_pre, post_ms=ms_post))
        log(f"mhc t={t}: pre {ms_pre * 1e3:7.1f} us, post {ms_post * 1e3:7.1f} us")
    return rows


def fla_probe() -> list[dict]:
    """chunk_kda from fla-core: is it chunk-boundary invariant on the 64 grid, batch invariant, close to our twin?"""
    try:
        from fla.ops.kda import chunk_kda
    except Exception as exc:  # the device kit may be missing
        return [dict(check="fla chunk_kda", error=repr(exc))]
    from kernels import kda as ref
    torch.manual_seed(0)
    h, dk, t, extra = 8, 128, 320, 81
    inputs = [torch.randn(1, t + extra, h, dk, device="cuda", dtype=BF16) for _ in range(4)]  # q, k, v, g
    inputs.append(torch.randn(1, t + extra, h, device="cuda", dtype=BF16))  # beta
    a_log, dt_bias = torch.randn(h, device="cuda") * 0.3, torch.randn(h * dk, device="cuda") * 0.3
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              safe_gate=True, lower_bound=-5.0, A_log=a_log, dt_bias=dt_bias, output_final_state=True)

    def run(spans: list[tuple[int, int]], state: torch.Tensor | None):
        """One call over the given row spans as separate sequences; the first starts from `state`."""
        parts = [torch.cat([x[:, lo:hi] for lo, hi in spans], dim=1) for x in inputs]
        lens = torch.tensor([0] + [hi - lo for lo, hi in spans]).cumsum(0).to("cuda")
        init = torch.zeros(len(spans), h, dk, dk, device="cuda")
        if state is not None:
            init[0] = state
        o, st = chunk_kda(*parts, initial_state=init, cu_seqlens=lens, **kw)
        return o, st

    whole, st_whole = run([(0, t)], None)
    a, st_a = run([(0, 128)], None)
    b, st_b = run([(128, 256)], st_a[0])
    c, st_c = run([(256, t)], st_b[0])
    chunked = torch.cat([a, b, c], dim=1)
    batched, _ = run([(0, t), (t, t + extra)], None)
    q, k, v, g, beta = (x[0, :t].float() for x in inputs)
    gf = -5.0 * torch.sigmoid(a_log.exp().view(1, h, 1) * (g + dt_bias.view(h, dk)))
    o_ref, _ = ref.chunked(q, k, v, gf, torch.sigmoid(beta), torch.zeros(h, dk, dk, device="cuda"))
    res = [dict(check="fla chunk_kda whole vs 64-grid chunks (output, final state)",
                max_abs_diff=float((whole - chunked).abs().max()), state_diff=float((st_whole[0] - st_c[0]).abs().max())),
           dict(check="fla chunk_kda alone vs with another sequence",
                max_abs_diff=float((whole - batched[:, :t]).abs().max())),
           dict(check="fla chunk_kda vs torch twin (fp32)", max_abs_diff=float((whole[0].float() - o_ref).abs().max()),
                ref_scale=float(o_ref.abs().max()))]
    for r in res:
        log(f"{r}")
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results", help="folder for the results (default bench/results)")
    p.add_argument("--only", default="", help="comma list of sections: gemm, formats, formatsweep, splitsweep, "
                   "exl3inv, sweep, exl3pin, exl3builds, exl3shard, moe, moesweep, intmoe, intsweep, intinv (the "
                   "integer experts on humming-kernels: bench/kernels_int.py), kda, mla, mlasweep, mlaxsweep "
                   "(the latent and the expanded form's prompt tiles), dsa (the indexer's scores), mhc, invariance, "
                   "fla "
                   "(formats / formatsweep / splitsweep / exl3inv / exl3pin / exl3builds / exl3shard: "
                   "bench/kernels_formats.py — every "
                   "weight format against exllamav3's EXL3 kernel, decode tiles per format, the decode K split, "
                   "exllamav3's row invariance, and with its kernel choice pinned, tile shapes of the CUDA EXL3 "
                   "product, on the layer's shapes and on the MoE's virtual-shard shapes)")
    p.add_argument("--formats", default="", help="comma list of weight formats for the formats and moe sections "
                   "(bf16, fp8, w4a16, exl3:BITS; default: formats: bf16, fp8, w4a16, exl3 at 2.5 / 3.0 / 4.0; moe: "
                   "bf16, w4a16, exl3:3.0)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    only = set(filter(None, args.only.split(",")))
    want = lambda s: not only or s in only  # noqa: E731
    picked = [f for f in args.formats.split(",") if f]
    dev = torch.device("cuda")
    bw = roofline.hbm_copy_bandwidth(dev)["bytes_per_s"]
    mm = roofline.matmul_rate(dev)["flops_per_s"]
    log(f"ceilings: HBM copy {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s")
    data: dict = {"meta": {"date": dt.datetime.now().isoformat(timespec="seconds"),
                           "device": torch.cuda.get_device_name(), "torch": torch.__version__},
                  "ceilings": {"hbm_bytes_per_s": bw, "matmul_flops_per_s": mm}, "rows": [], "checks": []}
    with torch.inference_mode():
        if want("gemm"):
            data["rows"] += gemm_rows(bw, mm)
        if want("formats"):
            from bench.kernels_formats import FORMATS, format_rows
            data["rows"] += format_rows(bw, log, tuple(picked) if picked else FORMATS)
        if want("formatsweep"):
            from bench.kernels_formats import format_sweep
            data["rows"] += format_sweep(bw, mm, log)
        if want("splitsweep"):
            from bench.kernels_formats import split_sweep
            data["rows"] += split_sweep(bw, log)
        if want("exl3inv"):
            from bench.kernels_formats import exllamav3_invariance
            data["checks"] += exllamav3_invariance(log)
        if want("exl3builds"):
            from bench.kernels_formats import exl3_builds
            data["rows"] += exl3_builds(log)
        if want("exl3shard"):
            from bench.kernels_formats import exl3_shard_builds
            data["rows"] += exl3_shard_builds(log)
        if want("exl3pin"):
            from bench.kernels_formats import exllamav3_forced
            data["checks"] += exllamav3_forced(log)
        if want("invariance"):
            data["checks"] += gemm_invariance()
        if want("moe") or want("invariance") or want("moesweep"):
            weights = moe_setup()
            formats = {"bf16": weights, "w4a16": moe_w4a16(weights)}
            if want("moe"):
                for fmt in picked or ["bf16", "w4a16", "exl3:3.0"]:
                    w = formats.get(fmt) or moe_exl3(weights, float(fmt.split(":")[1]))
                    data["rows"] += moe_rows(bw, mm, w, fmt)
                    del w
            if want("moesweep"):
                data["rows"] += moe_sweep(bw, mm, formats)
            if want("invariance"):
                data["checks"] += moe_invariance(formats)
            del weights, formats
        if want("intmoe"):
            from bench.kernels_int import moe_formats
            data["rows"] += moe_formats(bw, mm)
        if want("intsweep"):
            from bench.kernels_int import tile_sweep
            data["rows"] += tile_sweep(bw, mm)
        if want("intinv"):
            from bench.kernels_int import invariance
            data["checks"] += invariance()
        if want("kda"):
            data["rows"] += kda_rows(bw)
        if want("mla"):
            data["rows"] += mla_rows(bw)
        if want("mlasweep"):
            data["rows"] += mla_sweep()
        if want("mlaxsweep"):
            data["rows"] += expanded_sweep()
        if want("dsa"):
            data["rows"] += dsa_score_rows()
        if want("mhc"):
            data["rows"] += mhc_rows()
        if want("fla"):
            data["checks"] += fla_probe()
        if want("sweep"):
            data["rows"] += gemm_sweep(bw, mm)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"kernels-{dt.datetime.now():%Y%m%d-%H%M%S}"
    (out / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")
    log(f"wrote {out / stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
