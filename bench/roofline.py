"""The two ceilings (HBM copy bandwidth, bf16 matmul rate), measured, and the model's ideal bytes / FLOPs.

docs/reference.md §5: speed is reported as a fraction of the roofline, and the ceilings are measured in the same run.
- decode is bandwidth-bound: ideal time = bytes a step must move (the weights it touches + the cache and KDA state
  it reads and writes) / measured copy bandwidth.
- prefill is compute-bound: ideal time = FLOPs (2 x active params x tokens + attention) / measured matmul rate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from bench.random_weights import keeps_fp32, text_tensors
from bench.timing import median, time_calls
from model.row_store import row_bytes
from model.checkpoint.spec import KDA, TinySpec
from model.checkpoint.weights import TEXT

EMBED_KEY = TEXT + "embed_tokens.weight"
LM_HEAD_KEY = "lm_head.weight"


# ----- ceilings -----

def hbm_copy_bandwidth(device: torch.device, *, nbytes: int = 4 << 30, iters: int = 20, warmup: int = 3) -> dict:
    """Device-to-device copy of `nbytes`: (bytes read + bytes written) / time."""
    n = nbytes // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = time_calls(lambda i: dst.copy_(src), warmup=warmup, iters=iters, device=device)
    ms = median(times)
    moved = 2 * n * 2
    del src, dst
    return {"bytes_per_copy": n * 2, "bytes_moved": moved, "median_ms": ms, "iters": iters,
            "bytes_per_s": moved / (ms / 1e3)}


def matmul_rate(device: torch.device, *, n: int = 8192, dtype: torch.dtype = torch.bfloat16, iters: int = 20,
                warmup: int = 3) -> dict:
    """n x n x n matmul: 2 n^3 / time."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    times = time_calls(lambda i: torch.matmul(a, b, out=out), warmup=warmup, iters=iters, device=device)
    ms = median(times)
    del a, b, out
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "median_ms": ms, "iters": iters,
            "flops_per_s": 2 * n ** 3 / (ms / 1e3)}


# ----- what the model must move / compute -----

@dataclass(frozen=True)
class ParamCounts:
    """Parameters (and their bytes at the run's dtype) by how often a step touches them."""

    always: int  # every non-expert, non-embedding weight, lm_head included
    always_bytes: int
    expert: int  # one routed expert (gate + up + down)
    expert_bytes: int
    lm_head: int
    lm_head_bytes: int
    embed_row_bytes: int  # one embedding row
    moe_layers: int
    total: int  # every text tensor stored
    total_bytes: int


def param_counts(spec: TinySpec, dtype: torch.dtype, stored: Mapping[str, int] | None = None) -> ParamCounts:
    """stored: bytes per key as the model holds them (a packed recipe's, `RandomWeightReader.stored_bytes`); keys
    not in it count at `dtype` (fp32 where the model keeps fp32)."""
    item = torch.empty((), dtype=dtype).element_size()
    always = always_b = expert = expert_b = head = head_b = total = total_b = 0
    first_expert = None
    stored = stored or {}
    for t in text_tensors(spec):
        nb = stored.get(t.key, t.numel * (4 if keeps_fp32(t.key) else item))
        total += t.numel
        total_b += nb
        if t.key == EMBED_KEY:
            continue
        if ".mlp.experts." in t.key:
            ident = t.key.split(".mlp.experts.", 1)
            layer_expert = (ident[0], ident[1].split(".", 1)[0])
            if first_expert is None:
                first_expert = layer_expert
            if layer_expert == first_expert:
                expert += t.numel
                expert_b += nb
            continue
        always += t.numel
        always_b += nb
        if t.key == LM_HEAD_KEY:
            head, head_b = t.numel, nb
    moe = sum(1 for m in spec.mlp_layer_types if m == "sparse")
    return ParamCounts(always, always_b, expert, expert_b, head, head_b, spec.hidden_size * item, moe, total, total_b)


