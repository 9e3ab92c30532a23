"""NoPE MLA layer with the DSA sparse indexer (every 4th layer of GLM-5.3-Flash, and the MTP block).

Replicated: q_a_proj + norm (the query latent), kv_a_proj + norm (the cached key/value latent, one row per position
shared by all heads) and the indexer. Split by heads over virtual shards: q_b_proj, kv_b_proj (folded into the query
and the output, see kernels/mla.py) and o_proj (row-parallel partials). A "full" layer runs its indexer and leaves
its per-sequence selection in `selections`; a "shared" layer reuses the nearest earlier full layer's selection.
"""

from __future__ import annotations

import torch

from kernels import dsa
from kernels.linear import linear, linear_fp32
from kernels.mla import latent_attention
from kernels.norms import layer_norm, rms_norm
from services.rank_worker.model.batch import Batch
from services.rank_worker.model.cache import PagedCache
from services.rank_worker.model.config import ModelConfig
from services.rank_worker.model.weights import WeightReader

QUERY_BLOCK = 1024
Selections = dict[int, list[torch.Tensor]]  # full-indexer layer -> per-sequence [n, context] bool masks


class Indexer:
    def __init__(self, cfg: ModelConfig, reader: WeightReader, prefix: str) -> None:
        p = prefix + "self_attn.indexer."
        self.wq_b = reader.full(p + "wq_b.weight")
        self.wk = reader.full(p + "wk.weight")
        self.k_norm_w = reader.full(p + "k_norm.weight")
        self.k_norm_b = reader.full(p + "k_norm.bias")
        self.weights_proj = reader.full(p + "weights_proj.weight")
        self.ape = reader.full(p + "index_kpool_compress_ape")
        self.gate = reader.full(p + "index_kpool_compress_gate")
        self.heads = cfg.index_n_heads
        self.dim = cfg.index_head_dim
        self.kpool = cfg.index_kpool
        self.topk = cfg.index_topk
        self.tail = cfg.index_kpool_always_select_tail

    def cache_rows(self, x: torch.Tensor) -> torch.Tensor:
        """What a position leaves in the indexer cache: its key (LayerNorm'd) and its k-pool gate score."""
        k = layer_norm(linear(x, self.wk), self.k_norm_w, self.k_norm_b, 1e-6)
        return torch.cat([k, linear(x, self.gate)], dim=-1)

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, batch: Batch, cache: PagedCache, layer: int) -> list[torch.Tensor]:
        q = linear(q_resid, self.wq_b).view(-1, self.heads, self.dim)
        w = linear(x, self.weights_proj).float() * (self.heads ** -0.5)
        store = cache.index_keys[layer]
        positions = batch.positions
        masks = []
        for s, (off, n, start) in enumerate(zip(batch.offsets, batch.lengths, batch.starts)):
            # A verify window is n one-row decodes: each row sees exactly the context a decode at its position sees.
            parts = [(off + r, 1, start + r) for r in range(n)] if batch.is_verify(s) else [(off, n, start)]
            per_row = []
            for o, m, st in parts:
                ctx = st + m
                rows = cache.read_sequence(store, batch.block_tables[s], ctx)
                keys, gates = rows.split(self.dim, dim=-1)
                pooled = dsa.pool_keys(keys, gates, self.ape, self.kpool)
                scores = dsa.index_scores(q[o : o + m], w[o : o + m], pooled)
                per_row.append(dsa.select(scores, positions[o : o + m], ctx, self.kpool, self.topk, self.tail))
            # Verify sequences keep a list of [1, ctx_r] masks (one per row), others one [n, ctx] mask.
            masks.append(per_row if batch.is_verify(s) else per_row[0])
        return masks


class MlaAttention:
    def __init__(self, cfg: ModelConfig, reader: WeightReader, prefix: str, layer: int, full_indexer: bool,
                 shares_with: int | None) -> None:
        self.layer = layer
        self.shares_with = shares_with
        self.eps = cfg.rms_norm_eps
        self.dn, self.dv, self.r = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.scale = cfg.qk_nope_head_dim ** -0.5
        p = prefix + "self_attn."
        self.q_a = reader.full(p + "q_a_proj.weight")
        self.q_a_norm = reader.full(p + "q_a_layernorm.weight")
        self.q_b = reader.split(p + "q_b_proj.weight", 0)
        self.kv_a = reader.full(p + "kv_a_proj_with_mqa.weight")
        self.kv_a_norm = reader.full(p + "kv_a_layernorm.weight")
        kv_b = reader.split(p + "kv_b_proj.weight", 0)
        self.heads = kv_b[0].shape[0] // (self.dn + self.dv)  # heads per virtual shard
        # kv_b rows per head are [k_nope (dn) | v (dv)]: keep W_uk [h, dn, r] and W_uv [h, dv, r] per shard.
        per_head = [w.view(self.heads, self.dn + self.dv, self.r) for w in kv_b]
        self.w_uk = [w[:, : self.dn] for w in per_head]
        self.w_uv = [w[:, self.dn :] for w in per_head]
        self.o_w = reader.split(p + "o_proj.weight", 1)
        self.indexer = Indexer(cfg, reader, prefix) if full_indexer else None

    def forward(self, x: torch.Tensor, batch: Batch, cache: PagedCache, selections: Selections) -> list[torch.Tensor]:
        q_resid = rms_norm(linear(x, self.q_a), self.q_a_norm, self.eps)
        latent_new = rms_norm(linear(x, self.kv_a), self.kv_a_norm, self.eps)
        cache.write_rows(cache.latent[self.layer], batch, latent_new)
        if self.indexer is not None:
            cache.write_rows(cache.index_keys[self.layer], batch, self.indexer.cache_rows(x))
            selections[self.layer] = self.indexer.select(x, q_resid, batch, cache, self.layer)
        masks = selections[self.shares_with if self.indexer is None else self.layer]

        latents = [cache.read_sequence(cache.latent[self.layer], batch.block_tables[s], st + n)
                   for s, (st, n) in enumerate(zip(batch.starts, batch.lengths))]
        partials = []
        for j in range(len(self.q_b)):
            q = linear(q_resid, self.q_b[j]).view(-1, self.heads, self.dn)
            out = torch.zeros(x.shape[0], self.heads, self.dv, dtype=x.dtype, device=x.device)
            for s, (off, n, st) in enumerate(zip(batch.offsets, batch.lengths, batch.starts)):
                if batch.is_verify(s):
                    # One query row at a time over exactly its own context: the arithmetic of a one-row decode.
                    for r in range(n):
                        row = slice(off + r, off + r + 1)
                        q_lat = torch.einsum("nhd,hdr->nhr", q[row].float(), self.w_uk[j].float())
                        o_lat = latent_attention(q_lat, latents[s][: st + r + 1], masks[s][r], self.scale)
                        out[row] = torch.einsum("nhr,hvr->nhv", o_lat, self.w_uv[j].float()).to(x.dtype)
                    continue
                # Long prefills go QUERY_BLOCK rows at a time so the [heads, rows, context] scores stay bounded.
                for b in range(0, n, QUERY_BLOCK):
                    rows = slice(off + b, off + min(b + QUERY_BLOCK, n))
                    q_lat = torch.einsum("nhd,hdr->nhr", q[rows].float(), self.w_uk[j].float())
                    o_lat = latent_attention(q_lat, latents[s], masks[s][b : b + QUERY_BLOCK], self.scale)
                    out[rows] = torch.einsum("nhr,hvr->nhv", o_lat, self.w_uv[j].float()).to(x.dtype)
            partials.append(linear_fp32(out.reshape(x.shape[0], -1), self.o_w[j]))
        return partials
