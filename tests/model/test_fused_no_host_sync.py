"""The fused forward queues a round without waiting for the device: none of its torch ops is one that reads a device
value back to the host (`.item()` and friends, `nonzero`, boolean-mask indexing, `repeat_interleave` without its
output size, `unique`). On a GPU each of those holds the host until every kernel queued before it has run, so the
rank could not launch round n+1 while round n runs, and a prompt round's launch would stall once per op (a served
prompt round's host time was ~the GPU's: bench/results/whole_model-20261204-195605's round stats).

No GPU here: the fast path runs in Triton's CPU interpreter (as tests/model/test_gpu_path.py does) under a torch
dispatch mode that sees every aten op the forward issues. Triton's own launches and fla-core (GPU only) are not
seen; the rank's round stats catch those on a GPU ("host launch" against "GPU per round")."""

from __future__ import annotations

import traceback
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.kernels.gpu_support import triton  # noqa: F401  (skips the module without Triton)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without CUDA")

from model.checkpoint import make_tiny  # noqa: E402
from model.model import Glm5Model  # noqa: E402
from model.parallel import Sharding  # noqa: E402
from tests.model.reference import CAP, fresh_cache, random_ids, step  # noqa: E402

# aten ops whose output depends on device values the host must read first
READS_BACK = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_dim", "bincount",
              "masked_scatter"}


class _Watch(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.syncs: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        sync = name in READS_BACK
        if name.startswith("index") and len(args) > 1 and isinstance(args[1], (list, tuple)):
            sync = any(getattr(i, "dtype", None) == torch.bool for i in args[1] if i is not None)  # mask indexing
        if name == "repeat_interleave" and isinstance(args[0], torch.Tensor) and args[0].dtype != torch.bool:
            sync = kwargs.get("output_size") is None and (len(args) < 2 or isinstance(args[1], torch.Tensor))
        if sync:
            ours = [f for f in traceback.extract_stack()[:-1] if "/tests/" not in f.filename
                    and "site-packages" not in f.filename and "/lib/python" not in f.filename]
            self.syncs[f"{name} at {ours[-1].filename}:{ours[-1].lineno}" if ours else name] += 1
        return func(*args, **kwargs)


def test_a_mixed_round_reads_nothing_back(tmp_path_factory, monkeypatch) -> None:
    # KDA and MLA layers, a full indexer then a shared one, top-16 so the selection drops pools; MoE after layer 0
    path = make_tiny(tmp_path_factory.mktemp("no_sync") / "ckpt", seed=4, layers=4, layer_pattern="KMKM",
                     index_topk=16, indexer_pattern="FFFS")
    model = Glm5Model.load(path, dtype=torch.float32, progress=False, sharding=Sharding(virtual=2))
    a, b, c = random_ids(80, seed=1), random_ids(80, seed=2), random_ids(80, seed=3)
    cache = fresh_cache(model, CAP, slots=4)
    step(model, cache, [(0, a[:40], 0, True, False), (1, b[:21], 0, True, False)], gpu=True)
    # torch.inference_mode hides ops from a dispatch mode: the forward runs undecorated here, under no_grad
    monkeypatch.setattr(Glm5Model, "forward", Glm5Model.forward.__wrapped__)
    monkeypatch.setattr(Glm5Model, "run", Glm5Model.run.__wrapped__)
    monkeypatch.setattr(Glm5Model, "commit_verify", Glm5Model.commit_verify.__wrapped__)
    watch = _Watch()
    with torch.no_grad(), watch:
        # a decode row, a verify window (and its commit), a continuing prompt chunk and a fresh one shorter than the
        # conv history
        step(model, cache, [(1, b[21:22], 21, False, False), (0, a[40:43], 40, False, True),
                            (2, c[:30], 0, True, False), (3, c[30:32], 0, True, False)], gpu=True)
    assert not watch.syncs, f"ops that read the device back: {dict(watch.syncs)}"
