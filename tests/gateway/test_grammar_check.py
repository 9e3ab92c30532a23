"""Grammars the structured-output library cannot run are refused at admission, within 1 s, with a 400
`invalid_grammar` carrying its message — one test per class — while hard-looking grammars it can run pass; the
check's worker outlives the library crashing on it. Through the real gateway (STAND-IN scheduler: a refused
grammar never reaches it)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from services.gateway.checkpoint import CheckpointInfo
from services.gateway.errors import GatewayError
from services.gateway.prepare import ModelContext, prepare_chat
from services.gateway.schemas import ChatCompletionRequest, parse
from services.gateway.template import ChatTemplate
from services.gateway.tokenizer import TextTokenizer

from .conftest import GatewayServer
from .standin_scheduler import StandinServer

USER = [{"role": "user", "content": "hi"}]


def _props(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


def _ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]}
            for i in range(n)}
    return {"$defs": {**defs, f"d{n}": {"type": "integer"}}, "$ref": "#/$defs/d0"}


def _schema(schema: object) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


LARK_CHAIN = "start: r0\n" + "\n".join(f'r{i}: "x" r{i + 1} | "y"' for i in range(3_000)) + '\nr3000: "z"'
# (class, body fields, what the message says: the library's own words, or the check's)
REFUSED = [
    ("thousands of properties", _schema(_props(3_000)), ("items; max is 2000", "too complex")),
    ("a row past the limit deep inside", _schema({"type": "object", "required": ["x", "a"], "properties": {
        "x": {"type": "string"}, "a": {"type": "array", "items": _props(600)}}}), ("items; max is 2000",)),
    ("a $ref cycle that allows nothing", _schema({"$ref": "#"}), ("allows no output",)),
    ("a $ref chain that overflows the library's stack", _schema(_ref_chain(1_500)), ("crashed",)),
    ("a huge bound in a regex", {"structured_outputs": {"regex": "a{1000000}"}}, ("lexer", "too complex")),
    ("30,000 choices (a 0.7 s compile; 100,000 panic the library after 16 s)",
     {"structured_outputs": {"choice": [f"option {i}" for i in range(30_000)]}}, ("too complex",)),
    ("a Lark rule chain that overflows the stack", {"structured_outputs": {"grammar": LARK_CHAIN}}, ("crashed",)),
    ("10,000 properties (a 10 s compile)", {"guided_json": _props(10_000)}, ("too complex",)),
    ("an invalid regex", {"structured_outputs": {"regex": "(?=a)b"}}, ("look-around",)),
]
PASSED = [
    _schema({"type": "string", "pattern": "^(a+)+$"}), _schema({"type": "array", "minItems": 100_000}),
    _schema({"type": "string", "maxLength": 10**9}), _schema({"type": "string", "pattern": "^[a-z]{1000000}$"}),
    {"structured_outputs": {"choice": ["yes", "no"]}},
    _schema({"$defs": {"n": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}},
             "$ref": "#/$defs/n"}),
]


@pytest.mark.parametrize("what,fields,says", REFUSED, ids=[w for w, _, _ in REFUSED])
def test_refused_at_admission_within_a_second(gateway: GatewayServer, standin: StandinServer, what: str,
                                              fields: dict, says: tuple[str, ...]) -> None:
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        def chat(fields: dict) -> httpx.Response:
            return client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **fields})

        assert chat(PASSED[0]).status_code == 200  # the check's worker is up (or back up after the last crash)
        took = []
        for _ in range(2):  # the faster of two tries: a loaded 2-core machine may stall one of them
            before = len(standin.generator.records)
            started = time.monotonic()
            r = chat(fields)
            took.append(time.monotonic() - started)
            err = r.json()["error"]
            assert r.status_code == 400 and err["code"] == "invalid_grammar", (what, r.text[:300])
            assert any(s in err["message"] for s in says), (what, err["message"][:300])
            assert len(standin.generator.records) == before  # it never reached the scheduler
            if took[-1] <= 1.0:
                break
            assert chat(PASSED[0]).status_code == 200  # a crash of the check's worker: let it come back first
        assert min(took) <= 1.0, (what, took)


@pytest.mark.parametrize("fields", PASSED)
def test_hard_looking_grammars_the_library_runs_pass(gateway: GatewayServer, fields: dict) -> None:
    r = httpx.post(gateway.url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **fields},
                   timeout=30)
    assert r.status_code == 200, r.text[:300]


def _context(tiny_default: Path) -> ModelContext:
    """The gateway's model context of the tiny checkpoint, with a window that holds a tool's description (the test
    gateway's does not)."""
    ckpt = CheckpointInfo.load(tiny_default)
    return ModelContext(checkpoint=ckpt, tokenizer=TextTokenizer(tiny_default),
                        template=ChatTemplate.load(tiny_default, ckpt.tokenizer_config), max_model_len=4096)


def test_a_forced_tool_call_grammar_is_checked_too(tiny_default: Path) -> None:
    """Through `prepare_chat` (`_context`'s window holds the tools' description)."""
    ctx = _context(tiny_default)
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "^(?=a)b$"}}}}}
    req = parse(ChatCompletionRequest, ChatCompletionRequest(messages=USER, tools=[tool], tool_choice="required")
                .model_dump_json(exclude_none=True, by_alias=True).encode())
    try:
        with pytest.raises(GatewayError) as err:
            asyncio.run(prepare_chat(ctx, req))
    finally:
        ctx.grammar_check.close()
    assert err.value.status == 400 and err.value.code == "invalid_grammar" and err.value.param == "tool_choice"
    assert "look-around" in err.value.message


def test_a_grammars_verdict_is_kept(tiny_default: Path) -> None:
    """A client sends one schema with every request: its verdict is kept, so the second check asks no worker (the
    first one's worker is gone and none is started)."""
    from llguidance import LLMatcher

    checker = _context(tiny_default).grammar_check
    grammar = LLMatcher.grammar_from_json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    try:
        assert checker.verdict(grammar) is None
        checker._drop()  # the worker that checked it
        assert checker.verdict(grammar) is None and checker._proc is None
    finally:
        checker.close()


def test_a_starved_worker_is_waited_for(tiny_default: Path) -> None:
    """A loaded machine may not schedule the worker within WALL_S: stopped (SIGSTOP) for twice that, it has used no
    CPU, so the gateway waits and the grammar passes; the wait is bounded by STARVED_WALL_S, not the check's load."""
    import os
    import signal
    import threading

    from llguidance import LLMatcher

    from services.gateway.grammar_check import WALL_S

    checker = _context(tiny_default).grammar_check
    grammar = LLMatcher.grammar_from_json_schema({"type": "object", "properties": {"b": {"type": "string"}}})
    try:
        pid = checker._worker().pid
        os.kill(pid, signal.SIGSTOP)
        resume = threading.Timer(2 * WALL_S, os.kill, (pid, signal.SIGCONT))
        resume.start()
        started = time.monotonic()
        assert checker.verdict(grammar) is None
        assert time.monotonic() - started >= 2 * WALL_S and checker._proc is not None and checker._proc.pid == pid
        resume.join()
    finally:
        checker.close()
