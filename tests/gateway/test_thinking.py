"""The thinking budget in the gateway: which budget a request gets in each API (thinking.py), what the scheduler is
told to force, the room a grammar needs after thinking (shortest.py), the reasoning grammar, the parser and
reasoning_tokens around a forced or a tool-call end of thinking, and the server's settings."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import anthropic
import numpy as np
import openai
import pytest
from llguidance import LLMatcher, LLTokenizer

from services.common.shared_flags import parse_effort_budgets
from services.gateway.checkpoint import CheckpointInfo
from services.gateway.errors import GatewayError
from services.gateway.generation import Final
from services.gateway.prepare import ModelContext, prepare_chat, prepare_completion
from services.gateway.reply_parser import ContentDelta, ReasoningDelta, ReplyParser, ToolCall
from services.gateway.responses import reasoning_tokens
from services.gateway.schemas import ChatCompletionRequest, ChatTool, CompletionRequest, parse
from services.gateway.shortest import shortest_json, shortest_tool_call
from services.gateway.template import ChatTemplate
from services.gateway.thinking import ThinkingIds, ThinkingSettings
from services.gateway.tokenizer import TextTokenizer

from .conftest import GatewayServer
from .standin_scheduler import StandinServer

MSG = [{"role": "user", "content": "hi"}]
CLOSE, TOOL = 1017, 1018  # the tiny tokenizer's </think> and <tool_call>
EOS = 1000
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"]}}}]
PERSON = {"type": "object", "required": ["name", "age"], "properties": {
    "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0}}}


def _ctx(tiny: Path, **settings) -> ModelContext:
    ckpt = CheckpointInfo.load(tiny)
    return ModelContext(checkpoint=ckpt, tokenizer=TextTokenizer(tiny),
                        template=ChatTemplate.load(tiny, ckpt.tokenizer_config),
                        thinking_settings=ThinkingSettings(**settings))


@pytest.fixture(scope="module")
def ctx(tiny_default: Path) -> ModelContext:
    c = _ctx(tiny_default)
    yield c
    c.grammar_check.close()


def _chat(ctx: ModelContext, **fields):
    req = parse(ChatCompletionRequest, json.dumps({"messages": MSG, **fields}).encode())
    return asyncio.run(prepare_chat(ctx, req))


def _completion(ctx: ModelContext, **fields):
    return asyncio.run(prepare_completion(ctx, parse(CompletionRequest, json.dumps(fields).encode())))


# ---------------------------------------------------------------------------------------- which budget applies

def test_no_budget_unless_one_is_named(ctx: ModelContext) -> None:
    assert not _chat(ctx).request.HasField("thinking")  # thinking on, unbounded: vLLM's default


def test_thinking_token_budget_reaches_the_scheduler_with_what_to_force(ctx: ModelContext) -> None:
    t = _chat(ctx, thinking_token_budget=5).request.thinking
    assert (t.budget, list(t.forced_ids), list(t.end_ids)) == (5, [CLOSE], [CLOSE])
    t = _chat(ctx, thinking_token_budget=0, tools=TOOLS).request.thinking  # calls parsed: an opening ends thinking
    assert (t.budget, list(t.forced_ids), list(t.end_ids)) == (0, [CLOSE], [CLOSE, TOOL])
    assert not _chat(ctx, thinking_token_budget=5, tools=TOOLS, tool_choice="none").request.thinking.end_ids[1:]
    both = _chat(ctx, thinking_token_budget=3, n=2)
    assert [r.thinking.budget for r in both.requests] == [3, 3]  # every choice


def test_reasoning_effort_budgets_and_what_wins(tiny_default: Path, ctx: ModelContext) -> None:
    assert _chat(ctx, reasoning_effort="low").request.thinking.budget == 1024  # the default table
    assert _chat(ctx, reasoning_effort="minimal").request.thinking.budget == 256
    assert not _chat(ctx, reasoning_effort="xhigh").request.HasField("thinking")  # unlimited
    assert not _chat(ctx, reasoning_effort="none", thinking_token_budget=4).request.HasField("thinking")  # off
    assert _chat(ctx, reasoning_effort="low", thinking_token_budget=4).request.thinking.budget == 4  # explicit wins
    off = _chat(ctx, thinking_token_budget=4, chat_template_kwargs={"enable_thinking": False})
    assert not off.request.HasField("thinking")  # nothing to bound: the prompt closed the think block
    custom = _ctx(tiny_default, default_budget=7, message=" Time to answer.",
                  efforts=parse_effort_budgets("low=16,xhigh=64"))
    try:
        assert _chat(custom, reasoning_effort="low").request.thinking.budget == 16
        assert _chat(custom, reasoning_effort="max").request.thinking.budget == 64  # chat's "max" is xhigh
        t = _chat(custom).request.thinking  # the server's --reasoning-budget
        message = custom.tokenizer.encode(" Time to answer.")
        assert t.budget == 7 and list(t.forced_ids) == [*message, CLOSE]
    finally:
        custom.grammar_check.close()


def test_completions_take_a_budget_when_their_prompt_opens_a_think_block(ctx: ModelContext) -> None:
    prep = _completion(ctx, prompt="Question?<think>", thinking_token_budget=2)
    assert prep.reasoning and prep.request.thinking.budget == 2
    assert not _completion(ctx, prompt="Question?<think>x</think>", thinking_token_budget=2).request.HasField(
        "thinking")
    assert not _completion(ctx, prompt="plain", thinking_token_budget=2).request.HasField("thinking")


def test_bad_budgets_and_settings_are_refused(tiny_default: Path, ctx: ModelContext) -> None:
    for bad in (-1, 1.5, "8", 1 << 31):
        with pytest.raises(GatewayError) as err:
            _chat(ctx, thinking_token_budget=bad)
        assert err.value.status == 400 and err.value.param == "thinking_token_budget"
    for text in ("low", "huge=5", "low=-1", "low=many"):
        with pytest.raises(ValueError):
            parse_effort_budgets(text)
    assert parse_effort_budgets("low=16, high=unlimited")["high"] is None
    with pytest.raises(ValueError, match="reasoning-budget-message"):
        ThinkingIds(TextTokenizer(tiny_default), ThinkingSettings(message="stop</think>"))


# ----------------------------------------------------------------------------------- room for the constrained part

def test_a_budget_must_leave_room_for_the_constrained_part(ctx: ModelContext) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    with pytest.raises(GatewayError) as err:
        _chat(ctx, response_format=fmt, thinking_token_budget=20, max_tokens=25)
    e = err.value
    assert e.status == 400 and e.param == "max_tokens" and e.code == "thinking_budget_exceeds_max_tokens"
    shortest = len(ctx.tokenizer.encode('\n{"name": "", "age": 0}')) + 1  # + the end token
    need = 20 + 1 + shortest
    assert f"needs max_tokens >= {need} (20 thinking tokens from thinking_token_budget, 1 forced" in e.message
    assert _chat(ctx, response_format=fmt, thinking_token_budget=20, max_tokens=need).request.thinking.budget == 20
    with pytest.raises(GatewayError, match="shortest tool call"):
        _chat(ctx, tools=TOOLS, tool_choice="required", thinking_token_budget=20, max_tokens=22)
    assert _chat(ctx, tools=TOOLS, tool_choice="auto", thinking_token_budget=20, max_tokens=22)  # free: no floor


def test_shortest_values_follow_the_schema() -> None:
    assert shortest_json(PERSON) == '{"name": "", "age": 0}'
    assert shortest_json({"type": "integer", "minimum": 18}) == "18"
    assert shortest_json({"type": "number", "exclusiveMaximum": -2}) == "-3"
    assert shortest_json({"type": "string", "minLength": 3}) == '"aaa"'
    assert shortest_json({"enum": ["long", "s"]}) == '"s"'
    assert shortest_json({"type": ["string", "null"]}) == '""'
    assert shortest_json({"type": "array", "minItems": 2, "items": {"type": "boolean"}}) == "[true, true]"
    ref = {"$defs": {"p": {"type": "object", "required": ["x"], "properties": {"x": {"const": 1}}}},
           "anyOf": [{"$ref": "#/$defs/p"}, {"type": "string", "minLength": 9}]}
    assert shortest_json(ref) == '{"x": 1}'
    loop = {"$ref": "#"}  # a schema that refers to itself ends at the depth bound
    assert shortest_json(loop) == "0"
    tool = ChatTool.model_validate(TOOLS[0])
    assert shortest_tool_call(tool) == "<tool_call>get_time<arg_key>zone</arg_key><arg_value></arg_value></tool_call>"


# ------------------------------------------------------------------------------------------- the reasoning grammar

def _matcher(ctx: ModelContext, grammar: str) -> LLMatcher:
    tok = LLTokenizer(ctx.tokenizer.json, n_vocab=ctx.vocab_size, eos_token=sorted(ctx.checkpoint.eos_token_ids))
    m = LLMatcher(tok, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def _allowed(m: LLMatcher) -> np.ndarray:
    return np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little").astype(bool)


def test_the_reasoning_is_tokens_so_a_budget_can_end_it_after_any_of_them(ctx: ModelContext) -> None:
    """A byte-level token that leaves a UTF-8 character open (the random model draws them) must not forbid the
    forced message or `</think>` next: the reasoning was a text lexeme, which did (a 400 mid-generation)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    prep = _chat(ctx, response_format=fmt)
    m = _matcher(ctx, prep.request.grammar)
    lead = ctx.tokenizer.token_to_id("ä")  # the first byte of a two-byte character
    assert m.consume_tokens([lead])
    allowed = _allowed(m)
    message = ctx.tokenizer.encode(" Time to answer.")
    assert allowed[CLOSE] and allowed[message[0]] and not any(allowed[sorted(ctx.checkpoint.eos_token_ids)])
    assert allowed[TOOL]  # no tools: <tool_call> is a token like any other
    assert m.consume_tokens([*message, CLOSE])
    assert np.flatnonzero(_allowed(m)).tolist() == [ctx.tokenizer.encode("\n")[0]]
    with_tools = _matcher(ctx, _chat(ctx, response_format=fmt, tools=TOOLS).request.grammar)
    assert not _allowed(with_tools)[TOOL]  # calls are parsed: an opening would end the reasoning, not be JSON


