"""The hand-written CUDA EXL3 product (kernels/gpu/cuda/exl3_grouped.cu) compiles for every architecture the kernel
tables have a row for (kernels/gpu/arch.py: Hopper, sm_90; GB10, sm_121), both tile builds, every rate it is
instantiated at, within the architecture's shared memory a block and without spills. On a GPU torch's extension
builder compiles it for the GPU at hand on first use; nothing else builds it for GB10 before a Spark meets it.

nvcc only, no GPU: the kernels alone (TWINSPARK_DEVICE_ONLY leaves out torch's headers and the host code), with
the runtime's flags (exl3_cuda.cuda_flags). Skips where no nvcc of CUDA 12.9 or newer (sm_121) is installed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kernels.gpu import arch as gpu_arch, exl3_cuda


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    found = shutil.which("nvcc") or (str(Path(home) / "bin" / "nvcc") if home else None)
    return found if found and Path(found).exists() else None


NVCC = _nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="no nvcc here (CUDA 12.9 or newer has sm_121); on the GPU "
                                "machine the extension builds at a rank's warm-up")


@pytest.mark.parametrize("variant", [(), exl3_cuda.SHORT_K_BUILD], ids=["8-warp", "short-K"])
@pytest.mark.parametrize("arch", gpu_arch.ROWS)
def test_every_rate_builds_within_the_architecture(arch: int, variant, tmp_path) -> None:
    out = subprocess.run([NVCC, "--cubin", "-std=c++17", f"-arch=sm_{arch}", "-DTWINSPARK_DEVICE_ONLY",
                          "--resource-usage", *exl3_cuda.cuda_flags(variant), str(exl3_cuda.SOURCE), "-o",
                          str(tmp_path / "exl3.cubin")], capture_output=True, text=True, timeout=300)
    if "is not defined for option 'gpu-architecture'" in out.stderr:
        pytest.skip(f"this nvcc has no sm_{arch}: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    used = re.findall(r"Used (\d+) registers, used \d+ barriers, (\d+) bytes smem", out.stdout + out.stderr)
    spills = re.findall(r"(\d+) bytes spill stores", out.stdout + out.stderr)
    assert len(used) == len(exl3_cuda.RATES)
    assert all(int(smem) <= gpu_arch.SHARED_PER_BLOCK[arch] for _, smem in used), used
    assert all(int(regs) <= 255 for regs, _ in used) and set(spills) == {"0"}, (used, spills)
