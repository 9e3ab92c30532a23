"""The wide fp8 linears of the rest (e4m3, an fp32 scale per 128 x 128 block) on humming-kernels' dense GEMM for
decode-class rows, opt-in (`serve-rank --rest-fp8-kernel humming`): vLLM's JIT kernel streams a wide fp8 weight
closer to the copy rate than our fixed-schedule Triton GEMM at 1 to 8 rows, and loses on narrow ones (no K split
puts too few blocks on the chip): docs/benchmarks.md, "The rest on humming's dense GEMM (one H100, a probe)".
Prompt rows keep our
GEMM's prompt schedule (kernels/gpu/gemm.py), so a chosen linear is held twice: as stored, and repacked.

Exactness (docs/design.md §5.1): humming's batch-invariant mode with one pinned tile (`TILE`, for every row count)
and no K split: an output element is one chain of tensor-core steps over K in ascending order whatever the row
count or the tile's columns. The choice (`chooses`) is a function of the linear's shape and the setting only, and
the shape is the whole linear's (every virtual shard's outputs), the same at every TP size; a rank launches its
local virtual shards side by side as one product over its broadcast input, each shard's columns the bits of its own
product (tests/gpu/test_fp8_dense_humming.py checks both).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from kernels.gpu import gemm
from kernels.gpu.int_moe import Tile, build, load_humming
from kernels.gpu.wtiles import Fmt, WeightArgs

SETTINGS = ("triton", "humming")  # serve-rank --rest-fp8-kernel
# Products this wide (the whole linear's outputs) and wider run on humming: KDA's q|k|v, MLA's q_b and the dense
# MLP's gate|up at the release's dims; the 4,096-wide ones (o_proj, down, wq_b) and narrower stay on ours.
MIN_N = 16384
BLOCK = (128, 128)  # the fp8 block whose scales humming reads as stored (its BLOCK scale type)
# The pinned decode tile: 16-row blocks of 64 columns on the warp-level mma, 3 blocks an SM — the best of the
# humdense probe's pinned tiles at the wide shapes (bench/kernels_rest.py's TILES).
TILE = Tile(16, 64, 32, 4, 3, "mma")
COMPUTE = json.dumps({"gemm_type": "dense", "use_batch_invariant": True})


def chooses(fmt: Fmt, block: tuple[int, int], n: int, k: int, setting: str) -> bool:
    """Whether a linear of `n` outputs (all virtual shards') and `k` inputs, stored as `fmt` in `block` scale blocks,
    runs its decode rows on humming under `setting`: fp8 in 128 x 128 blocks, n >= MIN_N, and whole tiles of the
    pinned config and of the scale blocks (a shard boundary then never cuts a tile)."""
    if setting not in SETTINGS:
        raise ValueError(f"rest fp8 kernel {setting!r}: one of {', '.join(SETTINGS)}")
    return (setting == "humming" and fmt is Fmt.FP8_BLOCK and tuple(block) == BLOCK and n >= MIN_N
            and n % BLOCK[0] == 0 and n % TILE.block_n == 0 and k % BLOCK[1] == 0)


def schema():
    """humming's schema of our stored fp8: e4m3 codes, fp32 scales per 128 x 128 block."""
    load_humming()
    from humming.schema import HummingWeightSchema
    return HummingWeightSchema(b_dtype="float8e4m3", weight_scale_group_size=BLOCK[1],
                               weight_scale_group_size_n=BLOCK[0])


@dataclass
class Repacked:
    """One weight in humming's layout for the GPU at hand: its layer config (JSON) and tensors."""
    layer: str
    weight: torch.Tensor
    scale: torch.Tensor


def repack(stored: dict[str, torch.Tensor], dtype: torch.dtype) -> Repacked:
    """humming's tensors of a weight in humming's stored form ({"weight": int32 words, "weight_scale": fp32
    blocks}), transformed for this GPU (a new copy: the input is left as it is)."""
    load_humming()
    from humming.transform import prepare_layer_config, transform_humming_tensors
    n, k = stored["weight"].shape[0], stored["weight"].shape[1] * 4
    config = prepare_layer_config(shape_n=n, shape_k=k, weight_schema=schema(), torch_dtype=dtype,
                                  device=stored["weight"].device, tensors=dict(stored))
    out = transform_humming_tensors(config, dict(stored))
    return Repacked(config.to_str(), out["weight"], out["weight_scale"])


@dataclass(frozen=True)
class Fp8Dense(WeightArgs):
    """A stored fp8 operand [S, N, K] (what our GEMM reads for prompt rows) with its local shards' rows side by side,
    [S x N, K], in humming's layout for decode rows."""
    humming: Repacked = field(kw_only=True)


def prepare(w: WeightArgs, dtype: torch.dtype) -> Fp8Dense:
    """`w` (FP8_BLOCK in BLOCK, every local shard) with humming's copy, its kernel built now: before CUDA graph
    capture, which must not compile. Our e4m3 bytes are humming's packed codes (4 an int32 word) and our block scale
    (`weight_scale_inv`, a multiplier) is its block scale, so only the tile layout changes."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"humming's fp8 GEMM takes bfloat16 / float16 rows, not {dtype}")
    shards, n, k = w.data.shape
    codes = w.data.reshape(shards * n, k).contiguous().view(torch.int32)
    scale = w.scale.reshape(shards * n // BLOCK[0], -1).float().contiguous()
    hum = repack({"weight": codes, "weight_scale": scale}, dtype)
    build(hum.layer, COMPUTE, TILE, w.data.device.index or 0)
    return Fp8Dense(w.fmt, w.data, w.scale, w.block_n, w.block_k, humming=hum)


def launch(x: torch.Tensor, hum: Repacked, out: torch.Tensor) -> None:
    """out [M, N] = x [M, K] @ W^T in the pinned tile (x, out contiguous, x's dtype)."""
    load_humming().ops.launch_kernel(configs=build(hum.layer, COMPUTE, TILE, x.device.index or 0), inputs=x,
                                     weight=hum.weight, weight_scale=hum.scale, outputs=out)


def bmm(x: torch.Tensor, w: Fp8Dense, decode_rows: int, out_dtype: torch.dtype | None = None,
        out: torch.Tensor | None = None) -> torch.Tensor:
    """gemm.bmm for a prepared operand: x [S, M, K] (every shard the same input: a broadcast view) -> [S, M, N].
    Rows [0, decode_rows) on humming as one product over every local shard, the rest on our prompt schedule."""
    s, m, k = x.shape
    if out is None:
        out = torch.empty(s, m, w.n, dtype=out_dtype or x.dtype, device=x.device)
    split = min(max(decode_rows, 0), m)
    if split:
        if s > 1 and x.stride(0) != 0:
            raise ValueError("humming's fp8 product takes one input for every shard (column-parallel or replicated)")
        y = torch.empty(split, s * w.n, dtype=x.dtype, device=x.device)
        launch(x[0, :split].contiguous(), w.humming, y)
        out[:, :split] = y.view(split, s, w.n).transpose(0, 1)
    if split < m:
        gemm.bmm(x[:, split:], w, 0, out_dtype, out=out[:, split:])
    return out
