"""Structured output in the scheduler: one llguidance matcher per constrained request, and its token masks.

The gateway turns JSON schemas, regexes, choices, grammars and tool calls into an llguidance grammar (JSON text,
`GenerateRequest.grammar`); here it is compiled against the checkpoint's tokenizer (`--tokenizer`) and walked with
the request's tokens. A mask is a pure function of the grammar and the tokens so far (exactness: the same request
gets the same masks, alone or in any batch, with or without drafts). Why llguidance and not xgrammar:
docs/benchmarks.md, "Grammar masks (CPU)".

Drafts: the masks of a verify window's rows are those of the grammar after the drafts before each row. A draft the
grammar forbids is cut off together with everything after it — the rank's own masked sample at that row could never
equal it, so it would be rejected anyway; cutting it saves the rows.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from llguidance import LLMatcher, LLTokenizer

from services.common.grammar_limits import parser_limits

log = logging.getLogger("twinspark.scheduler.grammar")


class GrammarError(ValueError):
    """The grammar does not compile (its text says why)."""


def allows(mask: torch.Tensor, token: int) -> bool:
    word = token // 32
    return 0 <= word < mask.numel() and bool((int(mask[word]) >> (token % 32)) & 1)


class RequestGrammar:
    """One request's matcher: the state after its generated tokens so far."""

    def __init__(self, matcher: LLMatcher) -> None:
        self._m = matcher
        self._masks: list[torch.Tensor] = []  # the masks of the rows sampled last, one per row
        self._committed = 0

    def _compute(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(self._m.compute_bitmask()), dtype=torch.int32)

    def mask(self) -> torch.Tensor:
        """int32 [V // 32 + 1] (llguidance's width): the tokens allowed next."""
        self._masks = [self._compute()]
        return self._masks[0]

    def window(self, drafts: list[int]) -> tuple[list[torch.Tensor], list[int]]:
        """Masks for a decode row followed by `drafts` (one per row), and the drafts the grammar allows (a prefix
        of `drafts`). The matcher is back in its current state afterwards."""
        masks = [self._compute()]
        kept: list[int] = []
        for d in drafts:
            if not allows(masks[-1], d) or not self._m.consume_token(d):
                break
            kept.append(d)
            masks.append(self._compute())
        if kept:
            self._m.rollback(len(kept))
        self._masks = masks[: len(kept) + 1]
        return self._masks, kept

    def commit(self, tokens: list[int]) -> str | None:
        """Advance past committed tokens (the samples of the rows masked last); None, or the FINISH_ERROR text.

        The library can fail on its own limits (a parser row or the lexer past its bound) in a mask or here, on
        the request's grammar: "invalid_grammar: ..." (generate.proto: the client's 400). The matcher then stays
        failed, and also reads as stopped (hence the error check first); a mask that failed allowed only EOS, so
        the stopping token comes here too. A token outside its row's mask is ours (a rank that did not apply it)."""
        if self._m.is_error():
            return self._failed()
        if self._m.is_stopped():  # past the grammar's end only stop ids follow; nothing left to check
            return None
        for t, mask in zip(tokens, self._masks):
            if not allows(mask, t):
                return f"structured output: token {t} was sampled outside its grammar mask"
        if not self._m.consume_tokens(tokens):
            return self._failed()
        self._committed += len(tokens)
        return None

    def _failed(self) -> str:
        return f"invalid_grammar: the grammar failed after {self._committed} output tokens: {self._m.get_error()}"


class GrammarBook:
    """The tokenizer's llguidance view, built once; compiles each request's grammar."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int]) -> None:
        # n_vocab: the model's (padded) vocabulary, so masks cover every id the ranks can sample; ids the
        # tokenizer lacks are never allowed. The stop ids are the grammar's end-of-sequence tokens: once the
        # grammar is complete, only they are allowed.
        self._tok = LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids))
        self.vocab_size = vocab_size

    @classmethod
    def load(cls, path: str, vocab_size: int, eos_ids: list[int]) -> "GrammarBook":
        """`path`: a checkpoint directory (its tokenizer.json) or the tokenizer.json file."""
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        text = p.read_text(encoding="utf-8")
        json.loads(text)  # a clear error for a file that is not a tokenizer
        book = cls(text, vocab_size, eos_ids)
        log.info("structured output on: llguidance over %s (%d ids)", p, vocab_size)
        return book

    def compile(self, grammar: str) -> RequestGrammar:
        """The grammar's matcher (the gateway checked it under the same limits before admission)."""
        try:
            matcher = LLMatcher(self._tok, grammar, log_level=0, limits=parser_limits())
        except BaseException as exc:  # noqa: BLE001 — a panic inside the library arrives as a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise GrammarError(f"the structured-output library failed on the grammar: {exc}") from None
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return RequestGrammar(matcher)
