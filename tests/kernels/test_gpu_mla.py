"""The GPU DSA indexer and sparse MLA kernels (kernels/gpu/mla.py) against their torch twins (kernels/dsa.py,
kernels/mla.py): pool keys, scores, the selection, attention over the paged latent cache, row invariance, and heads
(every local virtual shard's) in one launch."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gpu_support import DEVICE, HALF, HALF_TOL, randn

from kernels import dsa  # noqa: E402
from kernels.gpu import arch as gpu_arch, mla  # noqa: E402
from kernels.kv_quant import FP8, quantize_rows  # noqa: E402
from kernels.mla import latent_attention  # noqa: E402

BS, KP, DI, NH, R, H = 16, 4, 16, 16, 32, 4
LENS = [37, 70]  # two sequences' context lengths
TABLES = [[5, 2, 7], [1, 8, 0, 3, 6]]  # their (shuffled) physical blocks
BLOCKS = 9


class Paged:
    """Two sequences' index rows and latent rows in a paged store, plus the dense copies the twins read."""

    def __init__(self, fp8: bool = False) -> None:
        self.tables = torch.tensor([t + [0] * (5 - len(t)) for t in TABLES], dtype=torch.int32, device=DEVICE)
        self.index = torch.zeros(BLOCKS, BS, 2 * DI, dtype=HALF, device=DEVICE)
        self.latent = torch.zeros(BLOCKS, BS, R, dtype=FP8 if fp8 else HALF, device=DEVICE)
        self.latent_scale = torch.ones(BLOCKS, BS, device=DEVICE) if fp8 else None
        self.dense_index, self.dense_latent = [], []
        for s, n in enumerate(LENS):
            idx, lat = randn(n, 2 * DI, seed=10 + s), randn(n, R, seed=20 + s)
            blocks = torch.tensor(TABLES[s], device=DEVICE)[torch.arange(n, device=DEVICE) // BS]
            offs = torch.arange(n, device=DEVICE) % BS
            self.index[blocks, offs] = idx
            if fp8:
                q, scale = quantize_rows(lat)
                self.latent[blocks, offs], self.latent_scale[blocks, offs] = q, scale
                lat = (q.float() * scale.unsqueeze(-1)).to(HALF)
            else:
                self.latent[blocks, offs] = lat
            self.dense_index.append(idx)
            self.dense_latent.append(lat)
        self.pooled = torch.zeros(BLOCKS, BS // KP, DI, dtype=HALF, device=DEVICE)
        self.ape = randn(KP, DI, seed=30)


def rows_of(queries: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.tensor([s for s, _ in queries], dtype=torch.int32, device=DEVICE)
    pos = torch.tensor([p for _, p in queries], dtype=torch.int32, device=DEVICE)
    return pos, seq


@pytest.fixture(scope="module")
def paged() -> Paged:
    cache = Paged()
    every = [(s, p) for s, n in enumerate(LENS) for p in range(n)]
    pos, seq = rows_of(every)
    mla.write_pools(cache.index, None, cache.pooled, cache.ape, cache.tables, pos, seq, KP)
    return cache


def test_pool_keys_match_twin(paged: Paged) -> None:
    for s, n in enumerate(LENS):
        keys, gates = paged.dense_index[s].split(DI, dim=-1)
        want = dsa.pool_keys(keys.cpu().float(), gates.cpu().float(), paged.ape.cpu().float(), KP)
        for p in range(n // KP):
            block, slot = TABLES[s][p * KP // BS], (p * KP % BS) // KP
            torch.testing.assert_close(paged.pooled[block, slot].cpu().float(), want[p], rtol=1e-2, atol=1e-2)


QUERIES = [(0, 36), (1, 69), (1, 3), (0, 15), (1, 40)]
MAX_POSITIONS = max(LENS) + KP
# decode-class rows in several splits (16 positions each), or every row a prompt row in one program
CLASSES = {"decode": dict(decode_rows=1 << 30, decode_split=16), "prefill": dict(decode_rows=0)}


def attend(q_lat, cache: Paged, pos, seq, sel, count, **cls) -> torch.Tensor:
    out = torch.empty(q_lat.shape, dtype=HALF, device=DEVICE)
    mla.sparse_attention(q_lat, cache.latent, cache.latent_scale, cache.tables, pos, seq, sel, count, KP, 0.25, out,
                         max_positions=MAX_POSITIONS, **cls)
    return out


@pytest.mark.parametrize("cls", CLASSES.values(), ids=CLASSES.keys())
def test_scores_selection_and_attention_match_twin(paged: Paged, cls: dict) -> None:
    pos, seq = rows_of(QUERIES)
    q_idx, w = randn(len(QUERIES), NH, DI, seed=40), randn(len(QUERIES), NH, dtype=torch.float32, seed=41)
    n_pools = max(LENS) // KP
    scores = mla.index_scores(q_idx, w, paged.pooled, paged.tables, pos, seq, KP, n_pools)
    keep = 5  # topk 20 / kpool 4: fewer than the pools most rows see, so selection drops some
    sel, count = mla.select_pools(scores, pos, KP, keep, n_pools)
    q_lat = randn(len(QUERIES), H, R, seed=42)
    out = attend(q_lat, paged, pos, seq, sel, count, **cls)
    for i, (s, p) in enumerate(QUERIES):
        keys, gates = paged.dense_index[s][: p + 1].split(DI, dim=-1)
        pooled = dsa.pool_keys(keys.cpu().float(), gates.cpu().float(), paged.ape.cpu().float(), KP)
        ref_scores = dsa.index_scores(q_idx[i : i + 1].cpu().float(), w[i : i + 1].cpu(), pooled)
        got = scores[i, : (p + 1) // KP].cpu()
        torch.testing.assert_close(got, ref_scores[0], **HALF_TOL)
        assert torch.all(scores[i, (p + 1) // KP :].cpu() == float("-inf"))
        mask = dsa.select(got.unsqueeze(0), torch.tensor([p]), p + 1, KP, keep * KP, True)
        chosen = sel[i, : count[i]].long().cpu()
        assert torch.equal(chosen, torch.sort(chosen).values)
        mine = torch.zeros(p + 1, dtype=torch.bool)
        for pool in chosen.tolist():
            mine[pool * KP : pool * KP + KP] = True
        mine[(p + 1) // KP * KP : p + 1] = True
        assert torch.equal(mine, mask[0])
        want = latent_attention(q_lat[i : i + 1].cpu().float(), paged.dense_latent[s][: p + 1].cpu().float(), mask,
                                0.25)
        torch.testing.assert_close(out[i].cpu().float(), want[0], **HALF_TOL)


def test_pools_scored_and_ranked_a_tile_at_a_time_pick_the_same(paged: Paged) -> None:
    """Scores of a pool range = that slice of the whole row's scores; the running top-k over tiles picks what one
    sort over every pool picks, ties (here: many equal scores) to the lowest pool."""
    pos, seq = rows_of(QUERIES)
    q_idx, w = randn(len(QUERIES), NH, DI, seed=40), randn(len(QUERIES), NH, dtype=torch.float32, seed=41)
    n_pools = max(LENS) // KP
    whole = mla.index_scores(q_idx, w, paged.pooled, paged.tables, pos, seq, KP, n_pools)
    part = mla.index_scores(q_idx, w, paged.pooled, paged.tables, pos, seq, KP, 13, first=6)
    assert torch.equal(part, whole[:, 6:13])
    tied = torch.where(torch.isinf(whole), whole, (whole * 2).round() / 2)  # few distinct values: many ties
    for scores in (whole, tied):
        want = mla.select_pools(scores, pos, KP, 5, n_pools, tile=n_pools)
        for tile in (5, 6, 7):
            got = mla.select_pools(lambda p0, p1: scores[:, p0:p1], pos, KP, 5, n_pools, tile=tile)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"tile {tile}"


PROMPT = [(1, p) for p in range(58, 70)] + [(0, p) for p in range(29, 37)]  # two prompt chunks, unaligned starts


def prompt_scores(paged: Paged, queries: list[tuple[int, int]], decode: int, q_idx, w) -> torch.Tensor:
    """index_scores with the first `decode` queries scored one a program and the rest (prompt rows, sequence by
    sequence in position order) in blocks."""
    pos, seq = rows_of(queries)
    chunks: list[list[int]] = []  # [start, length] of each prompt sequence's run of rows
    for s, p in queries[decode:]:
        if chunks and chunks[-1][2] == s and chunks[-1][0] + chunks[-1][1] == p:
            chunks[-1][1] += 1
        else:
            chunks.append([p, 1, s])
    blocks = mla.score_blocks([c[0] for c in chunks], [c[1] for c in chunks], decode).to(DEVICE)
    return mla.index_scores(q_idx, w, paged.pooled, paged.tables, pos, seq, KP, max(LENS) // KP, decode_rows=decode,
                            blocks=blocks)


def test_score_blocks_put_a_row_at_its_position_mod_the_block() -> None:
    table = mla.score_blocks([6, 0], [5, 2], first_row=3, bt=4)  # positions 6..10, then another prompt's 0..1
    assert table.tolist() == [[-1, -1, 3, 4], [5, 6, 7, -1], [8, 9, -1, -1]]


def test_prompt_rows_scored_in_blocks_match_twin_and_rows_alone(paged: Paged) -> None:
    """Prompt rows scored SCORE_ROWS a program: each row against the twin, and its bits the same whatever block,
    chunk or company it comes in (alone; in a chunk cut elsewhere; behind a decode row)."""
    n = len(PROMPT)
    q_idx, w = randn(n, NH, DI, seed=47), randn(n, NH, dtype=torch.float32, seed=48)
    scores = prompt_scores(paged, PROMPT, 0, q_idx, w)
    for i, (s, p) in enumerate(PROMPT):
        keys, gates = paged.dense_index[s][: p + 1].split(DI, dim=-1)
        pooled = dsa.pool_keys(keys.cpu().float(), gates.cpu().float(), paged.ape.cpu().float(), KP)
        want = dsa.index_scores(q_idx[i : i + 1].cpu().float(), w[i : i + 1].cpu(), pooled)
        torch.testing.assert_close(scores[i, : (p + 1) // KP].cpu(), want[0], **HALF_TOL)
        assert torch.all(scores[i, (p + 1) // KP :].cpu() == float("-inf"))
    for i in (0, 5, 11, 12, 19):
        alone = prompt_scores(paged, [PROMPT[i]], 0, q_idx[i : i + 1], w[i : i + 1])
        assert torch.equal(alone[0], scores[i]), f"row {i} alone"
    cut = list(range(3, 9))  # positions 61..66: another chunk of the same prompt
    part = prompt_scores(paged, [PROMPT[i] for i in cut], 0, q_idx[cut], w[cut])
    assert torch.equal(part, scores[cut])
    behind = [(0, 36)] + PROMPT  # a decode row first, scored one a program
    q2, w2 = torch.cat([randn(1, NH, DI, seed=49), q_idx]), torch.cat([randn(1, NH, dtype=torch.float32), w])
    assert torch.equal(prompt_scores(paged, behind, 1, q2, w2)[1:], scores)


def test_select_takes_everything_when_few_pools(paged: Paged) -> None:
    pos, _ = rows_of([(0, 3), (0, 36)])
    sel, count = mla.select_pools(None, pos, KP, keep=16, n_pools=9)
    assert count.tolist() == [1, 9] and sel[1].tolist() == list(range(9))


def torch_counts(positions: torch.Tensor, keep: int, n_pools: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """What select_pools computed with torch ops before its count kernel: (sel when it takes all, count)."""
    visible = torch.div(positions.long() + 1, KP, rounding_mode="floor").clamp(max=n_pools)
    count = visible.clamp(max=keep).to(torch.int32)
    if n_pools > keep:
        return None, count
    sel = torch.arange(n_pools, dtype=torch.int32, device=positions.device).expand(positions.numel(), n_pools)
    return sel.contiguous(), count


@pytest.mark.parametrize("keep, n_pools", [(16, 0), (16, 1), (16, 9), (9, 9), (300, 290), (5, 9)])
def test_selection_counts_equal_torch_ops(keep: int, n_pools: int) -> None:
    """The count kernel (and the take-all selection) against the torch ops it replaced: rows before their first
    pool, at a pool's last position and past n_pools, alone or together; (5, 9) scores, so only counts come."""
    positions = [0, 2, 3, 4, 7, 35, 36, 1200]
    pos = torch.tensor(positions, dtype=torch.int32, device=DEVICE)
    want_sel, want_count = torch_counts(pos, keep, n_pools)
    scores = None if n_pools <= keep else randn(len(positions), n_pools, dtype=torch.float32, seed=46)
    sel, count = mla.select_pools(scores, pos, KP, keep, n_pools)
    assert torch.equal(count, want_count) and count.dtype == torch.int32
    if want_sel is not None:
        assert torch.equal(sel, want_sel) and sel.is_contiguous()
        for i in range(len(positions)):  # a row's selection whatever rows come with it
            alone = mla.select_pools(None, pos[i : i + 1], KP, keep, n_pools)
            assert torch.equal(alone[0], sel[i : i + 1]) and torch.equal(alone[1], count[i : i + 1])


@pytest.mark.parametrize("cls", CLASSES.values(), ids=CLASSES.keys())
def test_fp8_latent_rows(cls: dict) -> None:
    cache = Paged(fp8=True)
    pos, seq = rows_of(QUERIES)
    sel, count = mla.select_pools(None, pos, KP, keep=64, n_pools=max(LENS) // KP)
    q_lat = randn(len(QUERIES), H, R, seed=43)
    out = attend(q_lat, cache, pos, seq, sel, count, **cls)
    for i, (s, p) in enumerate(QUERIES):
        want = latent_attention(q_lat[i : i + 1].cpu().float(), cache.dense_latent[s][: p + 1].cpu().float(),
                                torch.ones(1, p + 1, dtype=torch.bool), 0.25)
        torch.testing.assert_close(out[i].cpu().float(), want[0], **HALF_TOL)


@pytest.mark.parametrize("arch", gpu_arch.ROWS, ids=lambda a: f"sm_{a}")
@pytest.mark.parametrize("cls", CLASSES.values(), ids=CLASSES.keys())
def test_row_alone_equals_row_in_company(paged: Paged, cls: dict, arch: int) -> None:
    """On each architecture's prompt tile (mla.prompt_tile: GB10's is 16 heads x 32 positions, Hopper's 64 x 64)."""
    q_lat = randn(len(QUERIES), H, R, seed=44)
    n_pools = max(LENS) // KP

    def run(rows: list[int]) -> torch.Tensor:
        pos, seq = rows_of([QUERIES[i] for i in rows])
        sel, count = mla.select_pools(None, pos, KP, keep=64, n_pools=n_pools)
        return attend(q_lat[rows].contiguous(), paged, pos, seq, sel, count, **cls)

    with gpu_arch.assume(arch):
        alone = run([1])[0]
        assert torch.equal(run([0, 1, 2, 3, 4])[1], alone)
        assert torch.equal(run([3, 1])[1], alone)


@pytest.mark.parametrize("cls", CLASSES.values(), ids=CLASSES.keys())
def test_heads_in_one_launch_equal_one_launch_per_shard(paged: Paged, cls: dict) -> None:
    """The model attends with every local shard's heads in one launch: 4 shards of 2 heads each get the bits of
    their own launch (a head's arithmetic never depends on the heads beside it in a program)."""
    shards, heads = 4, 2
    pos, seq = rows_of(QUERIES)
    sel, count = mla.select_pools(None, pos, KP, keep=64, n_pools=max(LENS) // KP)
    q_lat = randn(len(QUERIES), shards * heads, R, seed=45)
    fused = attend(q_lat, paged, pos, seq, sel, count, **cls)
    for j in range(shards):
        mine = slice(j * heads, (j + 1) * heads)
        assert torch.equal(fused[:, mine], attend(q_lat[:, mine], paged, pos, seq, sel, count, **cls)), f"shard {j}"
