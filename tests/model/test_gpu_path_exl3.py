"""A tiny EXL3 checkpoint (`make-tiny --format exl3`) through the GPU fast path with its experts kept packed (the
grouped EXL3 kernels of kernels/gpu, in Triton's CPU interpreter) against the torch reference forward, which reads
the same experts dequantized at load: the same logits within float32 rounding, and a decode row's logits the same
bits alone and packed with other rows.

On the CPU the loader hands the model dense experts (packing is for CUDA), so `PackedReader`
(tests/model/packed_reader.py) — test-only — claims a
CUDA device to the MoE layers while reading the shards on the CPU, which is what the interpreter computes on.
On a GPU, tests/gpu/test_exl3_kernels.py runs the EXL3 model at real dims instead."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gpu_support import triton  # noqa: F401  (skips the module without Triton)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without CUDA; on a "
                                "GPU tests/gpu/test_exl3_kernels.py covers this at real dims")

from kernels.gpu.wtiles import Fmt  # noqa: E402
from model.ffn import Moe  # noqa: E402
from model.model import Glm5Model  # noqa: E402
from model.parallel import Sharding  # noqa: E402
from model.checkpoint import make_tiny  # noqa: E402
from model.weights import TEXT_PREFIX, WeightReader  # noqa: E402
from tests.model.packed_reader import PackedReader  # noqa: E402
from tests.model.reference import CAP, clone_cache, fresh_cache, random_ids, step  # noqa: E402




@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Glm5Model, Glm5Model]:
    """(reference, packed): 2 layers KM (a dense FFN, then the MoE), 4 experts, one virtual shard, float32."""
    path = make_tiny(tmp_path_factory.mktemp("gpu_path_exl3") / "ckpt", seed=6, layers=2, experts=4,
                     layer_pattern="KM", indexer_pattern="FF", format="exl3", exl3_bits=3, exl3_codebook="mcg")
    load = dict(dtype=torch.float32, progress=False, sharding=Sharding(virtual=1), load_mtp=False)
    reference, packed = Glm5Model.load(path, **load), Glm5Model.load(path, **load)
    reader = WeightReader(path, Sharding(virtual=1), torch.float32, torch.device("cpu"), progress=False)
    swapped = 0
    for i, layer in enumerate(packed.layers):
        if isinstance(layer.ffn, Moe):
            layer.ffn = Moe(packed.cfg, PackedReader(reader), f"{TEXT_PREFIX}layers.{i}.")
            moe = layer.ffn.params
            assert moe.packed and moe.gate.fmt is Fmt.EXL3 and moe.shared_in_stack and layer.ffn.shared_apart is None
            swapped += 1
    reader.close()
    assert swapped == 1
    return reference, packed


def test_packed_exl3_experts_match_reference_and_keep_rows_invariant(models) -> None:
    """A prompt round, then a decode round (a decode row beside a prompt chunk), against the reference; and the
    decode row's logits alone = in that batch, bit for bit."""
    reference, packed = models
    ids = [random_ids(30, seed=s) for s in range(2)]
    caches = [fresh_cache(reference, CAP, slots=2), None]
    caches[1] = clone_cache(caches[0])
    prompts = [(0, ids[0][:20], 0, True, False), (1, ids[1][:9], 0, True, False)]
    decode = [(1, ids[1][9:10], 9, False, False), (0, ids[0][20:24], 20, True, False)]
    for seqs in (prompts, decode):
        want = step(reference, caches[0], seqs, gpu=False)
        if seqs is decode:
            alone = step(packed, clone_cache(caches[1]), decode[:1], gpu=True)[0]
        got = step(packed, caches[1], seqs, gpu=True)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    assert torch.equal(alone, got[0])
