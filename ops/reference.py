"""The torch reference ops (the CPU path, and the oracle every fused kernel is tested against), bound to one forward.

Batch-wide tensors carry a multiple of ROW_TILE rows (zero-token padding rows that belong to no sequence), and every
product runs over fixed row tiles, so a row's bits do not depend on how many rows share the batch (kernels/linear.py
says why torch's CPU kernels need this). Operands are made contiguous before each op: a view into a joined
projection's output would otherwise take other element-wise code paths than the tensor it stands for.

The per-sequence work (KDA's recurrence, the indexer's selection, sparse attention) reads `Batch`'s Python lists:
one readable loop per row class, which is what the fused kernels are checked against.
"""

from __future__ import annotations

import torch

from kernels import dsa, kda, mhc, moe
from kernels.linear import linear, pad_rows
from kernels.mla import sparse_latent_attention
from kernels.norms import gated_rms_norm, layer_norm, rms_norm
from model.batch import Batch
from model.cache import PagedCache, PendingStates
from model.forward import PositionSelection
from model.params import HyperConnectionParams, IndexerParams, KdaParams, MlaParams, MoeParams
from model.parallel import Collective
from model.projection import Projection
from model.row_store import RowStore

# The CPU path works on blocks of query rows and of k-pools, so its buffers stay the same size whatever the context
# length (a 1M-token prompt prefills with the memory of a short one, beside the cache itself): index scores
# [QUERY_BLOCK, heads, POOL_BLOCK], selected positions [rows, topk + kpool], gathered latent rows
# [ATTENTION_BLOCK, topk + kpool, kv_lora_rank].
QUERY_BLOCK = 256
POOL_BLOCK = 1024
ATTENTION_BLOCK = 64


