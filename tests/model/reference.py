"""transformers' `glm5_next` as the fp32 reference, plus helpers to drive our runtime the same way."""

from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path

import torch

from model.batch import Batch
from model.cache import PagedCache
from model.model import Glm5Model

BLOCK = 16
CAP = 96  # positions per slot in `step`'s block tables


@lru_cache(maxsize=4)
def hf_model(path: Path):
    from transformers import Glm5NextForConditionalGeneration

    model = Glm5NextForConditionalGeneration.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@lru_cache(maxsize=4)
def our_model(path: Path) -> Glm5Model:
    return Glm5Model.load(path, dtype=torch.float32, progress=False)


@torch.no_grad()
def hf_logits(path: Path, ids: list[int]) -> torch.Tensor:
    return hf_model(path)(torch.tensor([ids])).logits[0].float()


def random_ids(n: int, seed: int, vocab: int = 500) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def fresh_cache(model: Glm5Model, tokens: int, slots: int = 4, kv_dtype: torch.dtype | None = None) -> PagedCache:
    return model.new_cache(num_blocks=slots * (-(-tokens // BLOCK)), block_size=BLOCK, num_slots=slots,
                           kv_dtype=kv_dtype)


def table(slot: int, tokens: int) -> list[int]:
    """Slot s uses its own contiguous run of blocks (enough for `tokens`)."""
    n = -(-tokens // BLOCK)
    return list(range(slot * n, (slot + 1) * n))


def run_chunks(model: Glm5Model, cache: PagedCache, ids: list[int], chunks: list[int], *, slot: int = 0,
               capacity: int = 512) -> torch.Tensor:
    """Feed `ids` as consecutive chunks of the given sizes (the rest one token at a time); logits of every row."""
    out, pos = [], 0
    sizes = chunks + [1] * (len(ids) - sum(chunks))
    for n in sizes:
        batch = Batch.single(ids[pos : pos + n], pos, table(slot, capacity), slot=slot, all_logits=True)
        out.append(model.forward(batch, cache).logits)
        pos += n
    return torch.cat(out)


def step(model: Glm5Model, cache: PagedCache, seqs: list[tuple[int, list[int], int, bool, bool]], *, gpu: bool
         ) -> list[torch.Tensor]:
    """One packed forward (the fused ops, or the torch reference); seqs: (slot, new ids, start,
    prompt, verify) in decode-class-first order -> logits of every row, per sequence. Verify windows keep one
    accepted draft."""
    ids = [i for _, new, _, _, _ in seqs for i in new]
    batch = Batch(token_ids=torch.tensor(ids), starts=[st for _, _, st, _, _ in seqs],
                  lengths=[len(new) for _, new, _, _, _ in seqs],
                  block_tables=torch.tensor([table(slot, CAP) for slot, _, _, _, _ in seqs]),
                  slots=[slot for slot, _, _, _, _ in seqs], logit_rows=torch.arange(len(ids)),
                  verify=[v for *_, v in seqs], prompt=[p for *_, p, _ in seqs])
    out = model.forward(batch, cache, fused=gpu)
    if any(v for *_, v in seqs):
        model.commit_verify(batch, cache, {s: 1 for s, (*_, v) in enumerate(seqs) if v})
    return list(out.logits.split(batch.lengths))


def clone_cache(cache: PagedCache) -> PagedCache:
    """A deep copy, so one cache state can be replayed several ways."""
    return copy.deepcopy(cache)


def cache_tensors(cache: PagedCache) -> dict[str, torch.Tensor]:
    """Every tensor a cache holds, by a readable name (fp8 scales included), to compare two caches bit for bit."""
    out = {}
    for name in ("latent", "index_keys"):
        for layer, store in getattr(cache, name).items():
            out[f"{name}[{layer}]"] = store.data
            if store.scale is not None:
                out[f"{name}[{layer}].scale"] = store.scale
    for name in ("kda_state", "conv_state"):
        out.update({f"{name}[{layer}]": t for layer, t in getattr(cache, name).items()})
    return out
