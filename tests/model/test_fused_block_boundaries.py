"""The fused forward's block boundaries (FusedForward.hc_post_pre: a block's post and the next block's pre, one
launch fewer for decode-class rows) against the two ops they replace, hc_post then hc_pre: the same logits, final
hidden states and layer outputs bit for bit, here in Triton's CPU interpreter, for decode rows, a verify window and
both classes in one batch."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gpu_support import triton  # noqa: F401  (skips the module without Triton)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without CUDA")

from model.batch import Batch  # noqa: E402
from model.checkpoint import PRESETS, make_tiny  # noqa: E402
from model.model import Glm5Model  # noqa: E402
from ops.fused import FusedForward  # noqa: E402
from tests.model.reference import CAP, clone_cache, fresh_cache, random_ids, table  # noqa: E402


class TwoOps(FusedForward):
    """Every block boundary as the two fused ops it was before hc_post_pre."""

    def hc_post_pre(self, partials, streams, post, comb, coll, next_hc, next_norm, eps):
        streams = self.hc_post(partials, streams, post, comb, coll)
        return streams, *self.hc_pre(streams, next_hc, next_norm, eps)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Glm5Model:
    """Hidden 256, a multiple of the mHC projection's 256-wide chunk: make-tiny's 64 is none, and there
    hc_post_pre runs the two ops. 3 layers (KDA, MLA, KDA): two layer-to-layer boundaries besides each layer's own;
    4 virtual shards, so the boundary sums 4 partials."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(PRESETS, "hidden256", dict(hidden_size=256))
        path = make_tiny(tmp_path_factory.mktemp("boundaries") / "ckpt", seed=5, layers=3, index_topk=16,
                         layer_pattern="KMK", preset="hidden256")
    return Glm5Model.load(path, dtype=torch.float32, progress=False)


def batch(seqs: list[tuple[int, list[int], int, bool, bool]]) -> Batch:
    """seqs: (slot, new ids, start, prompt, verify), decode-class first."""
    ids = [i for _, new, _, _, _ in seqs for i in new]
    return Batch(token_ids=torch.tensor(ids), starts=[st for _, _, st, _, _ in seqs],
                 lengths=[len(new) for _, new, _, _, _ in seqs],
                 block_tables=torch.tensor([table(slot, CAP) for slot, _, _, _, _ in seqs]),
                 slots=[slot for slot, _, _, _, _ in seqs], logit_rows=torch.arange(len(ids)),
                 verify=[v for *_, v in seqs], prompt=[p for *_, p, _ in seqs])


def test_fused_boundaries_equal_the_two_ops(model: Glm5Model) -> None:
    a, b, c = random_ids(40, seed=1), random_ids(40, seed=2), random_ids(40, seed=3)
    cache = fresh_cache(model, CAP, slots=3)
    # the prompts on the torch path: the rounds below start from any cache state
    model.forward(batch([(0, a[:12], 0, True, False), (1, b[:5], 0, True, False)]), cache, fused=False)
    rounds = [
        [(1, b[5:6], 5, False, False), (0, a[12:15], 12, False, True), (2, c[:3], 0, True, False)],  # both classes
        [(1, b[6:7], 6, False, False), (0, a[14:15], 14, False, False), (2, c[3:4], 3, False, False)],  # decode
    ]
    caches = {TwoOps: cache, FusedForward: clone_cache(cache)}
    for seqs in rounds:
        bt = batch(seqs)
        outs = {}
        for ops, c_ in caches.items():
            outs[ops] = model.run(ops(bt, c_), layers=(0, 1, 2))
            model.commit_verify(bt, c_, {s: 1 for s, (*_, v) in enumerate(seqs) if v})
        want, got = outs[TwoOps], outs[FusedForward]
        assert torch.equal(got.logits, want.logits)
        assert torch.equal(got.hidden, want.hidden)
        assert torch.equal(got.layers, want.layers)
