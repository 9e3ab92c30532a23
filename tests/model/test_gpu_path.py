"""The GPU fast path (the fused ops of ops/fused.py: the Triton kernels of kernels/gpu, here in Triton's CPU interpreter)
against the torch reference forward on a tiny checkpoint in fp32: the same logits for prompt chunks, decode rows and
verify windows, and a decode row's logits bit-identical alone and packed with other rows.

On a GPU the same comparison runs in bf16 at real dims (tests/gpu); here it checks the fast path's logic —
metadata, cache addressing, pool keys, selection, the fused KDA decode — on every CPU test run."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gpu_support import triton  # noqa: F401  (skips the module without Triton)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without CUDA; on a "
                                "GPU tests/gpu/test_fast_path.py covers this at real dims")

from model.model import Glm5Model  # noqa: E402
from model.parallel import Sharding  # noqa: E402
from model.checkpoint import make_tiny  # noqa: E402
from tests.model.reference import CAP, clone_cache, fresh_cache, random_ids, step  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """5 layers KMKKM (dense FFNs then MoE; layer 4 reuses layer 1's DSA selection), index_topk 16 so selection
    drops pools, one virtual shard: the interpreter runs every kernel launch in Python, so fewer launches keep this
    test to seconds."""
    path = make_tiny(tmp_path_factory.mktemp("gpu_path") / "ckpt", seed=4, layers=5, index_topk=16,
                     layer_pattern="KMKKM", indexer_pattern="FFFFS")
    return Glm5Model.load(path, dtype=torch.float32, progress=False, sharding=Sharding(virtual=1))


def test_fast_path_matches_reference(model) -> None:
    a, b, c = random_ids(80, seed=1), random_ids(80, seed=2), random_ids(80, seed=3)
    rounds = [  # (slot, new ids, start, prompt, verify)
        [(0, a[:64], 0, True, False), (1, b[:21], 0, True, False)],  # prompt chunks, one ending on the 64 grid
        [(1, b[21:22], 21, False, False), (0, a[64:70], 64, True, False), (2, c[:1], 0, True, False)],
        [(1, b[22:25], 22, False, True), (0, a[70:71], 70, False, False), (2, c[1:9], 1, True, False)],
        # chunks shorter than the conv's history, continuing (its history keeps old inputs) and fresh, then decodes
        # that read the histories they left
        [(2, c[9:11], 9, True, False), (0, a[71:73], 71, True, False), (3, b[:2], 0, True, False)],
        [(2, c[11:12], 11, False, False), (0, a[73:74], 73, False, False), (3, b[2:3], 2, False, False)],
    ]
    caches = [fresh_cache(model, CAP, slots=4), None]
    caches[1] = clone_cache(caches[0])
    for seqs in rounds:
        want = step(model, caches[0], seqs, gpu=False)
        got = step(model, caches[1], seqs, gpu=True)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_fp8_cache_prompt_rows_match_reference(model) -> None:
    """Prompt rows over an fp8 latent cache: both attention forms (rows below the layer's `dense_until` take the
    expanded one) read the rows scaled back as the reference does; the second round's prompt continues from rows
    the first round stored."""
    a, b = random_ids(40, seed=5), random_ids(40, seed=6)
    rounds = [[(0, a[:30], 0, True, False), (1, b[:10], 0, True, False)],
              [(0, a[30:31], 30, False, False), (1, b[10:18], 10, True, False)]]
    caches = [fresh_cache(model, CAP, slots=2, kv_dtype=torch.float8_e4m3fn), None]
    caches[1] = clone_cache(caches[0])
    for seqs in rounds:
        want = step(model, caches[0], seqs, gpu=False)
        got = step(model, caches[1], seqs, gpu=True)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_decode_row_alone_equals_row_in_batch(model) -> None:
    ids = [random_ids(40, seed=10 + s) for s in range(4)]
    cache = fresh_cache(model, CAP, slots=4)
    # the prompts on the torch path: the check below starts from any cache state, and the interpreter's prompt
    # rows are most of this test's time
    step(model, cache, [(s, ids[s][:26 + s], 0, True, False) for s in range(4)], gpu=False)
    alone = step(model, clone_cache(cache), [(2, ids[2][28:29], 28, False, False)], gpu=True)[0]
    together = step(model, clone_cache(cache), [(0, ids[0][26:27], 26, False, False),
                                                (3, ids[3][29:32], 29, False, True),
                                                (2, ids[2][28:29], 28, False, False),
                                                (1, ids[1][27:33], 27, True, False)], gpu=True)[2]
    assert torch.equal(alone, together)
