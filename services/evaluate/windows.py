"""A long token sequence cut into the windows a model scores, and which positions of each are counted.

Window i covers tokens [i * stride, i * stride + window). Each scored position is counted once: the first window
counts its positions 1.. (position 0 has nothing before it), a later one only the positions after the previous
window's end (the tokens before them are its context). stride == window: non-overlapping windows, the first token
of each unscored; stride < window: Hugging Face's sliding-window perplexity.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    start: int          # the window's first token in the text
    ids: list[int]
    counted_from: int   # index inside the window of the first counted position (>= 1)

    @property
    def counted(self) -> int:
        return len(self.ids) - self.counted_from


def cut(ids: list[int], window: int, stride: int | None = None, limit: int | None = None) -> list[Window]:
    """The windows of `ids` (at most `limit` of them); a last window shorter than 2 tokens is dropped."""
    stride = stride or window
    if window < 2 or not 1 <= stride <= window:
        raise ValueError(f"need window >= 2 and 1 <= stride <= window, got window {window}, stride {stride}")
    out: list[Window] = []
    counted_to = 1  # positions below this are counted (position 0 never is)
    for start in range(0, max(0, len(ids) - 1), stride):
        end = min(start + window, len(ids))
        first = max(counted_to, start + 1)
        if end - first >= 1 and end - start >= 2:
            out.append(Window(start, ids[start:end], first - start))
        counted_to = end
        if end == len(ids) or (limit is not None and len(out) >= limit):
            break
    return out
