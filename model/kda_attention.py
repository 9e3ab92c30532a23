"""KDA linear-attention layer (34 of GLM-5.3-Flash's 45 layers).

x -> q, k, v projections -> short causal conv + SiLU -> per-channel forget gate g and per-head beta -> KDA
recurrence (chunked for prefill rows, one step for decode rows) -> gated RMSNorm -> o_proj (row-parallel).
Heads are split over virtual shards; each shard's heads run independently until o_proj, whose per-shard partial
sums the caller reduces.

Weights are stacked over the rank's local virtual shards ([S, ...]): per shard q|k|v as one projection. The
narrow products of the layer input join one replicated projection, f_a | g_a | b with b over every head (a rank
takes its own heads' columns): at every TP size one product of one shape, so its bits do not depend on the rank
count, and a quantized q|k|v beside a dense b costs no second product over the input. f_b and g_b, one shape
with inputs of their own, are stacked along the shard dim and run as one product (model/projection.py
`load_stacked`). So the fused path reads each input once per projection for every local shard.

The recurrence and the gated norm are the ops layer's (`kda_attention`): the reference runs them row class by
row class (kernels/kda.py), the fused path through the recurrent kernel, which norms decode-class
rows in the same launch (kernels/gpu/kda.py), and fla-core's `chunk_kda` — chunk-grid and batch invariant and close
to the reference on a GPU (docs/benchmarks.md, "Kernels on one H200").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from model import projection
from model.cache import PagedCache
from model.config import ModelConfig
from model.params import KdaParams
from model.projection import COLUMNS, ROWS
from model.weights import WeightReader

if TYPE_CHECKING:
    from model.forward import Forward, Selections


class KdaAttention:
    def __init__(self, cfg: ModelConfig, reader: WeightReader, prefix: str, layer: int) -> None:
        self.layer = layer
        self.eps = cfg.rms_norm_eps
        p = prefix + "self_attn."
        self.qkv = projection.load(reader, [p + f"{n}.weight" for n in ("q_proj", "k_proj", "v_proj")], COLUMNS)
        q_c, k_c, v_c = (reader.split(p + f"{n}_conv1d.weight", 0) for n in "qkv")
        # [S, 3C, K]: per shard (q, k, v) channels — the layout of the shard's slice of the conv state.
        conv_w = torch.stack([torch.cat([a, b, c]).squeeze(1) for a, b, c in zip(q_c, k_c, v_c)])
        # f_a | g_a | b (every head's beta), replicated; this rank's heads are the columns `self.beta` of b
        self.narrow = projection.load(reader, [p + f"{n}.weight" for n in ("f_a_proj", "g_a_proj", "b_proj")])
        rank_f, rank_g, all_heads = self.narrow.outputs
        if rank_f != rank_g:
            raise ValueError(f"{p}: f_a and g_a of {rank_f} and {rank_g} outputs (KDA's gates share one rank)")
        local = reader.sharding.split(all_heads, p + "b_proj.weight")
        self.beta = slice(2 * rank_f + local[0].start, 2 * rank_f + local[-1].stop)
        self.rank = rank_f
        # f_b then g_b, each [S, heads * d, rank]: one product over f_a's and g_a's outputs
        self.fg_b = projection.load_stacked(reader, [p + "f_b_proj.weight", p + "g_b_proj.weight"])
        dt_bias = torch.stack(reader.split(p + "dt_bias", 0))  # [S, heads * dk]
        a_log = torch.stack(reader.split(p + "A_log", 0))  # [S, heads]
        self.o_norm = reader.full(p + "o_norm.weight")
        self.o_w = projection.load(reader, [p + "o_proj.weight"], ROWS)  # [S, D, heads * dv] (row-parallel)
        shards, heads = a_log.shape  # local virtual shards, heads per shard
        self.params = KdaParams(layer=layer, shards=shards, heads=heads, dl=cfg.linear_head_dim,
                                width=self.qkv.n, conv_w=conv_w, dt_bias=dt_bias, a_log=a_log,
                                lower_bound=cfg.linear_lower_bound)

    def forward(self, x: torch.Tensor, fwd: "Forward", selections: "Selections") -> torch.Tensor:
        """x [T, D] -> this rank's row-parallel partials [S, T, D] fp32."""
        k = self.params
        t, r = x.shape[0], self.rank
        narrow = fwd.linear(x, self.narrow)  # [T, f rank + g rank + every head]
        low = narrow[:, : 2 * r].view(t, 2, r).transpose(0, 1)  # f_a's and g_a's outputs, [2, T, rank] (a view)
        g_raw, gate = fwd.shard_linear(low, self.fg_b).split(k.shards)
        beta_raw = narrow[:, self.beta].view(t, k.shards, k.heads).transpose(0, 1)  # this rank's heads, [S, T, H]
        mixed = fwd.shard_linear(x, self.qkv)  # [S, T, 3C]
        out = fwd.kda_attention(k, mixed, g_raw, beta_raw, gate, self.o_norm, self.eps)
        return fwd.shard_linear(out, self.o_w, torch.float32)

    def commit(self, cache: PagedCache, slots: torch.Tensor, picks: torch.Tensor) -> None:
        """After sampling: each verify window's slot (slots[i]) keeps the state and conv history of its pending row
        picks[i], its last accepted row (`Glm5Model.commit_verify` works them out); rows after it are dropped. One
        gather and one scatter per cache for every window."""
        pending = cache.pending.pop(self.layer, None)
        if pending is None:
            return
        cache.kda_state[self.layer].index_copy_(0, slots, pending.state.index_select(0, picks))
        cache.conv_state[self.layer].index_copy_(0, slots, pending.conv.index_select(0, picks))