def decode_bytes(spec: TinySpec, dtype: torch.dtype, contexts: list[int], experts_hit: list[int],
                 kv_dtype: torch.dtype | None = None, stored: Mapping[str, int] | None = None) -> dict:
    """Bytes one decode step over len(contexts) sequences must move at least.

    contexts: per sequence, the cached positions it attends (its start); experts_hit: per MoE layer, the distinct
    routed experts the batch's real rows chose; kv_dtype: how the latent / indexer rows are stored (None: dtype);
    stored: the weights' bytes per key as the model holds them (`param_counts`).
    """
    item = torch.empty((), dtype=dtype).element_size()
    pc = param_counts(spec, dtype, stored)
    b = len(contexts)
    weights = pc.always_bytes + pc.expert_bytes * sum(experts_hit) + pc.embed_row_bytes * b
    params = pc.always + pc.expert * sum(experts_hit) + spec.hidden_size * b
    kda_layers = sum(1 for t in spec.layer_types if t == KDA)
    mla_layers = len(spec.layer_types) - kda_layers
    full_layers = sum(1 for t, i in zip(spec.layer_types, spec.indexer_types) if t != KDA and i == "full")
    heads, d = spec.linear_num_heads, spec.linear_head_dim
    # KDA: fp32 state read + written, conv history (K-1 rows of q|k|v channels) read + written, per sequence.
    kda = kda_layers * b * 2 * (heads * d * d * 4 + (spec.linear_conv_kernel_dim - 1) * 3 * heads * d * item)
    # MLA: the latent rows of the context read (+ the new row written); indexer keys + gate scores likewise.
    rows = sum(c + 1 for c in contexts)
    stored = kv_dtype or dtype
    mla = mla_layers * rows * row_bytes(spec.kv_lora_rank, stored) + \
        full_layers * rows * row_bytes(2 * spec.index_head_dim, stored)
    return {"weight_params": params, "weight_bytes": weights, "state_bytes": kda, "cache_bytes": mla,
            "total_bytes": weights + kda + mla}


def _dsa_pairs(spec: TinySpec, n: int) -> tuple[int, int]:
    """(query-key pairs MLA attends, query-pool pairs the indexer scores) over one causal prompt of n tokens."""
    k, keep = spec.index_kpool, spec.index_topk // spec.index_kpool
    attended = scored = 0
    for t in range(n):
        pools = (t + 1) // k
        attended += min(keep, pools) * k + (t + 1) % k
        scored += pools
    return attended, scored


def prefill_flops(spec: TinySpec, dtype: torch.dtype, tokens: int) -> dict:
    """FLOPs of one prefill of `tokens` tokens (one sequence, logits for the last row only).

    2 x active params x tokens (top-k + shared experts; lm_head for one row) + attention: MLA 2 h (dn + dv) per
    attended (query, key) pair with the DSA selection (top-k pools + the tail), the indexer 2 h_i d_i per scored
    (query, pool) pair, KDA ~6 dk dv per head per token (S^T k, k delta^T, S^T q).
    """
    pc = param_counts(spec, dtype)
    active = pc.always - pc.lm_head + pc.moe_layers * spec.num_experts_per_tok * pc.expert
    linear = 2 * active * tokens + 2 * pc.lm_head
    kda_layers = sum(1 for t in spec.layer_types if t == KDA)
    mla_layers = len(spec.layer_types) - kda_layers
    full_layers = sum(1 for t, i in zip(spec.layer_types, spec.indexer_types) if t != KDA and i == "full")
    attended, scored = _dsa_pairs(spec, tokens)
    mla = mla_layers * attended * 2 * spec.num_attention_heads * (spec.qk_nope_head_dim + spec.v_head_dim)
    indexer = full_layers * scored * 2 * spec.index_n_heads * spec.index_head_dim
    kda = kda_layers * tokens * 6 * spec.linear_num_heads * spec.linear_head_dim ** 2
    return {"active_params_per_token": active, "linear_flops": linear, "attention_flops": mla + indexer + kda,
            "total_flops": linear + mla + indexer + kda}
