"""Virtual shards on the GPU path (the fused ops: the Triton kernels of kernels/gpu in Triton's CPU interpreter): a
rank runs all of its local virtual shards in one launch per op, and that changes no bit.

A tiny model with 4 virtual shards runs the same rounds — prompt chunks, then a decode row, a verify window and a
prompt's next chunk together — at TP=1 (4 shards per launch), TP=2 (gloo ranks, 2 per launch) and TP=4 (one shard per rank:
the per-shard path). The logits are bit-identical, each rank makes the same launches whatever its shard count, and
TP=1 agrees with the torch reference forward.

fla-core's chunk_kda (prompt chunks, CUDA only) still runs once per shard (kda_attention.py says why); here the torch
twin stands in for it, so its calls are not Triton launches."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from tests.kernels.gpu_support import triton  # noqa: F401  (skips the module without Triton)

pytestmark = [pytest.mark.tp,  # several rank processes over gloo
              pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without CUDA")]

from model.model import Glm5Model  # noqa: E402
from model.checkpoint import make_tiny  # noqa: E402
from services.rank_worker.offline import run_on_ranks  # noqa: E402
from tests.model.reference import CAP, fresh_cache, random_ids, step  # noqa: E402
from tests.model.tp_jobs import gpu_path_rounds  # noqa: E402

A, B, C = (random_ids(24, seed=s) for s in (1, 2, 3))
ROUNDS = [  # (slot, new ids, start, prompt, verify), decode-class sequences first
    [(0, A[:20], 0, True, False), (1, B[:9], 0, True, False), (2, C[:6], 0, True, False)],
    [(0, A[20:21], 20, False, False), (1, B[9:12], 9, False, True), (2, C[6:11], 6, True, False)],
]
JOB = partial(gpu_path_rounds, rounds=ROUNDS, slots=3)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """2 layers (KDA + dense FFN, MLA/DSA + MoE), index_topk 8 so selection drops pools; 4 virtual shards (the
    default), 1 KDA head, 1 MLA head, a quarter of every FFN and of the vocabulary per shard."""
    return make_tiny(tmp_path_factory.mktemp("gpu_virtual_shards") / "ckpt", seed=5, layers=2, layer_pattern="KM",
                     indexer_pattern="FF", index_topk=8)


@pytest.fixture(scope="module")
def tp1(ckpt):
    return run_on_ranks(ckpt, JOB, tp=1)


def test_fused_shards_match_reference(ckpt, tp1) -> None:
    reference = Glm5Model.load(ckpt, dtype=torch.float32, progress=False)
    cache = fresh_cache(reference, CAP, slots=3)
    for seqs, got in zip(ROUNDS, tp1["logits"]):
        torch.testing.assert_close(got, torch.cat(step(reference, cache, seqs, gpu=False)), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_equals_tp1_with_the_same_launches(ckpt, tp1, tp) -> None:
    """TP=4 is the per-shard path (one local shard per rank); TP=1 runs the 4 shards in each launch."""
    result = run_on_ranks(ckpt, JOB, tp=tp)
    for r, (got, want) in enumerate(zip(result["logits"], tp1["logits"])):
        assert torch.equal(got, want), f"round {r}: TP={tp} max |dlogits| {(got - want).abs().max().item():.1e}"
    assert result["launches"] == tp1["launches"], f"TP={tp} rank 0 vs TP=1 launches by kernel"
    assert tp1["launches"]["_kda_decode_kernel"] == 1 and tp1["launches"]["_gated_norm_kernel"] == 2
