"""Feed-forward layers: the dense SwiGLU MLP (first layers) and the MoE (routed experts + shared expert).

Both are split by intermediate channels over virtual shards: gate/up column-parallel, down row-parallel, so each
shard returns a partial [T, D] that the caller reduces. The router is replicated (every rank routes identically).

A dense MLP keeps gate|up as one projection and down as another, stacked over the rank's local virtual shards. The
MoE keeps every shard's experts stacked with the shared expert last ([E+1, I, D] / [E+1, D, I]) so the grouped
kernels treat it as one more expert (kernels/gpu/moe.py); on CUDA quantized experts stay packed and the kernels
dequantize them tile by tile (integer experts: repacked for humming-kernels, kernels/gpu/int_moe.py), elsewhere
every expert is read dense (the reference's input).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from model import projection
from model.config import ModelConfig
from model.params import MoeParams
from model.projection import COLUMNS, ROWS
from model.weights import WeightReader

if TYPE_CHECKING:
    from model.forward import Forward


class DenseMlp:
    def __init__(self, gate_up: projection.Projection, down: projection.Projection, limit: float) -> None:
        if len(gate_up.outputs) != 2 or gate_up.outputs[0] != gate_up.outputs[1]:
            raise ValueError(f"a SwiGLU MLP's gate|up projection of {gate_up.outputs} outputs")
        self.gate_up, self.down, self.limit = gate_up, down, limit

    @classmethod
    def load(cls, cfg: ModelConfig, reader: WeightReader, prefix: str) -> "DenseMlp":
        return cls(projection.load(reader, [prefix + "gate_proj.weight", prefix + "up_proj.weight"], COLUMNS),
                   projection.load(reader, [prefix + "down_proj.weight"], ROWS), cfg.swiglu_limit)

    def forward(self, x: torch.Tensor, fwd: "Forward") -> torch.Tensor:
        """x [T, D] -> every local shard's partial [S, T, D] fp32."""
        return fwd.swiglu_linear(fwd.shard_linear(x, self.gate_up), self.down, self.limit, torch.float32)


class Moe:
    def __init__(self, cfg: ModelConfig, reader: WeightReader, prefix: str) -> None:
        p = prefix + "mlp."
        router = reader.full(p + "gate.weight")
        bias = reader.full(p + "gate.e_score_correction_bias")
        names = ("gate_proj", "up_proj", "down_proj")
        read = reader.split_packed if reader.device.type == "cuda" else reader.split
        routed = [[read(p + f"experts.{e}.{n}.weight", 0 if n != "down_proj" else 1)
                   for e in range(cfg.n_routed_experts)] for n in names]
        shared = [read(p + f"shared_experts.{n}.weight", 0 if n != "down_proj" else 1) for n in names]
        packed = not isinstance(routed[0][0][0], torch.Tensor)
        shards = len(shared[0])
        # The shared expert runs as a dense MLP beside the routed ones when it is not stored like them (packed
        # experts only); its partial is added after the routed sum, in the experts' combine launch.
        self.shared_apart: DenseMlp | None = None
        if not packed:
            gate, up, down = _dense_stacks(routed, shared, shards)
        else:
            gate, up, down, together = _packed_stacks(routed, shared, shards, reader.dtype)
            if not together:
                self.shared_apart = DenseMlp(projection.join(shared[:2], cut=COLUMNS),
                                             projection.join(shared[2:], cut=ROWS), cfg.swiglu_limit)
        self.params = MoeParams(
            router=router, bias=bias, gate=gate, up=up, down=down, shards=shards, packed=packed,
            shared_in_stack=self.shared_apart is None, n_routed_experts=cfg.n_routed_experts,
            num_experts_per_tok=cfg.num_experts_per_tok, n_group=cfg.n_group, topk_group=cfg.topk_group,
            norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor,
            swiglu_limit=cfg.swiglu_limit)

    def forward(self, x: torch.Tensor, fwd: "Forward") -> torch.Tensor:
        """x [T, D] -> every local shard's partial [S, T, D] fp32."""
        shared = self.shared_apart.forward(x, fwd) if self.shared_apart is not None else None
        return fwd.moe(self.params, x, add=shared)


# Experts are stored for one launch over every local virtual shard (kernels/gpu/moe.experts): gate / up [E+1, I_local,
# D] with the shards' I slices side by side, down [shards * (E+1), D, I_local / shards] shard-major; the shared
# expert last in each. The reference reads per-shard views of the same tensors.
def _dense_stacks(routed: list[list[list]], shared: list[list], shards: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate, up, down) of dense experts (routed[n][e][j]: linear n of expert e, shard j; shared[n][j])."""
    stacks = [[torch.stack([w[j] for w in ws + [sh]]) for j in range(shards)] for ws, sh in zip(routed, shared)]
    gate, up = (torch.cat(st, dim=1) for st in stacks[:2])
    return gate, up, torch.cat(stacks[2], dim=0)


def _packed_stacks(routed: list[list[list]], shared: list[list], shards: int, dtype: torch.dtype
                   ) -> tuple[Any, Any, Any, bool]:
    """(gate, up, down, whether the shared expert is in the stacks) of packed experts (CUDA): EXL3 stacks, integer
    experts prepared for humming-kernels (gate|up joined, up and down None), or stacks of another format."""
    from kernels.gpu import wtiles  # packed experts exist on CUDA only

    # The shared expert joins the routed stack when it is stored alike; else it runs as a dense MLP beside it.
    together = all(not isinstance(sh[0], torch.Tensor) and sh[0].format == ws[0][0].format
                   and dict(sh[0].params) == dict(ws[0][0].params) and sh[0].shape == ws[0][0].shape
                   for ws, sh in zip(routed, shared))
    stacks = []
    for ws, sh in zip(routed, shared):
        stacks.append([wtiles.stack_quantized([w[j] for w in ws + ([sh] if together else [])])
                       for j in range(shards)])
        ws.clear()  # the per-expert copies: a layer's experts are gigabytes, held once is enough
    from kernels.gpu import int_moe
    if stacks[0][0].fmt is wtiles.Fmt.EXL3:  # each shard's experts a block of all three stacks (moe.experts)
        gate, up, down = (wtiles.cat(st, dim=0) for st in stacks)
        return gate, up, down, together
    if int_moe.covers(stacks[0][0], stacks[1][0], stacks[2][0], dtype):
        # Integer experts run on humming-kernels (kernels/gpu/int_moe.py): gate|up joined along N, repacked once
        # for this GPU; each stored copy is dropped as soon as the next one exists (peak: two copies of gate|up).
        gate_up = wtiles.cat(stacks[0] + stacks[1], dim=1)
        down = wtiles.cat(stacks[2], dim=0)
        stacks.clear()
        return int_moe.prepare(gate_up, down, shards, dtype), None, None, together
    gate, up = (wtiles.cat(st, dim=1) for st in stacks[:2])
    return gate, up, wtiles.cat(stacks[2], dim=0), together


def build_ffn(cfg: ModelConfig, reader: WeightReader, prefix: str, layer: int) -> DenseMlp | Moe:
    if layer < cfg.num_hidden_layers and cfg.mlp_layer_types[layer] == "dense":
        return DenseMlp.load(cfg, reader, prefix + "mlp.")
    return Moe(cfg, reader, prefix)
