"""Feed-forward layers: the dense SwiGLU MLP (first layers) and the MoE (routed experts + shared expert).

Both are split by intermediate channels over virtual shards: gate/up column-parallel, down row-parallel, so each
shard returns a partial [T, D] that the caller reduces. The router is replicated (every rank routes identically).
"""

from __future__ import annotations

import torch

from kernels import moe
from kernels.linear import linear, linear_fp32
from services.rank_worker.model.config import ModelConfig
from services.rank_worker.model.weights import WeightReader


class DenseMlp:
    def __init__(self, cfg: ModelConfig, reader: WeightReader, prefix: str) -> None:
        self.limit = cfg.swiglu_limit
        self.gate = reader.split(prefix + "gate_proj.weight", 0)
        self.up = reader.split(prefix + "up_proj.weight", 0)
        self.down = reader.split(prefix + "down_proj.weight", 1)

    def partial(self, x: torch.Tensor, j: int) -> torch.Tensor:
        return linear_fp32(moe.swiglu(linear(x, self.gate[j]), linear(x, self.up[j]), self.limit), self.down[j])

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [self.partial(x, j) for j in range(len(self.gate))]


class Moe:
    def __init__(self, cfg: ModelConfig, reader: WeightReader, prefix: str) -> None:
        self.cfg = cfg
        p = prefix + "mlp."
        self.router = reader.full(p + "gate.weight")
        self.bias = reader.full(p + "gate.e_score_correction_bias")
        per_expert = [[reader.split(p + f"experts.{e}.{n}.weight", 0 if n != "down_proj" else 1)
                       for e in range(cfg.n_routed_experts)] for n in ("gate_proj", "up_proj", "down_proj")]
        # [shard][E, ...]: stack each shard's slice of every expert.
        self.gate, self.up, self.down = ([torch.stack([w[j] for w in ws]) for j in range(len(ws[0]))] for ws in per_expert)
        self.shared = DenseMlp(cfg, reader, p + "shared_experts.")

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        c = self.cfg
        ids, w = moe.route(x, self.router, self.bias, top_k=c.num_experts_per_tok, n_group=c.n_group,
                           topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob, scaling=c.routed_scaling_factor)
        return [moe.experts(x, ids, w, self.gate[j], self.up[j], self.down[j], c.swiglu_limit) + self.shared.partial(x, j)
                for j in range(len(self.gate))]


def build_ffn(cfg: ModelConfig, reader: WeightReader, prefix: str, layer: int) -> DenseMlp | Moe:
    if layer < cfg.num_hidden_layers and cfg.mlp_layer_types[layer] == "dense":
        return DenseMlp(cfg, reader, prefix + "mlp.")
    return Moe(cfg, reader, prefix)
