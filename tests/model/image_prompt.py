"""An image-conditioned prompt on a tiny checkpoint and its prefill in chunks, shared by the vision tests of the torch
path (tests/model/test_vision.py), of the GPU path in the interpreter (tests/model/test_vision_gpu_path.py) and on
CUDA (tests/gpu/test_vision_cuda.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from PIL import Image

from services.gateway.images import ImageProcessor
from model.batch import Batch
from model.cache import PagedCache
from model.model import Glm5Model
from tests.model.reference import fresh_cache, random_ids, table

# (first, count) -> the image's embeddings [first, first + count): what a chunk's placeholder rows take
Embeds = Callable[[int, int], torch.Tensor]


@dataclass(frozen=True)
class ImagePrompt:
    ids: list[int]  # text ids with the image's begin / placeholder / end tokens
    pixels: torch.Tensor  # [patches, patch_dim] fp32, as the gateway's image processor makes them
    grid: tuple[int, int, int]
    offset: int  # position of the first placeholder
    tokens: int  # placeholders (the tower's output rows)


def image_prompt(path: Path, before: int = 37, after: int = 30) -> ImagePrompt:
    """`before` random text ids, a 90 x 130 random image (20 placeholders on the tiny checkpoints), `after` more."""
    cfg = json.loads((path / "config.json").read_text())
    img = Image.fromarray(np.random.default_rng(3).integers(0, 256, (90, 130, 3), dtype=np.uint8))
    proc = ImageProcessor.from_checkpoint(path)(img)
    ids = random_ids(before, seed=1) + [cfg["image_start_token_id"]] + [cfg["image_token_id"]] * proc.tokens + \
        [cfg["image_end_token_id"]] + random_ids(after, seed=2)
    return ImagePrompt(ids, torch.from_numpy(proc.pixel_values), tuple(proc.grid), before + 1, proc.tokens)


def chunk_batches(p: ImagePrompt, chunks: list[int] | None, embeds: Embeds, *, slot: int = 0,
                  device: torch.device | str = "cpu") -> Iterator[Batch]:
    """The prompt in chunks of the given sizes (None: whole; the last chunk takes the rest), every row's logits
    wanted, a chunk's placeholder rows in `Batch.embeds` as the executor puts them there from `StepPlan.images`."""
    pos, n_ids = 0, len(p.ids)
    for n in chunks or [n_ids]:
        n = min(n, n_ids - pos)
        batch = Batch.single(p.ids[pos : pos + n], pos, table(slot, n_ids), slot=slot, all_logits=True,
                             device=device)
        lo, hi = max(pos, p.offset), min(pos + n, p.offset + p.tokens)
        if lo < hi:  # this chunk holds (part of) the image
            batch.embeds = [(lo - pos, embeds(lo - p.offset, hi - lo))]
        yield batch
        pos += n
    assert pos == n_ids, "the chunks must cover the prompt"


def torch_path(model: Glm5Model, batch: Batch, cache: PagedCache) -> torch.Tensor:
    return model.forward(batch, cache).logits


def gpu_path(model: Glm5Model, batch: Batch, cache: PagedCache) -> torch.Tensor:
    """Logits of the fused ops (the Triton kernels: in the interpreter on a CPU)."""
    return model.forward(batch, cache, fused=True).logits


def prefill_logits(model: Glm5Model, p: ImagePrompt, chunks: list[int] | None, embeds: Embeds,
                   run: Callable[[Glm5Model, Batch, PagedCache], torch.Tensor] = torch_path,
                   cache: PagedCache | None = None) -> torch.Tensor:
    """Every row's logits of the prompt prefilled in `chunks` (into a fresh cache unless one is given)."""
    cache = cache or fresh_cache(model, len(p.ids))
    return torch.cat([run(model, batch, cache) for batch in chunk_batches(p, chunks, embeds, device=model.device)])
