"""FP8 e4m3 weights with float32 scales: 128x128 blocks (DeepSeek-V3 / transformers `FineGrainedFP8`) or one scale
per output channel. Torch reference (quantize and dequantize), which is also the CPU compute path and the parity
oracle of the GPU FP8 linear.

Storage of a linear `X` with dense weight W [out, in] (HF key names):
- blocks [bo, bi]: `X.weight` float8_e4m3fn [out, in] and `X.weight_scale_inv` float32 [ceil(out/bo), ceil(in/bi)],
  W[r, c] = weight[r, c] * weight_scale_inv[r // bo, c // bi] (DeepSeek's name: the scale that undoes the
  quantization); `quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
  "weight_block_size": [bo, bi]}`.
- per channel: `X.weight` float8_e4m3fn [out, in] and `X.weight_scale` float32 [out, 1] (vLLM's channel-scale
  shape), W[r, c] = weight[r, c] * weight_scale[r]; the same config without `weight_block_size`.
Quantization rounds to nearest (torch's cast to e4m3, ties to even) after dividing by scale = amax / 448 of the block
(or row); an all-zero block gets scale 1.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from kernels.quant.codec import Codec, Index, Params, axis_index, tiles_of

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
DEFAULT_BLOCK = (128, 128)
RANDOM_SPREAD = 64.0  # std of random e4m3 values: 7 std below the largest, well above the subnormals


def _scale(amax: torch.Tensor) -> torch.Tensor:
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def _to_e4m3(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Block scales [R, C] repeated over their blocks and cropped to [out, in]."""
    out, inp = shape
    return scale.repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :inp]


def quantize_blocks(w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> dict[str, torch.Tensor]:
    """W [out, in] -> {"weight", "weight_scale_inv"} with one scale per block (a partial last block allowed)."""
    out, inp = w.shape
    bo, bi = block
    w = w.float()
    rows, cols = -(-out // bo), -(-inp // bi)
    padded = torch.zeros(rows * bo, cols * bi, dtype=torch.float32, device=w.device)
    padded[:out, :inp] = w
    amax = padded.view(rows, bo, cols, bi).abs().amax(dim=(1, 3))
    scale = _scale(amax)
    return {"weight": _to_e4m3(w, _expand(scale, (out, inp), block)), "weight_scale_inv": scale}


def quantize_channels(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """W [out, in] -> {"weight", "weight_scale"} with one scale per output row."""
    w = w.float()
    scale = _scale(w.abs().amax(dim=1, keepdim=True))
    return {"weight": _to_e4m3(w, scale), "weight_scale": scale}


def random_linear(out: int, inp: int, *, std: float, block: tuple[int, int] | None = DEFAULT_BLOCK,
                  generator: torch.Generator | None = None, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """FP8 tensors of a random [out, in] linear whose dense weight has about `std` per element, drawn straight into
    e4m3 (normal values of std RANDOM_SPREAD, a few rows at a time) with every scale std / RANDOM_SPREAD."""
    weight = torch.empty(out, inp, dtype=E4M3, device=device)
    rows = max(1, (16 << 20) // inp)  # draw ~64 MB of float32 at a time
    for r in range(0, out, rows):
        chunk = torch.randn(min(rows, out - r), inp, generator=generator, device=device).mul_(RANDOM_SPREAD)
        weight[r : r + rows] = chunk.clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    scale_shape = (out, 1) if block is None else (-(-out // block[0]), -(-inp // block[1]))
    scale = torch.full(scale_shape, std / RANDOM_SPREAD, dtype=torch.float32, device=device)
    return {"weight": weight, "weight_scale" if block is None else "weight_scale_inv": scale}


class Fp8Codec(Codec):
    name = "fp8"
    quant_method = "fp8"
    required = frozenset({"weight"})
    optional = frozenset({"weight_scale_inv", "weight_scale"})

    def stores(self, names: set[str], dtype: Callable[[str], torch.dtype]) -> bool:
        # "weight_scale" alone is also W4A16's and the int format's scale name; they store "weight_packed"
        # instead of "weight".
        return "weight" in names and bool(names & self.optional)

    def params(self, qcfg: Mapping[str, Any] | None, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
        out, inp = shapes["weight"]
        if "weight_scale_inv" in shapes:
            bo, bi = (qcfg or {}).get("weight_block_size") or DEFAULT_BLOCK
            want = (-(-out // bo), -(-inp // bi))
            if tuple(shapes["weight_scale_inv"]) != want:
                raise ValueError(f"fp8 block scales {tuple(shapes['weight_scale_inv'])} do not cover a [{out}, {inp}] "
                                 f"weight in [{bo}, {bi}] blocks (expected {want})")
            return {"block": (int(bo), int(bi))}
        if tuple(shapes["weight_scale"]) not in ((out, 1), (out,)):
            raise ValueError(f"fp8 channel scales {tuple(shapes['weight_scale'])} do not fit a [{out}, {inp}] weight "
                             f"(expected [{out}, 1])")
        return {"block": None}

    def logical_shape(self, shapes: Mapping[str, tuple[int, ...]], params: Params) -> tuple[int, int]:
        out, inp = shapes["weight"]
        return int(out), int(inp)

    def tile(self, dim: int, params: Params) -> int:
        return 1 if params["block"] is None else params["block"][dim]

    def cut(self, name: str, dim: int, part: slice, params: Params) -> Index | None:
        if name == "weight":
            return axis_index(dim, part)
        if name == "weight_scale_inv":
            return axis_index(dim, tiles_of(part, params["block"][dim]))
        return axis_index(0, part) if dim == 0 else None  # per-channel scales follow the rows

    def dequantize(self, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int], params: Params) -> torch.Tensor:
        w = tensors["weight"].float()
        if params["block"] is None:
            return w * tensors["weight_scale"].float().reshape(-1, 1)
        return w * _expand(tensors["weight_scale_inv"].float(), shape, params["block"])


CODEC = Fp8Codec()
