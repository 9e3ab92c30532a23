"""The fused ops: the fixed-schedule Triton kernels of kernels/gpu, bound to one forward (docs/design.md §5.1).

No host sync inside a forward, so a CUDA graph can capture it (model/cuda_graphs.py builds a `FusedForward` over
static buffers). Rows come decode-class first (`GpuRows`): every kernel runs each row class with its own fixed
schedule on a contiguous run of rows.

Virtual shards: every local shard runs in one launch per op. Column-parallel projections are one batched GEMM over
the shards' stacked weights with the input broadcast, and each batch element runs the one-shard (N, K) schedule
(kernels/gpu/gemm.py), so a shard's bits are those of its own product whatever the number of shards in the launch
(TP=1 runs 4, TP=2 two) — never one wider [S x N, K] product, whose tiles and K split could differ.
"""

from __future__ import annotations

import functools
import logging

import torch

from kernels import kda
from kernels.gpu import arch as gpu_arch, fp8_dense, gemm
from kernels.gpu import kda as gpu_kda
from kernels.gpu import mhc as gpu_mhc
from kernels.gpu import mla as gpu_mla
from kernels.gpu import mla_expanded as gpu_mla_expanded
from kernels.gpu import moe as gpu_moe
from kernels.gpu import norms as gpu_norms
from kernels.gpu import rows as gpu_rows
from kernels.gpu import swiglu as gpu_swiglu
from kernels.gpu import to_device
from model.batch import Batch
from model.cache import PagedCache, PendingStates
from model.forward import PoolSelection
from model.params import HyperConnectionParams, IndexerParams, KdaParams, MlaParams, MoeParams
from model.parallel import Collective
from model.projection import Projection
from model.row_store import RowStore
from ops import expanded_rows
from ops.expanded_rows import ExpandedRows
from ops.fused_rows import CONV_HISTORY, GpuRows, build

log = logging.getLogger("twinspark.rank")


