"""A thinking budget in the scheduler: when a reply that starts inside a think block has spent its budget without
ending it, the end of thinking is forced (`GenerateRequest.thinking`, generate.proto).

Forcing is sampling control, like a grammar: the row that must produce a forced token gets a mask allowing that
token alone (round_masks.py), so the ranks sample it as any other token — its logprob, its position in the keyed
draw, its verification inside a draft window and its count in the reply are the model's own. What is forced at a row
is a pure function of the request and the tokens before the row (exactness, docs/design.md §5):

- thinking has ended once a token of `end_ids` is generated (`</think>`, or a tool call's opening when the reply's
  tool calls are parsed: a call is never cut by a forced `</think>`); then nothing is forced, ever;
- otherwise the row at generated index i >= budget forces `forced_ids[i - budget]` (a message, then the end id).

Rounds overlap (engine.py): a row planned while earlier samples are in flight cannot know whether those samples
ended thinking, so a request whose next row could be forced asks for its samples first (`needs_samples`); rows
before the budget are never forced and keep the rounds overlapped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.common.thinking_limits import MAX_END_IDS, MAX_FORCED_IDS
from twinspark.v1 import generate_pb2


@dataclass(frozen=True)
class ThinkingSpec:
    """A request's budget, checked (validation.py `_thinking`)."""

    budget: int
    forced: tuple[int, ...]  # the message's ids, then the end-of-thinking id
    ends: frozenset[int]


def spec_error(msg: generate_pb2.ThinkingBudget, vocab: int) -> str | None:
    """Why `msg` cannot be run (the INVALID_ARGUMENT text), or None."""
    forced, ends = list(msg.forced_ids), set(msg.end_ids)
    if msg.budget < 0:
        return f"thinking.budget must be >= 0, got {msg.budget}"
    if not 1 <= len(forced) <= MAX_FORCED_IDS or not 1 <= len(msg.end_ids) <= MAX_END_IDS:
        return f"thinking needs 1..{MAX_FORCED_IDS} forced_ids and 1..{MAX_END_IDS} end_ids"
    bad = [t for t in forced + list(ends) if not 0 <= t < vocab]
    if bad:
        return f"thinking: token id {bad[0]} is outside the vocabulary [0, {vocab})"
    if forced[-1] not in ends or ends.intersection(forced[:-1]):
        return "thinking.forced_ids must end with one of end_ids and hold no other end id (the forced message " \
               "cannot end thinking half-way)"
    return None


class ThinkingBudget:
    """One request's budget and how far its committed tokens got."""

    def __init__(self, spec: ThinkingSpec) -> None:
        self.spec = spec
        self.ended = False  # an end id is among the committed tokens
        self.seen = 0  # committed tokens read so far (the request's generated tokens)
        self.conflict = False  # the request's grammar forbade a forced token (round_masks.py)

    def _forced_after(self, n: int, ended: bool) -> int | None:
        """The token forced at generated index n, with `ended` telling whether thinking ended before it."""
        if ended or n < self.spec.budget:
            return None
        return self.spec.forced[n - self.spec.budget]  # in range: the last forced id ends thinking

    def needs_samples(self, pending: int) -> bool:
        """Whether the next row (after `pending` samples in flight) could be forced: then it may be planned only
        once those samples are back, since one of them may have ended thinking."""
        return not self.ended and pending > 0 and self.seen + pending >= self.spec.budget

    def window(self, pending: int, drafts: Sequence[int]) -> tuple[list[int | None], int]:
        """The forced token of each sample row of a decode row followed by `drafts` (a verify window; none: one
        row), None where the row is free, and how many drafts to keep: a draft that differs from the token forced at
        its position is cut with everything after it (the rank's sample there could never equal it)."""
        assert not self.needs_samples(pending), "a row that may be forced is planned before its input is known"
        if pending:  # the row is before the budget (needs_samples): nothing forced, no drafts (windows never overlap)
            return [None], 0
        ended, n = self.ended, self.seen
        out = [self._forced_after(n, ended)]
        kept = 0
        for d in drafts:
            if out[-1] is not None and d != out[-1]:
                break
            ended = ended or d in self.spec.ends
            n += 1
            kept += 1
            out.append(self._forced_after(n, ended))
        return out, kept

    def commit(self, tokens: Sequence[int]) -> str | None:
        """Advance past committed tokens; None, or the FINISH_ERROR text when a forced row's sample is not its
        forced token (a grammar that forbade it, or a rank that did not apply the mask)."""
        for t in tokens:
            want = self._forced_after(self.seen, self.ended)
            if want is not None and t != want:
                if self.conflict:
                    return (f"invalid_grammar: the request's grammar does not allow token {want}, forced to end "
                            f"thinking after {self.spec.budget} thinking tokens")
                return f"thinking budget: token {t} was sampled where {want} was forced"
            self.ended = self.ended or t in self.spec.ends
            self.seen += 1
        return None
