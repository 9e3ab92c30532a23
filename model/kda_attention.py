"""KDA linear-attention layer (34 of GLM-5.3-Flash's 45 layers).

x -> q, k, v projections -> short causal conv + SiLU -> per-channel forget gate g and per-head beta -> KDA
recurrence (chunked for prefill rows, one step for decode rows) -> gated RMSNorm -> o_proj (row-parallel).
Heads are split over virtual shards; each shard's heads run independently until o_proj, whose per-shard partial
sums the caller reduces.

Storage serves both paths: every per-shard weight is stacked over the rank's local virtual shards ([S, ...]; per
shard q|k|v|b live in one [3C + heads, D] slice, f_a|g_a in one replicated tensor), so the GPU path runs each op
once for every local shard; the CPU twin reads per-shard views of the same tensors. The GPU path (`forward_gpu`)
runs decode and verify rows through the fused recurrent kernel (kernels/gpu/kda.py) and prompt chunks through
fla-core's `chunk_kda` — chunk-grid and batch invariant and within 4e-4 of the twin, measured on an H200
(bench/results/kernels-20261130-235732.*).
"""

from __future__ import annotations

import functools
import logging

import torch

from kernels import kda
from kernels.linear import linear, linear_fp32, pad_rows
from kernels.norms import gated_rms_norm
from model.batch import Batch
from model.cache import PagedCache
from model.config import ModelConfig
from model.gpu_rows import GpuRows
from model.weights import WeightReader

log = logging.getLogger("twinspark.rank")


