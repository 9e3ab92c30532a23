"""The peer side of bench/decode_prefill.py: transformers' `Glm5NextForConditionalGeneration` (with fla-core's KDA
kernels when they import) on the same shapes, timed the same way, so every figure comes with its ratio to the peer
measured in the same run (docs/reference.md §5).

The peer draws its own random weights with transformers' initialisation (its module layout fuses and renames
tensors, and copying ours across would tie this bench to one transformers version's conversion rules). Timings do not
depend on weight values except through routing, so the experts each step touches are counted for both sides.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bench.timing import median, time_calls
from model.checkpoint.config_builder import model_config
from model.checkpoint.spec import TinySpec

# ids the multimodal wrapper's config needs; the bench never feeds media, so any ids inside the vocabulary do
_MEDIA_IDS = {"<|image|>": 4, "<|video|>": 5, "<|begin_of_image|>": 6, "<|end_of_image|>": 7,
              "<|begin_of_video|>": 8, "<|end_of_video|>": 9}


def build(spec: TinySpec, device: torch.device, dtype: torch.dtype):
    """transformers' model for `spec` (text layers as ours, the tiny vision tower), random init, on `device`."""
    from transformers import AutoConfig, Glm5NextForConditionalGeneration

    raw = model_config(spec, token_ids=_MEDIA_IDS, pad_token_id=0, eos_token_ids=[1],
                       dtype=str(dtype).removeprefix("torch."))
    cfg = AutoConfig.for_model(**raw)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the compute dtype: an fp32 build of the real dims would not fit
    try:
        with torch.device(device):
            model = Glm5NextForConditionalGeneration(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


@torch.inference_mode()
def decode_ms(model, batch: int, context: int, vocab: int, *, warmup: int, iters: int, device: torch.device,
              gen: torch.Generator) -> float:
    """Median ms of one decode step of `batch` rows after a `context`-token prefill (transformers' own cache)."""
    ids = torch.randint(0, vocab, (batch, context), generator=gen).to(device)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    steps = [torch.randint(0, vocab, (batch, 1), generator=gen).to(device) for _ in range(warmup + iters)]

    def step(i: int) -> None:
        nonlocal cache
        cache = model(input_ids=steps[i], past_key_values=cache, use_cache=True, logits_to_keep=1).past_key_values

    return median(time_calls(step, warmup=warmup, iters=iters, device=device))


@torch.inference_mode()
def prefill_ms(model, tokens: int, vocab: int, *, warmup: int, iters: int, device: torch.device,
               gen: torch.Generator) -> float:
    """Median ms of one forward over a `tokens`-long prompt (logits of the last row only, as ours)."""
    ids = torch.randint(0, vocab, (1, tokens), generator=gen).to(device)
    step: Callable[[int], object] = lambda _i: model(input_ids=ids, use_cache=False, logits_to_keep=1)  # noqa: E731
    return median(time_calls(step, warmup=warmup, iters=iters, device=device))
