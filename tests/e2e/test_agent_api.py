"""The agent API end to end on the real TP = 2 stack (copy drafts on) with the official `openai` client: forced tool
calls, tool results, structured output, reasoning, logprobs, n > 1, and exactness of a mixed burst of them."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
import torch

from model.batch import Batch
from model.model import Glm5Model
from tests.e2e.replies import token_ids
from tests.e2e.stack import Stack

OFF = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 10},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "units": {"type": "string", "enum": ["metric", "imperial"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"]}}}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 120},
                         "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def m(stack_tp2: Stack) -> str:
    return stack_tp2.model_name


@pytest.fixture(scope="module")
def client(stack_tp2: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack_tp2.v1, api_key="unused", max_retries=0, timeout=120)


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _streamed_calls(chunks) -> tuple[list[tuple[str, str]], str | None]:
    calls: dict[int, list[str]] = {}
    finish = None
    for c in chunks:
        for choice in c.choices:
            finish = choice.finish_reason or finish
            for t in choice.delta.tool_calls or []:
                entry = calls.setdefault(t.index, ["", ""])
                entry[0] += t.function.name or ""
                entry[1] += t.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_validate_and_stream_equals_full(client: openai.OpenAI, m: str, choice) -> None:
    args = dict(model=m, messages=USER, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                max_tokens=60, temperature=1.0, extra_body=OFF)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in (1, 2, 3):
        full = client.chat.completions.create(seed=seed, **args).choices[0]
        calls = _calls(full.message)
        assert full.finish_reason == "tool_calls" and len(calls) == 1, full
        name, arguments = calls[0]
        if isinstance(choice, dict):
            assert name == "get_time"
        jsonschema.validate(json.loads(arguments), schemas[name])
        streamed, finish = _streamed_calls(client.chat.completions.create(seed=seed, stream=True, **args))
        assert streamed == calls and finish == "tool_calls"


def test_tool_result_round_trip(client: openai.OpenAI, m: str, stack_tp2: Stack) -> None:
    first = client.chat.completions.create(model=m, messages=USER, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=60, seed=4, extra_body=OFF)
    call = first.choices[0].message.tool_calls[0]
    messages = USER + [first.choices[0].message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 18}'}]
    prompt = httpx.post(stack_tp2.url + "/tokenize", json={"messages": messages, "tools": TOOLS, **OFF,
                                                            "return_token_strs": True},
                        timeout=30).json()
    assert "<tool_response>" in prompt["token_strs"] and "<tool_call>" in prompt["token_strs"]
    again = client.chat.completions.create(model=m, messages=messages, tools=TOOLS, max_tokens=8, seed=4,
                                           extra_body=OFF)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert again.usage.prompt_tokens == prompt["count"]


def test_json_schema_holds_for_20_seeds(client: openai.OpenAI, m: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def one(seed: int) -> str:
        r = client.chat.completions.create(model=m, messages=[{"role": "user", "content": "A person as JSON."}],
                                           response_format=fmt, max_tokens=80, seed=seed, extra_body=OFF)
        assert r.choices[0].finish_reason == "stop", r
        return r.choices[0].message.content

    with ThreadPoolExecutor(10) as pool:
        for text in pool.map(one, range(20)):
            jsonschema.validate(json.loads(text), PERSON)


def test_regex_choice_and_reasoning(client: openai.OpenAI, m: str) -> None:
    msg = [{"role": "user", "content": "Answer."}]
    r = client.chat.completions.create(model=m, messages=msg, max_tokens=30, seed=5,
                                       extra_body={**OFF, "structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2,4}"}})
    import re
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", r.choices[0].message.content)
    for seed in range(3):
        r = client.chat.completions.create(model=m, messages=msg, max_tokens=10, seed=seed,
                                           extra_body={**OFF, "structured_outputs": {"choice": ["yes", "no"]}})
        assert r.choices[0].message.content in ("yes", "no")
    # Thinking on (the default): the reply opens with reasoning; off: none.
    on = client.chat.completions.create(model=m, messages=msg, max_tokens=12, seed=6)
    assert on.choices[0].message.reasoning_content and "<think>" not in (on.choices[0].message.content or "")
    assert on.usage.completion_tokens_details.reasoning_tokens > 0
    off = client.chat.completions.create(model=m, messages=msg, max_tokens=12, seed=6, reasoning_effort="none")
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


def _reference_logits(model_dir, prompt: list[int], generated: list[int]) -> list[torch.Tensor]:
    """fp32 logits at each generated token's step, teacher-forced on one process (TP = 1)."""
    model = Glm5Model.load(model_dir, dtype=torch.float32, device="cpu")
    total = len(prompt) + len(generated)
    blocks = -(-total // 16)
    cache = model.new_cache(num_blocks=blocks, block_size=16, num_slots=1)
    out, pos, rows = [], 0, prompt
    for tok in [None] + generated[:-1]:
        if tok is not None:
            rows = [tok]
        result = model.forward(Batch.single(rows, pos, list(range(blocks)), device="cpu"), cache)
        pos += len(rows)
        out.append(result.logits[-1].double())
    return out


def test_logprobs_are_the_samplers_distribution(client: openai.OpenAI, m: str, stack_tp2: Stack) -> None:
    for temperature in (0.0, 0.7):
        r = client.completions.create(model=m, prompt="The weather today", max_tokens=6, temperature=temperature,
                                      top_p=1.0, seed=11, logprobs=5,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
        choice = r.choices[0]
        ids, prompt = choice.token_ids, r.model_extra["prompt_token_ids"]
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(ids) == 6
        for step, logits in enumerate(_reference_logits(stack_tp2.model, prompt, ids)):
            ref = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
            assert abs(lp.token_logprobs[step] - float(ref[ids[step]])) < 1e-5
            top = list(lp.top_logprobs[step].values())  # a dict by token text: partial UTF-8 tokens may collide
            assert 1 <= len(top) <= 5 and abs(max(top) - float(ref.max())) < 1e-5
    chat = client.chat.completions.create(model=m, messages=USER, max_tokens=4, logprobs=True, top_logprobs=3,
                                          seed=3)
    for entry in chat.choices[0].logprobs.content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True) and entry.logprob <= values[0] + 1e-6


def test_n_choices_equal_single_requests_with_seed_plus_i(client: openai.OpenAI, m: str) -> None:
    body = dict(model=m, messages=USER, max_tokens=10, temperature=0.9, extra_body={"return_token_ids": True})
    many = client.chat.completions.create(n=3, seed=40, **body)
    assert [c.index for c in many.choices] == [0, 1, 2]
    for i, c in enumerate(many.choices):
        single = client.chat.completions.create(seed=40 + i, **body).choices[0]
        assert c.model_extra["token_ids"] == single.model_extra["token_ids"]
    assert len({tuple(c.model_extra["token_ids"]) for c in many.choices}) > 1


def _mixed() -> list[tuple[str, dict]]:
    tool = {"messages": USER, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, **OFF}
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    return [
        ("chat", {**tool, "seed": 1}),
        ("chat", {"messages": USER, "response_format": fmt, "seed": 2, **OFF}),
        ("chat", {"messages": USER, "n": 2, "seed": 3}),
        ("chat", {"messages": USER, "logprobs": True, "top_logprobs": 2, "seed": 4}),
        ("completions", {"prompt": "Once upon", "logprobs": 2, "seed": 5, "ignore_eos": True}),
        ("chat", {"messages": USER, "structured_outputs": {"regex": "[a-z]{4,9}"}, "seed": 6, **OFF}),
        ("chat", {**tool, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "seed": 7,
                  "stream": True}),
        ("completions", {"prompt": [5, 6, 7, 8], "n": 2, "temperature": 0, "ignore_eos": True}),
    ]


async def _send(url: str, kind: str, body: dict) -> list:
    return (await token_ids(url, kind, {**body, "max_tokens": 40}))[0]


def test_mixed_burst_equals_one_by_one(stack_tp2: Stack) -> None:
    requests = _mixed()

    async def serial() -> list:
        return [await _send(stack_tp2.url, k, b) for k, b in requests]

    async def burst() -> list:
        return list(await asyncio.gather(*(_send(stack_tp2.url, k, b) for k, b in requests)))

    alone = asyncio.run(serial())
    together = asyncio.run(burst())
    assert together == alone


def test_responses_api(client: openai.OpenAI, m: str) -> None:
    off = {"effort": "none"}
    plain = client.responses.create(model=m, input="Hello", max_output_tokens=8, reasoning=off)
    assert plain.status == "incomplete" and plain.output_text and plain.usage.output_tokens == 8
    tools = [{"type": "function", "name": "get_time", "parameters": TOOLS[1]["function"]["parameters"]}]
    called = client.responses.create(model=m, input="time?", tools=tools, tool_choice="required",
                                     parallel_tool_calls=False, max_output_tokens=40, reasoning=off,
                                     extra_body={"seed": 3})
    calls = [o for o in called.output if o.type == "function_call"]
    assert [o.type for o in called.output] == ["function_call"] and calls[0].name == "get_time"
    jsonschema.validate(json.loads(calls[0].arguments), tools[0]["parameters"])
    more = client.responses.create(model=m, previous_response_id=called.id, reasoning=off, max_output_tokens=4,
                                   tools=tools,
                                   input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                           "output": "12:00"}])
    assert more.usage.input_tokens > called.usage.input_tokens
    fmt = {"format": {"type": "json_schema", "name": "p", "schema": PERSON, "strict": True}}
    structured = client.responses.create(model=m, input="json", text=fmt, max_output_tokens=80, reasoning=off)
    jsonschema.validate(json.loads(structured.output_text), PERSON)
    events = list(client.responses.create(model=m, input="Hi", max_output_tokens=8, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed and events[-1].response.output[0].content[0].text == streamed
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=m, input=[{"type": "bogus"}])
    assert exc.value.body["param"] == "input[0].type"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=m, input="x", previous_response_id="resp_missing")


