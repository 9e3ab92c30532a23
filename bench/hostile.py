"""The agent surface's share of the hostile set (bench/malformed.py draws these kinds in turn with its own): Responses
input items, Anthropic Messages blocks, JSON schemas of tools and structured output (pathological regexes, deep
nesting, huge bounds, `$ref` cycles and chains, thousands of properties), regex / choice / Lark / GBNF grammars,
images (bad base64, decompression-bomb headers, odd URL schemes) and the extremes of logit_bias, n, top_logprobs,
stop and their neighbours. Seeded like the rest: the same `rng` state gives the same request.

Requests that happen to be valid stay cheap (a few tokens, n and best_of small): the set is about the input.
"""

from __future__ import annotations

import base64
import io
import json
import random
import struct
import zlib
from collections.abc import Callable
from typing import Any

KINDS = ("responses_items", "messages_blocks", "schemas", "grammars", "images", "extremes")
USER = [{"role": "user", "content": "Say hi."}]


def responses_body(model: str) -> dict[str, Any]:
    """A valid Responses request with every kind of input item (no tools: their description would take the fuzz
    stack's whole window; the "schemas" kind sends tools)."""
    return {"model": model, "max_output_tokens": 4, "reasoning": {"effort": "none"},
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "time?"}]},
                      {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
                      {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": '{"zone": "UTC"}'},
                      {"type": "function_call_output", "call_id": "c1", "output": "12:00"},
                      {"type": "message", "role": "assistant",
                       "content": [{"type": "output_text", "text": "noon", "annotations": []}]},
                      {"role": "user", "content": "thanks"}]}


def messages_body(model: str) -> dict[str, Any]:
    """A valid Anthropic Messages request with every kind of content block (no tools, as above)."""
    return {"model": model, "max_tokens": 4, "system": [{"type": "text", "text": "Be brief."}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "time?"}]},
                         {"role": "assistant", "content": [
                             {"type": "thinking", "thinking": "hm", "signature": ""},
                             {"type": "text", "text": "let me see"},
                             {"type": "tool_use", "id": "t1", "name": "get_time", "input": {"zone": "UTC"}}]},
                         {"role": "user", "content": [
                             {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "12"}]},
                             {"type": "text", "text": "thanks"}]}]}


# ------------------------------------------------------------------------------------------------ catalogues

def _props(n: int, required: bool = False) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}
    if required:
        schema["required"] = list(schema["properties"])
    return schema


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _ref_chain(n: int) -> dict[str, Any]:
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]}
            for i in range(n)}
    return {"$defs": {**defs, f"d{n}": {"type": "integer"}}, "$ref": "#/$defs/d0"}


SCHEMAS: list[Callable[[], Any]] = [
    lambda: {"type": "string", "pattern": "^(a+)+$"}, lambda: {"type": "string", "pattern": "(a|aa)*b"},
    lambda: {"type": "string", "pattern": "(?=x)y"}, lambda: {"type": "string", "pattern": r"(a)\1"},
    lambda: {"type": "string", "pattern": "a{1000000}"}, lambda: {"type": "string", "pattern": "["},
    lambda: {"type": "string", "pattern": "a/b\nc"}, lambda: {"type": "string", "pattern": 5},
    lambda: {"type": "string", "minLength": 10**9}, lambda: {"type": "string", "maxLength": 10**18},
    lambda: {"type": "string", "minLength": 5, "maxLength": 2}, lambda: {"type": "string", "minLength": "3"},
    lambda: {"type": "string", "minLength": -1}, lambda: {"type": "string", "enum": "abc"},
    lambda: {"type": "array", "minItems": 10**6, "items": {"type": "integer"}},
    lambda: {"type": "array", "maxItems": 10**18}, lambda: {"type": "integer", "minimum": 10, "maximum": 1},
    lambda: {"type": "number", "multipleOf": 0}, lambda: {"type": "integer", "minimum": -(2**63), "maximum": 2**63},
    lambda: {"$ref": "#"}, lambda: {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"},
                                                                   "b": {"$ref": "#/$defs/a"}}},
    lambda: {"$ref": "#/nope"}, lambda: {"$ref": "http://127.0.0.1/schema.json"}, lambda: _ref_chain(1_500),
    lambda: _ref_chain(50), lambda: _nested(40), lambda: _nested(70), lambda: _props(600), lambda: _props(3_000),
    lambda: _props(3_000, required=True), lambda: _props(10_000),
    lambda: {"type": "array", "items": {"anyOf": [{"type": "string"}, _props(600)]}},
    lambda: {"anyOf": [_props(1) for _ in range(3_000)]}, lambda: {"enum": list(range(20_000))},
    lambda: {"enum": []}, lambda: {"not": {}}, lambda: {"allOf": [{"type": "string"}, {"type": "integer"}]},
    lambda: {"type": "object", "additionalProperties": {"$ref": "#"}}, lambda: {"type": "unknown"},
    lambda: {"type": ["string", 5]}, lambda: {"properties": []}, lambda: {"properties": {"x": 5}},
    lambda: {"required": 5}, lambda: {"required": [{"a": 1}]},
    lambda: {"type": "object", "patternProperties": {"(a+)+": {"type": "string"}}},
    lambda: {"type": "object", "properties": {"k": {"type": "string", "format": "date-time"}}},
    lambda: True, lambda: False, lambda: [], lambda: "not a schema", lambda: '{"type": "integer"}',
]
REGEXES = ["(a+)+$", "a{1000000}", "(", r"[\u0000-\uffff]{0,100000}", "(?=a)b", r"(a)\1", "", "x**",
           "(" * 500 + "a" + ")" * 500, "|".join(f"w{i}" for i in range(5_000)), "[0-9]{3}-[a-z]{2,4}"]
