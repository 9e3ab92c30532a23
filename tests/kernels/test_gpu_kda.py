"""The fused KDA decode / verify kernel (kernels/gpu/kda.py) against the torch twin (conv + recurrent step + gated
RMSNorm, as services/rank_worker/model/kda_attention.py composes them), and its row invariance."""

from __future__ import annotations

import torch

from tests.kernels.gpu_support import DEVICE, HALF, HALF_TOL, randn

from kernels import kda as ref  # noqa: E402
from kernels.gpu import kda  # noqa: E402
from kernels.norms import gated_rms_norm  # noqa: E402

H, DK, SLOTS, LB, EPS = 2, 64, 6, -5.0, 1e-5  # dk 64: two value blocks of 32 per head
C = H * DK
CH = 3 * C + 8  # the rank's conv channels: this shard's 3C start at CHAN_OFF (another shard owns the rest)
CHAN_OFF = 8
HEADS_RANK, HEAD_OFF = 3, 1  # the rank's state holds 3 heads; this shard's 2 start at head 1


def make_params(seed: int = 0) -> dict[str, torch.Tensor]:
    return dict(conv_w=randn(3 * C, 4, dtype=torch.float32, seed=seed + 1, scale=0.5),
                dt_bias=randn(C, dtype=torch.float32, seed=seed + 2, scale=0.3),
                a_log=randn(H, dtype=torch.float32, seed=seed + 3, scale=0.3),
                o_norm=1 + randn(DK, seed=seed + 4, scale=0.1))


def make_inputs(t: int, seed: int) -> dict[str, torch.Tensor]:
    return dict(mixed=randn(t, 3 * C, seed=seed), g_raw=randn(t, C, seed=seed + 10),
                beta_raw=randn(t, H, seed=seed + 20), gate=randn(t, C, seed=seed + 30))


