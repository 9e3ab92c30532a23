"""Which output tile a program computes: grouped ordering for L2 reuse, shared by the GEMM and the grouped MoE
kernels. It changes which program runs a tile, never a tile's arithmetic, so it keeps every bit.

Programs are dispatched in id order, so the ones running at once are neighbours in id. Row-tile-major order (one
row tile sweeping every column tile) gives each concurrent program its own weight columns; column-major (one
column tile over every row tile) its own rows, and a grouped MoE tile's rows belong to one expert, so neighbours
there would read different experts' weights: the grouped gate|up and down launches of a long prompt ran that way
at about what their bytes allow when no tile is shared in L2 (docs/benchmarks.md, "Expert products"). Grouped
ordering lets GROUP_M row tiles sweep the column tiles together: their rows (and, in a GEMM or an
expert's run of row tiles, their weights) are read from L2 by the whole group.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program `pid` over a num_m x num_n grid of tiles."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def launch_tile(n_cols, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of this program in a launch of (row tiles x cdiv(n_cols, BLOCK_N)) programs along
    axis 0, in grouped order."""
    num_n = tl.cdiv(n_cols, BLOCK_N)
    return grouped_tile(tl.program_id(0), tl.num_programs(0) // num_n, num_n, GROUP_M)
