"""JSON Schema as clients write it (services/gateway/json_schema.py): what llguidance cannot compile is a 400 naming
the keyword and where it is, on every route that takes a schema (chat, completions, Responses, Messages; response
formats and forced tools), while the schemas pydantic and the SDKs generate (`$ref`s into `$defs`, recursion,
`allOf` of one ref, `anyOf` with null) pass; tool arguments compile apart from the tool's `$defs` and parse back
through the same references. Through the real gateway (STAND-IN scheduler)."""

from __future__ import annotations

import enum
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import httpx
import openai
import pytest
from llguidance import LLMatcher
from pydantic import BaseModel

from services.gateway import anthropic_messages, json_schema
from services.gateway.app import GatewaySettings
from services.gateway.constraints import GrammarBuilder
from services.gateway.reply_parser import typed_arguments
from services.gateway.schemas import ChatTool

from .conftest import GatewayServer
from .standin_scheduler import StandinServer

USER = [{"role": "user", "content": "hi"}]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}


class Color(str, enum.Enum):
    red = "red"
    green = "green"


class Point(BaseModel):
    x: int
    y: int


class Node(BaseModel):
    value: int
    next: Optional["Node"] = None


class Shape(BaseModel):
    color: Color
    origin: Point
    chain: Node
    label: Optional[str] = None


SHAPE = openai.pydantic_function_tool(Shape)["function"]["parameters"]  # strict: $refs, anyOf with null, $defs


def _compiles(grammar: dict) -> str:
    return LLMatcher.validate_grammar(json.dumps({"grammars": [grammar]}))


# ------------------------------------------------------------------------------------------ against the library

@pytest.mark.parametrize("keyword", sorted(json_schema.UNSUPPORTED))
def test_each_refused_keyword_is_one_the_library_does_not_implement(keyword: str) -> None:
    schema = {keyword: "#x" if keyword.startswith("$") else {} if keyword != "uniqueItems" else True}
    assert "Unimplemented keys" in _compiles(json.loads(LLMatcher.grammar_from_json_schema(schema))["grammars"][0])


def test_the_formats_let_through_are_the_ones_the_library_knows() -> None:
    def error(fmt: str) -> str:
        return _compiles(json.loads(LLMatcher.grammar_from_json_schema({"type": "string", "format": fmt}))
                         ["grammars"][0])

    assert not any(error(f) for f in json_schema.FORMATS)
    assert all("Unknown format" in error(f) for f in ("binary", "password", "uri-reference", "text"))


def test_tool_arguments_compile_apart_from_the_tools_defs_and_parse_back() -> None:
    tool = ChatTool.model_validate({"type": "function", "function": {"name": "shape", "parameters": SHAPE}})
    grammar = GrammarBuilder(set()).tool_calls([(tool, "tools[0].function.parameters")], one=True)
    assert _compiles(grammar) == ""
    rules = grammar["lark_grammar"]
    assert '"red" | "green"' in rules  # the enum behind a $ref is raw text, as a string argument
    assert '"$ref": "#/$defs/ref0"' in rules and '"x-guidance"' in rules  # nested: JSON with its own definitions
    args = typed_arguments([("color", "red"), ("origin", '{"x": 1, "y": 2}'), ("chain", '{"value": 1, "next": null}'),
                            ("label", "null")], SHAPE)
    assert Shape.model_validate(args) == Shape(color=Color.red, origin=Point(x=1, y=2), chain=Node(value=1),
                                               label=None)


def test_resolve_follows_refs_and_one_allof_and_stops_on_a_cycle() -> None:
    root = {"$defs": {"c": {"type": "string", "enum": ["a"]}, "loop": {"$ref": "#/$defs/loop"}}}
    assert json_schema.resolve({"allOf": [{"$ref": "#/$defs/c"}], "description": "d"}, root) == \
        {"type": "string", "enum": ["a"], "description": "d"}
    assert json_schema.resolve({"$ref": "#/$defs/loop"}, root) is None
    assert json_schema.resolve({"$ref": "#/$defs/none"}, root) is None


# ------------------------------------------------------------------------------------------ every route, for real

@pytest.fixture(scope="module")
def gateway_4k(tiny_default: Path, standin: StandinServer) -> Iterator[GatewayServer]:
    """A window that holds a tool's description (the shared test gateway's is 256 tokens)."""
    server = GatewayServer(GatewaySettings(model_dir=str(tiny_default), scheduler=standin.target,
                                           served_model_name="glm-tiny", max_model_len=4096)).start()
    yield server
    server.stop()


def _tool_schema(bad: dict) -> dict:
    return {"type": "object", "properties": {"a": bad, "b": {"$ref": "#/$defs/B"}},
            "$defs": {"B": {"type": "integer"}}, "required": ["a"]}


