"""The client libraries agents are built on, against the real stack (`twinspark up`, the tiny model): each library's
structured-output helper and its forced-tool helper, for 10 seeds, thinking off and thinking on with a budget, with
the JSON schemas the libraries generate from pydantic models holding an Enum, a nested model, Optional fields,
Literals and bounded lists (`$ref`s into `$defs`, `anyOf` with null, `enum`, `additionalProperties: false`,
`strict`). The tiny model's replies are random, but grammar-constrained output validates by construction: every
helper must hand back a validated object.

A library's helpers run together, 40 requests at once: on two cores the stack's batches then take twice the
requests in the time of one helper's 20. The `agents` tier (`-m agents`); the libraries are pinned in the `agents`
extra (`pip install -e '.[agents]'`).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal, Optional, TypeVar

import anthropic
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.e2e.stack import Stack, start

langchain_openai = pytest.importorskip("langchain_openai", reason="the agents extra: pip install -e '.[agents]'")
pydantic_ai = pytest.importorskip("pydantic_ai", reason="the agents extra: pip install -e '.[agents]'")

from langchain_core.output_parsers.openai_tools import PydanticToolsParser  # noqa: E402
from pydantic_ai.models.openai import OpenAIChatModel  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402

pytestmark = pytest.mark.agents

SEEDS = range(10)
CASES = [(seed, on) for on in (False, True) for seed in SEEDS]  # (seed, thinking on)
BUDGET = 8  # thinking tokens, when thinking is on: then `</think>` is forced and the constrained part follows
MAX_TOKENS = 300
OFF = {"chat_template_kwargs": {"enable_thinking": False}}
ON = {"thinking_token_budget": BUDGET}
T = TypeVar("T")


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Point(BaseModel):
    """Bounded coordinates: an unbounded integer lets the random model write digits until max_tokens, and one such
    reply holds a whole batch of requests that long."""

    model_config = ConfigDict(extra="forbid")

    x: int = Field(ge=-99, le=99)
    y: int = Field(ge=-99, le=99)


class Corner(BaseModel):
    """A nested model with no numeric or length bounds: Anthropic's SDK moves those out of the schema it sends
    (into descriptions), so what it validates must not hold them."""

    model_config = ConfigDict(extra="forbid")

    side: Literal["top", "bottom"]
    outer: bool


class Shape(BaseModel):
    """A shape as Anthropic's helpers send it (no bounds)."""

    model_config = ConfigDict(extra="forbid")

    color: Color
    corner: Corner
    kind: Literal["circle", "square"]
    shade: Optional[Color] = None


class BoundedShape(BaseModel):
    """With bounds, as OpenAI's, langchain's and pydantic-ai's schemas carry them to the server."""

    model_config = ConfigDict(extra="forbid")

    color: Color
    origin: Point = Field(description="where it is")
    kind: Literal["circle", "square"]
    shade: Optional[Color] = None
    label: Optional[str] = Field(None, max_length=8)
    tags: list[Literal["a", "b", "c"]] = Field(max_length=3)


@pytest.fixture(scope="module")
def stack(tiny_default: Path, tmp_path_factory: pytest.TempPathFactory) -> Stack:
    # The server's thinking budget bounds the thinking of every request that names none (Responses' default effort).
    stack = start(tiny_default, tmp_path_factory.mktemp("agents"), tp=1,
                  env={"TWINSPARK_DRAFTER": "none", "TWINSPARK_REASONING_BUDGET": str(BUDGET),
                       "TWINSPARK_MAX_NUM_SEQS": str(2 * len(CASES))})
    yield stack
    stack.down()


def across_seeds(*asks: Callable[[int, bool], T]) -> list[list[T]]:
    """Each `ask(seed, thinking)` for every case of CASES, all at once (the stack batches them): per ask, its
    results in CASES' order."""
    with ThreadPoolExecutor(len(asks) * len(CASES)) as pool:
        futures = [[pool.submit(ask, *case) for case in CASES] for ask in asks]
        return [[f.result() for f in row] for row in futures]


def ask_for(seed: int) -> str:
    return f"Describe shape number {seed}."


