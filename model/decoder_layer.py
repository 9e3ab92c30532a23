"""One text layer: mHC around (attention, then FFN), with row-parallel results reduced over the TP group."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from model.config import KDA, ModelConfig
from model.ffn import build_ffn
from model.kda_attention import KdaAttention
from model.mla_attention import MlaAttention
from model.params import HyperConnectionParams
from model.parallel import Collective
from model.weights import WeightReader

if TYPE_CHECKING:
    from model.forward import Forward, Selections


# hc_pre's results for a block: (its normed input [T, D], post [T, hc], comb [T, hc, hc])
BlockInput = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def hyper_connection(cfg: ModelConfig, reader: WeightReader, prefix: str, which: str) -> HyperConnectionParams:
    """The mHC weights around the layer's `which` block ("attn" or "ffn")."""
    return HyperConnectionParams(reader.full(f"{prefix}hc_{which}_fn"), reader.full(f"{prefix}hc_{which}_base"),
                                 reader.full(f"{prefix}hc_{which}_scale"), eps=cfg.hc_eps,
                                 norm_eps=cfg.rms_norm_eps, iters=cfg.hc_sinkhorn_iters)


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, reader: WeightReader, prefix: str, layer: int) -> None:
        self.eps = cfg.rms_norm_eps
        self.is_kda = cfg.layer_types[layer] == KDA
        if self.is_kda:
            self.attn: KdaAttention | MlaAttention = KdaAttention(cfg, reader, prefix, layer)
        else:
            full = cfg.indexer_types[layer] == "full"
            self.attn = MlaAttention(cfg, reader, prefix, layer, full, None if full else cfg.full_indexer_layer(layer))
        self.ffn = build_ffn(cfg, reader, prefix, layer)
        self.attn_norm = reader.full(prefix + "input_layernorm.weight")
        self.ffn_norm = reader.full(prefix + "post_attention_layernorm.weight")
        self.attn_hc = hyper_connection(cfg, reader, prefix, "attn")
        self.ffn_hc = hyper_connection(cfg, reader, prefix, "ffn")

    def forward(self, streams: torch.Tensor, fwd: "Forward", selections: "Selections", coll: Collective
                ) -> torch.Tensor:
        """streams [T, hc_mult, D] -> the streams after this layer (the layer on its own; the model chains its
        layers with `chained`)."""
        return self.chained(streams, self.attn_input(streams, fwd), fwd, selections, coll)[0]

    def attn_input(self, streams: torch.Tensor, fwd: "Forward") -> BlockInput:
        """The attention block's input, from the streams before this layer."""
        return fwd.hc_pre(streams, self.attn_hc, self.attn_norm, self.eps)

    def chained(self, streams: torch.Tensor, attn_in: BlockInput, fwd: "Forward", selections: "Selections",
                coll: Collective, following: "DecoderLayer | None" = None
                ) -> tuple[torch.Tensor, BlockInput | None]:
        """This layer from its attention's input (`attn_input`, or what the layer before returned) -> the streams
        after it and `following`'s attention input (None without a following layer). A block's post and the next
        block's pre are one op (`hc_post_pre`): the fused one saves a launch at each such boundary."""
        h, post, comb = attn_in
        streams, h, post, comb = fwd.hc_post_pre(self.attn.forward(h, fwd, selections), streams, post, comb, coll,
                                                 self.ffn_hc, self.ffn_norm, self.eps)
        partials = self.ffn.forward(h, fwd)
        if following is None:
            return fwd.hc_post(partials, streams, post, comb, coll), None
        out = fwd.hc_post_pre(partials, streams, post, comb, coll, following.attn_hc, following.attn_norm,
                              following.eps)
        return out[0], out[1:]
