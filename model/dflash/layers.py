"""The blocks of a DFlash2 drafter layer: RMSNorm, RoPE, the grouped dynamic causal convolutions, attention over
[target context, block] and the SwiGLU MLP. Parameter names follow the published checkpoint (module paths)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .config import DFlashConfig


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: normalised in fp32, scaled in the input's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos / sin [B, T, head_dim] for absolute `positions` [B, T]; computed in fp32 like Qwen3RotaryEmbedding."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
                               / head_dim)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [B, heads, T, D] by the half-split convention (Qwen3's rotate_half)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def grouped_causal_conv(x: Tensor, dynamic: Tensor, base: Tensor, group_size: int) -> Tensor:
    """out[t] = sum_o (base[o] + dynamic[t, o, group]) * x[t - o] along the block, zero before its first row.

    x [B, T, H]; dynamic [B, T, K, G], one predicted tap per channel group, taken at the output row t; base [K, H],
    a learned tap per channel. The convolution never reaches the target context: it runs over the block alone."""
    b, t, h = x.shape
    groups = h // group_size
    blocks = x.view(b, t, groups, group_size)
    out = torch.zeros_like(blocks)
    # Taps reaching before the block's first row see zeros; a block shorter than the kernel has no such rows at all
    # (z-lab's reference pads those taps to the wrong length and fails on blocks shorter than the kernel).
    for offset in range(min(base.shape[0], t)):
        shifted = blocks if offset == 0 else F.pad(blocks[:, :-offset], (0, 0, 0, 0, offset, 0))
        out = out + base[offset].view(1, 1, groups, group_size).to(x.dtype) * shifted
        out = out + dynamic[:, :, offset, :, None] * shifted
    return out.view(b, t, h)


class DynamicConv(nn.Module):
    """A pair of grouped dynamic causal convolutions around a sublayer (attention or MLP): both kernels are
    predicted from the sublayer's normalised input; the first filters that input, the second the sublayer's output."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.kernel_size = config.conv_kernel_size
        self.group_size = config.conv_group_size
        self.groups = config.conv_groups
        self.base_kernel = nn.Parameter(torch.zeros(2, config.conv_kernel_size, config.hidden_size))
        # Output laid out [which of the two kernels, tap, group], as the published weights are.
        self.kernel_projection = nn.Linear(config.hidden_size, 2 * config.conv_kernel_size * config.conv_groups,
                                           bias=False)

    def prepare(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Filter the sublayer input; return it with the kernel kept for `finish`."""
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        first = grouped_causal_conv(x, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size)
        return first, dynamic[..., 1, :, :]

    def finish(self, y: Tensor, dynamic: Tensor) -> Tensor:
        """Filter the sublayer output with the second predicted kernel."""
        return grouped_causal_conv(y, dynamic, self.base_kernel[1], self.group_size)


class Attention(nn.Module):
    """Qwen3 attention whose queries are the block rows and whose keys / values are the target context's rows
    followed by the block's, both projected with the same k / v weights. The context rows are the same for every
    layer (the fused target hidden states), so their keys depend only on their own position: a caller may cache them."""

    def __init__(self, config: DFlashConfig, layer: int) -> None:
        super().__init__()
        d, heads, kv_heads, bias = config.head_dim, config.num_attention_heads, config.num_key_value_heads, \
            config.attention_bias
        self.head_dim, self.heads, self.kv_heads = d, heads, kv_heads
        self.q_proj = nn.Linear(config.hidden_size, heads * d, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(heads * d, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.window = config.window(layer)
        self.causal = config.causal(layer)

    def visible(self, positions: Tensor, block_len: int) -> Tensor:
        """[B, 1, Q, C+Q] True where a block row may attend a key, from absolute positions: causal layers see no
        later row, windowed layers nothing `window` or more positions away (on both sides when not causal)."""
        q_pos = positions[:, -block_len:, None]
        k_pos = positions[:, None, :]
        ok = torch.ones(q_pos.shape[0], block_len, positions.shape[1], dtype=torch.bool, device=positions.device)
        if self.causal:
            ok &= k_pos <= q_pos
        if self.window is not None:
            ok &= q_pos - k_pos < self.window
            if not self.causal:
                ok &= k_pos - q_pos < self.window
        return ok[:, None]

    def forward(self, x: Tensor, context: Tensor, cos: Tensor, sin: Tensor, positions: Tensor) -> Tensor:
        """x [B, Q, H] block rows, context [B, C, H]; cos / sin / positions cover the C + Q rows, context first."""
        b, q_len, _ = x.shape
        rows = context.shape[1] + q_len
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.heads, self.head_dim)).transpose(1, 2)
        k = torch.cat((self.k_proj(context), self.k_proj(x)), dim=1).view(b, rows, self.kv_heads, self.head_dim)
        v = torch.cat((self.v_proj(context), self.v_proj(x)), dim=1).view(b, rows, self.kv_heads, self.head_dim)
        k = self.k_norm(k).transpose(1, 2)
        v = v.transpose(1, 2)
        q = apply_rope(q, cos[:, -q_len:], sin[:, -q_len:])
        k = apply_rope(k, cos, sin)
        # Grouped-query attention: query head h reads key / value head h // (heads / kv_heads).
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        scores = (q @ k.transpose(-1, -2)) * self.head_dim ** -0.5
        scores = scores.masked_fill(~self.visible(positions, q_len), float("-inf"))
        out = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each wrapped in its dynamic convolution pair, each with a residual."""

    def __init__(self, config: DFlashConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention_conv = DynamicConv(config)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp_conv = DynamicConv(config)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, context: Tensor, cos: Tensor, sin: Tensor, positions: Tensor) -> Tensor:
        h, kernel = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, context, cos, sin, positions), kernel)
        h, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), kernel)
