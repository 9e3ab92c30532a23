"""Penalties and logit bias: what a request's history and settings do to its fp32 logits before the keyed draw.

Semantics (OpenAI where it defines them, vLLM otherwise; applied in vLLM's sampler order):

1. logit bias (OpenAI `logit_bias`): ``z_i += bias_i`` for the listed ids;
2. banned ids (vLLM `min_tokens`: EOS and stop ids until enough tokens are generated): ``z_i = -inf``;
3. repetition penalty (vLLM / HF, ``r > 0``, 1 = off) on every id seen in the prompt or the output:
   ``z_i / r`` where ``z_i > 0``, else ``z_i * r``;
4. frequency and presence penalties (OpenAI) over the output: ``z_i - f * count_i - p * [count_i > 0]``.

Exactness (docs/design.md §5).  Every step is an elementwise IEEE operation (each rounded once, the same on CPU and CUDA)
or a scatter of distinct ids into one row, so a row's result depends only on its own logits and settings, never on
the other rows.  A step a row does not use leaves its values untouched bit for bit (it is selected away with
``where``, and only the listed ids are touched: adding a bias of 0 would turn -0.0 into +0.0).  The ids travel
sparse (a few per row) and stay sparse: the work is a gather and a scatter of each row's listed ids, on the rows that
use any of this only, so rows without penalties cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from kernels.gpu import to_device

__all__ = ["Penalties", "apply_penalties"]


@dataclass
class Penalties:
    """Per penalised row, as tensors on the logits' device; id tensors are padded with -1 (no id).

    The widths (P, B, M) are the same for every row of a batch; a row that lists fewer ids is padded."""

    rows: Tensor         # int64 [Q] rows of the logits these apply to, distinct
    presence: Tensor     # float32 [Q] 0 = off
    frequency: Tensor    # float32 [Q] 0 = off
    repetition: Tensor   # float32 [Q] > 0, 1 = off
    seen_ids: Tensor     # int64 [Q, P] distinct ids seen: generated, and for repetition also the prompt's
    seen_counts: Tensor  # int64 [Q, P] times each was generated (0: only in the prompt, or padding)
    bias_ids: Tensor     # int64 [Q, B] distinct
    bias_values: Tensor  # float32 [Q, B]
    banned_ids: Tensor   # int64 [Q, M]

    def to(self, device: torch.device | str) -> "Penalties":
        """The same on `device`, copied without waiting for the device's queue (`kernels.gpu.to_device`)."""
        return Penalties(*(to_device(getattr(self, f.name), device) for f in fields(self)))


def _penalise(z: Tensor, pen: Penalties) -> Tensor:
    """The four steps on the penalised rows' logits ``z`` [Q, V] (float32), each a gather of the listed ids' logits,
    elementwise work on those, and a scatter back. The real ids of a row are distinct, so no scatter's result depends
    on its order; padding ids (-1) read and write one extra column, dropped at the end."""
    q, vocab = z.shape
    z = torch.cat([z, z.new_zeros(q, 1)], dim=1)

    def at(ids: Tensor) -> Tensor:
        return torch.where(ids >= 0, ids, vocab)

    if pen.bias_ids.shape[1]:  # widths are host facts: no read of the device
        i = at(pen.bias_ids)
        z.scatter_(1, i, z.gather(1, i) + pen.bias_values)
    if pen.banned_ids.shape[1]:
        z.scatter_(1, at(pen.banned_ids), float("-inf"))
    if pen.seen_ids.shape[1]:
        i = at(pen.seen_ids)
        v = z.gather(1, i)
        r = pen.repetition[:, None]
        v = torch.where(v > 0, v / r, v * r)
        counts = pen.seen_counts
        f = pen.frequency[:, None] * counts.to(torch.float32)
        v = torch.where(counts > 0, (v - f) - pen.presence[:, None], v)
        z.scatter_(1, i, v)
    return z[:, :vocab]


def apply_penalties(logits: Tensor, pen: Penalties | None) -> Tensor:
    """``logits`` (float32 [R, V]) with each penalised row's logit bias, banned ids and penalties applied; the other
    rows are returned unchanged. ``pen.rows`` must be distinct (one entry per row)."""
    logits = logits.to(torch.float32)
    if pen is None or not pen.rows.shape[0]:
        return logits
    z = _penalise(logits.index_select(0, pen.rows), pen)
    return logits.index_copy(0, pen.rows, z)