class ReferenceForward:
    def __init__(self, batch: Batch, cache: PagedCache) -> None:
        self.batch = batch
        self.cache = cache
        self.n_rows = batch.token_ids.numel()
        self.token_ids = pad_rows(batch.token_ids)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        return pad_rows(x)

    # ----- products, norms, activations -----

    def linear(self, x: torch.Tensor, p: Projection, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        y = _per_linear(x.contiguous(), p.dense, p.outputs)
        return y if out_dtype is None else y.to(out_dtype)

    def shard_linear(self, x: torch.Tensor, p: Projection, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [T, K] (every shard's input), [S, T, K] (each shard's own) or [G, T, K] (input i for shards
        [i S / G, (i + 1) S / G)) -> [S, T, N]."""
        w = p.dense
        s = w.shape[0]
        if x.dim() == 3 and s % x.shape[0]:
            raise ValueError(f"{x.shape[0]} inputs for {s} shards")
        xs = [x[j * x.shape[0] // s] if x.dim() == 3 else x for j in range(s)]
        out = torch.stack([_per_linear(xj.contiguous(), w[j], p.outputs) for j, xj in enumerate(xs)])
        return out if out_dtype is None else out.to(out_dtype)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x.contiguous(), w, eps)

    def layer_norm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
        return layer_norm(x.contiguous(), w, b, eps)

    def swiglu_linear(self, gate_up: torch.Tensor, p: Projection, limit: float,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.shard_linear(moe.swiglu(gate.contiguous(), up.contiguous(), limit), p, out_dtype)

    # ----- hyper-connections -----

    def hc_pre(self, streams: torch.Tensor, hc: HyperConnectionParams, norm: torch.Tensor, eps: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the block's input: the streams collapsed by `pre` and normed, post, comb)."""
        pre, post, comb = mhc.hc_weights(streams, hc.fn, hc.base, hc.scale, eps=hc.eps, norm_eps=hc.norm_eps,
                                         iters=hc.iters)
        return rms_norm(mhc.collapse(streams, pre), norm, eps), post, comb

    def hc_post(self, partials: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                coll: Collective) -> torch.Tensor:
        return mhc.expand(coll.sum_partials(partials).to(streams.dtype), streams, post, comb)

    def hc_final(self, streams: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(streams.mean(dim=1), norm, eps)

    def logits(self, hidden: torch.Tensor, lm_head: Projection, coll: Collective) -> torch.Tensor:
        """fp32 logits of `batch.logit_rows` over the full vocabulary (the ranks' vocab columns gathered)."""
        rows = hidden[self.batch.logit_rows]
        return coll.gather_columns([linear(rows, w).float() for w in lm_head.dense])

    # ----- caches -----

    def write_rows(self, store: RowStore, values: torch.Tensor, tail: torch.Tensor | None = None) -> None:
        self.cache.write_rows(store, self.batch, values if tail is None else torch.cat([values, tail], dim=-1))

    # ----- KDA -----

    def kda_attention(self, attn: KdaParams, mixed: torch.Tensor, g_raw: torch.Tensor, beta_raw: torch.Tensor,
                      gate: torch.Tensor, norm_w: torch.Tensor, eps: float) -> torch.Tensor:
        """`_kda_core`, then each head's gated RMSNorm -> [S, T, heads * dv]."""
        core = self._kda_core(attn, mixed, g_raw, beta_raw)
        s, t, _ = core.shape
        h = attn.heads
        return torch.stack([gated_rms_norm(core[j].view(t, h, -1), gate[j].contiguous().view(t, h, -1), norm_w,
                                           eps).reshape(t, -1) for j in range(s)])

    def _kda_core(self, attn: KdaParams, mixed: torch.Tensor, g_raw: torch.Tensor, beta_raw: torch.Tensor
                  ) -> torch.Tensor:
        """The short conv and the KDA recurrence of every local shard -> core outputs [S, T, heads * dv]; caches
        move on (a verify window's per-row states wait in `cache.pending` for `KdaAttention.commit`)."""
        b, cache = self.batch, self.cache
        t = mixed.shape[1]
        conv_all, state_all = cache.conv_state[attn.layer], cache.kda_state[attn.layer]
        slots = torch.tensor(b.slots, device=mixed.device)
        fresh = torch.tensor([s == 0 for s in b.starts], device=mixed.device)
        offsets = b.offsets
        verify = [s for s in range(b.num_seqs) if b.is_verify(s)]
        decode = [s for s in range(b.num_seqs) if not b.is_prompt(s) and s not in verify]
        prefill = [s for s in range(b.num_seqs) if b.is_prompt(s)]
        pend_state = pend_conv = None
        if verify:
            # Verify windows: every row is a one-row decode step; each row's state (and conv history) is kept in
            # `cache.pending` until `commit` picks the last accepted row's. The slot itself is not touched here.
            longest = max(b.lengths[s] for s in verify)
            pend_state = torch.zeros(len(verify), longest, *state_all.shape[1:], dtype=state_all.dtype,
                                     device=mixed.device)
            pend_conv = torch.zeros(len(verify), longest, *conv_all.shape[1:], dtype=conv_all.dtype,
                                    device=mixed.device)
            cache.pending[attn.layer] = PendingStates(verify, [i * longest for i in range(len(verify))],
                                                      pend_state.flatten(0, 1), pend_conv.flatten(0, 1))
        cores = []
        for j in range(attn.shards):
            m = mixed[j].contiguous()
            chans = slice(j * m.shape[1], (j + 1) * m.shape[1])
            heads = slice(j * attn.heads, (j + 1) * attn.heads)
            g = _gate(attn, g_raw[j].contiguous(), j)
            beta = torch.sigmoid(beta_raw[j].contiguous())
            core = torch.zeros(t, attn.heads, attn.dl, dtype=torch.float32, device=mixed.device)
            step = _DecodeStep(attn, m, g, beta, j)
            if decode:
                sl, fr = slots[decode], fresh[decode]
                hist = torch.where(fr.view(-1, 1, 1), 0, conv_all[sl][:, :, chans])
                state = torch.where(fr.view(-1, 1, 1, 1), 0, state_all[sl][:, heads])
                core[[offsets[s] for s in decode]], conv_all[sl, :, chans], state_all[sl, heads] = step(
                    [offsets[s] for s in decode], hist, state)
            # Verify windows, step r: row r of every window that has one, as one decode group.
            for r in range(max((b.lengths[s] for s in verify), default=0)):
                group = [i for i, s in enumerate(verify) if b.lengths[s] > r]
                if r == 0:
                    sl, fr = slots[[verify[i] for i in group]], fresh[[verify[i] for i in group]]
                    hist = torch.where(fr.view(-1, 1, 1), 0, conv_all[sl][:, :, chans])
                    state = torch.where(fr.view(-1, 1, 1, 1), 0, state_all[sl][:, heads])
                else:
                    hist, state = pend_conv[group, r - 1][:, :, chans], pend_state[group, r - 1][:, heads]
                rows = [offsets[verify[i]] + r for i in group]
                core[rows], pend_conv[group, r, :, chans], pend_state[group, r, heads] = step(rows, hist, state)
            for s in prefill:
                rows = slice(offsets[s], offsets[s] + b.lengths[s])
                slot = b.slots[s]
                hist = conv_all[slot, :, chans] if b.starts[s] else torch.zeros_like(conv_all[slot, :, chans])
                conv = kda.causal_conv(m[rows], attn.conv_w[j], hist)
                conv_all[slot, :, chans] = kda.conv_history(m[rows], hist)
                q, k, v = (c.view(-1, attn.heads, attn.dl) for c in conv.chunk(3, dim=-1))
                state = state_all[slot, heads] if b.starts[s] else torch.zeros_like(state_all[slot, heads])
                core[rows], state_all[slot, heads] = kda.chunked(q, k, v, g[rows], beta[rows], state)
            cores.append(core.to(mixed.dtype).reshape(t, -1))
        return torch.stack(cores)

    # ----- MLA with the DSA indexer -----

    def dsa_select(self, ix: IndexerParams, x_parts: list[torch.Tensor], q_resid: torch.Tensor, layer: int
                   ) -> PositionSelection:
        """Write this batch's indexer rows (key, k-pool gate score), then each sequence's selected positions
        ([n, topk + kpool] ascending, -1 padded; a verify window: a list of [1, ...] per row, each row seeing what a
        decode at its position sees). x_parts: the layer input through wk, the k-pool gate and weights_proj."""
        b, cache = self.batch, self.cache
        wk_out, gate_out, w_out = (p.contiguous() for p in x_parts)
        store = cache.index_keys[layer]
        self.write_rows(store, layer_norm(wk_out, ix.k_norm_w, ix.k_norm_b, 1e-6), gate_out)
        q = self.linear(q_resid, ix.wq_b).view(-1, ix.heads, ix.dim)
        w = w_out.float() * (ix.heads ** -0.5)
        positions = b.positions
        out: PositionSelection = []
        for s, (off, n, start) in enumerate(zip(b.offsets, b.lengths, b.starts)):
            parts = [(off + r, 1, start + r) for r in range(n)] if b.is_verify(s) else [(off, n, start)]
            table = b.block_tables[s]
            per_part = []
            for o, m, st in parts:
                blocks = []
                for q0 in range(0, m, QUERY_BLOCK):
                    rows = slice(o + q0, o + min(m, q0 + QUERY_BLOCK))

                    def scores_of(p0: int, p1: int, rows: slice = rows) -> torch.Tensor:
                        keys, gates = cache.read_range(store, table, p0 * ix.kpool, p1 * ix.kpool).split(ix.dim, -1)
                        return dsa.index_scores(q[rows], w[rows], dsa.pool_keys(keys, gates, ix.ape, ix.kpool))

                    blocks.append(dsa.select_positions(scores_of, (st + m) // ix.kpool, positions[rows], ix.kpool,
                                                       ix.topk, ix.tail, POOL_BLOCK))
                per_part.append(torch.cat(blocks))
            out.append(per_part if b.is_verify(s) else per_part[0])
        return out

    def mla_attention(self, attn: MlaParams, q: torch.Tensor, chosen: PositionSelection) -> torch.Tensor:
        """q [S, T, heads * dn] -> every local head's attention output [S, T, heads * dv]: each query attends over
        its own selected positions' latent rows, gathered a block of rows at a time (verify rows one at a time,
        as one-row decodes), with kv_b folded into the query and the output (kernels/mla.py)."""
        b = self.batch
        store = self.cache.latent[attn.layer]
        spans = []  # (packed rows, their selected positions)
        for s, (off, n) in enumerate(zip(b.offsets, b.lengths)):
            if b.is_verify(s):
                spans += [(slice(off + r, off + r + 1), chosen[s][r]) for r in range(n)]
            else:
                spans += [(slice(off + i, off + min(i + ATTENTION_BLOCK, n)), chosen[s][i : i + ATTENTION_BLOCK])
                          for i in range(0, n, ATTENTION_BLOCK)]
        seq_of = b.row_seq.tolist()
        t = q.shape[1]
        outs = []
        for j in range(attn.shards):
            heads = slice(j * attn.heads, (j + 1) * attn.heads)
            qj = q[j].contiguous().view(t, attn.heads, attn.dn)
            out = torch.zeros(t, attn.heads, attn.dv, dtype=q.dtype, device=q.device)
            for rows, pos in spans:
                n = rows.stop - rows.start
                latent = self.cache.gather_positions(store, b.block_tables[seq_of[rows.start]], pos)
                # The kv_b products run on whole ATTENTION_BLOCK-row spans (a partial span zero-padded), as
                # `linear` does: torch's CPU GEMM picks its path for a few rows by the thread count (a rank at TP 2
                # has half the threads of one at TP 1), which moved the last rows of a chunk by an ulp.
                q_lat = torch.einsum("nhd,hdr->nhr", pad_rows(qj[rows].float(), ATTENTION_BLOCK),
                                     attn.w_uk[heads].float())[:n]
                o_lat = sparse_latent_attention(q_lat, latent, pos >= 0, attn.scale)
                out[rows] = torch.einsum("nhr,hvr->nhv", pad_rows(o_lat, ATTENTION_BLOCK),
                                         attn.w_uv[heads].float())[:n].to(q.dtype)
            outs.append(out.reshape(t, -1))
        return torch.stack(outs)

    # ----- MoE -----

    def moe(self, m: MoeParams, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """Routed experts (summed in expert-index order) + the shared expert, per local shard -> [S, T, D] fp32;
        plus `add` after the sum."""
        e = m.n_routed_experts
        if m.packed:
            raise RuntimeError("packed (quantized) experts run through the fused kernels only")
        ids, w = moe.route(x, m.router, m.bias, top_k=m.num_experts_per_tok, n_group=m.n_group,
                           topk_group=m.topk_group, norm_topk_prob=m.norm_topk_prob, scaling=m.routed_scaling_factor)
        width = m.gate.shape[1] // m.shards
        out = []
        for j in range(m.shards):
            g, u = (t[:, j * width : (j + 1) * width] for t in (m.gate, m.up))
            d = m.down[j * (e + 1) : (j + 1) * (e + 1)]
            routed = moe.experts(x, ids, w, g[:e], u[:e], d[:e], m.swiglu_limit)
            # the shared expert: dense experts always hold it last in each shard's stack (m.shared_in_stack)
            shared = linear(moe.swiglu(linear(x, g[e]), linear(x, u[e]), m.swiglu_limit), d[e]).float()
            out.append(routed + shared)
        stacked = torch.stack(out)
        return stacked if add is None else stacked + add


def _per_linear(x: torch.Tensor, w: torch.Tensor, outputs: list[int]) -> torch.Tensor:
    """One product per stored linear of a joined projection, outputs side by side: the reference's arithmetic does
    not depend on which linears the fused path reads together (torch's CPU GEMM takes another code path for a
    one-row weight, e.g. KDA's beta at one head per shard, than for that row inside a wider one)."""
    if len(outputs) == 1:
        return linear(x, w)
    return torch.cat([linear(x, part) for part in w.split(outputs)], dim=-1)


def _gate(attn: KdaParams, g_raw: torch.Tensor, j: int) -> torch.Tensor:
    """Per-channel log-decay g <= 0 of shard j: [T, heads, dk] fp32 (GLM's safe gate when a lower bound is set)."""
    g = (g_raw.float() + attn.dt_bias[j].float()).view(g_raw.shape[0], attn.heads, attn.dl)
    rate = attn.a_log[j].float().exp().view(1, attn.heads, 1)
    if attn.lower_bound is not None:
        return attn.lower_bound * torch.sigmoid(rate * g)
    return -rate * torch.nn.functional.softplus(g, threshold=20.0)


class _DecodeStep:
    """One recurrent step for a group of rows, one row per sequence: the arithmetic of every decode row (and of each
    verify row). The group is padded like every batch-wide tensor, so a row's bits do not depend on how many rows
    share the step."""

    def __init__(self, attn: KdaParams, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, j: int):
        self.attn, self.mixed, self.g, self.beta, self.j = attn, mixed, g, beta, j

    def __call__(self, rows: list[int], hist: torch.Tensor, state: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hist [n, K-1, C] conv history and state [n, heads, dk, dv] before the rows -> (core out [n, heads, dv],
        new conv history, new state)."""
        a = self.attn
        n = len(rows)
        idx = torch.tensor(rows, device=self.mixed.device)
        hist = pad_rows(hist)
        new = pad_rows(self.mixed[idx].unsqueeze(1))
        conv = kda.causal_conv(new, a.conv_w[self.j], hist).squeeze(1)
        q, k, v = (c.view(-1, a.heads, a.dl) for c in conv.chunk(3, dim=-1))
        out, state = kda.recurrent(q, k, v, pad_rows(self.g[idx]), pad_rows(self.beta[idx]), pad_rows(state))
        return out[:n], kda.conv_history(new, hist)[:n], state[:n]
