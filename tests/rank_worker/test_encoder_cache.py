"""Rank 0's encoder cache: an image whose placeholders span several prefill chunks is encoded once, and the
embeddings every chunk gets are the same bits as encoding it each time."""

from __future__ import annotations

import json

import pytest
import torch

from services.rank_worker.encoder_cache import EncoderCache
from services.rank_worker.executor import Executor
from services.rank_worker.plan_checks import ImagePart
from model.model import Glm5Model
from model.vision import VisionConfig
from tests.model.image_prompt import image_prompt


def test_lru_in_tokens():
    c = EncoderCache(max_tokens=10)
    a, b, big = torch.zeros(4, 2), torch.ones(5, 2), torch.zeros(11, 2)
    c.put((b"a", (1, 2, 2)), a)
    c.put((b"b", (1, 2, 2)), b)
    assert c.tokens == 9 and c.get((b"a", (1, 2, 2))) is a  # a is now the most recently used
    c.put((b"c", (1, 2, 2)), torch.zeros(3, 2))  # 12 > 10: the least recently used (b) goes
    assert c.get((b"b", (1, 2, 2))) is None and c.get((b"a", (1, 2, 2))) is a and c.tokens == 7
    c.put((b"big", (1, 2, 2)), big)  # larger than the whole cache: not kept, nothing evicted for it
    assert c.get((b"big", (1, 2, 2))) is None and len(c) == 2
    assert c.get((b"a", (1, 4, 4))) is None  # another grid is another key
    assert (c.hits, c.misses) == (2, 3)
    assert EncoderCache(0).max_tokens == 0


@pytest.fixture(scope="module")
def model(tiny_default) -> Glm5Model:
    return Glm5Model.load(tiny_default, dtype=torch.float32, progress=False, load_vision=True)


def _executor(model: Glm5Model, path, tokens: int) -> Executor:
    vision = VisionConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    return Executor(model, model.new_cache(num_blocks=8, block_size=16, num_slots=2), vision=vision,
                    encoder_cache_tokens=tokens)


@pytest.mark.parametrize("tokens", [0, 1000])
def test_an_image_over_three_chunks_is_encoded_once(model, tiny_default, monkeypatch, tokens):
    p = image_prompt(tiny_default)
    calls = []
    tower = model.vision.forward
    monkeypatch.setattr(model.vision, "forward", lambda *a, **k: calls.append(1) or tower(*a, **k))
    ex = _executor(model, tiny_default, tokens)
    whole = tower(p.pixels, [p.grid]).to(model.dtype)
    cuts = [0, 7, 15, p.tokens]  # three chunks, each holding part of the image
    got = []
    for lo, hi in zip(cuts, cuts[1:]):
        part = ImagePart(row=3, first=lo, count=hi - lo, pixels=p.pixels, grid=p.grid, digest=b"\x07" * 32)
        [(row, e)] = ex.embed_images([part])
        assert row == 3
        got.append(e)
    assert torch.equal(torch.cat(got), whole)  # the same bits as one encoding, cached or not
    assert len(calls) == (1 if tokens else 3)
    # without a digest (a plan that does not say which image it is) nothing is kept
    ex.embed_images([ImagePart(0, 0, 2, p.pixels, p.grid, b"")])
    assert len(calls) == (2 if tokens else 4)