def make_cache(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    conv = randn(SLOTS, 3, CH, seed=seed + 40)
    state = randn(SLOTS, HEADS_RANK, DK, DK, dtype=torch.float32, seed=seed + 50, scale=0.2)
    return conv, state


def seqs(rows: list[tuple[int, int, int, int, int]]) -> kda.DecodeSeqs:
    row0, length, slot, fresh, pending = (list(c) for c in zip(*rows))
    return kda.DecodeSeqs.build(row0, length, slot, [bool(f) for f in fresh], pending, DEVICE)


def run_kernel(p, x, conv, state, sq, pend_state=None, pend_conv=None) -> torch.Tensor:
    core = torch.zeros(x["mixed"].shape[0], C, dtype=HALF, device=DEVICE)
    kda.decode(sq, mixed=x["mixed"], conv_w=p["conv_w"], conv_state=conv, chan_off=CHAN_OFF, g_raw=x["g_raw"],
               dt_bias=p["dt_bias"], a_log=p["a_log"], lower_bound=LB, beta_raw=x["beta_raw"], state=state,
               head_off=HEAD_OFF, core=core, pend_state=pend_state, pend_conv=pend_conv)
    return kda.gated_norm(core, x["gate"], p["o_norm"], EPS)


def twin_step(p, x, row: int, hist: torch.Tensor, state: torch.Tensor):
    """One decode row by the torch reference: (gated output [C], new history [3, 3C], new state [H, DK, DK])."""
    f = lambda t: t.cpu().float()  # noqa: E731
    new = x["mixed"][row : row + 1].cpu()
    conv = ref.causal_conv(new.unsqueeze(0), f(p["conv_w"]), hist.unsqueeze(0)).squeeze(0)
    q, k, v = (c.view(1, H, DK) for c in conv.chunk(3, dim=-1))
    g = (f(x["g_raw"][row]) + f(p["dt_bias"])).view(1, H, DK)
    g = LB * torch.sigmoid(f(p["a_log"]).exp().view(1, H, 1) * g)
    beta = torch.sigmoid(x["beta_raw"][row : row + 1].cpu()).float()
    o, s = ref.recurrent(q, k, v, g, beta, state.unsqueeze(0))
    out = gated_rms_norm(o.to(new.dtype), x["gate"][row].cpu().view(1, H, DK), p["o_norm"].cpu(), EPS)
    return out.reshape(-1), ref.conv_history(new.unsqueeze(0), hist.unsqueeze(0)).squeeze(0), s.squeeze(0)


def test_decode_and_verify_rows_match_twin() -> None:
    p, x = make_params(), make_inputs(7, seed=100)
    conv, state = make_cache(seed=200)
    conv0, state0 = conv.clone(), state.clone()
    # rows: decode seq in slot 2, fresh decode seq in slot 4, verify window of 3 rows (slot 1), decode in slot 0
    sq = seqs([(0, 1, 2, 0, -1), (1, 1, 4, 1, -1), (2, 3, 1, 0, 0), (5, 1, 0, 0, -1)])
    pend_state = torch.zeros(1, 3, HEADS_RANK, DK, DK, device=DEVICE)
    pend_conv = torch.zeros(1, 3, 3, CH, dtype=HALF, device=DEVICE)
    out = run_kernel(p, x, conv, state, sq, pend_state, pend_conv)

    mine = slice(CHAN_OFF, CHAN_OFF + 3 * C)
    heads = slice(HEAD_OFF, HEAD_OFF + H)
    for row, slot, fresh in ((0, 2, False), (1, 4, True), (5, 0, False)):
        hist = torch.zeros(3, 3 * C, dtype=HALF) if fresh else conv0[slot, :, mine].cpu()
        st = torch.zeros(H, DK, DK) if fresh else state0[slot, heads].cpu()
        o, h, s = twin_step(p, x, row, hist, st)
        torch.testing.assert_close(out[row].cpu().float(), o.float(), **HALF_TOL)
        assert torch.equal(conv[slot, :, mine].cpu(), h)
        torch.testing.assert_close(state[slot, heads].cpu(), s, rtol=1e-4, atol=1e-5)
    hist, st = conv0[1, :, mine].cpu(), state0[1, heads].cpu()
    for r in range(3):
        o, hist, st = twin_step(p, x, 2 + r, hist, st)
        torch.testing.assert_close(out[2 + r].cpu().float(), o.float(), **HALF_TOL)
        assert torch.equal(pend_conv[0, r, :, mine].cpu(), hist)
        torch.testing.assert_close(pend_state[0, r, heads].cpu(), st, rtol=1e-4, atol=1e-5)
    assert torch.equal(state[1], state0[1]) and torch.equal(conv[1], conv0[1])  # verify leaves the slot alone
    # other shards' columns and heads are never touched
    assert torch.equal(conv[:, :, :CHAN_OFF], conv0[:, :, :CHAN_OFF]) and torch.equal(state[:, 0], state0[:, 0])


def test_decode_row_alone_equals_row_in_company() -> None:
    p, x = make_params(), make_inputs(6, seed=300)
    conv, state = make_cache(seed=400)
    alone_conv, alone_state = conv.clone(), state.clone()
    alone = run_kernel(p, x, alone_conv, alone_state, seqs([(3, 1, 5, 0, -1)]))
    crowd = run_kernel(p, x, conv, state, seqs([(0, 1, 0, 0, -1), (1, 2, 1, 0, 0), (3, 1, 5, 0, -1),
                                                 (4, 2, 2, 0, 1)]),
                       torch.zeros(2, 2, HEADS_RANK, DK, DK, device=DEVICE),
                       torch.zeros(2, 2, 3, CH, dtype=HALF, device=DEVICE))
    assert torch.equal(alone[3], crowd[3])
    assert torch.equal(alone_state[5], state[5]) and torch.equal(alone_conv[5], conv[5])


def test_prompt_conv_matches_twin() -> None:
    """Several prompt chunks in one launch: a fresh one, one continuing from its history, one shorter than the conv."""
    p = make_params()
    conv, _ = make_cache(seed=500)
    chunks = [(3, 7, True), (1, 5, False), (4, 2, False)]  # (slot, rows, fresh)
    x = randn(sum(n for _, n, _ in chunks), 3 * C, seed=501)
    first, slot, fresh, lo = [], [], [], 0
    for s, n, f in chunks:
        first += [lo] * n
        slot += [s] * n
        fresh += [int(f)] * n
        lo += n
    vec = lambda v: torch.tensor(v, dtype=torch.int32, device=DEVICE)  # noqa: E731
    out = kda.prompt_conv(x, p["conv_w"], conv, CHAN_OFF, vec(first), vec(slot), vec(fresh))
    lo = 0
    mine = slice(CHAN_OFF, CHAN_OFF + 3 * C)
    for s, n, f in chunks:
        hist = torch.zeros(3, 3 * C, dtype=HALF) if f else conv[s, :, mine].cpu()
        want = ref.causal_conv(x[lo : lo + n].cpu(), p["conv_w"].cpu().float(), hist)
        torch.testing.assert_close(out[lo : lo + n].cpu().float(), want.float(), **HALF_TOL)
        lo += n
