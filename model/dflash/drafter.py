"""`DFlashDrafter`: z-lab's DFlash2 block-diffusion drafter as a plain torch module.

One forward drafts a whole block: the block's rows are the anchor (the last committed token) followed by
`block_size - 1` mask tokens, embedded with the target's embedding; every layer attends, without a causal mask on
its full-attention layers, over the target's fused hidden states of the context and over the block itself. The
target's lm_head scores the block rows after the anchor, and a low-rank candidate selector then picks each draft
token among the top-k of its row, conditioned on the token picked before it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .config import DFlashConfig
from .layers import DecoderLayer, RMSNorm, rope_cos_sin


class CandidateSelector(nn.Module):
    """Re-ranks each row's top-k candidates by a bilinear score between the previous pick and the candidate,
    gated by the row's hidden state: score(c) = logit(c) + sum_r pred[prev, r] * proj(h)[r] * succ[c, r].

    The codebooks are bare parameters (not nn.Embedding) because the published checkpoint stores them without a
    `.weight` suffix; keeping the names equal means no renaming on load."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.top_k = config.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(config.vocab_size, config.selector_rank))
        self.successor_codebook = nn.Parameter(torch.zeros(config.vocab_size, config.selector_rank))
        self.hidden_projection = nn.Linear(config.hidden_size, config.selector_rank, bias=False)

    def forward(self, hidden: Tensor, logits: Tensor, anchor_ids: Tensor) -> Tensor:
        """Greedy picks [B, Q] for block rows hidden [B, Q, H] with logits [B, Q, V], after anchor_ids [B].

        Greedy only: the drafts are proposals that verification accepts or rejects exactly, so sampling them
        would change acceptance, never a reply."""
        # Sorted, so a tie in score goes to the candidate with the higher logit (the reference leaves the order to
        # topk's unsorted output); otherwise the same picks.
        unary, candidates = torch.topk(logits, self.top_k, dim=-1)
        gate = self.hidden_projection(hidden)
        prev = anchor_ids
        picks = []
        for row in range(hidden.shape[1]):
            query = F.embedding(prev, self.predecessor_codebook) * gate[:, row]  # [B, r]
            keys = F.embedding(candidates[:, row], self.successor_codebook)  # [B, k, r]
            scores = unary[:, row] + torch.einsum("br,bkr->bk", query, keys)
            prev = candidates[:, row].gather(-1, scores.argmax(dim=-1, keepdim=True))[:, 0]
            picks.append(prev)
        return torch.stack(picks, dim=1)


class DFlashDrafter(nn.Module):
    """The DFlash2 drafter. It owns no embedding or lm_head: both are the target's, passed in by the caller."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        # The chosen target layers' outputs, concatenated, are fused into one context row per position.
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.candidate_selector = CandidateSelector(config)

    def fuse(self, target_hidden: Tensor) -> Tensor:
        """Context rows [..., H] from the target's outputs of `target_layer_ids` [..., n·H] (concatenated in that
        order). Row by row: a row depends only on its own position's target outputs, so a caller may keep them."""
        return self.hidden_norm(self.fc(target_hidden))

    def block_hidden(self, target_hidden: Tensor, block_embedding: Tensor, positions: Tensor) -> Tensor:
        """Final-normed hidden states [B, Q, H] of every block row, the anchor's included.

        target_hidden [B, C, n·H]: the target's outputs of `target_layer_ids` (in that order, concatenated) at the
        C context positions; block_embedding [B, Q, H]; positions [B, C + Q]: absolute positions of the context rows
        then of the block rows (windows and causality are measured on them)."""
        return self.context_block_hidden(self.fuse(target_hidden), block_embedding, positions)

    def context_block_hidden(self, context: Tensor, block_embedding: Tensor, positions: Tensor) -> Tensor:
        """`block_hidden` from context rows already fused (`fuse`) [B, C, H]."""
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, block_embedding.dtype)
        x = block_embedding
        for layer in self.layers:
            x = layer(x, context, cos, sin, positions)
        return self.norm(x)

    def embed(self, block_ids: Tensor, embed_weight: Tensor) -> Tensor:
        """The block's rows through the target's embedding table, times the config's input scale."""
        return F.embedding(block_ids, embed_weight) * self.config.input_embedding_scale

    def logits(self, hidden: Tensor, head_weight: Tensor) -> Tensor:
        """Draft logits from hidden rows through the target's lm_head, scaled and soft-capped as configured."""
        logits = F.linear(hidden, head_weight) * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward(self, target_hidden: Tensor, block_ids: Tensor, positions: Tensor, embed_weight: Tensor,
                head_weight: Tensor) -> Tensor:
        """Draft logits [B, Q-1, V] for the block rows after the anchor.

        block_ids [B, Q]: the anchor then Q-1 copies of `mask_token_id`; embed_weight / head_weight: the target's
        embedding [V, H] and lm_head [V, H] weights. See `block_hidden` for the other arguments."""
        hidden = self.block_hidden(target_hidden, self.embed(block_ids, embed_weight), positions)
        return self.logits(hidden[:, 1:], head_weight)

    def propose(self, target_hidden: Tensor, block_ids: Tensor, positions: Tensor, embed_weight: Tensor,
                head_weight: Tensor) -> Tensor:
        """Draft token ids [B, Q-1]: `forward`'s logits re-ranked by the candidate selector (greedy)."""
        return self.propose_from_context(self.fuse(target_hidden), block_ids, positions, embed_weight, head_weight)

    def propose_from_context(self, context: Tensor, block_ids: Tensor, positions: Tensor, embed_weight: Tensor,
                             head_weight: Tensor) -> Tensor:
        """`propose` from context rows already fused (`fuse`) [B, C, H]."""
        hidden = self.context_block_hidden(context, self.embed(block_ids, embed_weight), positions)[:, 1:]
        return self.candidate_selector(hidden, self.logits(hidden, head_weight), block_ids[:, 0])

    def mask_block(self, anchor_ids: Tensor) -> Tensor:
        """The block to draft from: each anchor [B] followed by `block_size - 1` mask tokens."""
        masks = torch.full((anchor_ids.shape[0], self.config.block_size - 1), self.config.mask_token_id,
                           dtype=anchor_ids.dtype, device=anchor_ids.device)
        return torch.cat((anchor_ids[:, None], masks), dim=1)
