"""The MTP (next-token prediction) block stored at `layers.{num_hidden_layers}` (DeepSeek-V3 style).

Row i combines the target's final hidden state at position i with the embedding of token i+1 and predicts token
i+2: h = eh_proj(RMSNorm_e(embed(t_{i+1})) ++ RMSNorm_h(hidden_i)); then one plain pre-norm MLA(+DSA)+MoE block
(no mHC) with its own latent/indexer cache rows at position i; logits = lm_head(RMSNorm(h)).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from model import projection
from model.config import ModelConfig
from model.ffn import build_ffn
from model.mla_attention import MlaAttention
from model.parallel import Collective
from model.weights import WeightReader

if TYPE_CHECKING:
    from model.forward import Forward


class MtpBlock:
    def __init__(self, cfg: ModelConfig, reader: WeightReader, prefix: str) -> None:
        layer = cfg.mtp_layer_index
        self.eps = cfg.rms_norm_eps
        self.enorm = reader.full(prefix + "enorm.weight")
        self.hnorm = reader.full(prefix + "hnorm.weight")
        self.eh_proj = projection.load(reader, [prefix + "eh_proj.weight"])
        self.final_norm = reader.full(prefix + "shared_head.norm.weight")
        self.attn = MlaAttention(cfg, reader, prefix, layer, full_indexer=True, shares_with=None)
        self.ffn = build_ffn(cfg, reader, prefix, layer)
        self.attn_norm = reader.full(prefix + "input_layernorm.weight")
        self.ffn_norm = reader.full(prefix + "post_attention_layernorm.weight")

    def forward(self, embeds: torch.Tensor, fwd: "Forward", coll: Collective) -> torch.Tensor:
        """embeds [T, D] of the next tokens (laid out as `fwd` lays rows out); batch.hidden: [rows, D] the target's
        final hidden states -> the block's normed hidden [T, D]."""
        if fwd.batch.hidden is None:
            raise ValueError("an MTP forward needs the target's hidden states (batch.hidden)")
        target = fwd.pad(fwd.batch.hidden.to(embeds.dtype))
        h = fwd.linear(torch.cat([fwd.rms_norm(embeds, self.enorm, self.eps),
                                  fwd.rms_norm(target, self.hnorm, self.eps)], dim=-1), self.eh_proj)
        a = self.attn.forward(fwd.rms_norm(h, self.attn_norm, self.eps), fwd, {})
        h = h + coll.sum_partials(a).to(h.dtype)
        f = self.ffn.forward(fwd.rms_norm(h, self.ffn_norm, self.eps), fwd)
        h = h + coll.sum_partials(f).to(h.dtype)
        return fwd.rms_norm(h, self.final_norm, self.eps)