# (case, the bad property's schema, keyword, JSON pointer of the node that holds it)
CASES = [
    ("an unimplemented keyword", {"type": "array", "uniqueItems": True}, "uniqueItems", "#/properties/a"),
    ("a reference to nothing", {"$ref": "#/$defs/Nope"}, "$ref", "#/properties/a"),
    ("a remote reference", {"$ref": "https://example.com/s.json"}, "$ref", "#/properties/a"),
    ("an unknown format", {"type": "string", "format": "binary"}, "format", "#/properties/a"),
    ("an unknown type", {"type": "strin"}, "type", "#/properties/a"),
    ("a keyword deep in a definition", {"anyOf": [{"not": {"type": "null"}}, {"type": "null"}]}, "not",
     "#/properties/a/anyOf/0"),
]
# route, body fields carrying `schema`, the param OpenAI's shape names (the keyword's path under it)
ROUTES = [
    ("/v1/chat/completions", lambda s: {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": s}}}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", lambda s: {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": s}}], "tool_choice": "required"}, "tools[0].function.parameters"),
    ("/v1/completions", lambda s: {"prompt": "hi", "structured_outputs": {"json": s}}, "structured_outputs.json"),
    ("/v1/completions", lambda s: {"prompt": "hi", "guided_json": s}, "guided_json"),
    ("/v1/responses", lambda s: {"input": "hi", "text": {"format": {"type": "json_schema", "name": "s",
                                                                    "schema": s}}}, "text.format.schema"),
    ("/v1/responses", lambda s: {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": s}],
                                 "tool_choice": {"type": "function", "name": "f"}}, "tools[0].parameters"),
    ("/v1/messages", lambda s: {"messages": USER, "output_config": {"format": {"type": "json_schema", "schema": s}}},
     None),
    ("/v1/messages", lambda s: {"messages": USER, "tools": [{"name": "f", "input_schema": s}],
                                "tool_choice": {"type": "any"}}, None),
]


@pytest.mark.parametrize("case,bad,keyword,where", CASES, ids=[c[0] for c in CASES])
def test_what_the_library_cannot_compile_is_a_400_naming_keyword_and_path_on_every_route(
        gateway_4k: GatewayServer, standin: StandinServer, case: str, bad: dict, keyword: str, where: str) -> None:
    schema = _tool_schema(bad)
    with httpx.Client(base_url=gateway_4k.url, timeout=30) as client:
        for route, body, param in ROUTES:
            before = len(standin.generator.records)
            r = client.post(route, json={"model": "glm-tiny", "max_tokens": 8, **body(schema)})
            assert r.status_code == 400, (case, route, param, r.text[:300])
            if param is None:  # Anthropic's shape: no param, the message says where
                err = r.json()["error"]
                assert err["type"] == "invalid_request_error"
            else:
                err = r.json()["error"]
                keyword_path = where.removeprefix("#").replace("/", ".").replace(".0", "[0]") + "." + keyword
                assert err["code"] == "invalid_grammar" and err["param"] == param + keyword_path, (route, err)
            assert f"'{keyword}' at {where}:" in err["message"], (route, err["message"])
            assert len(standin.generator.records) == before  # never reached the scheduler


def test_generated_schemas_pass_on_every_route(gateway_4k: GatewayServer) -> None:
    with httpx.Client(base_url=gateway_4k.url, timeout=30) as client:
        for route, body, param in ROUTES:
            r = client.post(route, json={"model": "glm-tiny", "max_tokens": 8, **body(SHAPE), **OFF})
            assert r.status_code == 200, (route, param, r.text[:300])


def test_anthropic_output_config_is_a_constrained_response_format(gateway_4k: GatewayServer,
                                                                  standin: StandinServer) -> None:
    """What `messages.parse(output_format=...)` sends: `output_config.format` reaches the scheduler as a grammar (it
    was dropped as an unknown field), and `output_config.effort` is chat's reasoning_effort."""
    body = {"model": "glm-tiny", "max_tokens": 8, "messages": USER,
            "output_config": {"format": {"type": "json_schema", "schema": SHAPE}, "effort": "low"}}
    before = set(standin.generator.records)
    r = httpx.post(gateway_4k.url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 200 and "x-twinspark-ignored-fields" not in r.headers, r.text[:300]
    (new,) = [standin.generator.records[k] for k in set(standin.generator.records) - before]
    assert new.request.grammar and '"color"' in new.request.grammar
    chat = anthropic_messages.to_chat(anthropic_messages.MessagesRequest.model_validate(body))
    assert chat.response_format.json_schema.schema_ == SHAPE and chat.reasoning_effort == "low"
