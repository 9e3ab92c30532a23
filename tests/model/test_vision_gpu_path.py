"""Images on the GPU path (the fused ops: the Triton kernels, here in Triton's CPU interpreter) on a tiny
checkpoint in fp32. An image-conditioned prompt with its image across position 64, the chunked prefill's grid:
- its logits match the torch path's (which match transformers': tests/model/test_vision.py) within
  tests/model/test_gpu_path.py's tolerance, prefilled in chunks on the grid (the second starts mid-image);
- whole and chunked give the same bits;
- the chunk that starts mid-image gives the same bits alone and packed behind another sequence's decode row, the
  batch put in class order the way the executor does it (`Batch.permuted`, which moves the image rows).
The tower is plain torch on the rank's device: run on the meta device (a device that is not the CPU: shapes, dtypes
and devices only) it keeps everything there in the compute dtype. tests/gpu/test_vision_cuda.py runs it all on CUDA
and sends images through `twinspark up --device cuda`, at TP=2 too when there are two GPUs."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gpu_support import triton  # noqa: F401  (skips the module without Triton)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without CUDA; on a "
                                "GPU tests/gpu/test_vision_cuda.py covers this")

from model.batch import Batch  # noqa: E402
from model.model import Glm5Model  # noqa: E402
from model.parallel import Sharding  # noqa: E402
from model.checkpoint import make_tiny  # noqa: E402
from tests.model.image_prompt import chunk_batches, gpu_path, image_prompt, prefill_logits  # noqa: E402
from tests.model.reference import clone_cache, fresh_cache, table  # noqa: E402

# 50 text ids, then the image: its 20 placeholders at positions 51..70, across the grid point 64. The interpreter
# pays ~0.4 s per row, so the prompt ends soon after the image.
BEFORE, AFTER = 50, 2
CHUNKS = [64, 64]  # the scheduler's cut: the second chunk starts at the image's 14th row
TOL = dict(rtol=1e-4, atol=1e-4)  # tests/model/test_gpu_path.py's


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """test_gpu_path's layout (5 layers KMKKM, index_topk 16), with make-tiny's vision tower."""
    return make_tiny(tmp_path_factory.mktemp("vision_gpu") / "ckpt", seed=4, layers=5, index_topk=16,
                     layer_pattern="KMKKM", indexer_pattern="FFFFS")


@pytest.fixture(scope="module")
def model(ckpt):
    # one virtual shard: the interpreter runs every kernel launch in Python
    return Glm5Model.load(ckpt, dtype=torch.float32, progress=False, sharding=Sharding(virtual=1), load_vision=True)


@pytest.fixture(scope="module")
def prompt(ckpt):
    return image_prompt(ckpt, before=BEFORE, after=AFTER)


@pytest.fixture(scope="module")
def take(model, prompt):
    """A chunk's image rows, cut from the tower's output for the whole image (as the executor does)."""
    emb = model.vision.forward(prompt.pixels, [prompt.grid])
    assert emb.shape[0] == prompt.tokens and emb.std() > 0.5  # the image really conditions the prompt
    return lambda first, count: emb[first : first + count]


@pytest.fixture(scope="module")
def chunked(model, prompt, take):
    """The GPU path's logits of the prompt in CHUNKS, the cache as the first chunk left it (2 slots), the second
    chunk's batch."""
    cache = fresh_cache(model, len(prompt.ids), slots=2)
    first, second = chunk_batches(prompt, CHUNKS, take)
    logits = [gpu_path(model, first, cache)]
    after_first = clone_cache(cache)
    logits.append(gpu_path(model, second, cache))
    return torch.cat(logits), after_first, second


def test_image_prompt_gpu_path_matches_torch_path(model, prompt, take, chunked):
    want = prefill_logits(model, prompt, CHUNKS, take)
    placeholders = lambda first, count: model.embed[prompt.ids[prompt.offset : prompt.offset + count]]  # noqa: E731
    unmerged = prefill_logits(model, prompt, CHUNKS, placeholders)
    seen = slice(prompt.offset, None)  # the rows from the first placeholder on
    moved = (unmerged[seen] - want[seen]).abs().max().item()
    delta = (chunked[0] - want).abs().max().item()
    print(f"\nimage prompt ({len(prompt.ids)} rows, image rows {prompt.offset}..{prompt.offset + prompt.tokens - 1}), "
          f"chunks {CHUNKS}: GPU path vs torch path max |dlogits| {delta:.2e}; unmerged, the logits move by up to "
          f"{moved:.2f}")
    assert moved > 100 * TOL["atol"]  # matching the torch path means the image was merged
    torch.testing.assert_close(chunked[0], want, **TOL)


def test_image_prompt_whole_equals_chunked_on_gpu_path(model, prompt, take, chunked):
    whole = prefill_logits(model, prompt, None, take, gpu_path)
    print(f"\nGPU path, whole vs chunks {CHUNKS} (cut at image row {64 - prompt.offset}): bit-identical "
          f"{torch.equal(whole, chunked[0])}, max |d| {(whole - chunked[0]).abs().max().item():.1e}")
    assert torch.equal(whole, chunked[0])


def test_mid_image_chunk_alone_equals_packed_behind_a_decode_row(model, prompt, chunked):
    logits, after_first, second = chunked
    alone = logits[CHUNKS[0]:]
    n = second.lengths[0]
    ((row, rows),) = second.embeds
    assert second.starts == [64] and row == 0 and rows.shape[0] < prompt.tokens  # it starts mid-image
    # Listed prompt chunk first; class order puts the other sequence's decode row (fresh, in slot 1) before it.
    mixed = Batch(token_ids=torch.cat([second.token_ids, torch.tensor([7])]), starts=[64, 0], lengths=[n, 1],
                  block_tables=torch.tensor([table(0, len(prompt.ids)), table(1, len(prompt.ids))]), slots=[0, 1],
                  logit_rows=torch.arange(n + 1), prompt=[True, False], embeds=second.embeds)
    packed, _ = mixed.permuted(mixed.class_order())
    assert packed.embeds[0][0] == 1  # the image rows moved behind the decode row
    together = gpu_path(model, packed, clone_cache(after_first))[:n]  # logits keep logit_rows' order
    assert torch.equal(alone, together)


def test_vision_tower_stays_on_its_device_in_the_compute_dtype(ckpt, prompt):
    """A CPU constant mixed into the tower's elementwise arithmetic fails on the meta device as it would on CUDA."""
    meta = Glm5Model.load(ckpt, dtype=torch.bfloat16, device="meta", progress=False, load_target=False,
                          load_mtp=False, load_vision=True)
    out = meta.vision.forward(prompt.pixels, [prompt.grid])
    assert (out.device.type, out.dtype, tuple(out.shape)) == ("meta", torch.bfloat16,
                                                              (prompt.tokens, meta.cfg.hidden_size))