def test_a_forced_call_may_open_from_the_reasoning(ctx: ModelContext) -> None:
    prep = _chat(ctx, tools=TOOLS, tool_choice="required")
    m = _matcher(ctx, prep.request.grammar)
    assert m.consume_tokens(ctx.tokenizer.encode("thinking"))
    allowed = _allowed(m)
    assert allowed[TOOL] and allowed[CLOSE]
    assert m.consume_token(TOOL)  # the call starts at once: the tool's name follows
    assert not _allowed(m)[CLOSE]


# ------------------------------------------------------------------------------------ parsing and reasoning_tokens

def test_a_call_opened_inside_the_reasoning_ends_it_when_calls_are_parsed() -> None:
    text = "hmm<tool_call>get_time<arg_key>zone</arg_key><arg_value>UTC</arg_value></tool_call>"
    parser = ReplyParser(reasoning=True, tools={"get_time": TOOLS[0]["function"]["parameters"]})
    events = [e for piece in (text[:5], text[5:9], text[9:]) for e in parser.feed(piece)] + parser.finish()
    # The tag arrives split ("<t", "ool_", ...): held back until it is one, never leaked into the reasoning.
    assert [type(e) for e in events] == [ReasoningDelta, ToolCall] and events[0].text == "hmm"
    assert json.loads(events[-1].arguments) == {"zone": "UTC"}
    plain = ReplyParser(reasoning=True, tools=None)  # no tools: it is only text of the reasoning
    events = plain.feed(text + "</think>\nok") + plain.finish()
    assert [type(e) for e in events] == [ReasoningDelta, ContentDelta] and events[1].text == "ok"


