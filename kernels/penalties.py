"""Penalties and logit bias: what a request's history and settings do to its fp32 logits before the keyed draw.

Semantics (OpenAI where it defines them, vLLM otherwise; applied in vLLM's sampler order):

1. logit bias (OpenAI `logit_bias`): ``z_i += bias_i`` for the listed ids;
2. banned ids (vLLM `min_tokens`: EOS and stop ids until enough tokens are generated): ``z_i = -inf``;
3. repetition penalty (vLLM / HF, ``r > 0``, 1 = off) on every id seen in the prompt or the output:
   ``z_i / r`` where ``z_i > 0``, else ``z_i * r``;
4. frequency and presence penalties (OpenAI) over the output: ``z_i - f * count_i - p * [count_i > 0]``.

Exactness (DESIGN §5).  Every step is an elementwise IEEE operation (each rounded once, the same on CPU and CUDA)
or a scatter of distinct ids into one row, so a row's result depends only on its own logits and settings, never on
the other rows.  A step a row does not use leaves its values untouched bit for bit (it is selected away with
``where``, not added as 0, which would turn -0.0 into +0.0).  The ids travel sparse (a few per row), and only the
rows that use any of this are densified, so rows without penalties cost nothing.
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


def _dense(ids: Tensor, values: Tensor, vocab: int, fill) -> Tensor:
    """[Q, V]: ``values`` at each row's ``ids``, ``fill`` elsewhere. Padding ids (-1) write to one extra column,
    dropped afterwards; the real ids of a row are distinct, so the scatter's result does not depend on its order."""
    out = torch.full((ids.shape[0], vocab + 1), fill, dtype=values.dtype, device=ids.device)
    return out.scatter_(1, torch.where(ids >= 0, ids, vocab), values)[:, :vocab]


def _penalise(z: Tensor, pen: Penalties) -> Tensor:
    """The four steps on the penalised rows' logits ``z`` [Q, V] (float32)."""
    vocab = z.shape[1]
    if pen.bias_ids.shape[1]:  # widths are host facts: no read of the device
        biased = _dense(pen.bias_ids, pen.bias_ids >= 0, vocab, False)
        z = torch.where(biased, z + _dense(pen.bias_ids, pen.bias_values, vocab, 0.0), z)
    if pen.banned_ids.shape[1]:
        z = torch.where(_dense(pen.banned_ids, pen.banned_ids >= 0, vocab, False), float("-inf"), z)
    if pen.seen_ids.shape[1]:
        seen = _dense(pen.seen_ids, pen.seen_ids >= 0, vocab, False)
        r = pen.repetition[:, None]
        z = torch.where(seen, torch.where(z > 0, z / r, z * r), z)
        counts = _dense(pen.seen_ids, pen.seen_counts, vocab, 0)
        generated = counts > 0
        f = pen.frequency[:, None] * counts.to(torch.float32)
        z = torch.where(generated, (z - f) - pen.presence[:, None], z)
    return z


def apply_penalties(logits: Tensor, pen: Penalties | None) -> Tensor:
    """``logits`` (float32 [R, V]) with each penalised row's logit bias, banned ids and penalties applied; the other
    rows are returned unchanged. ``pen.rows`` must be distinct (one entry per row)."""
    logits = logits.to(torch.float32)
    if pen is None or not pen.rows.shape[0]:
        return logits
    z = _penalise(logits.index_select(0, pen.rows), pen)
    return logits.index_copy(0, pen.rows, z)