class FusedForward:
    def __init__(self, batch: Batch, cache: PagedCache, rows: GpuRows | None = None) -> None:
        """rows: a prepared description (a CUDA graph's static one); by default built from the batch."""
        self.batch = batch
        self.cache = cache
        self.rows = rows or build(batch, kpool=cache.kpool)
        self.n_rows = self.rows.n_rows
        self.token_ids = batch.token_ids
        self._expanded: dict[int, ExpandedRows | None] = {}  # MLA's expanded-form rows by `dense_until`
        self._blocks: torch.Tensor | None = None  # the indexer's prompt-row scoring blocks

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        return x

    # ----- products, norms, activations -----

    def linear(self, x: torch.Tensor, p: Projection, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return project(x.unsqueeze(0), p, self.rows.decode_rows, out_dtype)[0]

    def shard_linear(self, x: torch.Tensor, p: Projection, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [T, K] (broadcast to every shard), [S, T, K] or [G, T, K] (one input per G-th of the shards: a stacked
        projection) -> [S, T, N]."""
        return project(_per_shard(x, p), p, self.rows.decode_rows, out_dtype)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return gpu_norms.rms_norm(x, w, eps)

    def layer_norm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
        return gpu_norms.layer_norm(x, w, b, eps)

    def swiglu_linear(self, gate_up: torch.Tensor, p: Projection, limit: float,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The SwiGLU applied as the product loads its input (gemm.bmm's `swiglu`: no launch of its own, the bits of
        the SwiGLU kernel's output) when p is one operand our GEMM reads; else the SwiGLU kernel, then p."""
        part = p.parts[0]
        if len(p.parts) == 1 and gemm.reads_swiglu(part):
            return gemm.bmm(gate_up, part, self.rows.decode_rows, out_dtype, swiglu=limit)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.shard_linear(gpu_swiglu.swiglu(gate, up, limit), p, out_dtype)

    # ----- hyper-connections -----

    def hc_pre(self, streams: torch.Tensor, hc: HyperConnectionParams, norm: torch.Tensor, eps: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block input normed by `norm`, post, comb) in two launches (kernels/gpu/mhc.py)."""
        return gpu_mhc.pre(streams, hc.fn, hc.base, hc.scale, norm, rms_eps=eps, decode_rows=self.rows.decode_rows,
                           eps=hc.eps, norm_eps=hc.norm_eps, iters=hc.iters)

    def hc_post(self, partials: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                coll: Collective) -> torch.Tensor:
        return gpu_mhc.post(coll.gather_partials(partials), streams, post, comb)

    def hc_final(self, streams: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
        # The streams' mean as adds in stream order (a torch mean reduces in a shape-chosen order), then the norm.
        return gpu_norms.mean_rms_norm(streams, norm, eps)

    def logits(self, hidden: torch.Tensor, lm_head: Projection, coll: Collective) -> torch.Tensor:
        """fp32 logits of `batch.logit_rows` over the full vocabulary: decode-class rows with the decode schedule and
        prompt rows with theirs, returned in logit_rows' order; every local vocab shard in one batched GEMM."""
        wanted = self.batch.logit_rows.cpu()  # host indices (the executor builds them on the host: no sync there)
        if torch.equal(wanted, torch.arange(hidden.shape[0])):  # every row, in order (a decode graph's batch)
            return coll.gather_columns(self.shard_linear(hidden, lm_head, torch.float32))
        decode = wanted < self.rows.decode_rows
        order = torch.sort((~decode).to(torch.int8), stable=True).indices
        # The row indices go over asynchronously: a plain .to(device) copy from pageable memory waited for every
        # kernel queued before it, so the GPU drained and then idled while the host launched the logits (the gap it
        # left at the end of a prefill: docs/benchmarks.md, "Host work").
        picked = hidden[to_device(wanted[order], hidden.device)]
        logits = coll.gather_columns(project(_per_shard(picked, lm_head), lm_head, int(decode.sum()), torch.float32))
        if torch.equal(order, torch.arange(order.numel())):
            return logits
        out = torch.empty_like(logits)
        out[to_device(order, logits.device)] = logits
        return out

    # ----- caches -----

    def write_rows(self, store: RowStore, values: torch.Tensor, tail: torch.Tensor | None = None) -> None:
        """Each row's values (then tail's columns, when given) at its cache position, in one launch."""
        rows = self.rows
        gpu_rows.write(store.data, store.scale, rows.tables, rows.positions, rows.row_seq, values, tail)

    # ----- KDA -----

    def kda_attention(self, attn: KdaParams, mixed: torch.Tensor, g_raw: torch.Tensor, beta_raw: torch.Tensor,
                      gate: torch.Tensor, norm_w: torch.Tensor, eps: float) -> torch.Tensor:
        """Decode and verify rows through the fused recurrent kernel, which norms them too (one launch); prompt
        chunks through fla-core's chunk_kda, then the gated norm kernel -> [S, T, heads * dv]."""
        rows, cache = self.rows, self.cache
        d, s, t = rows.decode_rows, mixed.shape[0], mixed.shape[1]
        conv_all, state_all = cache.conv_state[attn.layer], cache.kda_state[attn.layer]
        pend_state = pend_conv = None
        if rows.verify:  # every row's state until `commit` keeps the last accepted one (as the reference)
            if rows.pending is not None:
                pend_state, pend_conv = rows.pending[attn.layer]
            else:
                pend_state = torch.empty(d, *state_all.shape[1:], dtype=state_all.dtype, device=mixed.device)
                pend_conv = torch.empty(d, *conv_all.shape[1:], dtype=conv_all.dtype, device=mixed.device)
            cache.pending[attn.layer] = PendingStates(rows.verify, rows.verify_rows, pend_state, pend_conv)
        core = torch.empty(s, t, attn.heads * attn.dl, dtype=mixed.dtype, device=mixed.device)
        out = torch.empty_like(core)
        gpu_kda.decode(rows.kda, mixed=mixed, conv_w=attn.conv_w, conv_state=conv_all, chan_off=0, g_raw=g_raw,
                       dt_bias=attn.dt_bias, a_log=attn.a_log, lower_bound=attn.lower_bound, beta_raw=beta_raw,
                       state=state_all, head_off=0, gate=gate, norm_w=norm_w, eps=eps, core=core, out=out,
                       pend_state=pend_state, pend_conv=pend_conv)
        if rows.prompt is not None:
            self._kda_prompt(attn, mixed[:, d:], g_raw[:, d:], beta_raw[:, d:], core[:, d:])
            gpu_kda.gated_norm(core[:, d:], gate[:, d:], norm_w, eps, out=out[:, d:])
        return out

    def _kda_prompt(self, attn: KdaParams, mixed: torch.Tensor, g_raw: torch.Tensor, beta_raw: torch.Tensor,
                    core: torch.Tensor) -> None:
        """Prompt chunks of every local shard ([S, prompt rows, ...] operands): the short conv over all of their
        rows, then chunked KDA from their slots' states (zero for a fresh sequence) into `core`; states and
        histories move on in place."""
        p = self.rows.prompt
        conv_all, state_all = self.cache.conv_state[attn.layer], self.cache.kda_state[attn.layer]
        s, width = attn.shards, attn.width
        conv = gpu_kda.prompt_conv(mixed, attn.conv_w, conv_all, 0, p.row_first, p.row_slot, p.row_fresh)
        # then each slot's history moves on to its chunk's last inputs, every sequence and shard at once (a loop over
        # the sequences cost ~5 host ops a sequence and layer: ~5,000 for 32 prompts on the whole model)
        old = conv_all[p.slots].masked_fill(p.fresh.view(-1, 1, 1), 0)  # a fresh sequence's past is zeros
        old = old.view(-1, s, width)[p.hist_old].to(mixed.dtype)  # [P*3, S, 3C]
        new = torch.where(p.hist_new.view(-1, 1, 1), mixed[:, p.hist_row].transpose(0, 1), old)
        conv_all[p.slots] = new.reshape(-1, CONV_HISTORY, s * width).to(conv_all.dtype)
        init = torch.where(p.fresh.view(-1, 1, 1, 1), 0.0, state_all[p.slots])
        # fla-core's chunk_kda runs once per shard: its kernels autotune their configs (some change the K split) keyed
        # on the head count, so one call over every local shard's heads could take another schedule at TP=1 (4
        # shards' heads) than at TP=2 (2 shards'), and TP=1 = TP=2 would no longer hold by construction.
        h, dl = attn.heads, attn.dl
        for j in range(s):
            heads = slice(j * h, (j + 1) * h)
            q, k, v = (conv[j, i].view(1, -1, h, dl) for i in range(3))
            out, final = _chunk_kda(q, k, v, g_raw[j].reshape(1, -1, h, dl), beta_raw[j].reshape(1, -1, h),
                                    init[:, heads], p.cu_seqlens, p.cu_seqlens_host, attn.a_log[j], attn.dt_bias[j],
                                    attn.lower_bound)
            state_all[:, heads].index_copy_(0, p.slots, final)
            core[j] = out.reshape(-1, h * dl)

    # ----- MLA with the DSA indexer -----

    def dsa_select(self, ix: IndexerParams, x_parts: list[torch.Tensor], q_resid: torch.Tensor, layer: int
                   ) -> PoolSelection:
        """Write this batch's index rows and completed pool keys, then each row's selected pools (pools [T, W]
        int32 ascending, count [T] int32)."""
        if not ix.tail:  # the attention kernel always appends the tail pool, as every GLM release does
            raise NotImplementedError("the fused path needs index_kpool_always_select_tail")
        rows, cache = self.rows, self.cache
        wk_out, gate_out, w_out = x_parts
        store = cache.index_keys[layer]
        key = gpu_norms.layer_norm(wk_out, ix.k_norm_w, ix.k_norm_b, 1e-6)
        self.write_rows(store, key, gate_out)
        pooled = cache.pooled[layer]
        gpu_mla.write_pools(store.data, store.scale, pooled, ix.ape, rows.tables, rows.positions, rows.row_seq,
                            ix.kpool)
        keep = ix.topk // ix.kpool
        if rows.max_pools <= keep:  # every row sees at most `keep` pools: it takes them all, no scores needed
            return gpu_mla.select_pools(None, rows.positions, ix.kpool, keep, rows.max_pools)
        q = self.linear(q_resid, ix.wq_b).view(q_resid.shape[0], ix.heads, ix.dim)
        w = w_out.float() * (ix.heads ** -0.5)

        blocks = self._score_blocks()

        def scores_of(p0: int, p1: int) -> torch.Tensor:  # one tile of pools at a time: memory flat in the context
            return gpu_mla.index_scores(q, w, pooled, rows.tables, rows.positions, rows.row_seq, ix.kpool, p1,
                                        first=p0, decode_rows=rows.decode_rows, blocks=blocks)
        return gpu_mla.select_pools(scores_of, rows.positions, ix.kpool, keep, rows.max_pools)

    def _score_blocks(self) -> torch.Tensor | None:
        """The prompt rows' scoring blocks (kernels/gpu/mla.score_blocks), built once a forward."""
        if self._blocks is None and self.rows.prompt is not None:
            b, seqs = self.batch, self.rows.prompt.seqs
            host = gpu_mla.score_blocks([b.starts[s] for s in seqs], [b.lengths[s] for s in seqs],
                                        self.rows.decode_rows)
            self._blocks = to_device(host, self.token_ids.device)
        return self._blocks

    def mla_attention(self, attn: MlaParams, q: torch.Tensor, chosen: PoolSelection) -> torch.Tensor:
        """q [S, T, heads * dn] -> [S, T, heads * dv]. The per-head products run as one batch over all local heads,
        and the attention kernels work on each head alone, so every shard gets the bits of its own launch. Prompt
        rows whose selection is their whole context take the expanded form (ops/expanded_rows.py), the rest the
        latent form."""
        s, t, _ = q.shape
        h = attn.heads
        q = q.view(s, t, h, attn.dn).transpose(1, 2).reshape(s * h, t, attn.dn)  # every local head a batch
        plan = self._expanded_plan(attn.dense_until)
        if plan is None:
            out = self._latent_form(attn, q, chosen, slice(None))
        else:
            out = torch.empty(s * h, t, attn.dv, dtype=q.dtype, device=q.device)
            rows = plan.latent_rows
            if isinstance(rows, torch.Tensor):
                out.index_copy_(1, rows, self._latent_form(attn, q.index_select(1, rows), chosen, rows))
            elif rows:
                out[:, :rows] = self._latent_form(attn, q[:, :rows], chosen, slice(0, rows))
            self._expanded_form(attn, q, out, plan)
        return out.view(s, h, t, attn.dv).transpose(1, 2).reshape(s, t, h * attn.dv)

    def _expanded_plan(self, until: int) -> ExpandedRows | None:
        """The batch's expanded-form rows (the same for every MLA layer of the forward: built once)."""
        if until not in self._expanded:
            bm = gpu_mla_expanded.tile_for(gpu_arch.row(self.rows.positions.device))["BM"]
            self._expanded[until] = expanded_rows.plan(self.batch, self.rows.tables, until, self.cache.block_size, bm)
        return self._expanded[until]

    def _latent_form(self, attn: MlaParams, q: torch.Tensor, chosen: PoolSelection, pick: slice | torch.Tensor
                     ) -> torch.Tensor:
        """Attention of the rows `pick` (the decode-class rows among them first) over their selections' latent rows,
        with W_uk folded into the query and W_uv into the output: q [S h, n, dn] -> [S h, n, dv]."""
        rows = self.rows
        d = rows.decode_rows
        latent = self.cache.latent[attn.layer]
        sel, count = chosen[0][pick], chosen[1][pick]
        kpool = self.cache.kpool
        max_positions = min(sel.shape[1], rows.max_pools) * kpool + kpool
        q_lat = gemm.bmm(q, attn.w_uk.transpose(1, 2), d)  # [S h, n, r]
        o_lat = torch.empty(q.shape[1], q.shape[0], attn.r, dtype=q.dtype, device=q.device)
        gpu_mla.sparse_attention(q_lat.transpose(0, 1), latent.data, latent.scale, rows.tables, rows.positions[pick],
                                 rows.row_seq[pick], sel, count, kpool, attn.scale, o_lat, d, max_positions)
        return gemm.bmm(o_lat.transpose(0, 1), attn.w_uv, d)  # [S h, n, dv]

    def _expanded_form(self, attn: MlaParams, q: torch.Tensor, out: torch.Tensor, plan: ExpandedRows) -> None:
        """The plan's rows into `out` ([S h, T, dv]): per group, its sequences' latent rows read as the latent
        kernel reads them (fp8 scaled back per row in fp32), expanded to every local head's keys and values by one
        product (prompt schedule), then causal attention."""
        latent = self.cache.latent[attn.layer]
        data = latent.data.view(-1, attn.r)
        for group in plan.groups:
            lat = data.index_select(0, group.key_rows)
            if latent.scale is not None:
                scale = latent.scale.view(-1).index_select(0, group.key_rows)
                lat = (lat.float() * scale.unsqueeze(1)).to(q.dtype)
            kv = gemm.bmm(lat.unsqueeze(0).expand(q.shape[0], -1, -1), attn.w_kv, 0)  # [S h, L, dn + dv]
            gpu_mla_expanded.attend(q, kv, out, group.tiles, attn.scale)

    # ----- MoE -----

    def moe(self, m: MoeParams, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """Every local shard's partial [S, T, D] fp32: routing and the grouped experts (the shared expert as one more
        expert when it is stored like them: m.shared_in_stack; else the block computes it first and hands it in as
        `add`, which the experts' combine adds after the routed sum)."""
        d = self.rows.decode_rows
        if m.n_group > 1:  # grouped routing has no fused kernel (GLM-5.3-Flash routes with one group)
            raise NotImplementedError("the fused MoE routes with n_group == 1 only")
        logits = gemm.matmul(x, m.router, d, torch.float32)
        grouping = gpu_moe.grouping(x, m.gate, d, m.shards)  # a decode step's: built in the routing's launch
        ids, w = gpu_moe.route(logits, m.bias, top_k=m.num_experts_per_tok, norm_topk_prob=m.norm_topk_prob,
                               scaling=m.routed_scaling_factor, n_real=self.rows.n_real, shared=m.shared_in_stack,
                               grouping=grouping)
        return gpu_moe.experts(x, ids, w, m.gate, m.up, m.down, m.swiglu_limit, d, shards=m.shards,
                               grouping=grouping, add=add)


def project(x: torch.Tensor, p: Projection, decode_rows: int, out_dtype: torch.dtype | None) -> torch.Tensor:
    """x [B / G, M, K] (each input feeding G consecutive shards: gemm.bmm) through every part of `p` ([B, N_i, K]
    each) -> [B, M, N], each part's columns written in place; rows [0, decode_rows) with the decode schedule, the
    rest with the prompt one (kernels/gpu/gemm.py; a run repacked for humming, model/rest_kernel.py:
    kernels/gpu/fp8_dense.py)."""
    if len(p.parts) == 1:
        return _bmm(p.parts[0])(x, p.parts[0], decode_rows, out_dtype)
    out = torch.empty(p.shards, x.shape[1], p.n, dtype=out_dtype or x.dtype, device=x.device)
    lo = 0
    for part, width in zip(p.parts, p.widths):
        _bmm(part)(x, part, decode_rows, out_dtype, out=out[..., lo : lo + width])
        lo += width
    return out


def _bmm(part: object):
    """The batched product that reads `part`."""
    return fp8_dense.bmm if isinstance(part, fp8_dense.Fp8Dense) else gemm.bmm


def _per_shard(x: torch.Tensor, p: Projection) -> torch.Tensor:
    """A sharded projection's input [S, T, K]: x itself, or x [T, K] broadcast to every shard."""
    return x if x.dim() == 3 else x.unsqueeze(0).expand(p.shards, -1, -1)


def _chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g_raw: torch.Tensor, beta_raw: torch.Tensor,
               init: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_host: torch.Tensor, a_log: torch.Tensor,
               dt_bias: torch.Tensor, lower_bound: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """fla-core's chunked KDA over varlen sequences with GLM's gate, beta and l2 norms inside the kernel
    -> (out [1, T, H, dv] in the input dtype, final states [N, H, dk, dv] fp32). Without fla-core (or off CUDA,
    where the Triton kernels run in the test interpreter) the torch twin runs sequence by sequence.
    cu_seqlens_host: the offsets on the host (the same host tensor for every call of a round: fla-core caches
    what it derives from them by identity)."""
    chunk_kda = _fla_chunk_kda() if q.is_cuda else None
    if chunk_kda is None:
        return _chunk_kda_twin(q, k, v, g_raw, beta_raw, init, cu_seqlens_host, a_log, dt_bias, lower_bound)
    return chunk_kda(q, k, v, g_raw, beta_raw, initial_state=init.contiguous(), output_final_state=True,
                     cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_host, use_qk_l2norm_in_kernel=True,
                     use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=lower_bound is not None,
                     lower_bound=lower_bound, A_log=a_log, dt_bias=dt_bias)


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
    """`_chunk_kda` by the torch reference (kernels/kda.py), with the gate and beta as the reference computes them."""
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
