"""NoPE MLA layer with the DSA sparse indexer (every 4th layer of GLM-5.3-Flash, and the MTP block).

Replicated: q_a_proj + norm (the query latent), kv_a_proj + norm (the cached key/value latent, one row per position
shared by all heads) and the indexer. Split by heads over virtual shards: q_b_proj, kv_b_proj (folded into the query
and the output, see kernels/mla.py) and o_proj (row-parallel partials), each stacked over the rank's local shards
([S, ...]) so the GPU path runs every local shard in one launch per op; the CPU twin reads per-shard views. A "full" layer runs its indexer and leaves
its per-sequence selection in `selections`; a "shared" layer reuses the nearest earlier full layer's selection.

The projections that read the layer input (q_a, kv_a and the indexer's wk, k-pool gate and head weights) live in
one tensor, so the GPU path reads it with one GEMM; the CPU twin reads views of it. The GPU path
(`forward_gpu`) selects pools and attends with kernels/gpu/mla.py over every row at once.
"""

from __future__ import annotations

import torch

from kernels import dsa
from kernels.linear import linear, linear_fp32
from kernels.mla import sparse_latent_attention
from kernels.norms import layer_norm, rms_norm
from model.batch import Batch
from model.cache import PagedCache
from model.config import ModelConfig
from model.gpu_rows import GpuRows
from model.weights import WeightReader

# The CPU path works on blocks of query rows and of k-pools, so its buffers stay the same size whatever the context
# length (a 1M-token prompt prefills with the memory of a short one, beside the cache itself): index scores
# [QUERY_BLOCK, heads, POOL_BLOCK], selected positions [rows, topk + kpool], gathered latent rows
# [ATTENTION_BLOCK, topk + kpool, kv_lora_rank].
QUERY_BLOCK = 256
POOL_BLOCK = 1024
ATTENTION_BLOCK = 64
# full-indexer layer -> its selection: per sequence the selected positions [n, topk + kpool] (ascending, -1 padded;
# a verify window: a list of [1, ...] per row) on the CPU path, or (pools [T, W] int32 ascending, count [T] int32)
# per row (GPU path)
Selections = dict[int, list[torch.Tensor] | tuple[torch.Tensor, torch.Tensor]]