def test_openai_parse_helpers(stack: Stack) -> None:
    """`chat.completions.parse` with a response format and with a forced `pydantic_function_tool` (strict, `$ref`s
    into `$defs`), and `responses.parse`."""
    oai = openai.OpenAI(base_url=stack.v1, api_key="unused", max_retries=0, timeout=600)
    tool = openai.pydantic_function_tool(BoundedShape)

    def structured(seed: int, on: bool):
        return oai.chat.completions.parse(model=stack.model_name, messages=[{"role": "user", "content": ask_for(seed)}],
                                          response_format=BoundedShape, max_tokens=MAX_TOKENS, seed=seed,
                                          temperature=1.0, extra_body=ON if on else OFF)

    def forced_tool(seed: int, on: bool):
        return oai.chat.completions.parse(model=stack.model_name, messages=[{"role": "user", "content": ask_for(seed)}],
                                          tools=[tool], seed=seed,
                                          tool_choice={"type": "function", "function": {"name": "BoundedShape"}},
                                          max_tokens=MAX_TOKENS, temperature=1.0, extra_body=ON if on else OFF)

    def responses(seed: int, on: bool):
        # Thinking on: the server's budget (Responses names one only through reasoning.effort's table).
        return oai.responses.parse(model=stack.model_name, input=ask_for(seed), text_format=BoundedShape,
                                   max_output_tokens=MAX_TOKENS, temperature=1.0, extra_body={"seed": seed},
                                   reasoning=None if on else {"effort": "none"})

    chats, calls, replies = across_seeds(structured, forced_tool, responses)
    assert all(isinstance(r.choices[0].message.parsed, BoundedShape) for r in chats)
    thought = {on: [r.usage.completion_tokens_details.reasoning_tokens for (_, o), r in zip(CASES, chats) if o == on]
               for on in (False, True)}
    assert not any(thought[False]) and any(thought[True]) and max(thought[True]) <= BUDGET, thought
    for reply in calls:
        (call,) = reply.choices[0].message.tool_calls
        assert isinstance(call.function.parsed_arguments, BoundedShape)
    assert all(isinstance(r.output_parsed, BoundedShape) for r in replies)


def test_anthropic_messages_parse_and_forced_tool(stack: Stack) -> None:
    """`messages.parse(output_format=...)` (output_config.format) and a forced tool whose input_schema is the
    model's; thinking on: an enabled thinking block with its budget_tokens."""
    claude = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0, timeout=600)

    def thinking(on: bool) -> dict:
        return {"thinking": {"type": "enabled", "budget_tokens": BUDGET}} if on else {}

    def structured(seed: int, on: bool):
        return claude.messages.parse(model=stack.model_name, max_tokens=MAX_TOKENS, output_format=Shape,
                                     messages=[{"role": "user", "content": ask_for(seed)}], **thinking(on))

    def forced_tool(seed: int, on: bool):
        return claude.messages.create(
            model=stack.model_name, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": ask_for(seed)}],
            tools=[{"name": "shape", "description": "Record a shape", "input_schema": Shape.model_json_schema()}],
            tool_choice={"type": "tool", "name": "shape"}, **thinking(on))

    parsed, calls = across_seeds(structured, forced_tool)
    for (seed, on), reply in zip(CASES, parsed):
        assert isinstance(reply.parsed_output, Shape), (seed, on)
        assert [b.type for b in reply.content] == (["thinking", "text"] if on else ["text"])
    for reply in calls:
        (use,) = [b for b in reply.content if b.type == "tool_use"]
        Shape.model_validate(use.input)
        assert reply.stop_reason == "tool_use"


def test_langchain_structured_output_and_bind_tools(stack: Stack) -> None:
    """`with_structured_output(Model)` (a strict json_schema response format) and `bind_tools([Model])` forced by
    name, read back by PydanticToolsParser."""
    def chat_model(seed: int, on: bool):
        return langchain_openai.ChatOpenAI(base_url=stack.v1, api_key="unused", model=stack.model_name, seed=seed,
                                           temperature=1.0, max_tokens=MAX_TOKENS, max_retries=0, timeout=600,
                                           extra_body=ON if on else OFF)

    def structured(seed: int, on: bool):
        return chat_model(seed, on).with_structured_output(BoundedShape).invoke(ask_for(seed))

    def forced_tool(seed: int, on: bool):
        chain = chat_model(seed, on).bind_tools([BoundedShape], tool_choice="BoundedShape") | \
            PydanticToolsParser(tools=[BoundedShape], first_tool_only=True)
        return chain.invoke(ask_for(seed))

    for helper in across_seeds(structured, forced_tool):
        assert all(isinstance(shape, BoundedShape) for shape in helper)


def test_pydantic_ai_tool_and_native_output(stack: Stack) -> None:
    """An Agent's default output (a forced `final_result` tool call) and its NativeOutput (a response format)."""
    async def all_runs() -> list:
        model = OpenAIChatModel(stack.model_name, provider=OpenAIProvider(base_url=stack.v1, api_key="unused"))
        agents = [pydantic_ai.Agent(model, output_type=BoundedShape, retries=0),
                  pydantic_ai.Agent(model, output_type=pydantic_ai.NativeOutput(BoundedShape), retries=0)]
        runs: list[Awaitable] = [
            agent.run(ask_for(seed), model_settings={"max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": seed,
                                                     "parallel_tool_calls": False, "extra_body": ON if on else OFF})
            for agent in agents for seed, on in CASES]
        return await asyncio.gather(*runs)

    assert all(isinstance(run.output, BoundedShape) for run in asyncio.run(all_runs()))
