"""The hand-written CUDA EXL3 grouped product (kernels/gpu/cuda/exl3_grouped.cu): when it runs, and its build.

It replaces the Triton grouped kernel for EXL3 experts (float16 rotated rows, 16-slot tiles, at the rates it is built
for) for decode and prompt rows alike (kernels/gpu/moe.py `_tile`), and runs the GEMM's decode rows of EXL3
weights (`dense`); everything else keeps the Triton kernel. Its schedule is fixed per shape as the
Triton one's is (docs/design.md §5.1), but the two add K in different orders: a row's bits differ between them, so
the choice is a pure function of the weight and the row class, never of the batch.

The extension is compiled for the GPU in use by torch's extension builder (nvcc + ninja) on first use, in a cache
directory (`TWINSPARK_CUDA_CACHE`, default ~/.cache/twinspark/cuda): a rank builds it during warm-up, before it
reports healthy, and a second start loads the cached build. `TWINSPARK_EXL3_KERNEL=triton` turns it off (to compare
the two in bench/).
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import torch

from kernels.gpu.wtiles import Fmt, WeightArgs

SOURCE = Path(__file__).with_name("cuda") / "exl3_grouped.cu"
BLOCK_M = 16  # slots per tile: the decode class's grouping (kernels/gpu/moe.py's moe_schedule)
K_MULTIPLE = 512  # 8 warps x 4 unrolled 16-wide K tiles
N_MULTIPLE = 32  # two 16-wide output tiles per block
# Products of K <= SHORT_K (the MoE's down projection: 2,048 split over 4 virtual shards is 512 a shard) take a build
# of 2 warps on K and 4 output tiles a block: with 8 warps each held 4 K tiles, and the block's setup and warp
# reduction were most of its time (bench.kernels' exl3shard: docs/benchmarks.md, "Expert products"). The build
# depends on K alone, so a product's K order is still a function of its shape (docs/design.md §5.1).
SHORT_K = 1024
SHORT_K_BUILD = (("TS_WARPS", 2), ("TS_N_TILES", 4))
SHORT_K_N_MULTIPLE = 64  # four 16-wide output tiles per block
# (codebook id, 2 x bits) pairs the .cu file instantiates: mul1 at 2.0-4.0 bits with the half rates, the other two
# codebooks at 2, 3 and 4 bits.
RATES = frozenset({(2, b) for b in (4, 5, 6, 7, 8)} | {(cb, b) for cb in (0, 1) for b in (4, 6, 8)})


def enabled() -> bool:
    choice = os.environ.get("TWINSPARK_EXL3_KERNEL", "auto")
    if choice not in ("auto", "cuda", "triton"):
        raise ValueError(f"TWINSPARK_EXL3_KERNEL must be auto, cuda or triton; got {choice!r}")
    return choice != "triton"


def covers(a: torch.Tensor, w: WeightArgs, block_m: int) -> bool:
    """Whether this product runs here: EXL3 weights at a built rate, float16 rows on CUDA, 16-slot tiles."""
    return runs(a.device, a.dtype, w, block_m)


def runs(device: torch.device, dtype: torch.dtype, w: WeightArgs, block_m: int) -> bool:
    """`covers` for rows of `dtype` on `device` that are not made yet."""
    n_multiple = SHORT_K_N_MULTIPLE if w.k <= SHORT_K else N_MULTIPLE
    return (w.fmt is Fmt.EXL3 and device.type == "cuda" and dtype == torch.float16 and block_m == BLOCK_M
            and (w.block_n, w.block_k // 8) in RATES and w.k % K_MULTIPLE == 0 and w.n % n_multiple == 0
            and enabled())


def build_of(k: int) -> tuple[tuple[str, int], ...]:
    """The tile-shape build a product of inner dimension k runs in (`extension`'s variant)."""
    return SHORT_K_BUILD if k <= SHORT_K else ()


def cache_dir() -> Path:
    root = Path(os.environ.get("TWINSPARK_CUDA_CACHE", Path.home() / ".cache" / "twinspark" / "cuda"))
    # One build per torch / CUDA version and GPU generation: a build of another is never loaded.
    major, minor = torch.cuda.get_device_capability()
    return root / f"torch{torch.__version__}-cuda{torch.version.cuda}-sm{major}{minor}".replace("+", "_")


def _build_dir(name: str) -> Path:
    path = cache_dir() / name
    path.mkdir(parents=True, exist_ok=True)
    return path


@lru_cache(maxsize=None)
def extension(variant: tuple[tuple[str, int], ...] = ()):
    """The compiled module (built once per process; torch's builder skips the compile when the cache is current).
    `variant`: tile-shape macros (TS_WARPS, TS_N_TILES, TS_UNROLL, TS_STAGES) for bench/ to compare builds."""
    from torch.utils.cpp_extension import load
    name = "twinspark_exl3_grouped" + "".join(f"_{k.lower()}{v}" for k, v in variant)
    return load(name=name, sources=[str(SOURCE)], build_directory=str(_build_dir(name)),
                extra_cuda_cflags=cuda_flags(variant), verbose=False)


def cuda_flags(variant: tuple[tuple[str, int], ...] = ()) -> list[str]:
    """nvcc's flags for a build (tests/kernels/test_exl3_cuda_build.py compiles the same for each architecture)."""
    return ["-O3", "-lineinfo", *(f"-D{k}={v}" for k, v in variant)]


def grouped(a: torch.Tensor, w: WeightArgs, pair_of_slot: torch.Tensor, expert_of_block: torch.Tensor) -> torch.Tensor:
    """out [slots, N] float32 = a [slots, K] @ T[expert of the slot's tile] (see the .cu file); `covers` holds."""
    out = torch.empty(a.shape[0], w.n, dtype=torch.float32, device=a.device)
    extension(build_of(w.k)).exl3_grouped(a, w.data, out, pair_of_slot, expert_of_block, w.data.shape[0], w.block_n,
                             w.block_k // 8)
    return out


def grouped_pair(a: torch.Tensor, w: WeightArgs, w2: WeightArgs, pair_of_slot: torch.Tensor,
                 expert_of_block: torch.Tensor) -> torch.Tensor:
    """`grouped` of two stacks of one layout (the MoE's gate and up) on one slot grid, in one launch: a [2 x slots,
    K] (w's rows, then w2's) -> out [2 x slots, N] float32 alike; each half's bits are those of `grouped` alone."""
    out = torch.empty(a.shape[0], w.n, dtype=torch.float32, device=a.device)
    extension(build_of(w.k)).exl3_grouped_pair(a, w.data, w2.data, out, pair_of_slot, expert_of_block,
                                               w.data.shape[0], w.block_n, w.block_k // 8)
    return out


def pairs_with(w: WeightArgs, w2: WeightArgs) -> bool:
    """Whether two weights can share a `grouped_pair` launch: one codebook, rate and trellis layout."""
    return (w.fmt is Fmt.EXL3 and w2.fmt is Fmt.EXL3 and (w.block_n, w.block_k) == (w2.block_n, w2.block_k)
            and w.data.shape == w2.data.shape and w.data.stride() == w2.data.stride())


def dense(a: torch.Tensor, w: WeightArgs) -> torch.Tensor:
    """[B, M, N] float32 = a [B, M, K] @ T[b] for each weight b of the stack (`covers` holds for a's rows)."""
    b, m, k = a.shape
    out = torch.empty(b, m, w.n, dtype=torch.float32, device=a.device)
    extension(build_of(k)).exl3_dense(a.reshape(b * m, k), w.data, out.view(b * m, w.n), m, w.block_n, w.block_k // 8)
    return out
