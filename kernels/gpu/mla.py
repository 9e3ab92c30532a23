"""NoPE MLA with the DSA indexer on the GPU: k-pool compression, indexer scores, and sparse attention over the
paged latent cache. Torch twins: kernels/dsa.py (pool_keys, index_scores, select) and kernels/mla.py
(latent_attention), as model/mla_attention.py composes them.

What differs from the twin, and why:
- Compressed pool keys are computed once, when a pool's last position is written, and kept in the cache (one row
  per pool beside the index rows), instead of being recomputed over the whole context at every step. A pool key is
  a function of its own rows only, so keeping it changes no value; it makes a decode step's indexer cost
  O(context / kpool) reads instead of re-pooling everything.
- Every row (decode, verify or prompt) runs the same programs over its own selection: a row attends to its
  selected pools in ascending order, then to its tail, with an online softmax in fp32. The schedule is a function
  of the row's position and selection only, so a row's bits do not depend on its company (docs/design.md §5.1).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels.gpu import arch as gpu_arch, pdl
from kernels.gpu.pdl import wait_for_inputs


@triton.jit
def _row_address(bt_ptr, s_bt, seq, pos, BS: tl.constexpr):
    """Flat row index (block * BS + offset) of absolute position(s) `pos` of sequence `seq` in a paged store."""
    block = tl.load(bt_ptr + seq * s_bt + pos // BS)
    return block.to(tl.int64) * BS + pos % BS


@triton.jit
def _load_rows(data_ptr, scale_ptr, rows, cols, row_ok, width, FP8: tl.constexpr, act: tl.constexpr):
    """Cache rows [n, len(cols)] in the compute dtype (0 where not row_ok); fp8 rows are scaled back per row as the
    twin (kernels/kv_quant.py) does."""
    x = tl.load(data_ptr + rows[:, None] * width + cols[None, :], mask=row_ok[:, None], other=0.0)
    if FP8:
        scale = tl.load(scale_ptr + rows, mask=row_ok, other=1.0)
        x = (x.to(tl.float32) * scale[:, None]).to(act)
    return x


# Counts that change from round to round are not specialised on: one build whatever they are (docs/gpu-engine.md).
@triton.jit(do_not_specialize=["n_rows", "s_bt"], do_not_specialize_on_alignment=["pos_ptr", "seq_ptr"])
def _pool_kernel(idx_ptr, idx_scale_ptr, pooled_ptr, ape_ptr, bt_ptr, s_bt, pos_ptr, seq_ptr, n_rows,
                 DI: tl.constexpr, KP: tl.constexpr, BS: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr = False):
    """For each row that completes a pool (its position is the pool's last): the pool's compressed key =
    per-channel softmax over the pool's gate scores (+ ape) weighting its keys, stored in the pool store."""
    wait_for_inputs(PDL)
    r = tl.program_id(0)
    if r >= n_rows:
        return
    pos = tl.load(pos_ptr + r)
    if (pos + 1) % KP != 0:
        return
    seq = tl.load(seq_ptr + r)
    act = pooled_ptr.dtype.element_ty
    first = pos + 1 - KP
    slots = tl.arange(0, KP)
    rows = _row_address(bt_ptr, s_bt, seq, first + slots, BS)
    c = tl.arange(0, DI)
    full = slots >= 0
    keys = _load_rows(idx_ptr, idx_scale_ptr, rows, c, full, 2 * DI, FP8, act).to(tl.float32)
    gates = _load_rows(idx_ptr, idx_scale_ptr, rows, DI + c, full, 2 * DI, FP8, act).to(tl.float32)
    logits = gates + tl.load(ape_ptr + slots[:, None] * DI + c[None, :]).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, axis=0)[None, :])
    probs = (probs / tl.sum(probs, axis=0)[None, :]).to(act).to(tl.float32)
    pooled = tl.sum((probs * keys).to(act).to(tl.float32), axis=0)
    pool = pos // KP
    prow = _row_address(bt_ptr, s_bt, seq, pool * KP, BS) // KP  # BS % KP == 0: a block holds BS / KP pools
    tl.store(pooled_ptr + prow * DI + c, pooled.to(act))


