"""Feed-forward layers: the dense SwiGLU MLP (first layers) and the MoE (routed experts + shared expert).

Both are split by intermediate channels over virtual shards: gate/up column-parallel, down row-parallel, so each
shard returns a partial [T, D] that the caller reduces. The router is replicated (every rank routes identically).

Storage serves both paths: a dense MLP keeps gate and up as two halves of one [2I, D] tensor (one GEMM on the GPU;
the CPU twin reads the halves), and the MoE keeps every shard's experts stacked with the shared expert last
([E+1, I, D] / [E+1, D, I]) so the GPU's grouped kernels treat it as one more expert (kernels/gpu/moe.py).
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
        gate = reader.split(prefix + "gate_proj.weight", 0)
        up = reader.split(prefix + "up_proj.weight", 0)
        self.gate_up = [torch.cat([g, u]) for g, u in zip(gate, up)]
        self.inter = [g.shape[0] for g in gate]
        self.down = reader.split(prefix + "down_proj.weight", 1)

    def partial(self, x: torch.Tensor, j: int) -> torch.Tensor:
        gate, up = self.gate_up[j].split(self.inter[j])
        return linear_fp32(moe.swiglu(linear(x, gate), linear(x, up), self.limit), self.down[j])

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [self.partial(x, j) for j in range(len(self.down))]

    def forward_gpu(self, x: torch.Tensor, decode_rows: int) -> list[torch.Tensor]:
        from kernels.gpu import gemm
        out = []
        for j, w in enumerate(self.gate_up):
            gate, up = gemm.matmul(x, w, decode_rows).split(self.inter[j], dim=-1)
            out.append(gemm.matmul(moe.swiglu(gate, up, self.limit), self.down[j], decode_rows, torch.float32))
        return out


class Moe:
    def __init__(self, cfg: ModelConfig, reader: WeightReader, prefix: str) -> None:
        self.cfg = cfg
        p = prefix + "mlp."
        self.router = reader.full(p + "gate.weight")
        self.bias = reader.full(p + "gate.e_score_correction_bias")
        names = ("gate_proj", "up_proj", "down_proj")
        per_expert = [[reader.split(p + f"experts.{e}.{n}.weight", 0 if n != "down_proj" else 1)
                       for e in range(cfg.n_routed_experts)] + [reader.split(p + f"shared_experts.{n}.weight",
                                                                             0 if n != "down_proj" else 1)]
                      for n in names]
        # [shard][E+1, ...]: each shard's slice of every expert, the shared expert last.
        self.gate, self.up, self.down = ([torch.stack([w[j] for w in ws]) for j in range(len(ws[0]))]
                                         for ws in per_expert)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        c = self.cfg
        e = c.n_routed_experts
        ids, w = moe.route(x, self.router, self.bias, top_k=c.num_experts_per_tok, n_group=c.n_group,
                           topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob, scaling=c.routed_scaling_factor)
        out = []
        for g, u, d in zip(self.gate, self.up, self.down):
            routed = moe.experts(x, ids, w, g[:e], u[:e], d[:e], c.swiglu_limit)
            shared = linear_fp32(moe.swiglu(linear(x, g[e]), linear(x, u[e]), c.swiglu_limit), d[e])
            out.append(routed + shared)
        return out

    def forward_gpu(self, x: torch.Tensor, decode_rows: int, n_real: torch.Tensor) -> list[torch.Tensor]:
        from kernels.gpu import gemm
        from kernels.gpu import moe as gpu_moe
        c = self.cfg
        if c.n_group > 1:  # grouped routing has no fused kernel (GLM-5.3-Flash routes with one group)
            raise NotImplementedError("the GPU MoE path routes with n_group == 1 only")
        logits = gemm.matmul(x, self.router, decode_rows, torch.float32)
        ids, w = gpu_moe.route(logits, self.bias, top_k=c.num_experts_per_tok, norm_topk_prob=c.norm_topk_prob,
                               scaling=c.routed_scaling_factor, n_real=n_real)
        return [gpu_moe.experts(x, ids, w, g, u, d, c.swiglu_limit, decode_rows)
                for g, u, d in zip(self.gate, self.up, self.down)]


def build_ffn(cfg: ModelConfig, reader: WeightReader, prefix: str, layer: int) -> DenseMlp | Moe:
    if layer < cfg.num_hidden_layers and cfg.mlp_layer_types[layer] == "dense":
        return DenseMlp(cfg, reader, prefix + "mlp.")
    return Moe(cfg, reader, prefix)