GRAMMARS = ["start: start", 'start: "a" start', "start: " + "(" * 300 + '"a"' + ")" * 300, 'root ::= "a" | "b"',
            "", "%import common.WORD\nstart: WORD", 'start: /(?=a)/', 'start: "a"{1000000}', "root ::= root",
            "start: r0\n" + "\n".join(f'r{i}: "x" r{i + 1} | "y"' for i in range(3_000)) + '\nr3000: "z"',
            'start: "yes" | "no"', "::=", "start: %json {\"type\": \"integer\"}", "start: @nope"]
CHOICES = [[], [""], ["a"] * 100_000, [f"option {i}" for i in range(30_000)], [5], ["<|endoftext|>"], ["yes", "no"]]


def _png(width: int, height: int, data: bytes = b"") -> bytes:
    """A PNG whose header claims `width` x `height` (the pixel data need not match: bombs, truncations)."""
    def chunk(tag: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(data)) + chunk(b"IEND", b"")


def _data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def _valid_png() -> bytes:
    from PIL import Image  # the gateway's own dependency

    raw = io.BytesIO()
    Image.new("RGB", (40, 24), (30, 120, 200)).save(raw, "PNG")
    return raw.getvalue()


IMAGE_URLS: list[Callable[[], str]] = [
    lambda: _data_url(_valid_png()),  # one that is fine, so the image path runs to the scheduler too
    lambda: _data_url(_png(100_000, 100_000)), lambda: _data_url(_png(2**31 - 1, 2)), lambda: _data_url(_png(0, 5)),
    lambda: _data_url(_png(7_000, 7_000)), lambda: _data_url(_png(2, 2, b"\0" * 3)),
    lambda: _data_url(_png(2, 2, b"\0" + b"\xff" * 6 + b"\0" + b"\x10" * 6)),
    lambda: _data_url(b"GIF89a" + b"\xff" * 20, "image/gif"), lambda: _data_url(b"\xff\xd8\xff\xe0" + b"\0" * 30),
    lambda: "data:image/png;base64,!!!not base64!!!", lambda: "data:image/png;base64,",
    lambda: "data:text/html;base64,PHNjcmlwdD4=", lambda: "data:image/png,rawbytes", lambda: "data:",
    lambda: "file:///etc/passwd", lambda: "ftp://example.com/a.png", lambda: "javascript:alert(1)",
    lambda: "gopher://127.0.0.1:70/_x", lambda: "http://127.0.0.1:50051/", lambda: "http://[::1]/a.png",
    lambda: "http://169.254.169.254/latest/meta-data/", lambda: "https://", lambda: "", lambda: "a" * 10_000,
]


def _image_body(rng: random.Random, model: str) -> tuple[str, dict[str, Any]]:
    url = rng.choice(IMAGE_URLS)()
    where = rng.randrange(4)
    if where == 0:  # an image in a system message (user messages only)
        return "/v1/chat/completions", {"messages": [{"role": "system", "content": [
            {"type": "image_url", "image_url": {"url": url}}]}] + USER, "max_tokens": 2}
    if where == 1:
        return "/v1/responses", {"model": model, "max_output_tokens": 2, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": url}, {"type": "input_text", "text": "what?"}]}]}
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url, "detail": rng.choice(["low", "x"])}}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "?"}]}],
                                    "max_tokens": 2}