def test_reasoning_tokens_count_up_to_the_token_that_ended_it(ctx: ModelContext) -> None:
    prep = _chat(ctx, tools=TOOLS)

    def final(ids: list[int]) -> Final:
        return Final("stop", None, 3, len(ids), 0, ids, "")

    assert reasoning_tokens(prep, final([5, 6, 41, 42, CLOSE, 9])) == 4  # a forced message counts, the end not
    assert reasoning_tokens(prep, final([5, TOOL, 9])) == 1
    assert reasoning_tokens(prep, final([5, 6])) == 2
    assert reasoning_tokens(_chat(ctx), final([5, TOOL, CLOSE])) == 2  # no tools: an opening is reasoning


# ------------------------------------------------------------------------------------ the other APIs' budgets

def test_anthropic_budget_tokens_and_responses_effort_reach_the_scheduler(gateway: GatewayServer,
                                                                          standin: StandinServer) -> None:
    claude = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=10)
    claude.messages.create(model="glm-tiny", max_tokens=40, messages=MSG,
                           thinking={"type": "enabled", "budget_tokens": 12})
    assert standin.generator.last().request.thinking.budget == 12
    claude.messages.create(model="glm-tiny", max_tokens=40, messages=MSG, thinking={"type": "adaptive"})
    assert not standin.generator.last().request.HasField("thinking")
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="glm-tiny", max_tokens=12, messages=MSG,
                               thinking={"type": "enabled", "budget_tokens": 12})
    assert err.value.body["type"] == "error" and "thinking.budget_tokens" in err.value.body["error"]["message"]
    oai = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=10)
    oai.responses.create(model="glm-tiny", input="hi", reasoning={"effort": "minimal"}, max_output_tokens=20)
    assert standin.generator.last().request.thinking.budget == 256
    with pytest.raises(openai.BadRequestError) as oerr:
        oai.responses.create(model="glm-tiny", input="hi", reasoning={"effort": "minimal"}, max_output_tokens=20,
                             text={"format": {"type": "json_schema", "name": "p", "schema": PERSON}})
    assert oerr.value.body["param"] == "max_output_tokens"
    assert "from reasoning.effort 'minimal'" in oerr.value.body["message"]
