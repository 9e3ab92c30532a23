"""The expanded-form MLA kernel (kernels/gpu/mla_expanded.py) against its torch twin (kernels/mla.py
`expanded_attention`) and the latent form it replaces for prompt rows, and its fixed schedule: a row's bits are the
same whatever tile, chunk, launch or heads it shares."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gpu_support import DEVICE, HALF, HALF_TOL, randn

from kernels.gpu import arch as gpu_arch, mla_expanded  # noqa: E402
from kernels.mla import expanded_attention, latent_attention  # noqa: E402

H, DN, DV, R = 3, 16, 32, 64
SCALE = DN ** -0.5
TILE = dict(BM=16, BN=16, num_warps=4, num_stages=1)
# two sequences: 50 and 37 keys; their prompt rows are positions 20..49 and 0..36
KEYS = [50, 37]
FIRST = [20, 0]


def weights() -> tuple[torch.Tensor, torch.Tensor]:
    """W_uk [H, DN, R] and W_uv [H, DV, R], small enough that the keys stay in the half type's range."""
    return randn(H, DN, R, seed=1, scale=0.15), randn(H, DV, R, seed=2, scale=0.15)


def context() -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each sequence's latent rows, and every key's [K | V] per head packed sequence after sequence [H, L, DN + DV]
    (as the fused path expands them: in the half type)."""
    w_uk, w_uv = weights()
    latents = [randn(n, R, seed=10 + s) for s, n in enumerate(KEYS)]
    kv = torch.cat([torch.einsum("lr,hdr->hld", lat.float(), torch.cat([w_uk, w_uv], 1).float()) for lat in latents],
                   dim=1)
    return latents, kv.to(HALF).contiguous()


def rows() -> list[tuple[int, int, int]]:
    """(sequence, position, key row of its position 0) of every prompt row, packed sequence after sequence."""
    return [(s, p, sum(KEYS[:s])) for s in range(len(KEYS)) for p in range(FIRST[s], KEYS[s])]


def tiles_of(picked: list[int], bm: int) -> torch.Tensor:
    """Tiles of at most bm consecutive picked rows of one sequence (picked: indices into rows(), packed in order)."""
    all_rows, out, i = rows(), [], 0
    while i < len(picked):
        s, p, k0 = all_rows[picked[i]]
        n = 1
        while n < bm and i + n < len(picked) and all_rows[picked[i + n]][0] == s and \
                all_rows[picked[i + n]][1] == p + n:
            n += 1
        out.append((i, n, p, k0))
        i += n
    return torch.tensor(out, dtype=torch.int32, device=DEVICE)


def run(q: torch.Tensor, kv: torch.Tensor, picked: list[int], bm: int = TILE["BM"], heads: slice = slice(None)
        ) -> torch.Tensor:
    """The kernel over the picked rows (their queries packed in that order) -> [h, len(picked), DV]."""
    qh = q[heads][:, picked].contiguous()
    out = torch.empty(qh.shape[0], len(picked), DV, dtype=HALF, device=DEVICE)
    mla_expanded.attend(qh, kv[heads].contiguous(), out, tiles_of(picked, bm), SCALE, tile={**TILE, "BM": bm})
    return out


def test_matches_twin_and_latent_form() -> None:
    latents, kv = context()
    w_uk, w_uv = weights()
    n = len(rows())
    q = randn(H, n, DN, seed=3)
    out = run(q, kv, list(range(n)))
    for i, (s, p, _) in enumerate(rows()):
        mask = torch.ones(1, p + 1, dtype=torch.bool)
        lat = latents[s][: p + 1].cpu()
        qi = q[:, i].unsqueeze(0).cpu()
        want = expanded_attention(qi, lat, w_uk.cpu(), w_uv.cpu(), mask, SCALE)[0]
        torch.testing.assert_close(out[:, i].cpu().float(), want, **HALF_TOL)
        q_lat = torch.einsum("nhd,hdr->nhr", qi.float(), w_uk.cpu().float())
        latent_form = torch.einsum("nhr,hvr->nhv", latent_attention(q_lat, lat, mask, SCALE), w_uv.cpu().float())
        torch.testing.assert_close(want, latent_form[0], rtol=1e-4, atol=1e-4)


def test_row_alone_equals_row_in_any_tile_chunk_or_launch() -> None:
    """Row 25 (sequence 0, position 45) alone, in a chunk that starts elsewhere, in tiles of other sizes, and
    behind the other sequence's rows: the same bits."""
    _, kv = context()
    n = len(rows())
    q = randn(H, n, DN, seed=4)
    target = 25
    alone = run(q, kv, [target])[:, 0]
    everything = list(range(n))
    assert torch.equal(run(q, kv, everything)[:, target], alone)
    assert torch.equal(run(q, kv, everything, bm=32)[:, target], alone)
    chunk = list(range(22, 30))  # positions 42..49: another tile start
    assert torch.equal(run(q, kv, chunk)[:, chunk.index(target)], alone)
    other_first = list(range(30, n)) + list(range(0, 30))
    assert torch.equal(run(q, kv, other_first)[:, other_first.index(target)], alone)


def test_heads_in_one_launch_equal_one_launch_each() -> None:
    _, kv = context()
    n = len(rows())
    q = randn(H, n, DN, seed=5)
    everything = list(range(n))
    fused = run(q, kv, everything)
    for h in range(H):
        assert torch.equal(fused[h : h + 1], run(q, kv, everything, heads=slice(h, h + 1))), f"head {h}"


@pytest.mark.parametrize("arch", gpu_arch.ROWS, ids=lambda a: f"sm_{a}")
def test_production_tile_row_invariance_at_release_widths(arch: int) -> None:
    """The tile the model runs on each architecture (mla_expanded.tile_for) at the release's 256 + 256 per head:
    each row of a 150-row prompt gets the same bits from tiles that start at position 0 and from tiles that start
    at 37 (a chunk cut there)."""
    dn = dv = 256
    n, bm = 150, mla_expanded.tile_for(arch)["BM"]
    q = randn(1, n, dn, seed=6)
    kv = randn(1, n, dn + dv, seed=7, scale=0.5)

    def attend(first: int) -> torch.Tensor:
        out = torch.empty(1, n, dv, dtype=HALF, device=DEVICE)
        cuts = list(range(0, first, bm)) + list(range(first, n, bm))
        tiles = [(lo, min(lo + bm, first if lo < first else n) - lo, lo, 0) for lo in cuts]
        mla_expanded.attend(q, kv, out, torch.tensor(tiles, dtype=torch.int32, device=DEVICE), dn ** -0.5)
        return out

    with gpu_arch.assume(arch):
        assert torch.equal(attend(0), attend(37))