def _schema_body(rng: random.Random, model: str, schema: Any) -> tuple[str, dict[str, Any]]:
    """`schema` where a route takes one: a response format, a tool's parameters (with the call forced or not)."""
    choice = rng.choice(["required", "auto", {"type": "function", "function": {"name": "f"}}])
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    return rng.choice([
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 4, "response_format": fmt}),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 4, "structured_outputs": {"json": schema}}),
        ("/v1/completions", {"prompt": "x", "max_tokens": 4, "guided_json": schema}),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 4, "tools": [tool], "tool_choice": choice}),
        ("/v1/responses", {"model": model, "input": "x", "max_output_tokens": 4,
                           "text": {"format": {"type": "json_schema", "name": "s", "schema": schema}}}),
        ("/v1/responses", {"model": model, "input": "x", "max_output_tokens": 4, "tool_choice": "required",
                           "tools": [{"type": "function", "name": "f", "parameters": schema}]}),
        ("/v1/messages", {"model": model, "max_tokens": 4, "messages": USER, "tool_choice": {"type": "any"},
                          "tools": [{"name": "f", "input_schema": schema}]}),
    ])


def _grammar_body(rng: random.Random) -> tuple[str, dict[str, Any]]:
    kind = rng.choice(["regex", "choice", "grammar", "json_object", "two", "legacy"])
    so: dict[str, Any] = {"regex": {"regex": rng.choice(REGEXES)}, "choice": {"choice": rng.choice(CHOICES)},
                          "grammar": {"grammar": rng.choice(GRAMMARS)}, "json_object": {"json_object": True},
                          "two": {"regex": "a", "choice": ["a"]}}.get(kind, {})
    path, body = rng.choice([("/v1/chat/completions", {"messages": USER, "max_tokens": 4}),
                             ("/v1/completions", {"prompt": "x", "max_tokens": 4})])
    if kind == "legacy":
        field = rng.choice(["regex", "choice", "grammar"])
        value = {"regex": REGEXES, "choice": CHOICES, "grammar": GRAMMARS}[field]
        return path, {**body, f"guided_{field}": rng.choice(value), "response_format": rng.choice(
            [None, {"type": "json_object"}])}
    return path, {**body, "structured_outputs": {**so, "whitespace_pattern": rng.choice([None, " *", "(", "\n+"])}}


EXTREMES: list[Callable[[random.Random], dict[str, Any]]] = [
    lambda r: {"logit_bias": {str(i): 1.0 for i in range(r.choice([300, 301, 5_000]))}},
    lambda r: {"logit_bias": {r.choice(["-1", "1e3", " 7", "07", "7", "99999999999", "", "x"]): r.choice(
        [100.0, 100.0001, -100.0, 1e308, "1", None])}},
    lambda r: {"logit_bias": {"7": 1.0, "07": 2.0}}, lambda r: {"logit_bias": [1, 2]},
    lambda r: {"n": r.choice([0, -1, 16, 17, 10**6, 2.0, True])},
    lambda r: {"logprobs": r.choice([True, False]), "top_logprobs": r.choice([-1, 0, 20, 21, 10**9, None])},
    lambda r: {"stop": r.choice([[""], ["s"] * 64, ["s"] * 65, "x" * 4_097, [5], [None], "", ["\x00"], ["ü" * 4_096]])},
    lambda r: {"stop_token_ids": r.choice([[-1], [10**7], list(range(1_025)), [0] * 1_024])},
    lambda r: {"best_of": r.choice([0, 1, 16, 17]), "n": r.choice([1, 2, 16])},
    lambda r: {"min_tokens": r.choice([0, 4, 5, 10**9, -1])},
    lambda r: {"max_tokens": r.choice([1, 0, 10**9, 2**31, -5])},
    lambda r: {"seed": r.choice([-(2**63), 2**64 - 1, -(2**63) - 1, 2**64])},
    lambda r: {"temperature": r.choice([0, 1e-30, 1e30, -0.0, 2.0]), "top_p": r.choice([1e-30, 1.0, 0, 1.0001])},
    lambda r: {"top_k": r.choice([-1, 0, 1, 2**31 - 1, 2**31]), "min_p": r.choice([0.0, 1.0, 1.5])},
    lambda r: {"repetition_penalty": r.choice([1e-30, 1e30, 0]), "presence_penalty": r.choice([-2, 2, 2.5])},
]


