"""KDA decode and verify rows on the GPU in one launch: a program per (sequence, head, block of value columns) does
the short conv + SiLU, the q/k l2 norms, the forget gate and beta and the fp32 recurrent state update of its
columns; whichever block of a head finishes last applies the head's gated output RMSNorm to the sequence's rows.

The torch twin is the composition in `model/kda_attention.py` (kernels/kda.py
`causal_conv` + `recurrent`, kernels/norms.py `gated_rms_norm`); the rounding points of the twin (conv output,
beta and the core output rounded to the activation dtype) are kept so the two agree to float noise.

A block owns its value columns (their conv history and state columns) and updates them in place; every block of a
head reads the head's q and k history, so the block that finishes last writes it. A verify window of L rows runs its
rows in order with the same per-step code as a one-row decode (docs/design.md §5.1: verify rows = decode
arithmetic) and leaves each row's state and conv history in the pending buffers instead of the slot; `commit` later
keeps the last accepted row's.

Virtual shards: every kernel here takes its operands as stacks over S local virtual shards ([S, T, ...], shard s's
conv channels and state heads following shard s-1's in the rank's caches) and runs all of them in one launch. A
program works on one head (or channel block) of one shard and reads that shard's operands through a shard stride, so
a head's arithmetic is the same whichever launch it is in and however many shards share it: TP=1 (4 shards per
launch) and TP=2 (2) give the same bits, and so does one launch per shard (S=1 with the shard's offsets).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gpu import arrivals, pdl
from kernels.gpu.pdl import wait_for_inputs
from kernels.gpu.seqs import DecodeSeqs

CONV_TAPS = 4  # GLM-5.3-Flash's short conv; the fused kernel keeps the three previous inputs in registers


@triton.jit
def _conv_silu(h0, h1, h2, x, w_ptr, ch, act: tl.constexpr):
    """silu(h0 w0 + h1 w1 + h2 w2 + x w3) over channels `ch` (taps summed oldest first), rounded like the twin."""
    acc = h0 * tl.load(w_ptr + ch * 4 + 0)
    acc += h1 * tl.load(w_ptr + ch * 4 + 1)
    acc += h2 * tl.load(w_ptr + ch * 4 + 2)
    acc += x * tl.load(w_ptr + ch * 4 + 3)
    return (acc * tl.sigmoid(acc)).to(act).to(tl.float32)


@triton.jit
def _load_history(hist, s_row, ch, fresh):
    """The three previous inputs of channels `ch` (oldest first) in fp32; zero for a fresh sequence."""
    h0 = tl.where(fresh, 0.0, tl.load(hist + ch).to(tl.float32))
    h1 = tl.where(fresh, 0.0, tl.load(hist + s_row + ch).to(tl.float32))
    h2 = tl.where(fresh, 0.0, tl.load(hist + 2 * s_row + ch).to(tl.float32))
    return h0, h1, h2


@triton.jit
def _gate(g_raw, dt, rate, lower_bound, HAS_LB: tl.constexpr):
    """Per-channel log-decay from the raw gate projection: GLM's safe gate with a lower bound, else -rate*softplus."""
    g = g_raw + dt
    if HAS_LB:
        g = lower_bound * tl.sigmoid(rate * g)
    else:  # -rate * softplus(g), softplus with torch's threshold of 20
        g = -rate * tl.where(g > 20.0, g, tl.log(1.0 + tl.exp(g)))
    return g


@triton.jit
def _delta_rule(s, q, k, v, g, beta):
    """One step of the gated delta rule on a [DK, BV] state block -> (new state, output columns)."""
    s = s * tl.exp(g)[:, None]
    kv = tl.sum(s * k[:, None], axis=0)
    delta = (v - kv) * beta
    s = s + k[:, None] * delta[None, :]
    return s, tl.sum(s * q[:, None], axis=0)


@triton.jit
def _store_history(dst, s_row, ch, h0, h1, h2, act: tl.constexpr, mask):
    tl.store(dst + ch, h0.to(act), mask=mask)
    tl.store(dst + s_row + ch, h1.to(act), mask=mask)
    tl.store(dst + 2 * s_row + ch, h2.to(act), mask=mask)


