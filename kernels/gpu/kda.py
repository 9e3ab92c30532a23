"""KDA decode and verify rows on the GPU: one fused program per (sequence, head) does the short conv + SiLU, the
q/k l2 norms, the forget gate and beta, the fp32 recurrent state update and the gated output RMSNorm.

The torch twin is the composition in `services/rank_worker/model/kda_attention.py` (kernels/kda.py
`causal_conv` + `recurrent`, kernels/norms.py `gated_rms_norm`); the rounding points of the twin (conv output,
beta and the core output rounded to the activation dtype) are kept so the two agree to float noise.

A program owns every channel of its head (q, k and v columns, the whole dk x dv state), so it can update the conv
history and the state in place. A verify window of L rows runs its rows in order with the same per-step code as a
one-row decode (DESIGN §5.1: verify rows = decode arithmetic) and leaves each row's state and conv history in the
pending buffers instead of the slot; `commit` later keeps the last accepted row's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

CONV_TAPS = 4  # GLM-5.3-Flash's short conv; the fused kernel keeps the three previous inputs in registers


@dataclass
class DecodeSeqs:
    """The decode-class sequences of one batch, as device int32 vectors (one entry per sequence)."""
    row0: torch.Tensor  # packed index of the sequence's first row
    length: torch.Tensor  # rows (1 for a decode step, the window size for a verify window)
    slot: torch.Tensor  # KDA state slot
    fresh: torch.Tensor  # 1 = starts at position 0 (zero state and history)
    pending: torch.Tensor  # index into the pending buffers for verify windows, -1 = commit into the slot

    @property
    def count(self) -> int:
        return self.row0.numel()


@triton.jit
def _conv_silu(h0, h1, h2, x, w_ptr, ch, act: tl.constexpr):
    """silu(h0 w0 + h1 w1 + h2 w2 + x w3) over channels `ch` (taps summed oldest first), rounded like the twin."""
    acc = h0 * tl.load(w_ptr + ch * 4 + 0)
    acc += h1 * tl.load(w_ptr + ch * 4 + 1)
    acc += h2 * tl.load(w_ptr + ch * 4 + 2)
    acc += x * tl.load(w_ptr + ch * 4 + 3)
    return (acc * tl.sigmoid(acc)).to(act).to(tl.float32)


@triton.jit
def _kda_decode_kernel(mixed_ptr, s_mixed, conv_w_ptr, conv_ptr, s_conv_slot, s_conv_row, chan_off,
                       graw_ptr, s_graw, dt_bias_ptr, a_log_ptr, braw_ptr, s_braw, gate_ptr, s_gate, onorm_ptr,
                       state_ptr, s_state_slot, head_off, out_ptr, s_out,
                       row0_ptr, len_ptr, slot_ptr, fresh_ptr, pend_ptr, pstate_ptr, s_pstate_seq, s_pstate_row,
                       pconv_ptr, s_pconv_seq, s_pconv_row, C, lower_bound, eps,
                       HAS_LB: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    act = mixed_ptr.dtype.element_ty
    row0 = tl.load(row0_ptr + seq)
    n_rows = tl.load(len_ptr + seq)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    fresh = tl.load(fresh_ptr + seq) != 0
    pend = tl.load(pend_ptr + seq)

    ik = tl.arange(0, DK)
    iv = tl.arange(0, DV)
    qc = head * DK + ik  # this head's q columns in `mixed` and its conv-weight rows
    kc = C + head * DK + ik
    vc = 2 * C + head * DV + iv
    hist = conv_ptr + slot * s_conv_slot + chan_off
    # A fresh sequence starts from zero history and state, whatever its slot held before.
    q0 = tl.where(fresh, 0.0, tl.load(hist + qc).to(tl.float32))
    q1 = tl.where(fresh, 0.0, tl.load(hist + s_conv_row + qc).to(tl.float32))
    q2 = tl.where(fresh, 0.0, tl.load(hist + 2 * s_conv_row + qc).to(tl.float32))
    k0 = tl.where(fresh, 0.0, tl.load(hist + kc).to(tl.float32))
    k1 = tl.where(fresh, 0.0, tl.load(hist + s_conv_row + kc).to(tl.float32))
    k2 = tl.where(fresh, 0.0, tl.load(hist + 2 * s_conv_row + kc).to(tl.float32))
    v0 = tl.where(fresh, 0.0, tl.load(hist + vc).to(tl.float32))
    v1 = tl.where(fresh, 0.0, tl.load(hist + s_conv_row + vc).to(tl.float32))
    v2 = tl.where(fresh, 0.0, tl.load(hist + 2 * s_conv_row + vc).to(tl.float32))

    hd = head_off + head
    st_ptr = state_ptr + slot * s_state_slot + hd * DK * DV + ik[:, None] * DV + iv[None, :]
    s = tl.where(fresh, 0.0, tl.load(st_ptr))
    rate = tl.exp(tl.load(a_log_ptr + head))
    dt = tl.load(dt_bias_ptr + head * DK + ik)
    w_norm = tl.load(onorm_ptr + iv).to(tl.float32)

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
        g = tl.load(graw_ptr + row * s_graw + head * DK + ik).to(tl.float32) + dt
        if HAS_LB:
            g = lower_bound * tl.sigmoid(rate * g)
        else:  # -rate * softplus(g), softplus with torch's threshold of 20
            g = -rate * tl.where(g > 20.0, g, tl.log(1.0 + tl.exp(g)))
        beta = tl.sigmoid(tl.load(braw_ptr + row * s_braw + head).to(tl.float32)).to(act).to(tl.float32)

        s = s * tl.exp(g)[:, None]
        kv = tl.sum(s * k[:, None], axis=0)
        delta = (v - kv) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0).to(act).to(tl.float32)

        gate = tl.load(gate_ptr + row * s_gate + head * DV + iv).to(tl.float32)
        o = o * (1.0 / tl.sqrt(tl.sum(o * o, axis=0) / DV + eps))
        o = w_norm * o * tl.sigmoid(gate)
        tl.store(out_ptr + row * s_out + head * DV + iv, o.to(out_ptr.dtype.element_ty))

        if pend >= 0:  # verify window: keep every row's state and history for the commit
            p_state = pstate_ptr + pend * s_pstate_seq + r * s_pstate_row + hd * DK * DV
            tl.store(p_state + ik[:, None] * DV + iv[None, :], s)
            p_conv = pconv_ptr + pend * s_pconv_seq + r * s_pconv_row + chan_off
            tl.store(p_conv + qc, q0.to(act))
            tl.store(p_conv + s_conv_row + qc, q1.to(act))
            tl.store(p_conv + 2 * s_conv_row + qc, q2.to(act))
            tl.store(p_conv + kc, k0.to(act))
            tl.store(p_conv + s_conv_row + kc, k1.to(act))
            tl.store(p_conv + 2 * s_conv_row + kc, k2.to(act))
            tl.store(p_conv + vc, v0.to(act))
            tl.store(p_conv + s_conv_row + vc, v1.to(act))
            tl.store(p_conv + 2 * s_conv_row + vc, v2.to(act))

    if pend < 0:  # decode step: the slot moves on
        tl.store(st_ptr, s)
        tl.store(hist + qc, q0.to(act))
        tl.store(hist + s_conv_row + qc, q1.to(act))
        tl.store(hist + 2 * s_conv_row + qc, q2.to(act))
        tl.store(hist + kc, k0.to(act))
        tl.store(hist + s_conv_row + kc, k1.to(act))
        tl.store(hist + 2 * s_conv_row + kc, k2.to(act))
        tl.store(hist + vc, v0.to(act))
        tl.store(hist + s_conv_row + vc, v1.to(act))
        tl.store(hist + 2 * s_conv_row + vc, v2.to(act))


def decode(seqs: DecodeSeqs, *, mixed: torch.Tensor, conv_w: torch.Tensor, conv_state: torch.Tensor, chan_off: int,
           g_raw: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, lower_bound: float | None,
           beta_raw: torch.Tensor, gate: torch.Tensor, o_norm: torch.Tensor, eps: float, state: torch.Tensor,
           head_off: int, out: torch.Tensor, pend_state: torch.Tensor | None = None,
           pend_conv: torch.Tensor | None = None) -> None:
    """Run every decode-class row of one virtual shard's heads, writing their gated outputs into `out`.

    mixed [T, 3C] (q|k|v before the conv, C = heads x dk of this shard); conv_w [3C, 4] fp32; conv_state [slots, 3,
    channels of the rank] (this shard's columns start at chan_off); g_raw [T, heads*dk]; dt_bias [heads*dk] fp32;
    a_log [heads] fp32; beta_raw [T, heads]; gate [T, heads*dv]; o_norm [dv]; state [slots, rank heads, dk, dv]
    fp32 (this shard's heads start at head_off); out [T, heads*dv]. Pending buffers (verify windows):
    pend_state [windows, L, rank heads, dk, dv] fp32, pend_conv [windows, L, 3, channels of the rank].
    """
    if seqs.count == 0:
        return
    heads = a_log.numel()
    dk = state.shape[-2]
    dv = state.shape[-1]
    if conv_w.shape[1] != CONV_TAPS or conv_state.shape[1] != CONV_TAPS - 1:
        raise ValueError(f"the fused KDA decode kernel handles a {CONV_TAPS}-tap conv only")
    c = heads * dk
    for t in (mixed, g_raw, beta_raw, gate, out):
        if t.stride(-1) != 1:
            raise ValueError("KDA decode operands need unit stride along their last dim")
    ps = pend_state if pend_state is not None else state
    pc = pend_conv if pend_conv is not None else conv_state
    _kda_decode_kernel[(seqs.count, heads)](
        mixed, mixed.stride(0), conv_w.contiguous(), conv_state, conv_state.stride(0), conv_state.stride(1), chan_off,
        g_raw, g_raw.stride(0), dt_bias, a_log, beta_raw, beta_raw.stride(0), gate, gate.stride(0), o_norm,
        state, state.stride(0), head_off, out, out.stride(0),
        seqs.row0, seqs.length, seqs.slot, seqs.fresh, seqs.pending,
        ps, ps.stride(0), ps.stride(1) if pend_state is not None else 0,
        pc, pc.stride(0), pc.stride(1) if pend_conv is not None else 0,
        c, float(lower_bound) if lower_bound is not None else 0.0, float(eps),
        HAS_LB=lower_bound is not None, DK=dk, DV=dv, num_warps=8)
