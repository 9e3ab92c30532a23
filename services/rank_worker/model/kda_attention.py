"""KDA linear-attention layer (34 of GLM-5.3-Flash's 45 layers).

x -> q, k, v projections -> short causal conv + SiLU -> per-channel forget gate g and per-head beta -> KDA
recurrence (chunked for prefill rows, one step for decode rows) -> gated RMSNorm -> o_proj (row-parallel).
Heads are split over virtual shards; each shard's heads run independently until o_proj, whose per-shard partial
sums the caller reduces.
"""

from __future__ import annotations

import torch

from kernels import kda
from kernels.linear import linear, linear_fp32, pad_rows
from kernels.norms import gated_rms_norm
from services.rank_worker.model.batch import Batch
from services.rank_worker.model.cache import PagedCache
from services.rank_worker.model.config import ModelConfig
from services.rank_worker.model.weights import WeightReader


class KdaAttention:
    def __init__(self, cfg: ModelConfig, reader: WeightReader, prefix: str, layer: int) -> None:
        self.layer = layer
        self.eps = cfg.rms_norm_eps
        self.dl = cfg.linear_head_dim
        self.lower_bound = cfg.linear_lower_bound
        p = prefix + "self_attn."
        self.q_w = reader.split(p + "q_proj.weight", 0)
        self.k_w = reader.split(p + "k_proj.weight", 0)
        self.v_w = reader.split(p + "v_proj.weight", 0)
        q_c, k_c, v_c = (reader.split(p + f"{n}_conv1d.weight", 0) for n in "qkv")
        # Per shard: [3 * channels, K] in (q, k, v) order — the layout of this shard's slice of the conv state.
        self.conv_w = [torch.cat([a, b, c]).squeeze(1) for a, b, c in zip(q_c, k_c, v_c)]
        self.f_a = reader.full(p + "f_a_proj.weight")
        self.f_b = reader.split(p + "f_b_proj.weight", 0)
        self.dt_bias = reader.split(p + "dt_bias", 0)
        self.a_log = reader.split(p + "A_log", 0)
        self.b_w = reader.split(p + "b_proj.weight", 0)
        self.g_a = reader.full(p + "g_a_proj.weight")
        self.g_b = reader.split(p + "g_b_proj.weight", 0)
        self.o_norm = reader.full(p + "o_norm.weight")
        self.o_w = reader.split(p + "o_proj.weight", 1)
        self.heads = self.a_log[0].numel()  # heads per virtual shard

    def _gate(self, fa: torch.Tensor, j: int) -> torch.Tensor:
        """Per-channel log-decay g <= 0 of shard j: [T, heads, dk] fp32."""
        g = (linear(fa, self.f_b[j]).float() + self.dt_bias[j].float()).view(fa.shape[0], self.heads, self.dl)
        rate = self.a_log[j].float().exp().view(1, self.heads, 1)
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * g)
        return -rate * torch.nn.functional.softplus(g, threshold=20.0)

    def forward(self, x: torch.Tensor, batch: Batch, cache: PagedCache) -> list[torch.Tensor]:
        t = x.shape[0]
        fa = linear(x, self.f_a)
        ga = linear(x, self.g_a)
        conv_all = cache.conv_state[self.layer]
        state_all = cache.kda_state[self.layer]
        slots = torch.tensor(batch.slots, device=x.device)
        fresh = torch.tensor([s == 0 for s in batch.starts], device=x.device)
        offsets = batch.offsets
        decode = [s for s, n in enumerate(batch.lengths) if n == 1]
        prefill = [s for s, n in enumerate(batch.lengths) if n > 1]
        partials = []
        for j in range(len(self.q_w)):
            mixed = torch.cat([linear(x, self.q_w[j]), linear(x, self.k_w[j]), linear(x, self.v_w[j])], dim=-1)
            chans = slice(j * mixed.shape[1], (j + 1) * mixed.shape[1])
            heads = slice(j * self.heads, (j + 1) * self.heads)
            g = self._gate(fa, j)
            beta = torch.sigmoid(linear(x, self.b_w[j]))
            core = torch.zeros(t, self.heads, self.dl, dtype=torch.float32, device=x.device)

            if decode:
                # One recurrent step for all decode rows at once; the group is padded like every batch-wide tensor
                # (kernels/linear.py) so a row's bits do not depend on how many decode rows share the step.
                nd = len(decode)
                rows = torch.tensor([offsets[s] for s in decode], device=x.device)
                sl, fr = slots[decode], fresh[decode]
                hist = pad_rows(torch.where(fr.view(-1, 1, 1), 0, conv_all[sl][:, :, chans]))
                new = pad_rows(mixed[rows].unsqueeze(1))
                conv = kda.causal_conv(new, self.conv_w[j], hist).squeeze(1)
                conv_all[sl, :, chans] = kda.conv_history(new, hist)[:nd]
                q, k, v = (c.view(-1, self.heads, self.dl) for c in conv.chunk(3, dim=-1))
                state = pad_rows(torch.where(fr.view(-1, 1, 1, 1), 0, state_all[sl][:, heads]))
                out, state = kda.recurrent(q, k, v, pad_rows(g[rows]), pad_rows(beta[rows]), state)
                core[rows] = out[:nd]
                state_all[sl, heads] = state[:nd]

            for s in prefill:
                rows = slice(offsets[s], offsets[s] + batch.lengths[s])
                slot = batch.slots[s]
                hist = conv_all[slot, :, chans] if batch.starts[s] else torch.zeros_like(conv_all[slot, :, chans])
                conv = kda.causal_conv(mixed[rows], self.conv_w[j], hist)
                conv_all[slot, :, chans] = kda.conv_history(mixed[rows], hist)
                q, k, v = (c.view(-1, self.heads, self.dl) for c in conv.chunk(3, dim=-1))
                state = state_all[slot, heads] if batch.starts[s] else torch.zeros_like(state_all[slot, heads])
                core[rows], state_all[slot, heads] = kda.chunked(q, k, v, g[rows], beta[rows], state)

            gate = linear(ga, self.g_b[j]).view(t, self.heads, self.dl)
            out = gated_rms_norm(core.to(x.dtype), gate, self.o_norm, self.eps).reshape(t, -1)
            partials.append(linear_fp32(out, self.o_w[j]))
        return partials
