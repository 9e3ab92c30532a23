"""The parameter records a block hands its ops: exactly what an op reads, frozen once the block has loaded them.

A block (model/*.py) owns its weights and states its math as calls on a `Forward` (model/forward.py). Where an op
needs more than a tensor or a projection (KDA's recurrence, the indexer's selection, MLA's attention, the MoE, mHC),
the block passes one of these records, never itself: the ops (ops/) then depend on this file alone, not on the
blocks, and a record says in one place what each op reads. Records compare by identity (eq=False): their fields are
tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from model.projection import Projection

if TYPE_CHECKING:
    from kernels.gpu.int_moe import IntExperts
    from kernels.gpu.wtiles import WeightArgs


@dataclass(frozen=True, eq=False)
class HyperConnectionParams:
    """The learned mixing of the hc_mult residual streams around one block (kernels/mhc.py has the math)."""
    fn: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor
    eps: float  # added to the mixing weights and the Sinkhorn sums
    norm_eps: float  # the streams' RMS norm inside the mixing weights
    iters: int  # Sinkhorn iterations


@dataclass(frozen=True, eq=False)
class KdaParams:
    """What KDA's short conv and recurrence read (`kda_attention`), stacked over the rank's local virtual shards."""
    layer: int  # the cache's key for this layer's conv history and state
    shards: int  # local virtual shards
    heads: int  # heads per shard
    dl: int  # head dim (dk = dv)
    width: int  # q|k|v channels of one shard (3C): the conv's input, beta's columns follow
    conv_w: torch.Tensor  # [S, 3C, K] per shard (q, k, v) channels, as the conv state lays them out
    dt_bias: torch.Tensor  # [S, heads * dk]
    a_log: torch.Tensor  # [S, heads]
    lower_bound: float | None  # GLM's safe gate, or None for the softplus gate


@dataclass(frozen=True, eq=False)
class IndexerParams:
    """The DSA indexer's weights and shape (`dsa_select`); its input projections are part of the layer's."""
    wq_b: Projection
    k_norm_w: torch.Tensor
    k_norm_b: torch.Tensor
    ape: torch.Tensor  # the k-pool compression's position embedding
    heads: int
    dim: int
    kpool: int
    topk: int
    tail: bool  # every row also selects its own (incomplete) tail pool


@dataclass(frozen=True, eq=False)
class MlaParams:
    """What MLA's sparse attention reads (`mla_attention`): kv_b split per head, stacked over the local shards."""
    layer: int  # the cache's key for this layer's latent rows
    shards: int
    heads: int  # heads per shard
    dn: int  # qk nope head dim
    dv: int  # v head dim
    r: int  # kv_lora_rank: the latent's width
    scale: float  # the softmax scale
    # The first position whose DSA selection can leave a position out: rows before it attend to their whole context.
    dense_until: int
    # kv_b rows per head [k_nope (dn) | v (dv)], shard-major: W_kv [S h, dn + dv, r] and its views W_uk [S h, dn, r],
    # W_uv [S h, dv, r] (the latent form folds them into query and output, the expanded form reads both at once).
    w_kv: torch.Tensor
    w_uk: torch.Tensor
    w_uv: torch.Tensor


@dataclass(frozen=True, eq=False)
class MoeParams:
    """The router and the experts of one MoE layer (`moe`), and the config values its routing and SwiGLU take.

    Experts are stacked over every local shard with the shared expert last in each shard's stack when it is stored
    like them (model/ffn.py says how); when it is not, the block runs it apart and `shared_in_stack` is False."""
    router: torch.Tensor  # [E, D]
    bias: torch.Tensor  # [E] e_score_correction_bias
    # dense tensors (the reference's input), packed stacks (kernels/gpu/wtiles), or integer experts prepared for
    # humming-kernels (gate|up joined in `gate`, `up` and `down` None: kernels/gpu/int_moe.py)
    gate: torch.Tensor | WeightArgs | IntExperts
    up: torch.Tensor | WeightArgs | None
    down: torch.Tensor | WeightArgs | None
    shards: int
    packed: bool  # stored quantized (CUDA): only the fused kernels read them
    shared_in_stack: bool
    n_routed_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