class Indexer:
    # the indexer's part of the layer's fused input projection, in this order
    X_PROJ = ("wk.weight", "index_kpool_compress_gate", "weights_proj.weight")

    def __init__(self, cfg: ModelConfig, reader: WeightReader, prefix: str, x_proj: list[torch.Tensor]) -> None:
        """x_proj: views of wk, the k-pool gate and weights_proj inside the layer's fused input projection."""
        p = prefix + "self_attn.indexer."
        self.wq_b = reader.full(p + "wq_b.weight")
        self.wk, self.gate, self.weights_proj = x_proj
        self.k_norm_w = reader.full(p + "k_norm.weight")
        self.k_norm_b = reader.full(p + "k_norm.bias")
        self.ape = reader.full(p + "index_kpool_compress_ape")
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
        out = []
        for s, (off, n, start) in enumerate(zip(batch.offsets, batch.lengths, batch.starts)):
            # A verify window is n one-row decodes: each row sees exactly the context a decode at its position sees.
            parts = [(off + r, 1, start + r) for r in range(n)] if batch.is_verify(s) else [(off, n, start)]
            table = batch.block_tables[s]
            per_part = []
            for o, m, st in parts:
                n_pools = (st + m) // self.kpool
                blocks = []
                for q0 in range(0, m, QUERY_BLOCK):
                    rows = slice(o + q0, o + min(m, q0 + QUERY_BLOCK))

                    def scores_of(p0: int, p1: int, rows: slice = rows) -> torch.Tensor:
                        keys, gates = cache.read_range(store, table, p0 * self.kpool, p1 * self.kpool).split(
                            self.dim, dim=-1)
                        return dsa.index_scores(q[rows], w[rows], dsa.pool_keys(keys, gates, self.ape, self.kpool))

                    blocks.append(dsa.select_positions(scores_of, n_pools, positions[rows], self.kpool, self.topk,
                                                       self.tail, POOL_BLOCK))
                per_part.append(torch.cat(blocks))
            # Verify sequences keep a list of [1, S] selections (one per row), others one [n, S].
            out.append(per_part if batch.is_verify(s) else per_part[0])
        return out


    def select_gpu(self, x_parts: list[torch.Tensor], q_resid: torch.Tensor, rows: GpuRows, cache: PagedCache,
                   layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """GPU: write this batch's index rows and completed pool keys, then each row's selected pools.
        x_parts: the layer input through wk, the k-pool gate and weights_proj (from the fused projection)."""
        from kernels.gpu import gemm
        from kernels.gpu import mla as gpu_mla
        from kernels.gpu import norms as gpu_norms
        if not self.tail:  # the GPU attention kernel always appends the tail pool, as every GLM release does
            raise NotImplementedError("the GPU path needs index_kpool_always_select_tail")
        wk_out, gate_out, w_out = x_parts
        store = cache.index_keys[layer]
        blocks, offsets = rows.addresses()
        key = gpu_norms.layer_norm(wk_out, self.k_norm_w, self.k_norm_b, 1e-6)
        store.write(blocks, offsets, torch.cat([key, gate_out], dim=-1))
        pooled = cache.pooled[layer]
        gpu_mla.write_pools(store.data, store.scale, pooled, self.ape, rows.tables, rows.positions, rows.row_seq,
                            self.kpool)
        keep = self.topk // self.kpool
        if rows.max_pools <= keep:  # every row sees at most `keep` pools: it takes them all, no scores needed
            return gpu_mla.select_pools(None, rows.positions, self.kpool, keep, rows.max_pools)
        t = q_resid.shape[0]
        q = gemm.matmul(q_resid, self.wq_b, rows.decode_rows).view(t, self.heads, self.dim)
        w = w_out.float() * (self.heads ** -0.5)

        def scores_of(p0: int, p1: int) -> torch.Tensor:  # one tile of pools at a time: memory flat in the context
            return gpu_mla.index_scores(q, w, pooled, rows.tables, rows.positions, rows.row_seq, self.kpool, p1,
                                        first=p0)
        return gpu_mla.select_pools(scores_of, rows.positions, self.kpool, keep, rows.max_pools)


class MlaAttention:
    def __init__(self, cfg: ModelConfig, reader: WeightReader, prefix: str, layer: int, full_indexer: bool,
                 shares_with: int | None) -> None:
        self.layer = layer
        self.shares_with = shares_with
        self.eps = cfg.rms_norm_eps
        self.dn, self.dv, self.r = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.scale = cfg.qk_nope_head_dim ** -0.5
        p = prefix + "self_attn."
        parts = [reader.full(p + "q_a_proj.weight"), reader.full(p + "kv_a_proj_with_mqa.weight")]
        if full_indexer:
            parts += [reader.full(p + "indexer." + n) for n in Indexer.X_PROJ]
        self.x_proj = torch.cat(parts)
        self.x_split = [w.shape[0] for w in parts]
        views = list(self.x_proj.split(self.x_split))
        self.q_a, self.kv_a = views[:2]
        self.q_a_norm = reader.full(p + "q_a_layernorm.weight")
        self.q_b = torch.stack(reader.split(p + "q_b_proj.weight", 0))  # [S, heads * dn, q rank]
        self.kv_a_norm = reader.full(p + "kv_a_layernorm.weight")
        kv_b = torch.stack(reader.split(p + "kv_b_proj.weight", 0))
        self.shards = kv_b.shape[0]
        self.heads = kv_b.shape[1] // (self.dn + self.dv)  # heads per virtual shard
        # kv_b rows per head are [k_nope (dn) | v (dv)]: W_uk [S x h, dn, r] and W_uv [S x h, dv, r], shard-major
        # (the GPU runs every local head as one batch; the CPU twin reads shard j's heads [j h, (j + 1) h)).
        per_head = kv_b.view(self.shards * self.heads, self.dn + self.dv, self.r)
        self.w_uk, self.w_uv = per_head[:, : self.dn], per_head[:, self.dn :]
        self.o_w = torch.stack(reader.split(p + "o_proj.weight", 1))  # [S, D, heads * dv] (row-parallel)
        self.indexer = Indexer(cfg, reader, prefix, views[2:]) if full_indexer else None

    def forward(self, x: torch.Tensor, batch: Batch, cache: PagedCache, selections: Selections) -> list[torch.Tensor]:
        q_resid = rms_norm(linear(x, self.q_a), self.q_a_norm, self.eps)
        latent_new = rms_norm(linear(x, self.kv_a), self.kv_a_norm, self.eps)
        cache.write_rows(cache.latent[self.layer], batch, latent_new)
        if self.indexer is not None:
            cache.write_rows(cache.index_keys[self.layer], batch, self.indexer.cache_rows(x))
            selections[self.layer] = self.indexer.select(x, q_resid, batch, cache, self.layer)
        chosen = selections[self.shares_with if self.indexer is None else self.layer]

        # Each query attends over its own selected positions' latent rows, gathered from the paged cache a block of
        # rows at a time (verify rows one at a time, as one-row decodes): [rows, topk + kpool, r] at most.
        store = cache.latent[self.layer]
        spans = []  # (packed rows, their selected positions)
        for s, (off, n) in enumerate(zip(batch.offsets, batch.lengths)):
            if batch.is_verify(s):
                spans += [(slice(off + r, off + r + 1), chosen[s][r]) for r in range(n)]
            else:
                spans += [(slice(off + b, off + min(b + ATTENTION_BLOCK, n)), chosen[s][b : b + ATTENTION_BLOCK])
                          for b in range(0, n, ATTENTION_BLOCK)]
        seq_of = batch.row_seq.tolist()
        partials = []
        for j in range(self.shards):
            heads = slice(j * self.heads, (j + 1) * self.heads)
            q = linear(q_resid, self.q_b[j]).view(-1, self.heads, self.dn)
            out = torch.zeros(x.shape[0], self.heads, self.dv, dtype=x.dtype, device=x.device)
            for rows, pos in spans:
                latent = cache.gather_positions(store, batch.block_tables[seq_of[rows.start]], pos)
                q_lat = torch.einsum("nhd,hdr->nhr", q[rows].float(), self.w_uk[heads].float())
                o_lat = sparse_latent_attention(q_lat, latent, pos >= 0, self.scale)
                out[rows] = torch.einsum("nhr,hvr->nhv", o_lat, self.w_uv[heads].float()).to(x.dtype)
            partials.append(linear_fp32(out.reshape(x.shape[0], -1), self.o_w[j]))
        return partials

    def forward_gpu(self, x: torch.Tensor, rows: GpuRows, cache: PagedCache, selections: Selections
                    ) -> torch.Tensor:
        """Every local virtual shard in one launch per op -> the row-parallel partials [S, T, D] fp32. The
        per-head products run as one batch over all local heads and the projections as one batch over the shards'
        stacked weights: each batch element keeps the one-shard (N, K) schedule, and the attention kernel works on
        each head alone, so every shard gets the bits of its own launch (kernels/gpu/gemm.py, mla.py)."""
        from kernels.gpu import gemm
        from kernels.gpu import mla as gpu_mla
        from kernels.gpu import norms as gpu_norms
        d, t, s, h = rows.decode_rows, x.shape[0], self.shards, self.heads
        parts = gemm.matmul(x, self.x_proj, d).split(self.x_split, dim=-1)
        q_resid = gpu_norms.rms_norm(parts[0], self.q_a_norm, self.eps)
        latent = cache.latent[self.layer]
        blocks, offsets = rows.addresses()
        latent.write(blocks, offsets, gpu_norms.rms_norm(parts[1], self.kv_a_norm, self.eps))
        if self.indexer is not None:
            selections[self.layer] = self.indexer.select_gpu(list(parts[2:]), q_resid, rows, cache, self.layer)
        sel, count = selections[self.shares_with if self.indexer is None else self.layer]
        kpool = cache.kpool
        max_positions = min(sel.shape[1], rows.max_pools) * kpool + kpool
        q = gemm.bmm(q_resid.unsqueeze(0).expand(s, -1, -1), self.q_b, d)  # [S, T, h * dn]
        q = q.view(s, t, h, self.dn).transpose(1, 2).reshape(s * h, t, self.dn)  # every local head a batch
        q_lat = gemm.bmm(q, self.w_uk.transpose(1, 2), d)  # [S h, T, r]
        o_lat = torch.empty(t, s * h, self.r, dtype=x.dtype, device=x.device)
        gpu_mla.sparse_attention(q_lat.transpose(0, 1), latent.data, latent.scale, rows.tables, rows.positions,
                                 rows.row_seq, sel, count, kpool, self.scale, o_lat, d, max_positions)
        out = gemm.bmm(o_lat.transpose(0, 1), self.w_uv, d)  # [S h, T, dv]
        out = out.view(s, h, t, self.dv).transpose(1, 2).reshape(s, t, h * self.dv)
        return gemm.bmm(out, self.o_w, d, torch.float32)
