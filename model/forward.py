"""What a block calls: the ops of one forward pass, as a Protocol the blocks import without importing ops/.

A block (model/*.py) states its math once, as calls on a `Forward` bound to one batch and its caches. Two classes
implement it (ops/__init__.py picks one per device): `ops.reference.ReferenceForward` (the torch reference) and
`ops.fused.FusedForward` (the Triton kernels); tests/ops/test_forward_protocol.py checks that both have every op
below with these parameters. The ops take tensors, projections (model/projection.py) and parameter records
(model/params.py), never a block.

T = the forward's rows as the implementation lays them out (the reference pads them to a multiple of ROW_TILE, the
fused one orders them decode-class first); S = the rank's local virtual shards. Row-parallel partials come back
stacked per local shard ([S, T, D], fp32) for the collective to reduce.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from model.batch import Batch
    from model.cache import PagedCache
    from model.params import HyperConnectionParams, IndexerParams, KdaParams, MlaParams, MoeParams
    from model.parallel import Collective
    from model.projection import Projection
    from model.row_store import RowStore

# A full-indexer layer's DSA selection, in the form its implementation makes it (and only it reads back):
# the fused one: each row's selected k-pools [T, W] int32 ascending and their count [T] int32;
PoolSelection = tuple[torch.Tensor, torch.Tensor]
# the reference: per sequence its selected positions [n, topk + kpool] ascending, -1 padded (a verify window: a
# list of [1, topk + kpool], one per row).
PositionSelection = list[torch.Tensor | list[torch.Tensor]]
Selection = PoolSelection | PositionSelection
Selections = dict[int, Selection]  # full-indexer layer -> its selection, for the layers that share it


class Forward(Protocol):
    batch: Batch
    cache: PagedCache
    token_ids: torch.Tensor  # [T]
    n_rows: int  # real rows (the first n_rows of T)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """A per-row tensor of the batch's real rows, laid out like the rest ([T, ...])."""
        ...

    # ----- products, norms, activations -----

    def linear(self, x: torch.Tensor, p: Projection, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [T, K] through a replicated projection -> [T, N]."""
        ...

    def shard_linear(self, x: torch.Tensor, p: Projection, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [T, K] (every shard's input), [S, T, K] (each shard's own) or [G, T, K] (input i for shards
        [i S / G, (i + 1) S / G): a stacked projection's linears, model/projection.py `load_stacked`) -> [S, T, N]."""
        ...

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor: ...

    def layer_norm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor: ...

    def swiglu_linear(self, gate_up: torch.Tensor, p: Projection, limit: float,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """gate_up [S, T, 2I] (each shard's gate | up) -> the clamped SwiGLU of its halves [S, T, I] through the
        sharded projection p -> [S, T, N]."""
        ...

    # ----- hyper-connections -----

    def hc_pre(self, streams: torch.Tensor, hc: HyperConnectionParams, norm: torch.Tensor, eps: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, hc_mult, D] -> (the block's input [T, D], collapsed and normed by `norm`; post; comb)."""
        ...

    def hc_post(self, partials: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                coll: Collective) -> torch.Tensor:
        """The block's partials [S, T, D] reduced over the group and mixed back into the streams."""
        ...

    def hc_final(self, streams: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
        """The streams' mean, normed: the final hidden state [T, D]."""
        ...

    def logits(self, hidden: torch.Tensor, lm_head: Projection, coll: Collective) -> torch.Tensor:
        """fp32 logits of `batch.logit_rows` over the full vocabulary."""
        ...

    # ----- caches -----

    def write_rows(self, store: RowStore, values: torch.Tensor, tail: torch.Tensor | None = None) -> None:
        """Each row's values (then tail's columns, when given) at its cache position."""
        ...

    # ----- KDA -----

    def kda_attention(self, attn: KdaParams, mixed: torch.Tensor, g_raw: torch.Tensor, beta_raw: torch.Tensor,
                      gate: torch.Tensor, norm_w: torch.Tensor, eps: float) -> torch.Tensor:
        """The short conv, the KDA recurrence and the gated output RMSNorm (norm_w, eps) of every local shard
        -> [S, T, heads * dv], o_proj's input; the layer's conv history and state move on (a verify window's
        per-row states wait in `cache.pending` for the commit)."""
        ...

    # ----- MLA with the DSA indexer -----

    def dsa_select(self, ix: IndexerParams, x_parts: list[torch.Tensor], q_resid: torch.Tensor, layer: int
                   ) -> Selection:
        """Write this batch's indexer rows, then each row's selection. x_parts: the layer input through wk, the
        k-pool gate and weights_proj."""
        ...

    def mla_attention(self, attn: MlaParams, q: torch.Tensor, chosen: Selection) -> torch.Tensor:
        """q [S, T, heads * dn] -> [S, T, heads * dv], each row over its selection (made by this forward's
        `dsa_select`)."""
        ...

    # ----- MoE -----

    def moe(self, m: MoeParams, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, D] -> every local shard's partial [S, T, D] fp32 of the routed experts, with the shared expert
        when it is in their stack (m.shared_in_stack); plus `add` ([S, T, D] fp32: the shared expert's partial when
        it runs apart) after their sum."""
        ...