class KdaAttention:
    def __init__(self, cfg: ModelConfig, reader: WeightReader, prefix: str, layer: int) -> None:
        self.layer = layer
        self.eps = cfg.rms_norm_eps
        self.dl = cfg.linear_head_dim
        self.lower_bound = cfg.linear_lower_bound
        p = prefix + "self_attn."
        q_w, k_w, v_w, b_w = (reader.split(p + f"{n}.weight", 0) for n in ("q_proj", "k_proj", "v_proj", "b_proj"))
        self.width = q_w[0].shape[0] + k_w[0].shape[0] + v_w[0].shape[0]  # q|k|v columns of one shard (3C)
        self.qkvb = torch.stack([torch.cat(ws) for ws in zip(q_w, k_w, v_w, b_w)])  # [S, 3C + heads, D]
        self.q_w, self.k_w, self.v_w, self.b_w = zip(*(w.split([q_w[0].shape[0], k_w[0].shape[0], v_w[0].shape[0],
                                                                b_w[0].shape[0]]) for w in self.qkvb))
        q_c, k_c, v_c = (reader.split(p + f"{n}_conv1d.weight", 0) for n in "qkv")
        # [S, 3C, K]: per shard (q, k, v) channels — the layout of the shard's slice of the conv state.
        self.conv_w = torch.stack([torch.cat([a, b, c]).squeeze(1) for a, b, c in zip(q_c, k_c, v_c)])
        f_a, g_a = reader.full(p + "f_a_proj.weight"), reader.full(p + "g_a_proj.weight")
        self.fg_a = torch.cat([f_a, g_a])
        self.f_a, self.g_a = self.fg_a.split([f_a.shape[0], g_a.shape[0]])
        self.f_b = torch.stack(reader.split(p + "f_b_proj.weight", 0))  # [S, heads * dk, f rank]
        self.dt_bias = torch.stack(reader.split(p + "dt_bias", 0))  # [S, heads * dk]
        self.a_log = torch.stack(reader.split(p + "A_log", 0))  # [S, heads]
        self.g_b = torch.stack(reader.split(p + "g_b_proj.weight", 0))  # [S, heads * dv, g rank]
        self.o_norm = reader.full(p + "o_norm.weight")
        self.o_w = torch.stack(reader.split(p + "o_proj.weight", 1))  # [S, D, heads * dv] (row-parallel)
        self.shards, self.heads = self.a_log.shape  # local virtual shards, heads per shard

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
        for j in range(self.shards):
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

    # ----- GPU fast path -----

    def forward_gpu(self, x: torch.Tensor, batch: Batch, rows: GpuRows, cache: PagedCache) -> torch.Tensor:
        """Every local virtual shard in one launch per op -> the row-parallel partials [S, T, D] fp32.

        Column-parallel projections are one batched GEMM over the shards' stacked weights with the input broadcast:
        each batch element runs the one-shard (N, K) schedule (kernels/gpu/gemm.py), so each shard gets the bits of
        its own product whatever the number of shards in the launch (TP=1 runs 4, TP=2 two). Never one wider
        [S x N, K] product: its tiles and K split could differ from a shard's."""
        from kernels.gpu import gemm
        from kernels.gpu import kda as gpu_kda
        d, t, s = rows.decode_rows, x.shape[0], self.shards
        fa, ga = gemm.matmul(x, self.fg_a, d).split([self.f_a.shape[0], self.g_a.shape[0]], dim=-1)
        conv_all = cache.conv_state[self.layer]
        state_all = cache.kda_state[self.layer]
        pend_state = pend_conv = None
        if rows.verify:  # every row's state until `commit` keeps the last accepted one (as the CPU path)
            pend_state = torch.empty(len(rows.verify), rows.window, *state_all.shape[1:], dtype=state_all.dtype,
                                     device=x.device)
            pend_conv = torch.empty(len(rows.verify), rows.window, *conv_all.shape[1:], dtype=conv_all.dtype,
                                    device=x.device)
            cache.pending[self.layer] = (rows.verify, pend_state, pend_conv)
        xb = gemm.bmm(x.unsqueeze(0).expand(s, -1, -1), self.qkvb, d)  # [S, T, 3C + heads]
        mixed, beta_raw = xb[..., : self.width], xb[..., self.width :]
        g_raw = gemm.bmm(fa.unsqueeze(0).expand(s, -1, -1), self.f_b, d)
        gate = gemm.bmm(ga.unsqueeze(0).expand(s, -1, -1), self.g_b, d)
        core = torch.empty(s, t, self.heads * self.dl, dtype=x.dtype, device=x.device)
        gpu_kda.decode(rows.kda, mixed=mixed, conv_w=self.conv_w, conv_state=conv_all, chan_off=0, g_raw=g_raw,
                       dt_bias=self.dt_bias, a_log=self.a_log, lower_bound=self.lower_bound, beta_raw=beta_raw,
                       state=state_all, head_off=0, core=core, pend_state=pend_state, pend_conv=pend_conv)
        if rows.prompt is not None:
            self._prompt_gpu(batch, rows, cache, mixed[:, d:], g_raw[:, d:], beta_raw[:, d:], core[:, d:])
        out = gpu_kda.gated_norm(core, gate, self.o_norm, self.eps)
        return gemm.bmm(out, self.o_w, d, torch.float32)

    def _prompt_gpu(self, batch: Batch, rows: GpuRows, cache: PagedCache, mixed: torch.Tensor, g_raw: torch.Tensor,
                    beta_raw: torch.Tensor, core: torch.Tensor) -> None:
        """Prompt chunks of every local shard ([S, prompt rows, ...] operands): the short conv over all of their
        rows, then chunked KDA from their slots' states (zero for a fresh sequence) into `core`; states and
        histories move on in place."""
        from kernels.gpu import kda as gpu_kda
        p = rows.prompt
        conv_all = cache.conv_state[self.layer]
        state_all = cache.kda_state[self.layer]
        s, width = self.shards, self.width
        conv = gpu_kda.prompt_conv(mixed, self.conv_w, conv_all, 0, p.row_first, p.row_slot, p.row_fresh)
        lo = 0
        for seq in p.seqs:  # then each history moves on to the chunk's last inputs (every shard's columns at once)
            n, slot = batch.lengths[seq], batch.slots[seq]
            hist = conv_all[slot].view(-1, s, width).transpose(0, 1)  # [S, K-1, 3C]
            new = kda.conv_history(mixed[:, lo : lo + n], hist if batch.starts[seq] else torch.zeros_like(hist))
            hist.copy_(new)
            lo += n
        init = torch.where(p.fresh.view(-1, 1, 1, 1), 0.0, state_all[p.slots])
        # fla-core's chunk_kda runs once per shard: its kernels autotune their configs (some change the K split) keyed
        # on the head count, so one call over every local shard's heads could take another schedule at TP=1 (4
        # shards' heads) than at TP=2 (2 shards'), and TP=1 = TP=2 would no longer hold by construction.
        for j in range(s):
            heads = slice(j * self.heads, (j + 1) * self.heads)
            q, k, v = (c.reshape(1, -1, self.heads, self.dl) for c in conv[j].chunk(3, dim=-1))
            out, final = _chunk_kda(q, k, v, g_raw[j].reshape(1, -1, self.heads, self.dl),
                                    beta_raw[j].reshape(1, -1, self.heads), init[:, heads], p.cu_seqlens,
                                    self.a_log[j], self.dt_bias[j], self.lower_bound)
            state_all[:, heads].index_copy_(0, p.slots, final)
            core[j] = out.reshape(-1, self.heads * self.dl)


