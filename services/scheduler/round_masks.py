"""The sampling control of a round: which tokens each sample row may produce (`PlannedSeq.masks`, the plan's
`mask_index` / `bitmask`), from the request's thinking budget (thinking.py) and its grammar (grammar.py).

A forced row (the end of thinking once the budget is spent) allows its forced token alone; any other row of a
constrained request allows what its grammar allows. A verify window's rows are masked as if the drafts before them
were accepted, and a draft that a row's mask forbids is cut with everything after it — the rank's masked sample at
that row could never equal it. The thinking budget is applied first, so the grammar walks only the drafts it kept.
"""

from __future__ import annotations

import torch

from services.scheduler.batcher import PlannedSeq
from services.scheduler.grammar import allows


def one_token_mask(token: int, vocab: int) -> torch.Tensor:
    """int32 [vocab // 32 + 1] allowing `token` alone (bit i of word j allows token 32 j + i): llguidance's width
    for that vocabulary, so it stacks with grammar masks in one plan."""
    mask = torch.zeros(vocab // 32 + 1, dtype=torch.int32)
    bit = 1 << (token % 32)
    mask[token // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit  # the word's bits as a signed int32
    return mask


def apply_round_masks(seqs: list[PlannedSeq], vocab: int) -> None:
    """Set the masks of the sample rows of requests with a grammar or a thinking budget, cutting the drafts they
    forbid."""
    for s in seqs:
        g, th = s.req.grammar, s.req.thinking
        if not s.sample or (g is None and th is None):
            continue
        drafts = s.token_ids[1:] if s.verify else []
        forced: list[int | None] = [None] * (len(drafts) + 1)
        if th is not None:
            forced, kept = th.window(s.req.pending_samples, drafts)
            drafts = drafts[:kept]
        grammar_masks: list[torch.Tensor | None] = [None] * (len(drafts) + 1)
        if g is not None:
            if s.verify:
                masks, drafts = g.window(drafts)
                grammar_masks = list(masks)
            else:
                grammar_masks = [g.mask()]
        if s.verify:
            s.token_ids = s.token_ids[: 1 + len(drafts)]
            s.verify = bool(drafts)
        rows: list[torch.Tensor | None] = []
        for f, gm in zip(forced, grammar_masks):  # one per row kept (zip stops at the shorter list)
            if f is not None and gm is not None and not allows(gm, f):
                # A grammar the gateway did not build may forbid the end of thinking: the row keeps the grammar's
                # mask and the request fails at commit with invalid_grammar (thinking.py).
                assert th is not None
                th.conflict = True
                rows.append(gm)
            else:
                rows.append(one_token_mask(f, vocab) if f is not None else gm)
        s.masks = rows if any(m is not None for m in rows) else None
