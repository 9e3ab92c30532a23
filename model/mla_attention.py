"""NoPE MLA layer with the DSA sparse indexer (every 4th layer of GLM-5.3-Flash, and the MTP block).

Replicated: q_a_proj + norm (the query latent), kv_a_proj + norm (the cached key/value latent, one row per position
shared by all heads) and the indexer. Split by heads over virtual shards: q_b_proj, kv_b_proj (folded into the query
and the output, see kernels/mla.py) and o_proj (row-parallel partials), each stacked over the rank's local shards
([S, ...]). A "full" layer runs its indexer and leaves its selection in `selections`; a "shared" layer reuses the
nearest earlier full layer's selection.

The projections that read the layer input (q_a, kv_a and the indexer's wk, k-pool gate and head weights) are one
projection, so the fused path reads the input once. Selection and sparse attention are the ops layer's
(`dsa_select`, `mla_attention`): the reference works per sequence on blocks of rows and pools, the fused path over
every row at once (kernels/gpu/mla.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from model import projection
from model.config import ModelConfig
from model.params import IndexerParams, MlaParams
from model.projection import COLUMNS, ROWS
from model.weights import WeightReader

if TYPE_CHECKING:
    from model.forward import Forward, Selections

# the indexer's part of the layer's input projection, in this order
INDEXER_X_PROJ = ("wk.weight", "index_kpool_compress_gate", "weights_proj.weight")


def indexer(cfg: ModelConfig, reader: WeightReader, prefix: str) -> IndexerParams:
    """A full layer's DSA indexer, besides its input projections (INDEXER_X_PROJ, part of the layer's)."""
    p = prefix + "self_attn.indexer."
    return IndexerParams(wq_b=projection.load(reader, [p + "wq_b.weight"]), k_norm_w=reader.full(p + "k_norm.weight"),
                         k_norm_b=reader.full(p + "k_norm.bias"), ape=reader.full(p + "index_kpool_compress_ape"),
                         heads=cfg.index_n_heads, dim=cfg.index_head_dim, kpool=cfg.index_kpool,
                         topk=cfg.index_topk, tail=cfg.index_kpool_always_select_tail)


class MlaAttention:
    def __init__(self, cfg: ModelConfig, reader: WeightReader, prefix: str, layer: int, full_indexer: bool,
                 shares_with: int | None) -> None:
        self.layer = layer
        self.shares_with = shares_with
        self.eps = cfg.rms_norm_eps
        dn, dv, r = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        p = prefix + "self_attn."
        keys = [p + "q_a_proj.weight", p + "kv_a_proj_with_mqa.weight"]
        if full_indexer:
            keys += [p + "indexer." + n for n in INDEXER_X_PROJ]
        self.x_proj = projection.load(reader, keys)
        self.q_a_norm = reader.full(p + "q_a_layernorm.weight")
        self.q_b = projection.load(reader, [p + "q_b_proj.weight"], COLUMNS)  # [S, heads * dn, q rank]
        self.kv_a_norm = reader.full(p + "kv_a_layernorm.weight")
        kv_b = torch.stack(reader.split(p + "kv_b_proj.weight", 0))
        shards = kv_b.shape[0]
        heads = kv_b.shape[1] // (dn + dv)  # heads per virtual shard
        # kv_b rows per head are [k_nope (dn) | v (dv)]: W_uk [S x h, dn, r] and W_uv [S x h, dv, r], shard-major
        # (the fused path runs every local head as one batch; the reference reads shard j's heads [j h, (j + 1) h)).
        per_head = kv_b.view(shards * heads, dn + dv, r)
        self.params = MlaParams(
            layer=layer, shards=shards, heads=heads, dn=dn, dv=dv, r=r, scale=dn ** -0.5,
            # beyond `topk / kpool` complete pools besides a row's own tail, its selection can leave a position out
            dense_until=(cfg.index_topk // cfg.index_kpool + 1) * cfg.index_kpool - 1,
            w_kv=per_head, w_uk=per_head[:, :dn], w_uv=per_head[:, dn:])
        self.o_w = projection.load(reader, [p + "o_proj.weight"], ROWS)  # [S, D, heads * dv] (row-parallel)
        self.indexer = indexer(cfg, reader, prefix) if full_indexer else None

    def forward(self, x: torch.Tensor, fwd: "Forward", selections: "Selections") -> torch.Tensor:
        """x [T, D] -> this rank's row-parallel partials [S, T, D] fp32."""
        parts = fwd.linear(x, self.x_proj).split(self.x_proj.outputs, dim=-1)
        q_resid = fwd.rms_norm(parts[0], self.q_a_norm, self.eps)
        fwd.write_rows(fwd.cache.latent[self.layer], fwd.rms_norm(parts[1], self.kv_a_norm, self.eps))
        if self.indexer is not None:
            selections[self.layer] = fwd.dsa_select(self.indexer, list(parts[2:]), q_resid, self.layer)
        chosen = selections[self.layer if self.indexer is not None else self.shares_with]
        out = fwd.mla_attention(self.params, fwd.shard_linear(q_resid, self.q_b), chosen)  # [S, T, heads * dv]
        return fwd.shard_linear(out, self.o_w, torch.float32)
