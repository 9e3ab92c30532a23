"""Structured output failing mid-generation in the scheduler: the structured-output library's own limits end the
request with an "invalid_grammar: " error (the gateway's 400), a token outside its mask is ours, and a grammar that
failed in its mask cannot end as a silent stop on the EOS that mask allowed."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from llguidance import LLMatcher

from services.scheduler.grammar import GrammarBook
from tests.scheduler.harness import cluster, collect, make_request
from tests.scheduler.standin_rank import standin_token
from twinspark.v1 import generate_pb2

VOCAB = 1088  # the tiny checkpoint's
EOS = 1000
NEWLINE = 198


def _book(tiny: Path, eos: list[int]) -> GrammarBook:
    return GrammarBook.load(str(tiny), VOCAB, eos)


def _schema(schema: dict) -> str:
    return LLMatcher.grammar_from_json_schema(schema)


def _after_newline(schema: dict) -> str:
    """The gateway's reply grammar for a schema without reasoning: a newline, then the JSON."""
    body = {**json.loads(_schema(schema))["grammars"][0], "name": "body"}
    return json.dumps({"grammars": [{"name": "reply", "lark_grammar": "start: NL @body\nNL: /\\n/\n"}, body]})


def _allowed(mask, token: int) -> bool:
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


def test_a_parser_row_past_the_limit_is_invalid_grammar(tiny_default: Path) -> None:
    # 600 optional properties compile; the row after the newline holds 2,407 Earley items (the limit is 2,000).
    many = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}
    g = _book(tiny_default, [EOS]).compile(_after_newline(many))
    assert _allowed(g.mask(), NEWLINE)
    error = g.commit([NEWLINE])
    assert error is not None and error.startswith("invalid_grammar: the grammar failed after 0 output tokens")
    assert "2000" in error


def test_a_mask_that_failed_then_eos_is_invalid_grammar(tiny_default: Path) -> None:
    # {"$ref": "#"} compiles to a grammar that allows nothing: its first mask fails and allows only EOS.
    g = _book(tiny_default, [EOS]).compile(_schema({"$ref": "#"}))
    mask = g.mask()
    assert [t for t in range(VOCAB) if _allowed(mask, t)] == [EOS]
    error = g.commit([EOS])  # it read as stopped: None before
    assert error is not None and error.startswith("invalid_grammar:") and "NoExtension" in error


def test_a_token_outside_its_mask_is_not_blamed_on_the_grammar(tiny_default: Path) -> None:
    g = _book(tiny_default, [EOS]).compile(_after_newline({"type": "integer"}))
    g.mask()
    error = g.commit([5])  # only the newline was allowed
    assert error is not None and not error.startswith("invalid_grammar") and "outside its grammar mask" in error


def test_the_engine_finishes_a_failed_grammar_as_invalid_grammar_even_on_its_eos(tiny_default: Path) -> None:
    """The stand-in rank (which samples without masks) draws EOS first here, as a real rank must under a mask
    that allows only EOS: the engine skipped the grammar on stopping tokens and finished it as a plain stop."""
    prompt = [3, 1, 4]
    eos = standin_token(prompt, 0, 0.0, VOCAB)

    async def body() -> generate_pb2.Finished:
        async with cluster(1, rank=dict(vocab=VOCAB, eos=(eos,)), tokenizer=str(tiny_default)) as c:
            req = make_request(prompt, 4, rid="g", grammar=_schema({"$ref": "#"}))
            reply = await collect(c.stub.Generate(req, timeout=20))
            assert reply.tokens == [eos] and reply.finished is not None
            return reply.finished

    finished = asyncio.run(body())
    assert finished.reason == generate_pb2.FINISH_ERROR and finished.error.startswith("invalid_grammar:"), finished
