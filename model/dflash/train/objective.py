"""The block-diffusion training objective of a DFlash2 drafter, on the target's own greedy traces.

A training block is what serving drafts from: an anchor (a token the target committed, at position a) followed by
`block_size - 1` mask tokens, over the target layers' rows of positions 0 .. a - 1; its labels are the target's
greedy tokens at a + 1 .. a + block_size - 1, the drafts verification would accept. Every sequence of a batch takes
the same anchor position, so the contexts are of one length and need no padding (the drafter's full-attention layer
sees its whole context, which padding rows would join).

Two cross-entropies per block row, weighted down the block by exp(-(i - 1) / gamma) for row i, because a draft only
counts when every draft before it was accepted: one on the drafter's logits, which choose the candidate selector's
top-k, and one on the selector's score over the whole vocabulary, its bilinear term fed the true previous token
(teacher forcing; serving feeds it the previous pick).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

from model.dflash import DFlashDrafter

from .traces import Traces

IGNORE = -100  # cross_entropy's ignore_index: labels past the end of a trace


@dataclass
class Blocks:
    """One anchor position's training blocks for B sequences."""

    context: Tensor  # [B, a, L * D] the target layers' rows before the anchor
    block_ids: Tensor  # [B, Q] the anchor then Q - 1 mask tokens
    positions: Tensor  # [B, a + Q] context then block positions
    labels: Tensor  # [B, Q - 1] the target's greedy tokens after the anchor (IGNORE past the trace)


def anchor_range(traces: Traces) -> range:
    """Anchor positions a serving drafter meets: the last committed token is the prompt's first sampled token at
    the earliest, and a block needs at least one label after it."""
    return range(traces.prompt_len, traces.length - 1)


def make_blocks(drafter: DFlashDrafter, traces: Traces, seqs: Tensor, anchor: int) -> Blocks:
    """The blocks anchored at position `anchor` of the sequences `seqs` ([B] indices into `traces`)."""
    q = drafter.config.block_size
    tokens = traces.tokens[seqs]
    labels = torch.full((len(seqs), q - 1), IGNORE, dtype=torch.long)
    have = tokens[:, anchor + 1 : anchor + q]
    labels[:, : have.shape[1]] = have
    positions = torch.arange(anchor + q).expand(len(seqs), -1)
    return Blocks(traces.hidden[seqs, :anchor], drafter.mask_block(tokens[:, anchor]), positions, labels)


def position_weights(block_size: int, gamma: float) -> Tensor:
    """[Q - 1] loss weights of the block rows after the anchor, 1 for the first."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / gamma)


def selector_scores(drafter: DFlashDrafter, hidden: Tensor, logits: Tensor, previous: Tensor) -> Tensor:
    """The candidate selector's score of every vocabulary entry [B, Q - 1, V]: the logit plus the bilinear term
    between the previous token [B, Q - 1] and the entry, gated by the row. Serving scores only the top-k of each
    row's logits with the same formula (`CandidateSelector.forward`); training scores all, so every label counts."""
    sel = drafter.candidate_selector
    query = F.embedding(previous, sel.predecessor_codebook) * sel.hidden_projection(hidden)
    return logits + query @ sel.successor_codebook.T


@dataclass
class BlockLoss:
    loss: Tensor  # the weighted sum of both cross-entropies, to minimise
    first_hits: int  # blocks whose first selector pick (greedy) is the label
    blocks: int


def block_loss(drafter: DFlashDrafter, blocks: Blocks, embed: Tensor, head: Tensor, weights: Tensor) -> BlockLoss:
    """The objective on one batch of blocks; `embed` / `head` are the target's (frozen) embedding and lm_head."""
    hidden = drafter.block_hidden(blocks.context, drafter.embed(blocks.block_ids, embed), blocks.positions)[:, 1:]
    logits = drafter.logits(hidden, head)
    labels = blocks.labels
    previous = torch.cat((blocks.block_ids[:, :1], labels[:, :-1].clamp(min=0)), dim=1)
    scores = selector_scores(drafter, hidden, logits, previous)
    valid = labels != IGNORE
    w = weights.expand_as(labels) * valid
    loss = 0.0
    for out in (logits, scores):
        ce = F.cross_entropy(out.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="none")
        loss = loss + (ce * w.flatten()).sum() / w.sum()
    hits = int((scores[:, 0].argmax(dim=-1) == labels[:, 0]).sum())
    return BlockLoss(loss, hits, labels.shape[0])