def test_anthropic_messages(stack_tp2: Stack, m: str) -> None:
    import anthropic

    a = anthropic.Anthropic(base_url=stack_tp2.url, api_key="unused", max_retries=0, timeout=120)
    user = [{"role": "user", "content": "Hello"}]
    plain = a.messages.create(model=m, max_tokens=8, messages=user, system="Be brief.")
    assert plain.stop_reason == "max_tokens" and plain.content[0].type == "text" and plain.usage.output_tokens == 8
    tools = [{"name": "get_time", "input_schema": TOOLS[1]["function"]["parameters"]}]
    used = a.messages.create(model=m, max_tokens=40, messages=user, tools=tools,
                             tool_choice={"type": "tool", "name": "get_time"})
    blocks = [b for b in used.content if b.type == "tool_use"]
    assert used.stop_reason == "tool_use" and [b.type for b in used.content] == ["tool_use"]
    jsonschema.validate(blocks[0].input, tools[0]["input_schema"])
    follow = user + [{"role": "assistant", "content": [b.model_dump() for b in used.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": blocks[0].id,
                                                   "content": "12:00"}]}]
    assert a.messages.create(model=m, max_tokens=4, messages=follow, tools=tools).usage.input_tokens > \
        used.usage.input_tokens
    with a.messages.stream(model=m, max_tokens=8, messages=user, thinking={"type": "enabled",
                                                                           "budget_tokens": 4}) as s:
        final = s.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking and final.stop_reason == "max_tokens"
    count = a.messages.count_tokens(model=m, messages=user, system="Be brief.")
    assert count.input_tokens == plain.usage.input_tokens
    with pytest.raises(anthropic.BadRequestError) as exc:
        a.messages.create(model=m, max_tokens=0, messages=user)
    assert exc.value.body["type"] == "error" and exc.value.body["error"]["type"] == "invalid_request_error"


