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
        """streams [T, hc_mult, D] -> the streams after this layer."""
        h, post, comb = fwd.hc_pre(streams, self.attn_hc, self.attn_norm, self.eps)
        streams = fwd.hc_post(self.attn.forward(h, fwd, selections), streams, post, comb, coll)
        h, post, comb = fwd.hc_pre(streams, self.ffn_hc, self.ffn_norm, self.eps)
        return fwd.hc_post(self.ffn.forward(h, fwd), streams, post, comb, coll)
