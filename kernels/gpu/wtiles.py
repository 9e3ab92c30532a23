"""Weight tiles in the activation dtype, from dense or quantized storage: what lets one GEMM and one grouped-MoE
kernel serve every weight format with the same fixed schedule.

Formats (storage as kernels/quant describes it; the torch twins are the codecs' `dequantize`):
- DENSE: the weight itself.
- FP8_BLOCK: e4m3 values with one fp32 scale per [SB_N, SB_K] block (`weight_scale_inv`).
- FP8_CHANNEL: e4m3 values with one fp32 scale per output row (`weight_scale`).
- INT4: symmetric 4-bit values, 8 per int32 along K (lowest nibble first, stored as q + 8), one fp16 scale per
  SB_K inputs of a row (`weight_packed`, `weight_scale`).
A quantized tile is dequantized exactly as the twin dequantizes (value x scale in fp32, then rounded to the
activation dtype), so a quantized product equals the same kernel's product with the twin's dequantized weights, bit
for bit: the formats change the bytes read, never the arithmetic schedule (DESIGN §5.1).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch
import triton
import triton.language as tl


class Fmt(IntEnum):
    DENSE = 0
    FP8_BLOCK = 1
    FP8_CHANNEL = 2
    INT4 = 3


@dataclass(frozen=True)
class WeightArgs:
    """What a kernel needs to read one weight (or a stack of them: dim 0 = expert / batch)."""
    fmt: Fmt
    data: torch.Tensor  # [B, N, K] dense or e4m3, or [B, N, K / 8] int32 words
    scale: torch.Tensor  # [B, ...] scales (any tensor for DENSE: never read)
    block_n: int = 1  # scale block rows (FP8_BLOCK)
    block_k: int = 1  # scale block / group columns (FP8_BLOCK, INT4)

    @property
    def n(self) -> int:
        return self.data.shape[1]

    @property
    def k(self) -> int:
        return self.data.shape[2] * (8 if self.fmt is Fmt.INT4 else 1)

    def strides(self) -> tuple[int, int, int, int, int, int]:
        """(data batch, data n, data k, scale batch, scale n, scale k) element strides."""
        d, s = self.data, self.scale
        if self.fmt is Fmt.DENSE:
            return d.stride(0), d.stride(1), d.stride(2), 0, 0, 0
        sk = s.stride(2) if s.dim() == 3 else 0
        return d.stride(0), d.stride(1), d.stride(2), s.stride(0), s.stride(1), sk

    def max_block_k(self) -> int:
        """The widest K step a kernel may take: one scale block / group per step."""
        return 1 << 30 if self.fmt in (Fmt.DENSE, Fmt.FP8_CHANNEL) else self.block_k


def dense(w: torch.Tensor) -> WeightArgs:
    """A dense weight [N, K] or a stack [B, N, K]."""
    w3 = w if w.dim() == 3 else w.unsqueeze(0)
    return WeightArgs(Fmt.DENSE, w3, w3)


def quantized(fmt_name: str, tensors: dict[str, torch.Tensor], params: dict) -> WeightArgs:
    """A quantized weight (kernels/quant's stored tensors and parameters), one [N, K] or a stack [B, N, K]."""
    def three(t: torch.Tensor) -> torch.Tensor:
        return t if t.dim() == 3 else t.unsqueeze(0)
    if fmt_name == "fp8":
        if params.get("block") is not None:
            bn, bk = params["block"]
            return WeightArgs(Fmt.FP8_BLOCK, three(tensors["weight"]), three(tensors["weight_scale_inv"]), bn, bk)
        scale = tensors["weight_scale"]
        scale = scale.reshape(*scale.shape[:-1], 1) if scale.shape[-1] != 1 else scale
        return WeightArgs(Fmt.FP8_CHANNEL, three(tensors["weight"]), three(scale))
    if fmt_name == "w4a16":
        return WeightArgs(Fmt.INT4, three(tensors["weight_packed"]), three(tensors["weight_scale"]), 1,
                          int(params["group"]))
    raise NotImplementedError(f"no GPU kernel reads {fmt_name!r} weights yet")


@triton.jit
def weight_tile(w_ptr, s_ptr, rn, k0, N, K, swn, swk, ssn, ssk, FMT: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, SB_N: tl.constexpr, SB_K: tl.constexpr, act: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile of W^T at rows k0.. and columns rn, in the activation dtype (0 outside W).
    w_ptr / s_ptr point at this weight's (or expert's) data and scales."""
    kk = k0 + tl.arange(0, BLOCK_K)
    col = rn[None, :] < N
    if FMT == 3:  # INT4: BLOCK_K / 8 words per column, unpacked to nibbles along K
        kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(w_ptr + rn[None, :] * swn + kw[:, None] * swk, mask=col & (kw[:, None] < K // 8), other=0)
        nib = (words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF
        q = tl.reshape(nib, (BLOCK_K, BLOCK_N)) - 8
        s = tl.load(s_ptr + rn[None, :] * ssn + (k0 // SB_K) * ssk, mask=col, other=0.0).to(tl.float32)
        tile = (q.to(tl.float32) * s).to(act)
    else:
        raw = tl.load(w_ptr + rn[None, :] * swn + kk[:, None] * swk, mask=col & (kk[:, None] < K), other=0.0)
        if FMT == 0:
            tile = raw
        else:
            if FMT == 1:  # FP8_BLOCK
                s = tl.load(s_ptr + (rn // SB_N)[None, :] * ssn + (k0 // SB_K) * ssk, mask=col, other=0.0)
            else:  # FP8_CHANNEL
                s = tl.load(s_ptr + rn[None, :] * ssn, mask=col, other=0.0)
            tile = (raw.to(tl.float32) * s).to(act)
    return tile


def stack_quantized(parts: list) -> WeightArgs:
    """One WeightArgs over a list of same-format quantized weights (kernels/quant's QuantizedWeight: `format`,
    `tensors`, `params`), stacked along a new first dim (the experts of a MoE)."""
    first = parts[0]
    if any(p.format != first.format or dict(p.params) != dict(first.params) or p.shape != first.shape
           for p in parts):
        raise ValueError("stacked weights must share one format, its parameters and their shape")
    tensors = {name: torch.stack([p.tensors[name] for p in parts]) for name in first.tensors}
    return quantized(first.format, tensors, dict(first.params))
