"""Vision against transformers' `glm5_next` (fp32, CPU): the tower's embeddings, and the logits of a prompt with an
image in it (embeddings merged at the image's placeholder rows, prefilled whole and in chunks that cut the image)."""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from model.model import Glm5Model
from tests.model.image_prompt import image_prompt, prefill_logits
from tests.model.reference import hf_model

TOL = 1e-4


@lru_cache(maxsize=2)
def _ours(path) -> Glm5Model:
    return Glm5Model.load(path, dtype=torch.float32, progress=False, load_vision=True)


@pytest.fixture(scope="module")
def reference(tiny_default):
    p = image_prompt(tiny_default)
    with torch.no_grad():
        out = hf_model(tiny_default)(input_ids=torch.tensor([p.ids]), pixel_values=p.pixels,
                                     image_grid_thw=torch.tensor([p.grid]))
    return out.logits[0].float()


@pytest.mark.parametrize("chunks", [None, [40, 24, 100]])
def test_image_prompt_logits_match_transformers(tiny_default, reference, chunks):
    p = image_prompt(tiny_default)
    model = _ours(tiny_default)
    emb = model.vision.forward(p.pixels, [p.grid])
    assert emb.shape[0] == p.tokens and emb.std() > 0.5  # the image really conditions the prompt
    ours = prefill_logits(model, p, chunks, lambda first, count: emb[first : first + count])
    delta = (ours - reference).abs().max().item()
    print(f"image prompt ({len(p.ids)} tokens, {p.tokens} image tokens), chunks {chunks}: max |dlogits| "
          f"{delta:.2e}")
    assert delta <= TOL


def test_tower_attention_in_query_blocks(tiny_default, monkeypatch):
    """A large image's attention runs a block of query rows at a time (vision.SCORES_PER_BLOCK, so its scores never
    all exist at once); forced down to 7 rows a block, the tiny image's embeddings are what one block gives."""
    from model import vision

    p = image_prompt(tiny_default)
    tower = _ours(tiny_default).vision
    heads, patches = tower.cfg.num_heads, p.pixels.shape[0]
    one_block = tower.forward(p.pixels, [p.grid])
    assert vision.query_rows(heads, patches) == patches
    monkeypatch.setattr(vision, "SCORES_PER_BLOCK", heads * patches * 7)
    assert vision.query_rows(heads, patches) == 7
    blocked = tower.forward(p.pixels, [p.grid])
    print(f"\n{patches} patches in blocks of 7 query rows: max |d| {(blocked - one_block).abs().max().item():.1e}")
    torch.testing.assert_close(blocked, one_block, rtol=1e-5, atol=1e-5)  # fp32 rounding
