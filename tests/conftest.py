"""Shared fixtures: tiny checkpoints written once per test session by `make-tiny`.

Without a GPU, Triton kernels (kernels/gpu) run in Triton's CPU interpreter so their logic is tested against the
torch twins here too. The switch must be set before anything imports triton, hence at the top of this file; the
interpreter's `tl.dot` is made row-invariant as a GPU's is, and its device-function calls skip re-patching
`triton.language` (tests/interpreter.py says why).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from tests import interpreter
    interpreter.install()

from model.checkpoint import make_tiny
from tests.model.quant_helpers import QUANT_BLOCK


@pytest.fixture(scope="session")
def tiny_default(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny checkpoint (what `twinspark make-tiny` writes with no options)."""
    return make_tiny(tmp_path_factory.mktemp("tiny_default") / "ckpt")


@pytest.fixture(scope="session")
def tiny_dflash(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`make-tiny --drafter dflash`: the default tiny checkpoint with a random DFlash2 drafter in ckpt/dflash2."""
    from model.checkpoint.dflash_writer import DRAFTER_DIR, write_tiny_dflash

    ckpt = make_tiny(tmp_path_factory.mktemp("tiny_dflash") / "ckpt")
    write_tiny_dflash(ckpt / DRAFTER_DIR, ckpt)
    return ckpt


@pytest.fixture(scope="session")
def tiny_sparse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3:1 KDA/MLA layout with index_topk (16) far below the test prompts, so DSA selection really drops tokens."""
    return make_tiny(tmp_path_factory.mktemp("tiny_sparse") / "ckpt", seed=1, index_topk=16)


@pytest.fixture(scope="session")
def tiny_shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two adjacent MLA layers (3, 4) where layer 4 reuses layer 3's indexer selection — the only placement of a
    shared indexer layer that transformers supports — plus a full MLA layer 7."""
    return make_tiny(tmp_path_factory.mktemp("tiny_shared") / "ckpt", seed=2, index_topk=16,
                     layer_pattern="KKKMMKKM", indexer_pattern="FFFFSFFF")


# ----- quantized checkpoints (issue 10): the tiny model quantized, and a random-trellis EXL3 one -----


@pytest.fixture(scope="session")
def tiny_fp8(tiny_default: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from model.quantize.convert import quantize_checkpoint
    from model.quantize.select import Recipe

    out = tmp_path_factory.mktemp("tiny_fp8") / "ckpt"
    quantize_checkpoint(tiny_default, out, Recipe("fp8", "fp8", block=QUANT_BLOCK), progress=False)
    return out


@pytest.fixture(scope="session")
def tiny_fp8_head(tiny_default: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The recipe int4+fp8+fp8 in one quantize run: int4 experts, fp8 for the rest and for lm_head (8 x 8 blocks:
    the tiny vocabulary's 272 rows a virtual shard are whole blocks of 8)."""
    from model.quantize.convert import quantize_checkpoint
    from model.quantize.select import Recipe

    out = tmp_path_factory.mktemp("tiny_fp8_head") / "ckpt"
    quantize_checkpoint(tiny_default, out, Recipe.parse("int4+fp8+fp8", block=QUANT_BLOCK), progress=False)
    return out


@pytest.fixture(scope="session")
def tiny_w4a16(tiny_default: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from model.quantize.convert import quantize_checkpoint
    from model.quantize.select import Recipe

    out = tmp_path_factory.mktemp("tiny_w4a16") / "ckpt"
    quantize_checkpoint(tiny_default, out, Recipe("w4a16", "w4a16", block=QUANT_BLOCK), progress=False)
    return out


@pytest.fixture(scope="session")
def tiny_int3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`make-tiny --preset int` (experts 128 wide) quantized to int3 in groups of 32: every MLP linear, the experts'
    down_proj included, and the attention linears whose shards are whole groups of 32."""
    from model.quantize.convert import quantize_checkpoint
    from model.quantize.select import Recipe

    dense = make_tiny(tmp_path_factory.mktemp("tiny_int_dense") / "ckpt", preset="int")
    out = tmp_path_factory.mktemp("tiny_int3") / "ckpt"
    quantize_checkpoint(dense, out, Recipe("int3", "int3", block=32), progress=False)
    return out


@pytest.fixture(scope="session")
def tiny_exl3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`make-tiny --format exl3 --layers 4 --experts 4`: random 4-bit mul1 trellises for every MLP linear, bf16
    attention (4 layers and 4 experts: its MLPs are 16x the default tiny model's, and the CPU pays for them)."""
    return make_tiny(tmp_path_factory.mktemp("tiny_exl3") / "ckpt", format="exl3", layers=4, experts=4)


# ----- tiers: every test gets one marker (pyproject.toml lists them), so a run can pick a tier with -m -----

_STACK_AREAS = ("e2e", "deploy", "bench", "launcher", "cli")  # start real services or the CLI as processes
TIERS = ("unit", "interpreter", "tp", "stack", "gpu")


def _tier(item: pytest.Item) -> str:
    """A test's own tier mark (tp: several rank processes over gloo), else one read off where it lives and what its
    module imports."""
    own = [m.name for m in item.iter_markers() if m.name in TIERS]
    if own:
        return own[0]
    area = Path(str(item.fspath)).relative_to(Path(__file__).parent).parts[0]
    if area == "gpu":
        return "gpu"
    if area in _STACK_AREAS:
        return "stack"
    source = Path(getattr(item.module, "__file__", "") or "")
    text = source.read_text() if source.is_file() else ""
    if any(sign in text for sign in ("gpu_support", "fused=True", "gpu=True")):
        return "interpreter"  # Triton kernels in Triton's CPU interpreter
    return "unit"


# ----- two workers (pytest-xdist, the README's `-n 2`; pyproject's addopts pick --dist loadscope) -----


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        # A worker shares the cores with the others: one torch thread each (oversubscribed OpenMP threads spin), and
        # one for every process its stacks spawn (ranks, drafter), which take their default from OMP_NUM_THREADS: two
        # workers' stacks side by side on 2 cores ran the e2e exactness and penalty files ~15% slower with the
        # default. Thread-count invariance has its own test (tests/model/test_row_invariance.py).
        torch.set_num_threads(1)
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = _tier(item)
        if not any(m.name == tier for m in item.iter_markers()):
            item.add_marker(getattr(pytest.mark, tier))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # A worker takes a module whole (--dist loadscope: its module-scoped stacks, models and checkpoints are made
        # once). Modules with processes or the interpreter first, the many short unit modules last, so they fill the
        # end of the run while the other worker finishes (sorted is stable: a module's tests keep their order).
        heavy = {item.path for item in items if not item.get_closest_marker("unit")}
        items.sort(key=lambda item: item.path not in heavy)
