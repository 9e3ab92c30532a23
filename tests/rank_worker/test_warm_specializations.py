"""The warm-up builds every Triton kernel variant that serving needs: rounds of other sizes, mixes and table widths
than the warm-up's ask for no new build (on an H200 each one is 0.2-1.2 s inside a user's request: the served
4-layer profile of bench/results/served_profile-20261204-165402 met 13 of them, docs/gpu-engine.md).

No GPU here: the fused forward runs in Triton's CPU interpreter (as tests/model/test_gpu_path.py does), and each
launch's key is computed as Triton's JIT computes it on CUDA (tests/kernels/triton_keys.py). Two virtual shards, as
a served rank runs several; the served rounds vary what changes from round to round: how many sequences and rows,
the block-table width, prompt chunks off the 16-row grid, decode rows beside prompts, sampled rows."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gpu_support import triton  # noqa: F401  (skips the module without Triton)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without CUDA; on a "
                                "GPU the rank's compile watch reports builds after the warm-up "
                                "(tests/gpu/test_served_cuda.py)")

from model.checkpoint import make_tiny  # noqa: E402
from model.model import Glm5Model  # noqa: E402
from model.parallel import Sharding  # noqa: E402
from services.rank_worker.executor import Executor  # noqa: E402
from services.rank_worker.warmup import _ids, _plan, warm_up  # noqa: E402
from tests.kernels.triton_keys import recording  # noqa: E402

BUDGET = 128  # the smallest warm-up that runs every round (two 64-row grid chunks)


def _blocks(slot: int, n: int) -> list[int]:
    return list(range(slot * 16, slot * 16 + n))


def test_served_rounds_need_no_kernel_build_the_warm_up_did_not_make(tmp_path_factory) -> None:
    path = make_tiny(tmp_path_factory.mktemp("warm_keys") / "ckpt", seed=4, layers=2, layer_pattern="KM",
                     indexer_pattern="FF")
    model = Glm5Model.load(path, dtype=torch.float32, progress=False, sharding=Sharding(virtual=2))
    model.fused = True  # the GPU path, interpreted
    executor = Executor(model, model.new_cache(num_blocks=256, block_size=16, num_slots=8), cuda_graphs=False)
    with recording() as warm:
        assert warm_up(executor, BUDGET) > 0
    v = model.cfg.vocab_size
    lengths = {0: 24, 1: 9, 2: 17}  # three prompts at once, two off the 16-row grid, tables of 2 and 3 blocks
    rounds = [
        _plan([(_ids(n, v), 0, s, _blocks(s, 2 if n < 16 else 3), True) for s, n in lengths.items()],
              [23, 32, 49], temperature=0.0),
        # their decode rows beside two more prompts (5-block tables), sampled with logprobs
        _plan([([5], n, s, _blocks(s, 3), False) for s, n in lengths.items()]
              + [(_ids(13, v), 0, s, _blocks(s, 5), True) for s in (5, 6)], [0, 1, 2, 15, 28], temperature=0.0,
              logprobs_k=3),
        # five decode rows, sampled at a temperature
        _plan([([5], n + 1, s, _blocks(s, 5), False) for s, n in lengths.items()]
              + [([5], 13, s, _blocks(s, 5), False) for s in (5, 6)], list(range(5)), temperature=0.7),
    ]
    with recording() as served:
        for plan in rounds:
            executor.execute(plan)
    new = served.new_since(warm)
    assert not new, "kernel builds the warm-up did not make (kernel: arguments that differ): " + "; ".join(
        f"{name}: {diff}" for name, diffs in new.items() for diff in diffs)