def _chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g_raw: torch.Tensor, beta_raw: torch.Tensor,
               init: torch.Tensor, cu_seqlens: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
               lower_bound: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """fla-core's chunked KDA over varlen sequences with GLM's gate, beta and l2 norms inside the kernel
    -> (out [1, T, H, dv] in the input dtype, final states [N, H, dk, dv] fp32). Without fla-core (or off CUDA,
    where the Triton kernels run in the test interpreter) the torch twin runs sequence by sequence."""
    chunk_kda = _fla_chunk_kda() if q.is_cuda else None
    if chunk_kda is None:
        return _chunk_kda_twin(q, k, v, g_raw, beta_raw, init, cu_seqlens, a_log, dt_bias, lower_bound)
    return chunk_kda(q, k, v, g_raw, beta_raw, initial_state=init.contiguous(), output_final_state=True,
                     cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True, safe_gate=lower_bound is not None, lower_bound=lower_bound,
                     A_log=a_log, dt_bias=dt_bias)


@functools.cache
def _fla_chunk_kda():
    """fla-core's chunk_kda, or None (with one warning saying why) when it cannot be imported."""
    try:
        from fla.ops.kda import chunk_kda
    except ImportError as exc:
        log.warning("fla-core is not usable (%s): prompt chunks run KDA with the torch twin, which is slow", exc)
        return None
    return chunk_kda


def _chunk_kda_twin(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g_raw: torch.Tensor, beta_raw: torch.Tensor,
                    init: torch.Tensor, cu_seqlens: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                    lower_bound: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`_chunk_kda` by the torch reference (kernels/kda.py), with the gate and beta as `KdaAttention` computes
    them on the CPU path."""
    heads, dk = q.shape[2], q.shape[3]
    g = g_raw[0].float() + dt_bias.float().view(heads, dk)
    rate = a_log.float().exp().view(1, heads, 1)
    g = lower_bound * torch.sigmoid(rate * g) if lower_bound is not None else \
        -rate * torch.nn.functional.softplus(g, threshold=20.0)
    beta = torch.sigmoid(beta_raw[0])
    out = torch.empty(q.shape[1], heads, v.shape[-1], dtype=q.dtype, device=q.device)
    finals = []
    bounds = cu_seqlens.tolist()
    for i in range(len(bounds) - 1):
        r = slice(bounds[i], bounds[i + 1])
        o, st = kda.chunked(q[0, r], k[0, r], v[0, r], g[r], beta[r], init[i])
        out[r] = o.to(q.dtype)
        finals.append(st)
    return out.unsqueeze(0), torch.stack(finals)
