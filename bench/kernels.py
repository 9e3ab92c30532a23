"""Per-kernel speed and exactness of the Triton fast paths (kernels/gpu) at real GLM-5.3-Flash shapes, on a GPU.

For every hot kernel: time (CUDA events via triton.testing.do_bench, L2 flushed between calls) against the
bandwidth or matmul ceiling measured in the same run, and against the torch / cuBLAS op it replaces; then the
exactness checks that only real shapes expose: a row alone vs packed with up to 2,048 other rows, bit for bit.
Also a probe of fla-core's `chunk_kda` (prefill candidate): chunk-boundary and batch invariance, and parity with
the torch twin.

    python -m bench.kernels --out $OUT            # on a GPU; writes kernels-<date>.json
"""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench import flags, kernels_formats, kernels_int, kernels_rest, roofline
from bench.moe_layer import BF16, D, moe_exl3, moe_rows, moe_run, moe_setup, moe_sweep, moe_w4a16
from bench.output import RESULTS, write_results
from bench.timing import bench_ms, graph_ms, log
# (name, N, K) of the dense weights a decode step reads (fused where the fast path fuses them)
GEMMS = [("kda q|k|v", 3 * 8192, D), ("kda o_proj", D, 8192), ("mla q_a|kv_a", 1536 + 512, D),
         ("mla q_b", 16384, 1536), ("mla o_proj", D, 16384), ("dense gate|up", 2 * 12288, D),
         ("dense down", D, 12288), ("lm_head", 154880, D), ("kda f_b", 8192, 128)]


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
                    gate=torch.randn(s, b, c, device="cuda", dtype=BF16),
                    norm_w=torch.ones(dk, device="cuda", dtype=BF16), eps=1e-5,
                    core=torch.empty(s, b, c, device="cuda", dtype=BF16),
                    out=torch.empty(s, b, c, device="cuda", dtype=BF16))
        ms = bench_ms(lambda: kda.decode(seqs, **args))
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
    """mHC's pre and post at decode and prompt row counts, each timed as a CUDA graph replays it (a decode step's
    launches are graph-replayed: a host-timed call of a ~5 us kernel would time the launch)."""
    from kernels.gpu import mhc
    rows = []
    fn = torch.randn(24, 4 * D, device="cuda", dtype=BF16) * 0.01
    base, scale = torch.randn(24, device="cuda"), torch.ones(3, device="cuda")
    nw = torch.ones(D, device="cuda", dtype=BF16)
    for t in (1, 8, 64, 8192):
        s = torch.randn(t, 4, D, device="cuda", dtype=BF16)
        parts = torch.randn(1, t, D, device="cuda")
        post, comb = torch.rand(t, 4, device="cuda"), torch.rand(t, 4, 4, device="cuda")
        ms_pre = graph_ms([lambda: mhc.pre(s, fn, base, scale, nw, eps=1e-6, norm_eps=1e-5, rms_eps=1e-5, iters=20,
                                           decode_rows=t if t <= 64 else 0)])
        ms_post = graph_ms([lambda: mhc.post(parts, s, post, comb)])
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


def sections(bw: float, mm: float, formats: tuple[str, ...]) -> list[tuple[str, str, Callable[[], list[dict]]]]:
    """Every section but the MoE layer's: (name for --only, the results' list it adds to, what it runs)."""
    kf, ki = kernels_formats, kernels_int
    return [("gemm", "rows", lambda: gemm_rows(bw, mm)),
            ("formats", "rows", lambda: kf.format_rows(bw, formats or kf.FORMATS)),
            ("formatsweep", "rows", lambda: kf.format_sweep(bw, mm)),
            ("splitsweep", "rows", lambda: kf.split_sweep(bw)),
            ("exl3inv", "checks", kf.exllamav3_invariance),
            ("exl3builds", "rows", kf.exl3_builds),
            ("exl3shard", "rows", kf.exl3_shard_builds),
            ("exl3pin", "checks", kf.exllamav3_forced),
            ("invariance", "checks", gemm_invariance),
            ("intmoe", "rows", lambda: ki.moe_formats(bw, mm)),
            ("intsweep", "rows", lambda: ki.tile_sweep(bw, mm)),
            ("intinv", "checks", ki.invariance),
            ("humdense", "rows", lambda: kernels_rest.dense_rows(bw)),
            ("kda", "rows", lambda: kda_rows(bw)),
            ("mla", "rows", lambda: mla_rows(bw)),
            ("mlasweep", "rows", mla_sweep),
            ("mlaxsweep", "rows", expanded_sweep),
            ("dsa", "rows", dsa_score_rows),
            ("mhc", "rows", mhc_rows),
            ("fla", "checks", fla_probe),
            ("sweep", "rows", lambda: gemm_sweep(bw, mm))]


def moe_sections(bw: float, mm: float, formats: tuple[str, ...], want: Callable[[str], bool]) -> dict[str, list]:
    """`moe` (the whole layer per format), `moesweep` and the MoE half of `invariance`, over one draw of bf16 and
    W4A16 experts (~18 GB, dropped on return)."""
    out: dict[str, list] = {"rows": [], "checks": []}
    weights = moe_setup()
    drawn = {"bf16": weights, "w4a16": moe_w4a16(weights)}
    if want("moe"):
        for fmt in formats or ("bf16", "w4a16", "exl3:3.0"):
            out["rows"] += moe_rows(bw, mm, drawn.get(fmt) or moe_exl3(weights, float(fmt.split(":")[1])), fmt)
    if want("moesweep"):
        out["rows"] += moe_sweep(bw, mm, drawn)
    if want("invariance"):
        out["checks"] += moe_invariance(drawn)
    return out


def main(argv: list[str] | None = None) -> int:
    p = flags.parser("bench.kernels", __doc__)
    flags.add(p, flags.OUT, default=str(RESULTS))
    p.add_argument("--only", default="", help="comma list of sections: gemm, formats, formatsweep, splitsweep, "
                   "exl3inv, sweep, exl3pin, exl3builds, exl3shard, moe, moesweep, intmoe, intsweep, intinv (the "
                   "integer experts on humming-kernels: bench/kernels_int.py), humdense (the rest's fp8 / int4 products on "
                   "humming's dense GEMM: bench/kernels_rest.py), kda, mla, mlasweep, mlaxsweep "
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
    picked = tuple(f for f in args.formats.split(",") if f)
    dev = torch.device("cuda")
    bw = roofline.hbm_copy_bandwidth(dev)["bytes_per_s"]
    mm = roofline.matmul_rate(dev)["flops_per_s"]
    log(f"ceilings: HBM copy {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s")
    data: dict = {"meta": {"date": dt.datetime.now().isoformat(timespec="seconds"),
                           "device": torch.cuda.get_device_name(), "torch": torch.__version__},
                  "ceilings": {"hbm_bytes_per_s": bw, "matmul_flops_per_s": mm}, "rows": [], "checks": []}
    with torch.inference_mode():
        for name, key, run in sections(bw, mm, picked):
            if want(name):
                data[key] += run()
        if want("moe") or want("moesweep") or want("invariance"):
            for key, found in moe_sections(bw, mm, picked, want).items():
                data[key] += found
    log(f"wrote {write_results(args.out, 'kernels', data, None)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
