"""Which rows take MLA's expanded form and the tables its launches read (ops/expanded_rows.py), worked by hand."""

from __future__ import annotations

import torch

from model.batch import Batch
from ops import expanded_rows

BS = 16
UNTIL = 25  # the first position whose selection may drop a position


def batch() -> Batch:
    """A decode step (pos 100), a 3-row verify window, then prompt chunks: positions 10..39 (crosses UNTIL),
    0..19 (below it) and 30..34 (past it)."""
    starts, lengths = [100, 60, 10, 0, 30], [1, 3, 30, 20, 5]
    tables = torch.tensor([[0, 1, 2, 4, 6, 8, 9], [10, 11, 12, 13, 14, 15, 16], [7, 3, 5, 17, 18, 19, 20],
                           [21, 22, 23, 24, 25, 26, 27], [28, 29, 30, 31, 32, 33, 34]])
    return Batch(token_ids=torch.zeros(sum(lengths), dtype=torch.long), starts=starts, lengths=lengths,
                 block_tables=tables, slots=list(range(5)), logit_rows=torch.tensor([0]),
                 verify=[False, True, False, False, False], prompt=[False, False, True, True, True])


def test_rows_below_until_in_tiles_grouped_by_keys() -> None:
    b = batch()
    plan = expanded_rows.plan(b, b.block_tables, UNTIL, BS, bm=8, max_keys=30)
    # latent form: the 4 decode-class rows, the crossing chunk's positions 25..39 (rows 19..33), the last chunk
    want_latent = list(range(0, 4)) + list(range(19, 34)) + list(range(54, 59))
    assert plan.latent_rows.tolist() == want_latent
    assert len(plan.groups) == 2  # 25 keys, then 20 more would pass 30: a group each
    first, second = plan.groups
    # (first row, rows, first position, key row of position 0), most keys first
    assert first.tiles.tolist() == [[12, 7, 18, 0], [4, 8, 10, 0]]
    assert second.tiles.tolist() == [[50, 4, 16, 0], [42, 8, 8, 0], [34, 8, 0, 0]]
    # sequence 2's positions 0..24 through its table [7, 3, ...]; sequence 3's 0..19 through [21, 22, ...]
    assert first.key_rows.tolist() == [7 * BS + p for p in range(16)] + [3 * BS + p for p in range(9)]
    assert second.key_rows.tolist() == [21 * BS + p for p in range(16)] + [22 * BS + p for p in range(4)]


def test_one_group_when_the_keys_fit() -> None:
    b = batch()
    plan = expanded_rows.plan(b, b.block_tables, UNTIL, BS, bm=8)
    assert len(plan.groups) == 1
    tiles = plan.groups[0].tiles.tolist()
    assert [t[3] for t in tiles if t[0] >= 34] == [25, 25, 25]  # the second sequence's keys follow the first's 25


def test_the_latent_rows_are_a_count_when_they_lead() -> None:
    """Decode rows, then prompt chunks all below UNTIL: the latent rows are the first ones (no index gather)."""
    b = Batch(token_ids=torch.zeros(7, dtype=torch.long), starts=[40, 0, 3], lengths=[1, 4, 2],
              block_tables=torch.arange(15).view(3, 5), slots=[0, 1, 2], logit_rows=torch.tensor([0]),
              prompt=[False, True, True])
    plan = expanded_rows.plan(b, b.block_tables, UNTIL, BS, bm=8)
    assert plan.latent_rows == 1
    assert plan.groups[0].tiles.tolist() == [[5, 2, 3, 4], [1, 4, 0, 0]]


def test_none_without_prompt_rows_below_until() -> None:
    b = Batch(token_ids=torch.zeros(4, dtype=torch.long), starts=[40, 30], lengths=[1, 3],
              block_tables=torch.arange(10).view(2, 5), slots=[0, 1], logit_rows=torch.tensor([0]),
              prompt=[False, True])
    assert expanded_rows.plan(b, b.block_tables, UNTIL, BS, bm=8) is None
    decode_only = Batch(token_ids=torch.zeros(1, dtype=torch.long), starts=[3], lengths=[1],
                        block_tables=torch.arange(5).view(1, 5), slots=[0], logit_rows=torch.tensor([0]))
    assert expanded_rows.plan(decode_only, decode_only.block_tables, UNTIL, BS, bm=8) is None


def test_a_rows_form_depends_on_its_position_only() -> None:
    """A 40-token prompt cut into chunks at any 8-row boundary: each row takes the same form as in the whole."""
    def forms(cuts: list[int]) -> list[bool]:  # per position: True = expanded
        out = []
        for lo, hi in zip(cuts, cuts[1:]):
            b = Batch(token_ids=torch.zeros(hi - lo, dtype=torch.long), starts=[lo], lengths=[hi - lo],
                      block_tables=torch.arange(5).view(1, 5), slots=[0], logit_rows=torch.tensor([0]),
                      prompt=[True])
            plan = expanded_rows.plan(b, b.block_tables, UNTIL, BS, bm=8)
            expanded = set()
            for g in plan.groups if plan else []:
                expanded |= {r for r0, n, _, _ in g.tiles.tolist() for r in range(r0, r0 + n)}
            out += [r in expanded for r in range(hi - lo)]
        return out
    whole = forms([0, 40])
    assert whole == [p < UNTIL for p in range(40)]
    for cuts in ([0, 8, 40], [0, 16, 24, 32, 40], [0, 24, 40]):
        assert forms(cuts) == whole, cuts
