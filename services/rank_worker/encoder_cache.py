"""Rank 0's cache of vision-tower outputs, so an image is encoded once per prompt, not once per prefill chunk.

A prompt longer than a round's token budget is prefilled in chunks, and every chunk that holds some of an image's
placeholder rows carries the whole image (StepPlan.images: pixels, grid, which embeddings go where). Without this
cache rank 0 would run the tower on the whole image for each such chunk — dozens of times for a large image in
256-token chunks. vLLM keeps an encoder cache in its scheduler for the same reason; here the tower lives on rank 0,
so the cache does too. Entries are keyed by the request's sha256 of the decoded pixels (ImageRows.digest) and the
patch grid, bounded in embedding rows (tokens), least recently used out first. A cached output is the same tensor
the tower returned, so the embeddings — and every logit after them — are bit-identical with or without it.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

Key = tuple[bytes, tuple[int, int, int]]


class EncoderCache:
    def __init__(self, max_tokens: int) -> None:
        """max_tokens: embedding rows kept in all (0: nothing is kept)."""
        self.max_tokens = max(0, max_tokens)
        self.tokens = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[Key, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Key) -> torch.Tensor | None:
        e = self._entries.get(key)
        if e is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return e

    def put(self, key: Key, embeddings: torch.Tensor) -> None:
        """Keep an image's tower output [tokens, hidden]; one larger than the whole cache is not kept."""
        n = embeddings.shape[0]
        if n > self.max_tokens or key in self._entries:
            return
        while self.tokens + n > self.max_tokens:
            _, old = self._entries.popitem(last=False)
            self.tokens -= old.shape[0]
        self._entries[key] = embeddings
        self.tokens += n
