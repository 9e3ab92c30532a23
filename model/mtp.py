"""The MTP (next-token prediction) block stored at `layers.{num_hidden_layers}` (DeepSeek-V3 style).

Row i combines the target's final hidden state at position i with the embedding of token i+1 and predicts token
i+2: h = eh_proj(RMSNorm_e(embed(t_{i+1})) ++ RMSNorm_h(hidden_i)); then one plain pre-norm MLA(+DSA)+MoE block
(no mHC) with its own latent/indexer cache rows at position i; logits = lm_head(RMSNorm(h)).
"""

from __future__ import annotations

import torch

from kernels.linear import linear, pad_rows
from kernels.norms import rms_norm
from model.batch import Batch
from model.cache import PagedCache
from model.config import ModelConfig
from model.ffn import build_ffn
from model.gpu_rows import GpuRows
from model.mla_attention import MlaAttention
from model.parallel import Collective
from model.weights import WeightReader


class MtpBlock:
    def __init__(self, cfg: ModelConfig, reader: WeightReader, prefix: str) -> None:
        layer = cfg.mtp_layer_index
        self.eps = cfg.rms_norm_eps
        self.enorm = reader.full(prefix + "enorm.weight")
        self.hnorm = reader.full(prefix + "hnorm.weight")
        self.eh_proj = reader.full(prefix + "eh_proj.weight")
        self.final_norm = reader.full(prefix + "shared_head.norm.weight")
        self.attn = MlaAttention(cfg, reader, prefix, layer, full_indexer=True, shares_with=None)
        self.ffn = build_ffn(cfg, reader, prefix, layer)
        self.attn_norm = reader.full(prefix + "input_layernorm.weight")
        self.ffn_norm = reader.full(prefix + "post_attention_layernorm.weight")

    def forward(self, embeds: torch.Tensor, batch: Batch, cache: PagedCache, coll: Collective) -> torch.Tensor:
        """embeds: [T_pad, D] embeddings of the next tokens; batch.hidden: [T, D] -> normed hidden [T_pad, D]."""
        if batch.hidden is None:
            raise ValueError("an MTP forward needs the target's hidden states (batch.hidden)")
        h = linear(torch.cat([rms_norm(embeds, self.enorm, self.eps),
                              rms_norm(pad_rows(batch.hidden.to(embeds.dtype)), self.hnorm, self.eps)], dim=-1), self.eh_proj)
        a = self.attn.forward(rms_norm(h, self.attn_norm, self.eps), batch, cache, {})
        h = h + coll.sum_partials(a).to(h.dtype)
        f = self.ffn.forward(rms_norm(h, self.ffn_norm, self.eps))
        h = h + coll.sum_partials(f).to(h.dtype)
        return rms_norm(h, self.final_norm, self.eps)

    def forward_gpu(self, embeds: torch.Tensor, batch: Batch, rows: GpuRows, cache: PagedCache,
                    coll: Collective) -> torch.Tensor:
        """The same block through the fused kernels (embeds: [T, D], unpadded; also the path that reads packed
        quantized experts)."""
        from kernels.gpu import gemm
        from kernels.gpu import norms as gpu_norms
        from model.ffn import Moe
        if batch.hidden is None:
            raise ValueError("an MTP forward needs the target's hidden states (batch.hidden)")
        d = rows.decode_rows
        h = gemm.matmul(torch.cat([gpu_norms.rms_norm(embeds, self.enorm, self.eps),
                                   gpu_norms.rms_norm(batch.hidden.to(embeds.dtype), self.hnorm, self.eps)], dim=-1),
                        self.eh_proj, d)
        a = self.attn.forward_gpu(gpu_norms.rms_norm(h, self.attn_norm, self.eps), rows, cache, {})
        h = h + coll.sum_partials(a).to(h.dtype)
        x = gpu_norms.rms_norm(h, self.ffn_norm, self.eps)
        f = self.ffn.forward_gpu(x, d, rows.n_real) if isinstance(self.ffn, Moe) else self.ffn.forward_gpu(x, d)
        h = h + coll.sum_partials(f).to(h.dtype)
        return gpu_norms.rms_norm(h, self.final_norm, self.eps)
