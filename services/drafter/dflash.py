"""`DFlashDraftMethod`: block drafts from a DFlash2 drafter (`model/dflash`) conditioned on the target's layers.

What it reads: for every position of a request's context, the outputs of the drafter config's `target_layer_ids`
(each layer's mHC streams collapsed by their plain mean, concatenated in that order: `Glm5Model.forward(layers=)`),
which the ranks return for every row of a round when the plan asks (`StepPlan.hidden_layers`) and the scheduler
passes on as `DraftSequence.hidden` rows starting at the absolute position `hidden_start`. It uses the target's own
embedding and lm_head, read from the target checkpoint.

Context: **cache**. A request's context rows are fused (`DFlashDrafter.fuse`: fc + norm, one row at a time, so a
row depends only on its position's target outputs) once, when they arrive, and kept by absolute position; every
call drafts one block — the last committed token at position n - 1 (whose target outputs are not computed yet)
followed by `block_size - 1` masks — over the fused rows of positions start .. n - 2. The per-layer keys and values
of the context are recomputed each call (the fused rows are the state; a key cache would only save time). The rows
must arrive in order: rows that overlap the kept ones (a resend after a reply the scheduler did not get) replace them
from their first position; rows after a gap (the drafter restarted, or dropped the request) start the context anew
there. A context that does not reach position n - 2 gets no drafts. Contexts are dropped least-recently-used
beyond `max_requests`.

Drafts are proposals: the ranks verify them exactly, so a partial context (a prompt served from the prefix cache,
whose cached positions the ranks never recomputed) costs acceptance, never a reply's bits.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from model.dflash import DFlashConfig, DFlashDrafter, load_drafter
from model.parallel import Sharding
from model.weights import TEXT_PREFIX, WeightReader


@dataclass
class Context:
    """One request's fused context rows [n, H], for positions start .. start + n - 1."""

    start: int
    rows: torch.Tensor

    @property
    def end(self) -> int:
        return self.start + self.rows.shape[0]


class DFlashDraftMethod:
    name = "dflash2"

    def __init__(self, drafter_dir: str | Path, target_dir: str | Path, *, max_requests: int = 256,
                 device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.drafter: DFlashDrafter = load_drafter(drafter_dir, dtype=dtype, device=device)
        self.config: DFlashConfig = self.drafter.config
        reader = WeightReader(target_dir, Sharding(), dtype, torch.device(device), progress=False)
        try:
            self.embed = reader.full(TEXT_PREFIX + "embed_tokens.weight")
            self.head = reader.full("lm_head.weight")
        finally:
            reader.close()
        if tuple(self.embed.shape) != (self.config.vocab_size, self.config.hidden_size) or \
                self.head.shape != self.embed.shape:
            raise ValueError(f"{target_dir}: embedding {list(self.embed.shape)} / lm_head {list(self.head.shape)} "
                             f"do not fit the drafter ([{self.config.vocab_size}, {self.config.hidden_size}])")
        self.max_requests = max_requests
        self.device = torch.device(device)
        self._ctx: OrderedDict[str, Context] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def row_width(self) -> int:
        """Values per context position the scheduler sends: one hidden state per target layer read."""
        return len(self.config.target_layer_ids) * self.config.hidden_size

    def check(self, tokens: list[int], hidden: torch.Tensor | None) -> None:
        """Raise ValueError for ids outside the vocabulary or context rows of the wrong width."""
        if tokens and max(tokens) >= self.config.vocab_size:
            raise ValueError(f"token id {max(tokens)} is outside the vocabulary [0, {self.config.vocab_size})")
        if hidden is not None and (hidden.dim() != 2 or hidden.shape[1] != self.row_width):
            raise ValueError(f"hidden must be [n, {self.row_width}] (the target layers' outputs), "
                             f"got {list(hidden.shape)}")

    def forget(self, request_id: str) -> None:
        self._ctx.pop(request_id, None)

    def _keep(self, request_id: str, hidden: torch.Tensor | None, start: int) -> Context | None:
        """The request's context after taking in `hidden` (rows from position `start`)."""
        ctx = self._ctx.pop(request_id, None)
        if hidden is not None and hidden.shape[0]:
            with torch.inference_mode():
                fused = self.drafter.fuse(hidden.to(self.device, self.embed.dtype))
            if ctx is not None and ctx.start <= start <= ctx.end:
                ctx = Context(ctx.start, torch.cat((ctx.rows[: start - ctx.start], fused)))
            else:  # no context yet, or a gap: the context starts anew at these rows
                ctx = Context(start, fused)
        if ctx is not None:
            self._ctx[request_id] = ctx
            while len(self._ctx) > self.max_requests:
                self._ctx.popitem(last=False)
        return ctx

    def propose(self, request_id: str, tokens: list[int], k: int, hidden: torch.Tensor | None = None,
                hidden_start: int = 0) -> list[int]:
        """Up to min(k, block_size - 1) drafts after `tokens`."""
        with self._lock:
            ctx = self._keep(request_id, hidden, hidden_start)
            k = min(k, self.config.block_size - 1)
            anchor = len(tokens) - 1
            # Drafts need context rows for every position from the context's start up to the anchor's.
            if k < 1 or ctx is None or not ctx.start < anchor <= ctx.end:
                return []
            rows = ctx.rows[: anchor - ctx.start]  # positions before the anchor only
            return self._draft(rows, ctx.start, tokens[-1], anchor)[:k]

    @torch.inference_mode()
    def _draft(self, context: torch.Tensor, start: int, anchor_id: int, anchor_pos: int) -> list[int]:
        """One block from the anchor at `anchor_pos` over context rows at start .. anchor_pos - 1."""
        q = self.config.block_size
        block = self.drafter.mask_block(torch.tensor([anchor_id], device=self.device))
        positions = torch.cat((torch.arange(start, anchor_pos), torch.arange(anchor_pos, anchor_pos + q)))
        drafts = self.drafter.propose_from_context(context[None], block, positions[None].to(self.device),
                                                   self.embed, self.head)
        return drafts[0].tolist()