def test_hostile_agent_requests_are_400s_in_each_apis_shape(client: openai.OpenAI, m: str, stack_tp2: Stack) -> None:
    """Issue 26's four requests that were 5xx on the real stack: a 10,000-entry stop_sequences and a user turn
    holding a thinking block (/v1/messages: 500), a Responses reasoning item whose text is a number (500), a
    json_schema of 3,000 properties (a 503 after one token, from the grammar library mid-generation). Each is now
    a 400 naming the field, in its API's shape, the grammar refused before admission; the stack serves on."""
    import anthropic

    a = anthropic.Anthropic(base_url=stack_tp2.url, api_key="unused", max_retries=0, timeout=120)
    user = [{"role": "user", "content": "Hello"}]
    for fields, says in (({"stop_sequences": ["s"] * 10_000}, "stop_sequences"),
                         ({"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x",
                                                                       "signature": ""}]}]}, "messages[0].content[0]")):
        with pytest.raises(anthropic.BadRequestError) as exc:
            a.messages.create(model=m, max_tokens=8, **{"messages": user, **fields})
        assert exc.value.body["type"] == "error" and exc.value.body["error"]["type"] == "invalid_request_error"
        assert says in exc.value.body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=m, input=[{"type": "reasoning", "id": "rs_1", "summary": [],
                                                 "content": [{"type": "reasoning_text", "text": 5}]}, *user])
    assert err.value.body["param"] == "input[0].content[0].text"
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3_000)}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=m, messages=user, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert err.value.body["code"] == "invalid_grammar"
    assert err.value.body["param"] == "response_format.json_schema.schema"
    assert httpx.get(stack_tp2.url + "/health", timeout=10).status_code == 200
    assert a.messages.create(model=m, max_tokens=4, messages=user).stop_reason == "max_tokens"
