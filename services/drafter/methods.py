"""Draft methods. Each takes one sequence (its tokens so far, at most `k` drafts, the target's last hidden state)
and returns up to `k` draft token ids. Drafts only propose: the ranks verify them, so a wrong draft costs time,
never correctness.

- `CopyDrafter` (n-gram prompt lookup): when the last n tokens (n = 3, 2, 1) occurred earlier in the sequence,
  propose what followed their most recent earlier occurrence, up to k tokens (continued periodically over the drafts
  when it runs into the end of the sequence).
- `MtpDrafter`: the checkpoint's MTP layer (`Glm5Model.forward_mtp`). Row i of the MTP block combines the target's
  final hidden state at position i with the embedding of token i+1 and predicts token i+2. The scheduler sends the
  hidden state of the row that sampled the last committed token, so row 0 = (that hidden, last token) predicts the
  first draft; further drafts chain on the MTP block's own output hidden state while the top probability stays at or
  above `threshold`.
  Cache: **recompute**. The drafter keeps, per request, the last `history` (hidden, token) pairs it was sent (one
  per round — positions it was never sent a hidden state for, like the prompt or the middle of an accepted window,
  are simply absent) and re-runs them as one small MTP prefill at compact positions 0..m-1 in a scratch cache before
  chaining the drafts. Nothing per request lives in a cache between calls, so there is nothing to free or keep in
  step with the scheduler; per-request histories are dropped least-recently-used beyond `max_requests`.
- `dflash2`: z-lab's DFlash2 block drafter (`services/drafter/dflash.py`) from user-supplied weights (the
  published ones are under a non-commercial licence and not shipped; `make-tiny --drafter dflash` writes a random
  one), conditioned on the target layers' outputs the ranks return.

Every method's `propose(request_id, tokens, k, hidden, hidden_start)`: `hidden_start` is the absolute position of
the first row of a [n, width] `hidden` (DFlash context rows); the other methods ignore it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import torch


class DraftMethodUnavailable(RuntimeError):
    pass


class CopyDrafter:
    name = "copy"

    def __init__(self, max_ngram: int = 3) -> None:
        self.max_ngram = max_ngram

    def check(self, tokens: list[int], hidden: torch.Tensor | None) -> None:
        """Any token ids will do: drafts are copies of them, verified by the ranks."""

    def propose(self, request_id: str, tokens: list[int], k: int, hidden: torch.Tensor | None = None,
                hidden_start: int = 0) -> list[int]:
        if k < 1:
            return []
        n_tok = len(tokens)
        for n in range(min(self.max_ngram, n_tok - 1), 0, -1):
            tail = tokens[n_tok - n :]
            # The most recent earlier occurrence; what followed it is copied, and when that runs into the end of
            # the sequence the copy goes on over the drafts themselves (a periodic continuation: "a b a b" -> a b).
            for start in range(n_tok - n - 1, -1, -1):
                if tokens[start : start + n] == tail:
                    ext = list(tokens)
                    for i in range(k):
                        ext.append(ext[start + n + i])
                    return ext[n_tok:]
        return []


class MtpDrafter:
    name = "mtp"

    def __init__(self, model_dir: str | Path, *, threshold: float = 0.0, history: int = 64, max_requests: int = 256,
                 max_draft: int = 8, device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        from model.model import Glm5Model

        self.model = Glm5Model.load(model_dir, dtype=dtype, device=device, load_target=False, progress=False)
        if self.model.mtp is None:
            raise DraftMethodUnavailable(f"{model_dir} has no MTP layer (num_nextn_predict_layers = 0)")
        self.threshold = threshold
        self.history = history
        self.max_requests = max_requests
        self.block_size = 16
        cap = history + max_draft + 1
        self.capacity = -(-cap // self.block_size) * self.block_size
        self.max_draft = max_draft
        self.cache = self.model.new_cache(num_blocks=self.capacity // self.block_size, block_size=self.block_size,
                                          num_slots=1)
        self.table = torch.arange(self.capacity // self.block_size, device=self.model.device)[None]
        self._hist: OrderedDict[str, list[tuple[torch.Tensor, int]]] = OrderedDict()
        self._lock = threading.Lock()  # one scratch cache: calls run one at a time

    def check(self, tokens: list[int], hidden: torch.Tensor | None) -> None:
        """Raise ValueError for ids outside the vocabulary or a hidden state of the wrong size."""
        cfg = self.model.cfg
        if tokens and max(tokens) >= cfg.vocab_size:
            raise ValueError(f"token id {max(tokens)} is outside the vocabulary [0, {cfg.vocab_size})")
        if hidden is not None and hidden.numel() != cfg.hidden_size:
            raise ValueError(f"hidden has {hidden.numel()} values, the model's hidden size is {cfg.hidden_size}")

    def forget(self, request_id: str) -> None:
        self._hist.pop(request_id, None)

    def _run(self, tokens: list[int], hidden: torch.Tensor, start: int):
        from model.batch import Batch

        dev = self.model.device
        n = len(tokens)
        batch = Batch(token_ids=torch.tensor(tokens, dtype=torch.long, device=dev), starts=[start], lengths=[n],
                      block_tables=self.table, slots=[0], logit_rows=torch.tensor([n - 1], device=dev),
                      hidden=hidden.to(dev))
        out = self.model.forward_mtp(batch, self.cache)
        return out.logits[0], out.hidden[n - 1]

    def propose(self, request_id: str, tokens: list[int], k: int, hidden: torch.Tensor | None = None,
                hidden_start: int = 0) -> list[int]:
        k = min(k, self.max_draft)
        if k < 1 or hidden is None or hidden.numel() == 0 or not tokens:
            return []
        with self._lock:
            hist = self._hist.pop(request_id, [])
            if not hist or hist[-1][1] != tokens[-1] or not torch.equal(hist[-1][0], hidden):
                hist.append((hidden.float().reshape(-1), tokens[-1]))
            hist = hist[-self.history :]
            self._hist[request_id] = hist
            while len(self._hist) > self.max_requests:
                self._hist.popitem(last=False)
            logits, h = self._run([t for _, t in hist], torch.stack([x for x, _ in hist]), 0)
            drafts: list[int] = []
            pos = len(hist)
            while True:
                probs = torch.softmax(logits.float(), dim=-1)
                p, tok = probs.max(dim=-1)
                if float(p) < self.threshold:
                    break
                drafts.append(int(tok))
                if len(drafts) >= k:
                    break
                logits, h = self._run([int(tok)], h[None].float(), pos)
                pos += 1
            return drafts


def build(method: str, model_dir: str | None, **kw):
    if method == "copy":
        return CopyDrafter()
    if method == "mtp":
        if not model_dir:
            raise DraftMethodUnavailable("--method mtp needs --model DIR (the checkpoint with the MTP layer)")
        return MtpDrafter(model_dir, **kw)
    if method == "dflash2":
        weights = kw.pop("weights", None)
        if not weights or not model_dir:
            raise DraftMethodUnavailable("--method dflash2 needs --dflash2-weights DIR (the drafter's "
                                         "user-supplied weights: not shipped) and --model DIR (the target, for its embedding and lm_head)")
        from services.drafter.dflash import DFlashDraftMethod

        try:
            return DFlashDraftMethod(weights, model_dir, **kw)
        except (OSError, ValueError) as exc:  # a missing folder, a config or tensors that do not fit
            raise DraftMethodUnavailable(f"--method dflash2: {exc}") from exc
    raise DraftMethodUnavailable(f"unknown draft method {method!r} (copy, mtp, dflash2)")
