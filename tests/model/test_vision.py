"""Vision against transformers' `glm5_next` (fp32, CPU): the tower's embeddings, and the logits of a prompt with an
image in it (embeddings merged at the image's placeholder rows, prefilled whole and in chunks that cut the image)."""

from __future__ import annotations

import json
from functools import lru_cache

import numpy as np
import pytest
import torch
from PIL import Image

from services.gateway.images import ImageProcessor
from services.rank_worker.model.batch import Batch
from services.rank_worker.model.model import Glm5Model
from tests.model.reference import fresh_cache, hf_model, random_ids, table

TOL = 1e-4


@lru_cache(maxsize=2)
def _ours(path) -> Glm5Model:
    return Glm5Model.load(path, dtype=torch.float32, progress=False, load_vision=True)


def _case(path):
    """(input ids with the image's placeholders, pixel values, grid, placeholder offset)."""
    cfg = json.loads((path / "config.json").read_text())
    img = Image.fromarray(np.random.default_rng(3).integers(0, 256, (90, 130, 3), dtype=np.uint8))
    proc = ImageProcessor.from_checkpoint(path)(img)
    before, after = random_ids(37, seed=1), random_ids(30, seed=2)
    ids = before + [cfg["image_start_token_id"]] + [cfg["image_token_id"]] * proc.tokens + \
        [cfg["image_end_token_id"]] + after
    return ids, torch.from_numpy(proc.pixel_values), proc.grid, len(before) + 1


@pytest.fixture(scope="module")
def reference(tiny_default):
    ids, pixels, grid, _ = _case(tiny_default)
    with torch.no_grad():
        out = hf_model(tiny_default)(input_ids=torch.tensor([ids]), pixel_values=pixels,
                                     image_grid_thw=torch.tensor([grid]))
    return out.logits[0].float()


@pytest.mark.parametrize("chunks", [None, [40, 24, 100]])
def test_image_prompt_logits_match_transformers(tiny_default, reference, chunks):
    ids, pixels, grid, offset = _case(tiny_default)
    model = _ours(tiny_default)
    emb = model.vision.forward(pixels, [grid])
    assert emb.shape[0] == model.vision.tokens(grid) and emb.std() > 0.5  # the image really conditions the prompt
    cache = fresh_cache(model, len(ids))
    out, pos = [], 0
    for n in chunks or [len(ids)]:
        n = min(n, len(ids) - pos)
        batch = Batch.single(ids[pos : pos + n], pos, table(0, len(ids)), all_logits=True)
        lo, hi = max(pos, offset), min(pos + n, offset + emb.shape[0])
        if lo < hi:  # this chunk holds (part of) the image
            batch.embeds = [(lo - pos, emb[lo - offset : hi - offset])]
        out.append(model.forward(batch, cache).logits)
        pos += n
    ours = torch.cat(out)
    delta = (ours - reference).abs().max().item()
    print(f"image prompt ({len(ids)} tokens, {emb.shape[0]} image tokens), chunks {chunks}: max |dlogits| "
          f"{delta:.2e}")
    assert delta <= TOL
