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

    def _decode_rows(self, rows: list[int], hist: torch.Tensor, state: torch.Tensor, mixed: torch.Tensor,
                     g: torch.Tensor, beta: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One recurrent step for a group of rows, one row per sequence: the arithmetic of every decode row.

        hist: [n, K-1, C] conv history, state: [n, heads, dk, dv] of each row's sequence before the row. The group
        is padded like every batch-wide tensor (kernels/linear.py) so a row's bits do not depend on how many rows
        share the step. Returns (core out [n, heads, dv], new conv history, new state)."""
        n = len(rows)
        idx = torch.tensor(rows, device=mixed.device)
        hist = pad_rows(hist)
        new = pad_rows(mixed[idx].unsqueeze(1))
        conv = kda.causal_conv(new, self.conv_w[j], hist).squeeze(1)
        q, k, v = (c.view(-1, self.heads, self.dl) for c in conv.chunk(3, dim=-1))
        out, state = kda.recurrent(q, k, v, pad_rows(g[idx]), pad_rows(beta[idx]), pad_rows(state))
        return out[:n], kda.conv_history(new, hist)[:n], state[:n]

    def forward(self, x: torch.Tensor, batch: Batch, cache: PagedCache) -> list[torch.Tensor]:
        t = x.shape[0]
        fa = linear(x, self.f_a)
        ga = linear(x, self.g_a)
        conv_all = cache.conv_state[self.layer]
        state_all = cache.kda_state[self.layer]
        slots = torch.tensor(batch.slots, device=x.device)
        fresh = torch.tensor([s == 0 for s in batch.starts], device=x.device)
        offsets = batch.offsets
        verify = [s for s in range(batch.num_seqs) if batch.is_verify(s)]
        decode = [s for s in range(batch.num_seqs) if not batch.is_prompt(s) and s not in verify]
        prefill = [s for s in range(batch.num_seqs) if batch.is_prompt(s)]
        if verify:
            # Verify windows: every row is a one-row decode step; each row's state (and conv history) is kept in
            # `cache.pending` until `commit` picks the last accepted row's. The slot itself is not touched here.
            longest = max(batch.lengths[s] for s in verify)
            pend_state = torch.zeros(len(verify), longest, *state_all.shape[1:], dtype=state_all.dtype,
                                     device=x.device)
            pend_conv = torch.zeros(len(verify), longest, *conv_all.shape[1:], dtype=conv_all.dtype, device=x.device)
            cache.pending[self.layer] = (verify, pend_state, pend_conv)
        partials = []
        for j in range(len(self.q_w)):
            mixed = torch.cat([linear(x, self.q_w[j]), linear(x, self.k_w[j]), linear(x, self.v_w[j])], dim=-1)
            chans = slice(j * mixed.shape[1], (j + 1) * mixed.shape[1])
            heads = slice(j * self.heads, (j + 1) * self.heads)
            g = self._gate(fa, j)
            beta = torch.sigmoid(linear(x, self.b_w[j]))
            core = torch.zeros(t, self.heads, self.dl, dtype=torch.float32, device=x.device)

            if decode:
                sl, fr = slots[decode], fresh[decode]
                hist = torch.where(fr.view(-1, 1, 1), 0, conv_all[sl][:, :, chans])
                state = torch.where(fr.view(-1, 1, 1, 1), 0, state_all[sl][:, heads])
                rows = [offsets[s] for s in decode]
                core[rows], conv_all[sl, :, chans], state_all[sl, heads] = self._decode_rows(
                    rows, hist, state, mixed, g, beta, j)

            # Verify windows, step r: row r of every window that has one, as one decode group.
            for r in range(max((batch.lengths[s] for s in verify), default=0)):
                group = [i for i, s in enumerate(verify) if batch.lengths[s] > r]
                if r == 0:
                    seqs = [verify[i] for i in group]
                    sl, fr = slots[seqs], fresh[seqs]
                    hist = torch.where(fr.view(-1, 1, 1), 0, conv_all[sl][:, :, chans])
                    state = torch.where(fr.view(-1, 1, 1, 1), 0, state_all[sl][:, heads])
                else:
                    hist = pend_conv[group, r - 1][:, :, chans]
                    state = pend_state[group, r - 1][:, heads]
                rows = [offsets[verify[i]] + r for i in group]
                core[rows], pend_conv[group, r, :, chans], pend_state[group, r, heads] = self._decode_rows(
                    rows, hist, state, mixed, g, beta, j)

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

    def commit(self, batch: Batch, cache: PagedCache, accepted: dict[int, int]) -> None:
        """After sampling: each verify sequence s keeps the state of its last accepted row (row accepted[s]; row 0
        is the last committed token, so accepting a drafts keeps row a). Rows after it are dropped."""
        pending = cache.pending.pop(self.layer, None)
        if pending is None:
            return
        verify, pend_state, pend_conv = pending
        for i, s in enumerate(verify):
            a = accepted.get(s, 0)
            if not 0 <= a < batch.lengths[s]:
                raise ValueError(f"sequence {s}: {a} accepted drafts in a window of {batch.lengths[s]} rows")
            slot = batch.slots[s]
            cache.kda_state[self.layer][slot] = pend_state[i, a]
            cache.conv_state[self.layer][slot] = pend_conv[i, a]
