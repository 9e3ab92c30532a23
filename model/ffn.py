"""Feed-forward layers: the dense SwiGLU MLP (first layers) and the MoE (routed experts + shared expert).

Both are split by intermediate channels over virtual shards: gate/up column-parallel, down row-parallel, so each
shard returns a partial [T, D] that the caller reduces. The router is replicated (every rank routes identically).

Storage serves both paths: a dense MLP keeps per shard gate and up as two halves of one [2I, D] tensor, stacked
over the rank's local virtual shards ([S, 2I, D], down [S, D, I]) so the GPU runs every local shard in one batched
GEMM per projection; the CPU twin reads per-shard halves. The MoE keeps every shard's experts stacked with the
shared expert last ([E+1, I, D] / [E+1, D, I]) so the GPU's grouped kernels treat it as one more expert
(kernels/gpu/moe.py).
"""

from __future__ import annotations

import torch

from kernels import moe
from kernels.linear import linear, linear_fp32
from model.config import ModelConfig
from model.weights import WeightReader


class DenseMlp:
    def __init__(self, cfg: ModelConfig, reader: WeightReader, prefix: str) -> None:
        self.parts = _DenseParts(reader.split(prefix + "gate_proj.weight", 0),
                                 reader.split(prefix + "up_proj.weight", 0),
                                 reader.split(prefix + "down_proj.weight", 1), cfg.swiglu_limit)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [self.parts.partial(x, j) for j in range(len(self.parts.down))]

    def forward_gpu(self, x: torch.Tensor, decode_rows: int) -> torch.Tensor:
        return self.parts.partials_gpu(x, decode_rows)


class Moe:
    def __init__(self, cfg: ModelConfig, reader: WeightReader, prefix: str) -> None:
        self.cfg = cfg
        p = prefix + "mlp."
        self.router = reader.full(p + "gate.weight")
        self.bias = reader.full(p + "gate.e_score_correction_bias")
        names = ("gate_proj", "up_proj", "down_proj")
        # On a GPU quantized experts stay packed (the grouped kernels dequantize tile by tile); on the CPU every
        # expert is read dense, the torch twin's input.
        read = reader.split_packed if reader.device.type == "cuda" else reader.split
        routed = [[read(p + f"experts.{e}.{n}.weight", 0 if n != "down_proj" else 1)
                   for e in range(cfg.n_routed_experts)] for n in names]
        shared = [read(p + f"shared_experts.{n}.weight", 0 if n != "down_proj" else 1) for n in names]
        self.packed = not isinstance(routed[0][0][0], torch.Tensor)
        self.shards = len(shared[0])
        # Stored for one launch over every local virtual shard (kernels/gpu/moe.experts): gate / up [E+1, I_local,
        # D] with the shards' I slices side by side, down [shards * (E+1), D, I_local / shards] shard-major; the
        # shared expert last in each. The reference path reads per-shard views of the same tensors.
        if not self.packed:
            stacks = [[torch.stack([w[j] for w in ws + [sh]]) for j in range(self.shards)]
                      for ws, sh in zip(routed, shared)]
            self.gate, self.up = (torch.cat(st, dim=1) for st in stacks[:2])
            self.down = torch.cat(stacks[2], dim=0)
            self.shared_apart = None
            return
        from kernels.gpu import wtiles
        # The shared expert joins the routed stack when it is stored alike; else it runs as a dense MLP beside it.
        together = all(not isinstance(sh[0], torch.Tensor) and sh[0].format == ws[0][0].format
                       and dict(sh[0].params) == dict(ws[0][0].params) and sh[0].shape == ws[0][0].shape
                       for ws, sh in zip(routed, shared))
        stacks = [[wtiles.stack_quantized([w[j] for w in ws + ([sh] if together else [])]) for j in range(self.shards)]
                  for ws, sh in zip(routed, shared)]
        if stacks[0][0].fmt is wtiles.Fmt.EXL3:  # the EXL3 MoE path runs one virtual shard per launch
            self.gate, self.up, self.down = stacks
        else:
            self.gate, self.up = (wtiles.cat(st, dim=1) for st in stacks[:2])
            self.down = wtiles.cat(stacks[2], dim=0)
        if together:
            self.shared_apart = None
        else:
            dense = [[t if isinstance(t, torch.Tensor) else t.dequantize(reader.dtype) for t in sh] for sh in shared]
            self.shared_apart = _DenseParts(dense[0], dense[1], dense[2], cfg.swiglu_limit)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        c = self.cfg
        e = c.n_routed_experts
        if self.packed:  # packed experts exist only on CUDA, where every caller takes forward_gpu
            raise RuntimeError("packed (quantized) experts run through forward_gpu")
        ids, w = moe.route(x, self.router, self.bias, top_k=c.num_experts_per_tok, n_group=c.n_group,
                           topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob, scaling=c.routed_scaling_factor)
        out = []
        width = self.gate.shape[1] // self.shards
        for j in range(self.shards):
            g, u = (t[:, j * width : (j + 1) * width] for t in (self.gate, self.up))
            d = self.down[j * (e + 1) : (j + 1) * (e + 1)]
            routed = moe.experts(x, ids, w, g[:e], u[:e], d[:e], c.swiglu_limit)
            shared = linear_fp32(moe.swiglu(linear(x, g[e]), linear(x, u[e]), c.swiglu_limit), d[e])
            out.append(routed + shared)
        return out

    def forward_gpu(self, x: torch.Tensor, decode_rows: int, n_real: torch.Tensor) -> torch.Tensor:
        """Every local shard's partial [S, T, D] fp32."""
        from kernels.gpu import gemm
        from kernels.gpu import moe as gpu_moe
        c = self.cfg
        if c.n_group > 1:  # grouped routing has no fused kernel (GLM-5.3-Flash routes with one group)
            raise NotImplementedError("the GPU MoE path routes with n_group == 1 only")
        logits = gemm.matmul(x, self.router, decode_rows, torch.float32)
        ids, w = gpu_moe.route(logits, self.bias, top_k=c.num_experts_per_tok, norm_topk_prob=c.norm_topk_prob,
                               scaling=c.routed_scaling_factor, n_real=n_real, shared=self.shared_apart is None)
        if isinstance(self.gate, list):  # per-shard EXL3 stacks (the EXL3 grouped path takes one shard a launch)
            out = torch.stack([gpu_moe.experts(x, ids, w, g, u, d, c.swiglu_limit, decode_rows)[0]
                               for g, u, d in zip(self.gate, self.up, self.down)])
        else:
            out = gpu_moe.experts(x, ids, w, self.gate, self.up, self.down, c.swiglu_limit, decode_rows,
                                  shards=self.shards)
        if self.shared_apart is not None:  # added after the routed sum, the twin's order
            out = out + self.shared_apart.partials_gpu(x, decode_rows)
        return out


