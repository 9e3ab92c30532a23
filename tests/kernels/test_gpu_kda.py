"""The fused KDA decode / verify kernel (kernels/gpu/kda.py) against the torch twin (conv + recurrent step + gated
RMSNorm, as model/kda_attention.py composes them), its row invariance, and its virtual shards:
S shards in one launch give each shard the bits of its own one-shard launch. Its gated norm equals the norm
kernel's over its core outputs bit for bit, and its history writes equal the commit's data movement."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gpu_support import DEVICE, HALF, HALF_TOL, randn

from kernels import kda as ref  # noqa: E402
from kernels.gpu import arrivals, kda  # noqa: E402
from kernels.norms import gated_rms_norm  # noqa: E402

H, DK, SLOTS, LB, EPS = 2, 64, 6, -5.0, 1e-5  # dk 64: two value blocks of 32 per head
C = H * DK
CH = 3 * C + 8  # the rank's conv channels: this shard's 3C start at CHAN_OFF (another shard owns the rest)
CHAN_OFF = 8
HEADS_RANK, HEAD_OFF = 3, 1  # the rank's state holds 3 heads; this shard's 2 start at head 1


def make_params(seed: int = 0, shards: int = 1, heads: int = H) -> dict[str, torch.Tensor]:
    """Per-shard parameters stacked over `shards` virtual shards (the kernels' [S, ...] operands)."""
    c = heads * DK
    return dict(conv_w=randn(shards, 3 * c, 4, dtype=torch.float32, seed=seed + 1, scale=0.5),
                dt_bias=randn(shards, c, dtype=torch.float32, seed=seed + 2, scale=0.3),
                a_log=randn(shards, heads, dtype=torch.float32, seed=seed + 3, scale=0.3),
                o_norm=1 + randn(DK, seed=seed + 4, scale=0.1))


def make_inputs(t: int, seed: int, shards: int = 1, heads: int = H) -> dict[str, torch.Tensor]:
    # q|k|v and beta side by side in one tensor, as the model's fused projection leaves them
    c = heads * DK
    mixed_beta = randn(shards, t, 3 * c + heads, seed=seed)
    return dict(mixed=mixed_beta[..., : 3 * c], beta_raw=mixed_beta[..., 3 * c :],
                g_raw=randn(shards, t, c, seed=seed + 10), gate=randn(shards, t, c, seed=seed + 30))


def make_cache(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    conv = randn(SLOTS, 3, CH, seed=seed + 40)
    state = randn(SLOTS, HEADS_RANK, DK, DK, dtype=torch.float32, seed=seed + 50, scale=0.2)
    return conv, state


def seqs(rows: list[tuple[int, int, int, int, int]]) -> kda.DecodeSeqs:
    row0, length, slot, fresh, pending = (list(c) for c in zip(*rows))
    return kda.DecodeSeqs.build(row0, length, slot, [bool(f) for f in fresh], pending, DEVICE)


def run_kernel(p, x, conv, state, sq, pend_state=None, pend_conv=None, chan_off: int = CHAN_OFF,
               head_off: int = HEAD_OFF, core: torch.Tensor | None = None) -> torch.Tensor:
    """The fused decode (recurrence + gated norm + history) over the shards stacked in p and x -> gated outputs
    [S, T, heads*dk]; the core outputs go to `core` when given."""
    if core is None:
        core = torch.zeros_like(x["gate"])
    out = torch.zeros_like(x["gate"])
    kda.decode(sq, mixed=x["mixed"], conv_w=p["conv_w"], conv_state=conv, chan_off=chan_off, g_raw=x["g_raw"],
               dt_bias=p["dt_bias"], a_log=p["a_log"], lower_bound=LB, beta_raw=x["beta_raw"], state=state,
               head_off=head_off, gate=x["gate"], norm_w=p["o_norm"], eps=EPS, core=core, out=out,
               pend_state=pend_state, pend_conv=pend_conv)
    return out


def twin_step(p, x, row: int, hist: torch.Tensor, state: torch.Tensor):
    """One decode row of shard 0 by the torch reference: (gated output [C], new history [3, 3C], new state
    [H, DK, DK])."""
    f = lambda t: t.cpu().float()  # noqa: E731
    new = x["mixed"][0, row : row + 1].cpu()
    conv = ref.causal_conv(new.unsqueeze(0), f(p["conv_w"][0]), hist.unsqueeze(0)).squeeze(0)
    q, k, v = (c.view(1, H, DK) for c in conv.chunk(3, dim=-1))
    g = (f(x["g_raw"][0, row]) + f(p["dt_bias"][0])).view(1, H, DK)
    g = LB * torch.sigmoid(f(p["a_log"][0]).exp().view(1, H, 1) * g)
    beta = torch.sigmoid(x["beta_raw"][0, row : row + 1].cpu()).float()
    o, s = ref.recurrent(q, k, v, g, beta, state.unsqueeze(0))
    out = gated_rms_norm(o.to(new.dtype), x["gate"][0, row].cpu().view(1, H, DK), p["o_norm"].cpu(), EPS)
    return out.reshape(-1), ref.conv_history(new.unsqueeze(0), hist.unsqueeze(0)).squeeze(0), s.squeeze(0)


def test_decode_and_verify_rows_match_twin() -> None:
    p, x = make_params(), make_inputs(7, seed=100)
    conv, state = make_cache(seed=200)
    conv0, state0 = conv.clone(), state.clone()
    # rows: decode seq in slot 2, fresh decode seq in slot 4, verify window of 3 rows (slot 1), decode in slot 0
    # (the window's rows go to its first packed row on in the pending buffers, a row each)
    sq = seqs([(0, 1, 2, 0, -1), (1, 1, 4, 1, -1), (2, 3, 1, 0, 2), (5, 1, 0, 0, -1)])
    pend_state = torch.zeros(6, HEADS_RANK, DK, DK, device=DEVICE)
    pend_conv = torch.zeros(6, 3, CH, dtype=HALF, device=DEVICE)
    out = run_kernel(p, x, conv, state, sq, pend_state, pend_conv)[0]

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
        assert torch.equal(pend_conv[2 + r, :, mine].cpu(), hist)
        torch.testing.assert_close(pend_state[2 + r, heads].cpu(), st, rtol=1e-4, atol=1e-5)
    assert torch.equal(state[1], state0[1]) and torch.equal(conv[1], conv0[1])  # verify leaves the slot alone
    # other shards' columns and heads are never touched
    assert torch.equal(conv[:, :, :CHAN_OFF], conv0[:, :, :CHAN_OFF]) and torch.equal(state[:, 0], state0[:, 0])


def test_decode_row_alone_equals_row_in_company() -> None:
    """A decode step's gated output, state and history, and a verify window's gated outputs and pending rows, alone
    = among other sequences, bit for bit."""
    p, x = make_params(), make_inputs(6, seed=300)
    conv, state = make_cache(seed=400)

    def pending() -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.zeros(6, HEADS_RANK, DK, DK, device=DEVICE), torch.zeros(6, 3, CH, dtype=HALF, device=DEVICE))

    alone_conv, alone_state = conv.clone(), state.clone()
    alone = run_kernel(p, x, alone_conv, alone_state, seqs([(3, 1, 5, 0, -1)]))[0]
    alone_pend = pending()
    window = run_kernel(p, x, conv.clone(), state.clone(), seqs([(1, 2, 1, 0, 1)]), *alone_pend)[0]
    crowd_pend = pending()
    crowd = run_kernel(p, x, conv, state, seqs([(0, 1, 0, 0, -1), (1, 2, 1, 0, 1), (3, 1, 5, 0, -1),
                                                 (4, 2, 2, 0, 4)]), *crowd_pend)[0]
    assert torch.equal(alone[3], crowd[3])
    assert torch.equal(alone_state[5], state[5]) and torch.equal(alone_conv[5], conv[5])
    assert torch.equal(window[1:3], crowd[1:3])
    assert torch.equal(alone_pend[0][1:3], crowd_pend[0][1:3]) and torch.equal(alone_pend[1][1:3], crowd_pend[1][1:3])


# (row0, rows, slot, fresh, pending): a decode step (slot 2), a verify window of 3 (slot 1), a fresh decode step
# (slot 4), a fresh verify window of 2 (slot 5), and as a CUDA graph's padding sequences, a decode sequence of 2
# rows (slot 0) and a fresh one with no row (slot 3)
MIXED = [(0, 1, 2, 0, -1), (1, 3, 1, 0, 1), (4, 1, 4, 1, -1), (5, 2, 5, 1, 5), (7, 2, 0, 0, -1), (9, 0, 3, 1, -1)]
MIXED_ROWS = 9


def rank_cache(seed: int, shards: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank's caches around `shards` shards of `heads` heads, at CHAN_OFF and HEAD_OFF (others own the rest)."""
    conv = randn(SLOTS, 3, CHAN_OFF + shards * 3 * heads * DK, seed=seed)
    state = randn(SLOTS, HEAD_OFF + shards * heads, DK, DK, dtype=torch.float32, seed=seed + 1, scale=0.2)
    return conv, state


@pytest.mark.parametrize("heads", [H, 20], ids=["2 heads", "20 heads"])
def test_fused_norm_equals_the_norm_kernel_on_its_core(heads: int) -> None:
    """The gated outputs of the fused launch equal `gated_norm` over the core outputs it wrote, bit for bit, for
    every decode-class row of 2 shards: decode steps, verify windows, fresh sequences. 20 heads: the norm kernel's
    tile holds 16 heads, the fused one norms a single head in a tile of that shape."""
    p, x = make_params(seed=11, shards=2, heads=heads), make_inputs(MIXED_ROWS, seed=900, shards=2, heads=heads)
    conv, state = rank_cache(901, 2, heads)
    pend_state = torch.zeros(MIXED_ROWS, *state.shape[1:], device=DEVICE)
    pend_conv = torch.zeros(MIXED_ROWS, *conv.shape[1:], dtype=HALF, device=DEVICE)
    core = torch.zeros_like(x["gate"])
    out = run_kernel(p, x, conv, state, seqs(MIXED), pend_state, pend_conv, core=core)
    assert torch.equal(out, kda.gated_norm(core, x["gate"], p["o_norm"], EPS))
    assert out.abs().sum(-1).ne(0).all()  # every row was normed


def test_history_moves_on_as_the_commit_moved_it() -> None:
    """What the separate commit launch did: a decode step's slot gets the last 3 inputs of its history and rows
    in this shard's columns (zeros and its rows for a fresh one, zeros for a fresh one with no row), a verify
    window's slot and every other column stay as they were (the window's rows are in the pending buffers)."""
    p, x = make_params(seed=12), make_inputs(MIXED_ROWS, seed=910)
    conv, state = make_cache(seed=911)
    before, want = conv.clone(), conv.clone()
    mine = slice(CHAN_OFF, CHAN_OFF + 3 * C)
    for row0, n, slot, fresh, pending in MIXED:
        if pending < 0:
            hist = torch.zeros(3, 3 * C, dtype=HALF, device=DEVICE) if fresh else conv[slot, :, mine]
            want[slot, :, mine] = ref.conv_history(x["mixed"][0, row0 : row0 + n], hist)
    pend_state = torch.zeros(MIXED_ROWS, HEADS_RANK, DK, DK, device=DEVICE)
    pend_conv = torch.zeros(MIXED_ROWS, 3, CH, dtype=HALF, device=DEVICE)
    run_kernel(p, x, conv, state, seqs(MIXED), pend_state, pend_conv)
    assert torch.equal(conv, want)
    assert not torch.equal(conv[2], before[2])  # a decode step's history moved on


def test_arrival_counters_are_left_at_zero_and_a_replay_gives_the_same_bits() -> None:
    """The kernel puts every (sequence, head) counter back to zero, so the next launch (or a CUDA graph's replay,
    which runs no memset) counts from zero again and gives the same bits."""
    p, x = make_params(seed=13), make_inputs(MIXED_ROWS, seed=920)
    conv, state = make_cache(seed=921)
    runs = []
    for _ in range(2):
        c, st = conv.clone(), state.clone()
        pend = (torch.zeros(MIXED_ROWS, HEADS_RANK, DK, DK, device=DEVICE),
                torch.zeros(MIXED_ROWS, 3, CH, dtype=HALF, device=DEVICE))
        runs.append((run_kernel(p, x, c, st, seqs(MIXED), *pend), c, st, *pend))
        assert not arrivals._TABLES[x["mixed"].device].any()
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def prompt_rows(chunks: list[tuple[int, int, bool]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(first, slot, fresh) int32 per row of prompt chunks given as (slot, rows, fresh)."""
    first, slot, fresh, lo = [], [], [], 0
    for s, n, f in chunks:
        first += [lo] * n
        slot += [s] * n
        fresh += [int(f)] * n
        lo += n
    return tuple(torch.tensor(v, dtype=torch.int32, device=DEVICE) for v in (first, slot, fresh))


def rows_of(planes: torch.Tensor) -> torch.Tensor:
    """prompt_conv's [S, 3, T, C] (q, k, v planes) as [S, T, 3C] rows."""
    s, _, t, c = planes.shape
    return planes.permute(0, 2, 1, 3).reshape(s, t, 3 * c)


# (slot, rows, fresh): a fresh chunk and a continuing one longer than the kernel's 32-row blocks, one shorter
# than the conv, a single row
CHUNKS = [(3, 40, True), (1, 5, False), (4, 2, False), (0, 35, False), (2, 1, False)]


def test_prompt_conv_matches_twin() -> None:
    """Several prompt chunks in one launch, their rows across the kernel's row blocks."""
    p = make_params()
    conv, _ = make_cache(seed=500)
    chunks = CHUNKS
    x = randn(1, sum(n for _, n, _ in chunks), 3 * C, seed=501)
    out = rows_of(kda.prompt_conv(x, p["conv_w"], conv, CHAN_OFF, *prompt_rows(chunks)))[0]
    lo = 0
    mine = slice(CHAN_OFF, CHAN_OFF + 3 * C)
    for s, n, f in chunks:
        hist = torch.zeros(3, 3 * C, dtype=HALF) if f else conv[s, :, mine].cpu()
        want = ref.causal_conv(x[0, lo : lo + n].cpu(), p["conv_w"][0].cpu().float(), hist)
        torch.testing.assert_close(out[lo : lo + n].cpu().float(), want.float(), **HALF_TOL)
        lo += n


def test_prompt_conv_row_alone_equals_among_chunks() -> None:
    """A sequence's chunk launched alone gives the bits it got among the other chunks, wherever the row blocks
    cut it (docs/design.md §5.1: a row's bits never depend on its company)."""
    p = make_params(seed=3)
    conv, _ = make_cache(seed=510)
    x = randn(1, sum(n for _, n, _ in CHUNKS), 3 * C, seed=511)
    together = rows_of(kda.prompt_conv(x, p["conv_w"], conv, CHAN_OFF, *prompt_rows(CHUNKS)))[0]
    lo = 0
    for chunk in CHUNKS:
        n = chunk[1]
        alone = rows_of(kda.prompt_conv(x[:, lo : lo + n], p["conv_w"], conv, CHAN_OFF, *prompt_rows([chunk])))[0]
        assert torch.equal(alone, together[lo : lo + n]), f"chunk at row {lo}"
        lo += n


# ----- virtual shards: S shards in one launch = one launch per shard, bit for bit -----

S = 3  # shards in the fused launch (the rank holds exactly these: heads and conv channels shard after shard)


def shard(d: dict[str, torch.Tensor], j: int) -> dict[str, torch.Tensor]:
    """Shard j of stacked operands, as a one-shard stack (o_norm is shared)."""
    return {k: v if k == "o_norm" else v[j : j + 1] for k, v in d.items()}


def test_decode_shards_in_one_launch_equal_one_launch_per_shard() -> None:
    """Decode rows and a verify window over 3 shards in one launch: the gated outputs, the slots' states and
    histories and the pending buffers equal those of three one-shard launches (each at its shard's head and
    channel offsets)."""
    p, x = make_params(seed=7, shards=S), make_inputs(5, seed=600, shards=S)
    conv = randn(SLOTS, 3, S * 3 * C, seed=601)
    state = randn(SLOTS, S * H, DK, DK, dtype=torch.float32, seed=602, scale=0.2)
    sq = seqs([(0, 1, 2, 0, -1), (1, 3, 1, 0, 1), (4, 1, 3, 1, -1)])  # decode, verify window of 3, fresh decode

    def pending() -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.zeros(5, S * H, DK, DK, device=DEVICE), torch.zeros(5, 3, S * 3 * C, dtype=HALF, device=DEVICE))

    fused_cache, per_cache = (conv.clone(), state.clone()), (conv.clone(), state.clone())
    fused_pend, per_pend = pending(), pending()
    fused = run_kernel(p, x, *fused_cache, sq, *fused_pend, chan_off=0, head_off=0)
    for j in range(S):
        alone = run_kernel(shard(p, j), shard(x, j), *per_cache, sq, *per_pend, chan_off=j * 3 * C, head_off=j * H)
        assert torch.equal(fused[j], alone[0]), f"shard {j}: gated output"
    for name, a, b in (("conv", fused_cache[0], per_cache[0]), ("state", fused_cache[1], per_cache[1]),
                       ("pending state", fused_pend[0], per_pend[0]), ("pending conv", fused_pend[1], per_pend[1])):
        assert torch.equal(a, b), name
    assert not torch.equal(fused_cache[1], state)  # the decode steps moved their states on


def test_prompt_conv_shards_in_one_launch_equal_one_launch_per_shard() -> None:
    p = make_params(seed=8, shards=S)
    conv = randn(SLOTS, 3, S * 3 * C, seed=700)
    chunks = [(3, 6, True), (1, 2, False)]
    rows = prompt_rows(chunks)
    x = randn(S, 8, 3 * C, seed=701)
    fused = kda.prompt_conv(x, p["conv_w"], conv, 0, *rows)
    for j in range(S):
        assert torch.equal(fused[j], kda.prompt_conv(x[j : j + 1], p["conv_w"][j : j + 1], conv, j * 3 * C, *rows)[0])


def test_gated_norm_over_more_heads_than_a_program_step() -> None:
    """20 heads a shard: a program norms 16, then the 4 left (masked); each head against the twin, and a row's
    bits alone = among others, in every shard of a 2-shard launch."""
    heads, rows = 20, 5
    core, gate = randn(2, rows, heads * DK, seed=60), randn(2, rows, heads * DK, seed=61)
    w = 1 + randn(DK, seed=62, scale=0.1)
    out = kda.gated_norm(core, gate, w, EPS)
    into = torch.zeros(2, rows + 1, heads * DK, dtype=HALF, device=DEVICE)
    kda.gated_norm(core, gate, w, EPS, out=into[:, 1:])  # into a view, as the fused ops pass the prompt rows'
    assert torch.equal(into[:, 1:], out) and not into[:, 0].any()
    for s in range(2):
        want = gated_rms_norm(core[s].cpu().view(rows, heads, DK), gate[s].cpu().view(rows, heads, DK), w.cpu(), EPS)
        torch.testing.assert_close(out[s].cpu().float(), want.reshape(rows, -1).float(), **HALF_TOL)
    assert torch.equal(kda.gated_norm(core[:, 3:4], gate[:, 3:4], w, EPS), out[:, 3:4])
