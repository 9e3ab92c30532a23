"""Completion ids -> the text and ids a client sees: detokenization, the stopping token, stop strings.

The scheduler streams every token it committed, the one that stopped it included (its id comes back in
`Finished.stop_token_id`). That last token is hidden from both text and `token_ids` (its id is reported as
`stop_reason`; SGLang's `no_stop_trim` shows it like any other), so a token that ends generation is held back as soon as it arrives if it is one of the ids that can
end generation, until `Finished` says whether it did. Every other id is processed as soon as it arrives: no
latency is added for the common case.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

from .detokenizer import IncrementalDetokenizer
from .stop_strings import StopStringMatcher
from .tokenizer import TextTokenizer


def token_sha(ids: list[int]) -> str:
    """sha256 hex of the ids as int32 little-endian: compares two runs' outputs without shipping the ids."""
    return hashlib.sha256(struct.pack(f"<{len(ids)}i", *ids)).hexdigest()


@dataclass
class TokenLogprob:
    """One generated token's logprob and the most likely alternatives at its step (id, logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Delta:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # aligned with token_ids when asked for

    def __bool__(self) -> bool:
        return bool(self.text or self.token_ids)


class OutputAssembler:
    def __init__(self, tokenizer: TextTokenizer, *, stops: list[str], include_stop_str: bool = False,
                 skip_special_tokens: bool = True, final_ids: frozenset[int] = frozenset(), min_tokens: int = 0,
                 keep_stop_token: bool = False) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self._stops = StopStringMatcher(stops, include_stop_str)
        self._min_tokens = min_tokens  # vLLM: stop strings are looked for only in the text of later tokens
        self._final_ids = final_ids  # ids after which the scheduler stops (EOS unless ignore_eos, stop_token_ids)
        self._keep_stop_token = keep_stop_token  # SGLang's no_stop_trim: show the stopping token as any other
        self._held: int | None = None
        self._held_lp: TokenLogprob | None = None
        self.token_ids: list[int] = []   # the completion as reported (stopping token excluded)
        self.logprobs: list[TokenLogprob] = []  # aligned with token_ids when the request asked for logprobs
        self.text = ""                   # all text released so far
        self.stop_reason: str | int | None = None
        self.dropped_stop_token = False

    @property
    def stopped_by_string(self) -> bool:
        return self._stops.hit is not None

    @property
    def generated(self) -> int:
        """Tokens the model produced that count for this reply (the hidden stopping token included)."""
        return len(self.token_ids) + int(self.dropped_stop_token)

    def add(self, ids: list[int], logprobs: list[TokenLogprob] | None = None) -> Delta:
        """New ids (and their logprobs, when asked for) from the scheduler; returns what the client may see now.
        Stops consuming at a stop string."""
        delta = Delta()
        for i, tid in enumerate(ids):
            lp = logprobs[i] if logprobs else None
            if self._stops.hit is not None:
                break
            if self._held is not None:  # more output followed: the held id did not end generation after all
                held, self._held = self._held, None
                self._process(held, delta, self._held_lp)
                if self._stops.hit is not None:
                    break
            if tid in self._final_ids:
                self._held, self._held_lp = tid, lp
                continue
            self._process(tid, delta, lp)
        return delta

    def finish(self, stop_token_id: int | None) -> Delta:
        """The scheduler finished; `stop_token_id` is the id that stopped it (FINISH_STOP), else None."""
        delta = Delta()
        if self._stops.hit is not None:
            return delta
        if self._held is not None:
            held, self._held = self._held, None
            if held == stop_token_id and not self._keep_stop_token:
                self.dropped_stop_token = True
                self.stop_reason = held
            elif held == stop_token_id:
                self._process(held, delta, self._held_lp)
                self.stop_reason = held
            else:
                self._process(held, delta, self._held_lp)
        elif stop_token_id is not None:
            self.stop_reason = stop_token_id  # an id we did not know could stop; already shown (usually as "")
        if self._stops.hit is None:
            tail = self._detok.flush()
            if tail:
                self._emit_text(self._stops.feed(tail), delta)
            if self._stops.hit is None:
                self._emit_text(self._stops.flush(), delta)
        return delta

    def _process(self, tid: int, delta: Delta, lp: TokenLogprob | None = None) -> None:
        self.token_ids.append(tid)
        delta.token_ids.append(tid)
        if lp is not None:
            self.logprobs.append(lp)
            delta.logprobs.append(lp)
        piece = self._detok.push(tid)
        if piece:
            self._emit_text(piece if len(self.token_ids) <= self._min_tokens else self._stops.feed(piece), delta)

    def _emit_text(self, text: str, delta: Delta) -> None:
        if self._stops.hit is not None and self.stop_reason is None:
            self.stop_reason = self._stops.hit.stop
        if text:
            delta.text += text
            self.text += text