def write_pools(index_store: torch.Tensor, index_scale: torch.Tensor | None, pooled: torch.Tensor,
                ape: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor, row_seq: torch.Tensor,
                kpool: int) -> None:
    """Compress every pool completed by these rows (call after their index rows are in the cache).

    index_store [blocks, BS, 2*DI] (+ fp8 scale [blocks, BS]); pooled [blocks, BS / kpool, DI]; ape [kpool, DI];
    positions, row_seq [T] int32 of the packed rows (padding rows beyond len(positions) are not passed)."""
    t = positions.numel()
    if t == 0:
        return
    bs = index_store.shape[1]
    di = pooled.shape[-1]
    _pool_kernel[(t,)](index_store, index_scale if index_scale is not None else index_store, pooled, ape,
                       block_tables, block_tables.stride(0), positions, row_seq, t,
                       DI=di, KP=kpool, BS=bs, FP8=index_scale is not None, **pdl.options())


# Counts that change from round to round are not specialised on: one build whatever they are (docs/gpu-engine.md).
@triton.jit(do_not_specialize=["first", "n_pools", "s_bt", "s_out"],
            do_not_specialize_on_alignment=["pos_ptr", "seq_ptr", "blocks_ptr"])
def _scores_kernel(q_ptr, s_q, w_ptr, s_w, pooled_ptr, bt_ptr, s_bt, pos_ptr, seq_ptr, blocks_ptr, out_ptr, s_out,
                   first, n_pools, n_heads, scale, NH: tl.constexpr, DI: tl.constexpr, KP: tl.constexpr,
                   BS: tl.constexpr, BP: tl.constexpr, BT: tl.constexpr, PDL: tl.constexpr = False):
    """score[t, p - first] = sum_h w[t, h] * relu(q[t, h] . pooled[p] * scale) for pools first <= p < n_pools
    visible at t; -inf past them. A program scores BT rows of one sequence (blocks_ptr: their row indices, -1 for
    none; BT == 1: row program_id(0)) against BP pools, so the pools' keys are read once for the BT rows and the
    product is one [BT x NH, DI] x [DI, BP] tile."""
    wait_for_inputs(PDL)
    if BT == 1:
        rows = tl.program_id(0) + tl.arange(0, 1)
    else:
        rows = tl.load(blocks_ptr + tl.program_id(0) * BT + tl.arange(0, BT))
    live = rows >= 0
    pools = first + tl.program_id(1) * BP + tl.arange(0, BP)
    pos = tl.load(pos_ptr + rows, mask=live, other=-1)  # -1: an empty slot sees no pool
    seq = tl.load(seq_ptr + tl.max(rows, axis=0))
    seen = pools < (tl.max(pos, axis=0) + 1) // KP  # the pools the block's last row sees
    c = tl.arange(0, DI)
    prow = _row_address(bt_ptr, s_bt, seq, tl.where(seen, pools, 0) * KP, BS) // KP
    keys = tl.load(pooled_ptr + prow[:, None] * DI + c[None, :], mask=seen[:, None], other=0.0)
    m = tl.arange(0, BT * NH)  # (row slot, head), NH: the head count padded to a tensor-core tile (>= 16)
    row = tl.reshape(tl.broadcast_to(rows[:, None], (BT, NH)), (BT * NH,))
    h = m % NH
    ok = (row >= 0) & (h < n_heads)
    q = tl.load(q_ptr + row[:, None].to(tl.int64) * s_q + h[:, None] * DI + c[None, :], mask=ok[:, None], other=0.0)
    s = tl.dot(q, tl.trans(keys)) * scale
    w = tl.load(w_ptr + row.to(tl.int64) * s_w + h, mask=ok, other=0.0).to(tl.float32)
    score = tl.sum(tl.reshape(tl.maximum(s, 0.0) * w[:, None], (BT, NH, BP)), axis=1)
    visible = pools[None, :] < ((pos + 1) // KP)[:, None]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * s_out + (pools - first)[None, :],
             tl.where(visible, score, float("-inf")), mask=live[:, None] & (pools < n_pools)[None, :])


SCORE_ROWS = 4  # prompt rows a scores program takes (consecutive positions of one sequence, aligned to a multiple)