@triton.jit
def _gated_norm_heads(core_ptr, gate_ptr, out_ptr, w, h, live, eps, DV: tl.constexpr, CORE_CACHE: tl.constexpr):
    """One row's heads `h` (those `live`): RMSNorm over each head's DV core values, times w and sigmoid(gate). The
    norm kernel and the fused decode both run this body on the same [heads, DV] tile, so a head's reduction over DV
    has the same shape, hence the same bits, in both."""
    at = h[:, None] * DV + tl.arange(0, DV)[None, :]
    x = tl.load(core_ptr + at, mask=live[:, None], other=0.0, cache_modifier=CORE_CACHE).to(tl.float32)
    gate = tl.load(gate_ptr + at, mask=live[:, None], other=0.0).to(tl.float32)
    x = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / DV + eps))[:, None]
    tl.store(out_ptr + at, (w[None, :] * x * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty), mask=live[:, None])


@triton.jit(do_not_specialize=["s_braw_shard"],
            do_not_specialize_on_alignment=["row0_ptr", "len_ptr", "slot_ptr", "fresh_ptr", "pend_ptr"])
def _kda_decode_kernel(mixed_ptr, s_mixed_shard, s_mixed, conv_w_ptr, conv_ptr, s_conv_slot, s_conv_row, chan_off,
                       graw_ptr, s_graw_shard, s_graw, dt_bias_ptr, a_log_ptr, braw_ptr, s_braw_shard, s_braw,
                       state_ptr, s_state_slot, head_off, core_ptr, s_core_shard, s_core, gate_ptr, s_gate_shard,
                       s_gate, norm_w_ptr, out_ptr, s_out_shard, s_out, arrivals_ptr, conv_dst_ptr,
                       row0_ptr, len_ptr, slot_ptr, fresh_ptr, pend_ptr, pstate_ptr, s_pstate_row, pconv_ptr,
                       s_pconv_row, H, C, lower_bound, eps,
                       HAS_LB: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                       HB: tl.constexpr, PDL: tl.constexpr = False):
    """One (sequence, head of one shard, block of BV value columns). q and k are recomputed by every value block of a
    head (cheap) so blocks never wait on each other. The block that finishes the sequence's head last (an arrival
    counter per (sequence, head)) norms the head's rows from the core values every block stored and, for a decode
    step, writes the head's q/k history. The shard only moves the pointers (H heads and C = H x DK channels per
    shard): the arithmetic is the head's own."""
    wait_for_inputs(PDL)
    seq = tl.program_id(0)
    shard = tl.program_id(1) // H
    head = tl.program_id(1) % H
    vb = tl.program_id(2)
    act = mixed_ptr.dtype.element_ty
    shard64 = shard.to(tl.int64)
    mixed_ptr += shard64 * s_mixed_shard
    conv_w_ptr += shard * 3 * C * 4
    graw_ptr += shard64 * s_graw_shard
    dt_bias_ptr += shard * C
    a_log_ptr += shard * H
    braw_ptr += shard64 * s_braw_shard
    core_ptr += shard64 * s_core_shard
    gate_ptr += shard64 * s_gate_shard
    out_ptr += shard64 * s_out_shard
    chans = chan_off + shard * 3 * C  # this shard's first column in the rank's conv history
    row0 = tl.load(row0_ptr + seq)
    n_rows = tl.load(len_ptr + seq)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    fresh = tl.load(fresh_ptr + seq) != 0
    pend = tl.load(pend_ptr + seq)

    ik = tl.arange(0, DK)
    iv = vb * BV + tl.arange(0, BV)
    qc = head * DK + ik  # this head's q columns in `mixed` and its conv-weight rows
    kc = C + head * DK + ik
    vc = 2 * C + head * DV + iv
    hist = conv_ptr + slot * s_conv_slot + chans
    # A fresh sequence starts from zero history and state, whatever its slot held before.
    q0, q1, q2 = _load_history(hist, s_conv_row, qc, fresh)
    k0, k1, k2 = _load_history(hist, s_conv_row, kc, fresh)
    v0, v1, v2 = _load_history(hist, s_conv_row, vc, fresh)

    hd = head_off + shard * H + head
    st_ptr = state_ptr + slot * s_state_slot + hd * DK * DV + ik[:, None] * DV + iv[None, :]
    s = tl.where(fresh, 0.0, tl.load(st_ptr))
    rate = tl.exp(tl.load(a_log_ptr + head))
    dt = tl.load(dt_bias_ptr + head * DK + ik)
    first_block = ik < DK * (vb == 0).to(tl.int32)  # all-true in value block 0, all-false elsewhere

    for r in range(0, n_rows):
        row = (row0 + r).to(tl.int64)
        xq = tl.load(mixed_ptr + row * s_mixed + qc).to(tl.float32)
        xk = tl.load(mixed_ptr + row * s_mixed + kc).to(tl.float32)
        xv = tl.load(mixed_ptr + row * s_mixed + vc).to(tl.float32)
        q = _conv_silu(q0, q1, q2, xq, conv_w_ptr, qc, act)
        k = _conv_silu(k0, k1, k2, xk, conv_w_ptr, kc, act)
        v = _conv_silu(v0, v1, v2, xv, conv_w_ptr, vc, act)
        q0, q1, q2 = q1, q2, xq
        k0, k1, k2 = k1, k2, xk
        v0, v1, v2 = v1, v2, xv
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * (DK ** -0.5)
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        g = _gate(tl.load(graw_ptr + row * s_graw + head * DK + ik).to(tl.float32), dt, rate, lower_bound, HAS_LB)
        beta = tl.sigmoid(tl.load(braw_ptr + row * s_braw + head).to(tl.float32)).to(act).to(tl.float32)
        s, o = _delta_rule(s, q, k, v, g, beta)
        tl.store(core_ptr + row * s_core + head * DV + iv, o.to(act))

        if pend >= 0:  # verify window: keep every row's state and history for the commit
            p_row = (pend + r).to(tl.int64)
            p_state = pstate_ptr + p_row * s_pstate_row + hd * DK * DV
            tl.store(p_state + ik[:, None] * DV + iv[None, :], s)
            p_conv = pconv_ptr + p_row * s_pconv_row + chans
            _store_history(p_conv, s_conv_row, qc, q0, q1, q2, act, first_block)
            _store_history(p_conv, s_conv_row, kc, k0, k1, k2, act, first_block)
            _store_history(p_conv, s_conv_row, vc, v0, v1, v2, act, iv >= 0)

    # Written through conv_dst_ptr, the same cache as conv_ptr: through conv_ptr the compiler kept the reads'
    # addresses live across the row loop for these writes, and the kernel took more registers (bench.ptx_stats).
    hist_dst = conv_dst_ptr + slot * s_conv_slot + chans
    if pend < 0:  # decode step: the state and the block's own value columns of history move on in place
        tl.store(st_ptr, s)
        _store_history(hist_dst, s_conv_row, vc, v0, v1, v2, act, iv >= 0)

    # The split-K GEMM's "last to finish" (kernels/gpu/gemm.py), per (sequence, head): every thread's loads and
    # stores are done before the release; the last block's acquire sees the others' core values, and every block
    # has read the head's q/k history by then, so the last one may overwrite it. It puts the counter back to zero
    # for the next launch or graph replay.
    tl.debug_barrier()
    arrival = arrivals_ptr + seq * tl.num_programs(1) + tl.program_id(1)
    if tl.atomic_add(arrival, 1, sem="acq_rel") == tl.num_programs(2) - 1:
        if pend < 0:
            _store_history(hist_dst, s_conv_row, qc, q0, q1, q2, act, ik >= 0)
            _store_history(hist_dst, s_conv_row, kc, k0, k1, k2, act, ik >= 0)
        w = tl.load(norm_w_ptr + tl.arange(0, DV)).to(tl.float32)
        heads = head + tl.arange(0, HB)  # `gated_norm`'s tile, this head alone live in it
        for r in range(0, n_rows):
            row = (row0 + r).to(tl.int64)
            _gated_norm_heads(core_ptr + row * s_core, gate_ptr + row * s_gate, out_ptr + row * s_out, w, heads,
                              heads == head, eps, DV, ".cg")
        tl.atomic_xchg(arrival, 0)