def _extreme_body(rng: random.Random, model: str) -> tuple[str, dict[str, Any]]:
    fields = rng.choice(EXTREMES)(rng)
    if "n" in fields or "best_of" in fields:
        fields["max_tokens"] = 2  # n = 16 of 2 tokens each stays cheap
    route = rng.randrange(4)
    if route == 0:
        return "/v1/completions", {"prompt": "Once upon", "max_tokens": 4, **fields,
                                   **({"logprobs": 2} if "top_logprobs" in fields else {})}
    if route == 1:
        limits = {"max_output_tokens": fields.get("max_tokens", 4), "temperature": fields.get("temperature"),
                  "top_p": fields.get("top_p"), "seed": fields.get("seed")}
        return "/v1/responses", {"model": model, "input": "x", **{k: v for k, v in limits.items() if v is not None}}
    if route == 2:
        stop = fields.get("stop")
        return "/v1/messages", {"model": model, "max_tokens": fields.get("max_tokens", 4), "messages": USER,
                                **({"stop_sequences": stop if isinstance(stop, list) else [stop]} if stop else {}),
                                **{k: fields[k] for k in ("temperature", "top_p", "top_k") if k in fields}}
    return "/v1/chat/completions", {"messages": USER, "max_tokens": 4, **fields}


# ------------------------------------------------------------------------------------------------ mutations

def leaves(obj: Any, path: tuple = ()) -> list[tuple]:
    """Paths of every value in a body (object members and list items, nested)."""
    out = [path] if path else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += leaves(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += leaves(v, (*path, i))
    return out


def set_at(obj: Any, path: tuple, value: Any) -> Any:
    """A copy of `obj` with the value at `path` replaced."""
    obj = json.loads(json.dumps(obj))
    target = obj
    for p in path[:-1]:
        target = target[p]
    target[path[-1]] = value
    return obj


def mutate(rng: random.Random, body: dict[str, Any], value: Callable[[], Any]) -> dict[str, Any]:
    """`body` with the value at one random path replaced by `value()`."""
    return set_at(body, rng.choice(leaves(body)), value())


HOSTILE_ITEMS = [{"type": "bogus"}, {"type": 5}, {"type": None}, {"role": "tool", "content": "x"}, {},
                 {"type": "reasoning", "content": [{"type": "reasoning_text", "text": 5}]},
                 {"type": "reasoning", "summary": "text"}, {"type": "function_call", "call_id": 1, "name": "f"},
                 {"type": "function_call_output", "call_id": "c", "output": {"a": 1}},
                 {"role": "user", "content": [{"type": "input_file", "file_id": "f"}]},
                 {"role": "assistant", "content": [{"type": "input_image", "image_url": "data:image/png;base64,"}]},
                 {"role": "user", "content": [{"type": "input_image", "file_id": "x"}]},
                 {"type": "item_reference", "id": "x"}, {"role": "user", "content": None}]
HOSTILE_BLOCKS = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}},
                  {"type": "document"}, {"type": "thinking", "thinking": 5}, {"type": "tool_use", "id": "x"},
                  {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": 7}]},
                  {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]},
                  {"type": "redacted_thinking", "data": "x"}, {"type": "text"}, {"type": None}, "text", 5]


def case_body(rng: random.Random, kind: str, model: str, random_value: Callable[[], Any]) -> tuple[str, Any]:
    """(path, JSON body) of one request of `kind` (one of KINDS)."""
    if kind == "responses_items":
        body = responses_body(model)
        if rng.random() < 0.5:
            return "/v1/responses", mutate(rng, body, random_value)
        body["input"].insert(rng.randrange(len(body["input"]) + 1), rng.choice(HOSTILE_ITEMS))
        body["stream"] = rng.random() < 0.3
        return "/v1/responses", body
    if kind == "messages_blocks":
        path = rng.choice(["/v1/messages", "/v1/messages", "/v1/messages/count_tokens"])
        body = messages_body(model)
        if path.endswith("count_tokens"):
            body.pop("max_tokens")
        if rng.random() < 0.5:
            return path, mutate(rng, body, random_value)
        turn = rng.choice(body["messages"])
        turn["content"].insert(rng.randrange(len(turn["content"]) + 1),
                               rng.choice(HOSTILE_BLOCKS + [{"type": "thinking", "thinking": "in a user turn"}]))
        body["stream"] = rng.random() < 0.3 and not path.endswith("count_tokens")
        return path, body
    if kind == "schemas":
        return _schema_body(rng, model, rng.choice(SCHEMAS)())
    if kind == "grammars":
        return _grammar_body(rng)
    if kind == "images":
        return _image_body(rng, model)
    return _extreme_body(rng, model)
