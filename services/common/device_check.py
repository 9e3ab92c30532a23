"""What `--device cuda` needs, checked before anything starts, so a missing piece is one clear line instead of a
traceback from a child process.

The CPU path needs nothing beyond the base install. The GPU path needs a CUDA build of torch that sees a GPU and
Triton (CUDA builds of torch bring it: every fused kernel in kernels/gpu is a Triton kernel). fla-core and
humming-kernels (the `gpu` extra) are optional: without them prompt chunks run KDA through the torch twin and integer
experts the portable Triton decode, slow but exact, so their absence is a warning, not a refusal.
"""

from __future__ import annotations

import importlib.util

GPU_INSTALL_HINT = ("install a CUDA build of torch (e.g. pip install torch --index-url "
                    "https://download.pytorch.org/whl/cu130) and the GPU extra: pip install -e '.[gpu]'")


def device_problem(device: str) -> str | None:
    """None when `device` can run here, else one line naming what is missing and how to get it."""
    if not device.startswith("cuda"):
        return None
    import torch

    if torch.version.cuda is None:
        return (f"--device cuda needs a CUDA build of torch, but this torch ({torch.__version__}) is CPU-only; "
                f"{GPU_INSTALL_HINT}; or use --device cpu")
    if not torch.cuda.is_available():
        return (f"--device cuda needs a GPU, but torch {torch.__version__} (CUDA {torch.version.cuda}) sees none "
                f"(driver missing, or CUDA_VISIBLE_DEVICES hides every GPU); use --device cpu")
    if importlib.util.find_spec("triton") is None:
        return f"--device cuda needs Triton (every GPU kernel is a Triton kernel); pip install triton, or {GPU_INSTALL_HINT}"
    return None


def device_warnings(device: str) -> list[str]:
    """What still runs without a piece, but slower (said once at startup)."""
    if not device.startswith("cuda"):
        return []
    missing = []
    if importlib.util.find_spec("fla") is None:
        missing.append("fla-core is not installed: prompt chunks run KDA through the torch twin (exact, but slow); "
                       "pip install -e '.[gpu]' installs it")
    if importlib.util.find_spec("humming") is None:
        missing.append("humming-kernels is not installed: integer experts (int2/3/4/8) run the portable Triton "
                       "decode (exact, several times slower); pip install -e '.[gpu]' installs it")
    return missing