class _DenseParts:
    """A dense SwiGLU MLP's tensors stacked over the local virtual shards: gate_up [S, 2I, D] (gate and up as halves
    of one tensor: one GEMM on the GPU, views for the CPU twin), down [S, D, I]; also a shared expert stored apart
    from its routed experts."""

    def __init__(self, gate: list[torch.Tensor], up: list[torch.Tensor], down: list[torch.Tensor],
                 limit: float) -> None:
        self.gate_up = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        self.inter = gate[0].shape[0]  # intermediate channels per shard
        self.down = torch.stack(down)
        self.limit = limit

    def partial(self, x: torch.Tensor, j: int) -> torch.Tensor:
        gate, up = self.gate_up[j].split(self.inter)
        return linear_fp32(moe.swiglu(linear(x, gate), linear(x, up), self.limit), self.down[j])

    def partials_gpu(self, x: torch.Tensor, decode_rows: int) -> torch.Tensor:
        """Every shard's partial [S, T, D] fp32: one batched GEMM per projection over the stacked shards (x
        broadcast for gate/up), each shard with its one-shard (N, K) schedule (kernels/gpu/gemm.py)."""
        from kernels.gpu import gemm
        s = self.gate_up.shape[0]
        gate, up = gemm.bmm(x.unsqueeze(0).expand(s, -1, -1), self.gate_up, decode_rows).split(self.inter, dim=-1)
        return gemm.bmm(moe.swiglu(gate, up, self.limit), self.down, decode_rows, torch.float32)


def build_ffn(cfg: ModelConfig, reader: WeightReader, prefix: str, layer: int) -> DenseMlp | Moe:
    if layer < cfg.num_hidden_layers and cfg.mlp_layer_types[layer] == "dense":
        return DenseMlp(cfg, reader, prefix + "mlp.")
    return Moe(cfg, reader, prefix)