def score_blocks(starts: list[int], lengths: list[int], first_row: int, bt: int = SCORE_ROWS) -> torch.Tensor:
    """Host table of prompt rows' scoring blocks: int32 [n, bt], block j's slot i = the row of position bt * k + i
    of one sequence, -1 where the batch has no such row. A row's slot is its position mod bt, whatever chunk or
    company it comes in. starts, lengths: the prompt sequences' chunks, whose rows follow one another from
    first_row. (Sizes come from the lists, so nothing reads a tensor back.)"""
    counts = [(s + n - 1) // bt - s // bt + 1 for s, n in zip(starts, lengths)]
    table = torch.full((sum(counts), bt), -1, dtype=torch.int32)
    rows = sum(lengths)
    if rows == 0:
        return table
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])
    firsts = [sum(counts[:i]) - s // bt for i, s in enumerate(starts)]  # block of position 0, per sequence
    block = torch.repeat_interleave(torch.tensor(firsts), torch.tensor(lengths), output_size=rows) + pos // bt
    table[block, pos % bt] = torch.arange(first_row, first_row + rows, dtype=torch.int32)
    return table


def index_scores(q: torch.Tensor, weights: torch.Tensor, pooled: torch.Tensor, block_tables: torch.Tensor,
                 positions: torch.Tensor, row_seq: torch.Tensor, kpool: int, n_pools: int, first: int = 0,
                 decode_rows: int | None = None, blocks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, NH, DI]; weights [T, NH] fp32 (already scaled) -> scores [T, n_pools - first] fp32 of pools
    first .. n_pools - 1 (-inf = not visible). Rows [0, decode_rows) (default: all) are scored one a program;
    the prompt rows after them by `blocks` (score_blocks, on the device), SCORE_ROWS a program."""
    t, nh, di = q.shape
    out = torch.empty(t, n_pools - first, dtype=torch.float32, device=q.device)
    if t == 0 or n_pools <= first:
        return out
    d = t if decode_rows is None else decode_rows
    q = q.reshape(t, nh * di)
    bp = 64
    common = dict(NH=max(16, triton.next_power_of_2(nh)), DI=di, KP=kpool, BS=pooled.shape[1] * kpool, BP=bp)
    args = (q, q.stride(0), weights, weights.stride(0), pooled, block_tables, block_tables.stride(0), positions,
            row_seq)
    tail = (out, out.stride(0), first, n_pools, nh, di ** -0.5)
    pool_tiles = triton.cdiv(n_pools - first, bp)
    if d:
        _scores_kernel[(d, pool_tiles)](*args, positions, *tail, BT=1, **common, **pdl.options())
    if d < t:
        if blocks is None or blocks.shape[1] != SCORE_ROWS:
            raise ValueError("index_scores: prompt rows need their score_blocks table")
        _scores_kernel[(blocks.shape[0], pool_tiles)](*args, blocks, *tail, BT=SCORE_ROWS, **common, **pdl.options())
    return out


# Pools scored and ranked per step of the selection: a row's selection buffers are [keep + POOL_TILE] whatever the
# context (at 1M tokens a whole row of k-pools is 262,144 scores; sorted whole for a 4,096-row chunk that was ~16 GiB).
POOL_TILE = 16384


# Counts that change from round to round are not specialised on: one build whatever they are (docs/gpu-engine.md).
@triton.jit(do_not_specialize=["n_pools"], do_not_specialize_on_alignment=["pos_ptr"])
def _count_kernel(pos_ptr, count_ptr, sel_ptr, n_pools, keep, KP: tl.constexpr, TAKE_ALL: tl.constexpr,
                  BP: tl.constexpr, PDL: tl.constexpr = False):
    """count[r] = how many pools row r selects: those ending at or before it, at most n_pools and keep. TAKE_ALL
    (n_pools <= keep: every row takes every pool it sees): also sel[r, :] = 0, 1, ..., n_pools - 1."""
    wait_for_inputs(PDL)
    r = tl.program_id(0)
    visible = tl.minimum((tl.load(pos_ptr + r) + 1) // KP, n_pools)
    tl.store(count_ptr + r, tl.minimum(visible, keep))
    if TAKE_ALL:
        p = tl.arange(0, BP)
        for p0 in range(0, n_pools, BP):
            tl.store(sel_ptr + r.to(tl.int64) * n_pools + p0 + p, p0 + p, mask=p0 + p < n_pools)


def select_pools(scores: torch.Tensor | Callable[[int, int], torch.Tensor] | None, positions: torch.Tensor,
                 kpool: int, keep: int, n_pools: int, tile: int = POOL_TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's selected pools in ascending order, and how many: (sel [T, W] int32, count [T] int32).

    A row sees the pools that end at or before it; when it sees at most `keep` of them it takes them all (then no
    scores are needed: `scores` may be None when n_pools <= keep), else the `keep` best, ties to the lowest index
    (a stable sort, as the twin's `dsa.select`). scores: [T, n_pools], or scores_of(p0, p1) -> [T, p1 - p0] for
    pools p0 .. p1 - 1, asked for `tile` pools at a time: the best `keep` so far are kept across tiles (candidates =
    the best so far, all of lower index, then the tile in index order; a stable sort keeps ties to the lowest
    index), the same picks as one sort over every pool (kernels/dsa.py select_positions does this on the CPU)."""
    t, dev = positions.numel(), positions.device
    take_all = n_pools <= keep
    count = torch.empty(t, dtype=torch.int32, device=dev)
    sel = torch.empty(t, n_pools, dtype=torch.int32, device=dev) if take_all else None
    if t:  # one launch for what were a handful of torch index ops (a decode step's selection, when it takes all)
        out = sel if sel is not None and sel.numel() else count  # else a stand-in pointer, never written
        _count_kernel[(t,)](positions, count, out, n_pools, keep, KP=kpool, TAKE_ALL=take_all, BP=256, **pdl.options())
    if sel is not None:
        return sel, count
    scores_of = scores if callable(scores) else (lambda p0, p1: scores[:, p0:p1])
    tile = max(tile, keep)
    best_v = best_i = None
    for p0 in range(0, n_pools, tile):
        p1 = min(n_pools, p0 + tile)
        part = scores_of(p0, p1)
        # int32 pool indices: the final ascending sort then radix-sorts 4-byte keys, not int64's 8-byte ones (an 8k
        # prompt's picks: docs/benchmarks.md, "Attention, KDA and mHC")
        idx = torch.arange(p0, p1, dtype=torch.int32, device=positions.device).expand(part.shape[0], -1)
        cand_v = part if best_v is None else torch.cat([best_v, part], dim=1)
        cand_i = idx if best_i is None else torch.cat([best_i, idx], dim=1)
        order = torch.sort(cand_v, dim=-1, descending=True, stable=True).indices[:, :keep]
        best_v, best_i = cand_v.gather(1, order), cand_i.gather(1, order)
    slot = torch.arange(keep, device=positions.device)
    best = torch.where(slot < count.unsqueeze(1), best_i, n_pools)  # invisible picks sort to the end
    return torch.sort(best, dim=-1).values, count


@triton.jit(do_not_specialize=["s_bt", "s_sel", "split_len", "max_splits"],
            do_not_specialize_on_alignment=["pos_ptr", "seq_ptr", "sel_ptr", "count_ptr"])
def _attention_kernel(q_ptr, s_qt, s_qh, lat_ptr, lat_scale_ptr, bt_ptr, s_bt, pos_ptr, seq_ptr, sel_ptr, s_sel,
                      count_ptr, out_ptr, s_ot, s_oh, m_ptr, l_ptr, n_heads, scale, split_len, max_splits,
                      R: tl.constexpr, HB: tl.constexpr, KP: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
                      FP8: tl.constexpr, PARTIAL: tl.constexpr, PDL: tl.constexpr = False):
    """One row, HB heads, one split of the row's attended positions.

    A row attends to a virtual list: its selected pools' positions in ascending pool order, then its tail (the
    incomplete pool it sits in). Split `sp` covers list entries [sp * split_len, (sp + 1) * split_len) with an fp32
    online softmax. PARTIAL: write the split's (max, sum, unnormalised output) for `_combine_kernel`; otherwise
    the row has one split and the normalised output is written directly."""
    wait_for_inputs(PDL)
    r = tl.program_id(0)
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    sp = tl.program_id(2)
    has_head = heads < n_heads
    pos = tl.load(pos_ptr + r)
    seq = tl.load(seq_ptr + r)
    n_sel = tl.load(count_ptr + r)
    in_pools = n_sel * KP
    tail_start = (pos + 1) // KP * KP
    total = in_pools + pos + 1 - tail_start
    lo = sp * split_len
    hi = tl.minimum(lo + split_len, total)
    act = q_ptr.dtype.element_ty
    c = tl.arange(0, R)
    m = tl.full((HB,), -1.0e30, tl.float32)  # finite start: a block with nothing visible adds exp(-inf) = 0
    l = tl.zeros((HB,), tl.float32)
    acc = tl.zeros((HB, R), tl.float32)
    if lo < hi:
        q = tl.load(q_ptr + r * s_qt + heads[:, None] * s_qh + c[None, :], mask=has_head[:, None], other=0.0)
        j = tl.arange(0, BN)
        for b in range(lo, hi, BN):
            v = b + j
            ok = v < hi
            is_pool = v < in_pools
            pool = tl.load(sel_ptr + r * s_sel + v // KP, mask=ok & is_pool, other=0)
            p = tl.where(is_pool, pool * KP + v % KP, tail_start + v - in_pools)
            rows = _row_address(bt_ptr, s_bt, seq, tl.where(ok, p, 0), BS)
            kv = _load_rows(lat_ptr, lat_scale_ptr, rows, c, ok, R, FP8, act)
            s = tl.dot(q, tl.trans(kv)) * scale
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            prob = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(prob, axis=1)
            acc = acc * alpha[:, None] + tl.dot(prob.to(act), kv)
            m = m_new
    if PARTIAL:
        if lo < hi:
            part = (r * n_heads + heads) * max_splits + sp
            tl.store(m_ptr + part, m, mask=has_head)
            tl.store(l_ptr + part, l, mask=has_head)
            tl.store(out_ptr + part[:, None] * R + c[None, :], acc, mask=has_head[:, None])
    else:
        o = acc / l[:, None]
        tl.store(out_ptr + r * s_ot + heads[:, None] * s_oh + c[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=has_head[:, None])


@triton.jit(do_not_specialize=["split_len", "max_splits"], do_not_specialize_on_alignment=["pos_ptr", "count_ptr"])
def _combine_kernel(m_ptr, l_ptr, acc_ptr, pos_ptr, count_ptr, out_ptr, s_ot, s_oh, n_heads, split_len,
                    max_splits, R: tl.constexpr, KP: tl.constexpr, PDL: tl.constexpr = False):
    """Merge one row's split partials for one head, in split order (a function of the row's own list length)."""
    wait_for_inputs(PDL)
    r = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + r)
    total = tl.load(count_ptr + r) * KP + pos + 1 - (pos + 1) // KP * KP
    n_splits = tl.cdiv(total, split_len)
    base = (r * n_heads + h) * max_splits
    c = tl.arange(0, R)
    big = tl.load(m_ptr + base)
    for sp in range(1, n_splits):
        big = tl.maximum(big, tl.load(m_ptr + base + sp))
    den = 0.0
    o = tl.zeros((R,), tl.float32)
    for sp in range(0, n_splits):
        w = tl.exp(tl.load(m_ptr + base + sp) - big)
        den += tl.load(l_ptr + base + sp) * w
        o += tl.load(acc_ptr + (base + sp) * R + c) * w
    tl.store(out_ptr + r * s_ot + h * s_oh + c, (o / den).to(out_ptr.dtype.element_ty))


DECODE_SPLIT = 256  # attended positions per program for decode-class rows (a constant: the split is fixed)
# Prompt rows' tile: heads per program (the M side of the tensor-core tiles; heads past the rank's are masked, so
# the schedule is the same at every TP size), warps, pipeline stages and, when given, attended positions per step
# (BN; else the decode rows'). A program reads its row's selected latent rows once for its heads: the fewer heads
# a program, the more often they are read. `python -m bench.kernels --only mlasweep` times the choices at 8k; 64
# heads x 64 positions with 8 warps is its choice (docs/benchmarks.md, "Attention, KDA and mHC").
PROMPT_TILE: dict[str, int] = dict(HB=64, BN=64, num_warps=8, num_stages=2)
# GB10's row (kernels/gpu/arch.py): Hopper's tile needs 136 KiB of shared memory with bf16 latent rows and 192 KiB
# with fp8 (GB10 has 99 KiB a block); 32 heads x 32 positions needs 96 KiB at fp8 and spills, 16 x 32 with 4 warps
# (the decode rows' shape) 49 / 80 KiB and no spills (bench.kernel_census). Other bits than Hopper's (BN is the
# online softmax's step); not timed on a GB10 yet.
PROMPT_TILE_GB10: dict[str, int] = dict(HB=16, BN=32, num_warps=4, num_stages=2)


def prompt_tile(arch: int) -> dict[str, int]:
    """Prompt rows' tile on the architecture's table row (read at call time: bench.kernels sweeps PROMPT_TILE)."""
    return PROMPT_TILE if arch == gpu_arch.HOPPER else PROMPT_TILE_GB10


def sparse_attention(q_lat: torch.Tensor, latent: torch.Tensor, latent_scale: torch.Tensor | None,
                     block_tables: torch.Tensor, positions: torch.Tensor, row_seq: torch.Tensor, sel: torch.Tensor,
                     count: torch.Tensor, kpool: int, scale: float, out: torch.Tensor, decode_rows: int,
                     max_positions: int, decode_split: int = DECODE_SPLIT) -> None:
    """q_lat [T, H, R] (any strides, unit last); latent [blocks, BS, R] (+ fp8 scale [blocks, BS]); sel, count
    from `select_pools` -> out [T, H, R] (attention-weighted latent rows).

    Rows [0, decode_rows) are decode-class: their list is cut into fixed splits of DECODE_SPLIT positions run in
    parallel and merged in order (few rows, so the chip needs the splits). Prompt rows run their whole list in one
    program. max_positions bounds any row's list length (selected pools x kpool + tail), sizing the split grid.
    decode_split is a parameter only so the tests can exercise many splits on small contexts."""
    t, h, r_dim = q_lat.shape
    hb = 16  # heads per program: the M side of the tensor-core tiles (missing heads are masked)
    bs = latent.shape[1]
    bn = 32 if r_dim >= 256 else 64
    common = dict(R=r_dim, HB=hb, KP=kpool, BS=bs, BN=max(bn, kpool), FP8=latent_scale is not None)
    lat_scale = latent_scale if latent_scale is not None else latent
    split = min(max(decode_rows, 0), t)
    if split:
        n_splits = triton.cdiv(max_positions, decode_split)
        part = torch.empty(split, h, n_splits, r_dim, dtype=torch.float32, device=q_lat.device)
        m = torch.empty(split, h, n_splits, dtype=torch.float32, device=q_lat.device)
        l = torch.empty_like(m)
        _attention_kernel[(split, triton.cdiv(h, hb), n_splits)](
            q_lat, q_lat.stride(0), q_lat.stride(1), latent, lat_scale, block_tables, block_tables.stride(0),
            positions, row_seq, sel, sel.stride(0), count, part, 0, 0, m, l, h, float(scale), decode_split,
            n_splits, PARTIAL=True, num_warps=4, num_stages=2, **common, **pdl.options())
        _combine_kernel[(split, h)](m, l, part, positions, count, out, out.stride(0), out.stride(1), h, decode_split,
                                    n_splits, R=r_dim, KP=kpool, num_warps=4, **pdl.options())
    if split < t:
        rows = slice(split, t)
        tile = dict(prompt_tile(gpu_arch.row(q_lat.device)))
        hb_p, bn_p = tile.pop("HB"), max(tile.pop("BN", bn), kpool)
        _attention_kernel[(t - split, triton.cdiv(h, hb_p), 1)](
            q_lat[rows], q_lat.stride(0), q_lat.stride(1), latent, lat_scale, block_tables, block_tables.stride(0),
            positions[rows], row_seq[rows], sel[rows], sel.stride(0), count[rows], out[rows], out.stride(0),
            out.stride(1), out, out, h, float(scale), 1 << 30, 1, PARTIAL=False,
            **{**common, "HB": hb_p, "BN": bn_p}, **tile, **pdl.options())
