"""GLM-5.3-Flash's vision tower (GLM4V style): image patches -> embeddings in the text model's hidden size.

It runs on rank 0 only (the ranks' executor broadcasts its output to the others), in the compute dtype, over the
patches the gateway's image processor made (services/gateway/images.py):
patch embed (a Conv3d over temporal x spatial patches) -> `depth` blocks of [RMSNorm -> attention with per-head
q/k RMSNorm and 2D axial rotary positions, non-causal within each image -> RMSNorm -> clamped SwiGLU MLP] ->
RMSNorm -> spatial merge (a merge x merge Conv2d) -> merger (proj -> LayerNorm -> GELU -> clamped SwiGLU). One output
row per merge x merge patches: one per image placeholder token. Checked against transformers' `glm5_next` in fp32
(tests/model/test_vision.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from model.weights import WeightReader

PREFIX = "model.visual."


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    rms_norm_eps: float = 1e-5
    swiglu_limit: float = 10.0
    rope_theta: float = 10000.0

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "VisionConfig | None":
        v = raw.get("vision_config")
        if not v:
            return None
        rope = v.get("rope_parameters") or {}
        return cls(depth=v["depth"], hidden_size=v["hidden_size"], num_heads=v["num_heads"],
                   in_channels=v.get("in_channels", 3), patch_size=v["patch_size"],
                   temporal_patch_size=v.get("temporal_patch_size", 2),
                   spatial_merge_size=v.get("spatial_merge_size", 2), out_hidden_size=v["out_hidden_size"],
                   rms_norm_eps=v.get("rms_norm_eps", 1e-5), swiglu_limit=v.get("swiglu_limit", 10.0),
                   rope_theta=rope.get("rope_theta", v.get("rope_theta", 10000.0)))

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _swiglu(x: torch.Tensor, gate: tuple, up: tuple, down: tuple, limit: float) -> torch.Tensor:
    """down(silu(min(gate x, limit)) * clamp(up x, -limit, limit)); each of gate / up / down is (weight, bias)."""
    g = F.linear(x, *gate).clamp(max=limit)
    u = F.linear(x, *up).clamp(-limit, limit)
    return F.linear(F.silu(g) * u, *down)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def positions(grid: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """(h, w) of every patch [N, 2], patches ordered merge-block by merge-block (the image processor's layout)."""
    out = []
    for t, h, w in grid:
        hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        hh, ww = (p.reshape(shape).transpose(1, 2).flatten() for p in (hh, ww))
        out.append(torch.stack([hh, ww], dim=-1).repeat(t, 1))
    return torch.cat(out)


# Attention scores held at once: the tower's attention is dense within an image, and the release's largest image
# (8,000 tokens = 32,000 patches) has 32,000^2 scores per head, 8 bytes each with the fp32 softmax and the probabilities
# in the compute dtype: over 8 GB a head, more than a GPU keeps beside the KV pool. So queries go a block at a time,
# ~1 GiB at most; a small image is one block.
SCORES_PER_BLOCK = 1 << 27


def query_rows(heads: int, n: int) -> int:
    """Query rows of an n-patch image per attention block. A function of the image's size only, so the same image gets
    the same bits on every call (the executor runs the tower again for each prompt chunk the image lies in)."""
    return max(1, min(n, SCORES_PER_BLOCK // (heads * n)))


class VisionTower:
    def __init__(self, cfg: VisionConfig, reader: WeightReader) -> None:
        self.cfg = cfg
        w = lambda name: reader.full(PREFIX + name)  # noqa: E731
        self.patch_w, self.patch_b = w("patch_embed.proj.weight"), w("patch_embed.proj.bias")
        self.blocks = []
        for d in range(cfg.depth):
            b = f"blocks.{d}."
            pair = lambda n: (w(b + n + ".weight"), w(b + n + ".bias"))  # noqa: E731
            self.blocks.append(dict(
                norm1=w(b + "norm1.weight"), norm2=w(b + "norm2.weight"), qkv=pair("attn.qkv"),
                proj=pair("attn.proj"), q_norm=w(b + "attn.q_norm.weight"), k_norm=w(b + "attn.k_norm.weight"),
                gate=pair("mlp.gate_proj"), up=pair("mlp.up_proj"), down=pair("mlp.down_proj")))
        self.post_norm = w("post_layernorm.weight")
        self.down_w, self.down_b = w("downsample.weight"), w("downsample.bias")
        self.merger_proj = w("merger.proj.weight")
        self.merger_norm = (w("merger.post_projection_norm.weight"), w("merger.post_projection_norm.bias"))
        self.merger_gate, self.merger_up = w("merger.gate_proj.weight"), w("merger.up_proj.weight")
        self.merger_down = w("merger.down_proj.weight")
        head_dim = cfg.hidden_size // cfg.num_heads
        spatial = head_dim // 2
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))

    def tokens(self, grid: tuple[int, int, int]) -> int:
        """Placeholder tokens (output rows) of one image of patch grid (t, h, w)."""
        return grid[0] * grid[1] * grid[2] // self.cfg.spatial_merge_size ** 2

    def _rope(self, pos: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = pos.to(device)[..., None].float() * self.inv_freq.to(device)  # [N, 2, spatial/2]
        hw = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        angles = torch.cat([hw, hw], dim=-1)  # [N, head_dim]
        return angles.cos(), angles.sin()

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor, grid: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixels [N, patch_dim] of one or more images (patch grids `grid`) -> embeddings [sum tokens, out]."""
        c = self.cfg
        dtype = self.patch_w.dtype
        x = pixels.to(self.patch_w.device, dtype).view(-1, c.in_channels, c.temporal_patch_size, c.patch_size,
                                                          c.patch_size)
        x = F.conv3d(x, self.patch_w, self.patch_b, stride=self.patch_w.shape[2:]).view(-1, c.hidden_size)
        cos, sin = self._rope(positions(grid, c.spatial_merge_size), x.device)
        bounds = torch.tensor([t * h * w for t, h, w in grid]).cumsum(0).tolist()
        heads, head_dim = c.num_heads, c.hidden_size // c.num_heads
        for blk in self.blocks:
            h = _rms(x, blk["norm1"], c.rms_norm_eps)
            q, k, v = F.linear(h, *blk["qkv"]).view(-1, 3, heads, head_dim).unbind(1)
            q, k = _rms(q, blk["q_norm"], c.rms_norm_eps), _rms(k, blk["k_norm"], c.rms_norm_eps)
            q, k = ((t.float() * cos[:, None] + _rotate_half(t.float()) * sin[:, None]).to(dtype) for t in (q, k))
            out = torch.empty_like(v)
            lo = 0
            for hi in bounds:  # attention within each image (frame), never across
                qs, ks, vs = (t[lo:hi].transpose(0, 1) for t in (q, k, v))  # [heads, n, head_dim]
                step = query_rows(heads, hi - lo)
                for a in range(0, hi - lo, step):
                    scores = torch.matmul(qs[:, a : a + step], ks.transpose(1, 2)) * head_dim ** -0.5
                    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
                    out[lo + a : lo + a + step] = torch.matmul(probs, vs).transpose(0, 1)
                lo = hi
            x = x + F.linear(out.reshape(-1, c.hidden_size), *blk["proj"])
            x = x + _swiglu(_rms(x, blk["norm2"], c.rms_norm_eps), blk["gate"], blk["up"], blk["down"],
                            c.swiglu_limit)
        x = _rms(x, self.post_norm, c.rms_norm_eps)
        m = c.spatial_merge_size
        x = x.view(-1, m, m, c.hidden_size).permute(0, 3, 1, 2)
        x = F.conv2d(x, self.down_w, self.down_b, stride=m).view(-1, c.out_hidden_size)
        x = F.linear(x, self.merger_proj)
        x = F.gelu(F.layer_norm(x, (x.shape[-1],), *self.merger_norm, eps=1e-5))
        return _swiglu(x, (self.merger_gate, None), (self.merger_up, None), (self.merger_down, None),
                       c.swiglu_limit)