def _heads_per_step(heads: int) -> int:
    """The heads a gated-norm tile holds (the fused decode norms its one head in a tile of the same shape)."""
    return min(16, triton.next_power_of_2(heads))


def decode(seqs: DecodeSeqs, *, mixed: torch.Tensor, conv_w: torch.Tensor, conv_state: torch.Tensor, chan_off: int,
           g_raw: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, lower_bound: float | None,
           beta_raw: torch.Tensor, state: torch.Tensor, head_off: int, gate: torch.Tensor, norm_w: torch.Tensor,
           eps: float, core: torch.Tensor, out: torch.Tensor, pend_state: torch.Tensor | None = None,
           pend_conv: torch.Tensor | None = None) -> None:
    """Run every decode-class row of S virtual shards' heads in one launch: their core outputs (rounded to the
    activation dtype) into `core`, and the gated RMSNorm of those (`gated_norm`'s bits) into `out`.

    Per shard s (leading dim S; any strides, unit last): mixed [S, T, 3C] (q|k|v before the conv, C = heads x dk of
    one shard); conv_w [S, 3C, 4] fp32; g_raw [S, T, heads*dk]; dt_bias [S, heads*dk] fp32; a_log [S, heads] fp32;
    beta_raw [S, T, heads]; gate, core and out [S, T, heads*dv]; norm_w [dv]. The rank's caches: conv_state
    [slots, 3, channels of the rank] (shard s's columns start at chan_off + s x 3C); state [slots, rank heads, dk, dv]
    fp32 (shard s's heads start at head_off + s x heads): a decode step's (`seqs.pending` < 0) move on in place.
    Pending buffers (verify windows): pend_state [N, rank heads, dk, dv] fp32 and pend_conv [N, 3, channels of the
    rank], a row each: a verify window's row r leaves its state and history at row `seqs.pending + r` (the fused
    path passes the window's first packed row, so any mix of windows fits N = the decode-class rows).
    """
    if seqs.count == 0:
        return
    shards, heads = a_log.shape
    dk = state.shape[-2]
    dv = state.shape[-1]
    if conv_w.shape[2] != CONV_TAPS or conv_state.shape[1] != CONV_TAPS - 1:
        raise ValueError(f"the fused KDA decode kernel handles a {CONV_TAPS}-tap conv only")
    c = heads * dk
    for t in (mixed, g_raw, beta_raw, gate, core, out):
        if t.shape[0] != shards or t.stride(-1) != 1:
            raise ValueError(f"KDA decode operands need {shards} shards and unit stride along their last dim")
    counts = arrivals.counters(mixed.device, seqs.count * shards * heads, "KDA (sequence, head) pairs")
    ps = pend_state if pend_state is not None else state
    pc = pend_conv if pend_conv is not None else conv_state
    bv = min(32, dv)
    _kda_decode_kernel[(seqs.count, shards * heads, dv // bv)](
        mixed, mixed.stride(0), mixed.stride(1), conv_w.contiguous(), conv_state, conv_state.stride(0),
        conv_state.stride(1), chan_off, g_raw, g_raw.stride(0), g_raw.stride(1), dt_bias.contiguous(),
        a_log.contiguous(), beta_raw, beta_raw.stride(0), beta_raw.stride(1),
        state, state.stride(0), head_off, core, core.stride(0), core.stride(1), gate, gate.stride(0), gate.stride(1),
        norm_w, out, out.stride(0), out.stride(1), counts, conv_state,  # conv_state again: conv_dst_ptr
        seqs.row0, seqs.length, seqs.slot, seqs.fresh, seqs.pending, ps, ps.stride(0), pc, pc.stride(0),
        heads, c, float(lower_bound) if lower_bound is not None else 0.0, float(eps),
        HAS_LB=lower_bound is not None, DK=dk, DV=dv, BV=bv, HB=_heads_per_step(heads), num_warps=4, **pdl.options())


@triton.jit
def _gated_norm_kernel(core_ptr, s_core_shard, s_core, gate_ptr, s_gate_shard, s_gate, w_ptr, out_ptr, s_out_shard,
                       s_out, eps, heads, DV: tl.constexpr, HB: tl.constexpr, PDL: tl.constexpr = False):
    """One (row, shard): its heads HB at a time, each normed over its own DV values (a program per (row, head) moved
    128 values each, ~3x the time of its bytes: docs/benchmarks.md, "Attention, KDA and mHC")."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    shard = tl.program_id(1).to(tl.int64)
    w = tl.load(w_ptr + tl.arange(0, DV)).to(tl.float32)
    core_ptr += shard * s_core_shard + row * s_core
    gate_ptr += shard * s_gate_shard + row * s_gate
    out_ptr += shard * s_out_shard + row * s_out
    for h0 in range(0, heads, HB):
        h = h0 + tl.arange(0, HB)
        _gated_norm_heads(core_ptr, gate_ptr, out_ptr, w, h, h < heads, eps, DV, "")


def gated_norm(core: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """KDA's output norm per (row, head): RMSNorm over dv of the core output, times sigmoid(gate) (twin:
    kernels/norms.gated_rms_norm), every shard in one launch. core, gate [S, T, heads*dv] (any strides, unit last)
    -> [S, T, heads*dv], written into `out` when given (any strides, unit last), else a new contiguous tensor."""
    shards, t, width = core.shape
    dv = weight.numel()
    if out is None:
        out = torch.empty(shards, t, width, dtype=core.dtype, device=core.device)
    if t:
        heads = width // dv
        _gated_norm_kernel[(t, shards)](core, core.stride(0), core.stride(1), gate, gate.stride(0), gate.stride(1),
                                        weight, out, out.stride(0), out.stride(1), float(eps), heads, DV=dv,
                                        HB=_heads_per_step(heads), num_warps=4, **pdl.options())
    return out


@triton.jit(do_not_specialize=["T"], do_not_specialize_on_alignment=["first_ptr", "slot_ptr", "fresh_ptr"])
def _prompt_conv_kernel(x_ptr, s_x_shard, s_x, w_ptr, hist_ptr, s_hist_slot, s_hist_row, chan_off, first_ptr,
                        slot_ptr, fresh_ptr, out_ptr, s_out_shard, s_out_plane, T, C, ROWS: tl.constexpr,
                        BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """ROWS consecutive prompt rows, BLOCK channels of one of q / k / v of one shard: silu(sum_j w_j input[i-3+j])
    over the 4 taps oldest first, the inputs before a sequence's first row of this chunk from its conv history
    (zeros for a fresh sequence). The program walks its rows in order and keeps the three inputs before the current
    one in registers, so each input row is read once (a program per row read every input four times and the taps'
    weights once per row, over ten times its traffic's time: docs/benchmarks.md, "Attention, KDA and mHC").
    A row's arithmetic is the same whichever block, launch or company it is in: the taps are summed in a fixed
    order and a row takes a register only when it holds an input of its own sequence."""
    wait_for_inputs(PDL)
    rb = tl.program_id(0) * ROWS
    blocks = tl.cdiv(C, BLOCK)
    plane = tl.program_id(1) // blocks  # 0 q, 1 k, 2 v
    col = (tl.program_id(1) - plane * blocks) * BLOCK + tl.arange(0, BLOCK)
    cm = col < C
    ch = plane * C + col  # the column among this shard's 3C inputs
    shard = tl.program_id(2)
    x_ptr += shard.to(tl.int64) * s_x_shard + ch
    w_ptr += (shard * 3 * C + ch) * 4
    hist_ptr += chan_off + shard * 3 * C + ch  # shard s's columns in the rank's conv history
    out_ptr += shard.to(tl.int64) * s_out_shard + plane.to(tl.int64) * s_out_plane + col
    w0 = tl.load(w_ptr + 0, mask=cm, other=0.0)
    w1 = tl.load(w_ptr + 1, mask=cm, other=0.0)
    w2 = tl.load(w_ptr + 2, mask=cm, other=0.0)
    w3 = tl.load(w_ptr + 3, mask=cm, other=0.0)
    # the three rows before the block, whatever sequence they belong to (each row checks below)
    x0 = tl.load(x_ptr + (rb - 3).to(tl.int64) * s_x, mask=cm & (rb >= 3), other=0.0)
    x1 = tl.load(x_ptr + (rb - 2).to(tl.int64) * s_x, mask=cm & (rb >= 2), other=0.0)
    x2 = tl.load(x_ptr + (rb - 1).to(tl.int64) * s_x, mask=cm & (rb >= 1), other=0.0)
    # Each row's input is loaded one row ahead: the walk is a chain of dependent rows, and with one load in flight
    # per program it took about twice the bytes' time (docs/benchmarks.md, "Attention, KDA and mHC").
    x_next = tl.load(x_ptr + rb.to(tl.int64) * s_x, mask=cm & (rb < T), other=0.0)
    for k in range(ROWS):
        r = rb + k
        live = r < T
        x3 = x_next
        x_next = tl.load(x_ptr + (r + 1).to(tl.int64) * s_x, mask=cm & (r + 1 < T) & (k + 1 < ROWS), other=0.0)
        i = r - tl.load(first_ptr + r, mask=live, other=0)  # the row's index in its sequence's chunk
        hist = hist_ptr + tl.load(slot_ptr + r, mask=live, other=0).to(tl.int64) * s_hist_slot
        keep = cm & live & (tl.load(fresh_ptr + r, mask=live, other=1) == 0)  # a fresh sequence's past is zeros
        acc = tl.zeros((BLOCK,), tl.float32)
        # tap j reads input i-3+j: the register when it is in the chunk, else history row i+j (row 2 is the newest)
        acc += tl.where(i >= 3, x0.to(tl.float32),
                        tl.load(hist + i * s_hist_row, mask=keep & (i < 3), other=0.0).to(tl.float32)) * w0
        acc += tl.where(i >= 2, x1.to(tl.float32),
                        tl.load(hist + (i + 1) * s_hist_row, mask=keep & (i < 2), other=0.0).to(tl.float32)) * w1
        acc += tl.where(i >= 1, x2.to(tl.float32),
                        tl.load(hist + (i + 2) * s_hist_row, mask=keep & (i < 1), other=0.0).to(tl.float32)) * w2
        acc += x3.to(tl.float32) * w3
        tl.store(out_ptr + r.to(tl.int64) * C, (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty), mask=cm & live)
        x0, x1, x2 = x1, x2, x3


def prompt_conv(x: torch.Tensor, conv_w: torch.Tensor, conv_state: torch.Tensor, chan_off: int,
                first: torch.Tensor, slot: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """KDA's short conv + SiLU over the rows of several prompt chunks and S virtual shards at once (twin:
    kernels/kda.causal_conv).

    x [S, T, 3C] the chunks' inputs q|k|v, sequence after sequence (any strides, unit last); conv_w [S, 3C, 4]; per
    row (int32 [T]): `first` the row index of its sequence's first row, `slot` its KDA slot, `fresh` 1 when the
    sequence starts at position 0. conv_state [slots, 3, channels of the rank], shard s's columns from
    chan_off + s x 3C. -> [S, 3, T, C] contiguous: q, k and v each contiguous, as chunked KDA takes them (it copies
    strided inputs). The history itself is not updated here."""
    shards, t, c3 = x.shape
    if conv_w.shape[2] != CONV_TAPS or conv_state.shape[1] != CONV_TAPS - 1:
        raise ValueError(f"the prompt conv kernel handles a {CONV_TAPS}-tap conv only")
    c = c3 // 3
    out = torch.empty(shards, 3, t, c, dtype=x.dtype, device=x.device)
    if t:
        block, rows = min(1024, triton.next_power_of_2(c)), 32
        _prompt_conv_kernel[(triton.cdiv(t, rows), 3 * triton.cdiv(c, block), shards)](
            x, x.stride(0), x.stride(1), conv_w.contiguous(), conv_state, conv_state.stride(0), conv_state.stride(1),
            chan_off, first, slot, fresh, out, out.stride(0), out.stride(1), t, c, ROWS=rows, BLOCK=block,
            num_warps=4, **pdl.options())
    return out
