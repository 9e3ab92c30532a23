"""One text layer: mHC around (attention, then FFN), with row-parallel results reduced over the TP group.

`forward` is the torch reference (the CPU path); `forward_gpu` runs the same layer through the fused kernels of
kernels/gpu over a `GpuRows` description of the batch (rows ordered decode-class first)."""

from __future__ import annotations

import torch

from kernels import mhc
from kernels.norms import rms_norm
from model.batch import Batch
from model.cache import PagedCache
from model.config import KDA, ModelConfig
from model.ffn import Moe, build_ffn
from model.gpu_rows import GpuRows
from model.kda_attention import KdaAttention
from model.mla_attention import MlaAttention, Selections
from model.parallel import Collective
from model.weights import WeightReader


class HyperConnection:
    def __init__(self, cfg: ModelConfig, reader: WeightReader, prefix: str, which: str) -> None:
        self.fn = reader.full(f"{prefix}hc_{which}_fn")
        self.base = reader.full(f"{prefix}hc_{which}_base")
        self.scale = reader.full(f"{prefix}hc_{which}_scale")
        self.kw = dict(eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps, iters=cfg.hc_sinkhorn_iters)

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return mhc.hc_weights(streams, self.fn, self.base, self.scale, **self.kw)

    def pre_gpu(self, streams: torch.Tensor, norm: torch.Tensor, rms_eps: float, decode_rows: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block input normed by `norm`, post, comb) in two launches (kernels/gpu/mhc.py)."""
        from kernels.gpu import mhc as gpu_mhc
        return gpu_mhc.pre(streams, self.fn, self.base, self.scale, norm, rms_eps=rms_eps, decode_rows=decode_rows,
                           **self.kw)


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
        self.attn_hc = HyperConnection(cfg, reader, prefix, "attn")
        self.ffn_hc = HyperConnection(cfg, reader, prefix, "ffn")

    def forward(self, streams: torch.Tensor, batch: Batch, cache: PagedCache, selections: Selections,
                coll: Collective) -> torch.Tensor:
        pre, post, comb = self.attn_hc.weights(streams)
        h = rms_norm(mhc.collapse(streams, pre), self.attn_norm, self.eps)
        parts = self.attn.forward(h, batch, cache) if self.is_kda else self.attn.forward(h, batch, cache, selections)
        streams = mhc.expand(coll.sum_partials(parts).to(streams.dtype), streams, post, comb)

        pre, post, comb = self.ffn_hc.weights(streams)
        h = rms_norm(mhc.collapse(streams, pre), self.ffn_norm, self.eps)
        return mhc.expand(coll.sum_partials(self.ffn.forward(h)).to(streams.dtype), streams, post, comb)

    def forward_gpu(self, streams: torch.Tensor, batch: Batch, rows: GpuRows, cache: PagedCache,
                    selections: Selections, coll: Collective) -> torch.Tensor:
        from kernels.gpu import mhc as gpu_mhc
        d = rows.decode_rows
        h, post, comb = self.attn_hc.pre_gpu(streams, self.attn_norm, self.eps, d)
        if self.is_kda:
            parts = self.attn.forward_gpu(h, batch, rows, cache)
        else:
            parts = self.attn.forward_gpu(h, rows, cache, selections)
        streams = gpu_mhc.post(coll.gather_partials(parts), streams, post, comb)

        h, post, comb = self.ffn_hc.pre_gpu(streams, self.ffn_norm, self.eps, d)
        parts = self.ffn.forward_gpu(h, d, rows.n_real) if isinstance(self.ffn, Moe) else self.ffn.forward_gpu(h, d)
        return gpu_mhc.post(coll.gather_partials(parts), streams, post, comb)
