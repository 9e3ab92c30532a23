"""The shortest text a request's constrained part can be: the smallest JSON value a schema allows, the smallest tool
call a forced `tool_choice` allows, the shortest of a `choice`. A thinking budget must leave room for it within
max_tokens (prepare.py), and the refusal says how many tokens that takes.

Built from the schema, not searched in the grammar: required properties only, at their smallest values (strings at
their minLength, numbers at their bound or 0, arrays at minItems, the shortest `enum` / `anyOf` member); what cannot
be read statically (a regex, a Lark grammar, a string pattern) counts as empty. It is the floor of what any valid
reply needs, as the tokenizer would write it; a model that writes more still runs out of tokens.
"""

from __future__ import annotations

import json
import math
from typing import Any

from .constraints import TOOL_TAGS, raw_text, source
from .json_schema import lookup, resolve
from .schemas import ChatCompletionRequest, ChatTool, CompletionRequest, NamedToolChoice

_MAX_DEPTH = 16  # a recursive schema's shortest value never needs deeper nesting than its required chain


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))  # the grammar's compact JSON


def shortest_json(schema: Any, root: dict[str, Any] | None = None, depth: int = 0) -> str:
    """The shortest JSON text `schema` allows, as far as the schema says statically."""
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return "0"
    root = schema if root is None else root
    if "const" in schema:
        return _dump(schema["const"])
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return min((_dump(v) for v in schema["enum"]), key=len)
    if isinstance(schema.get("$ref"), str):
        return shortest_json(lookup(root, schema["$ref"]), root, depth + 1)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return min((shortest_json(s, root, depth + 1) for s in schema[key]), key=len)
    if isinstance(schema.get("allOf"), list):
        merged = {k: v for k, v in schema.items() if k != "allOf"}
        for part in schema["allOf"]:
            merged.update(part if isinstance(part, dict) else {})
        return shortest_json(merged, root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list) and kind:
        return min((shortest_json({**schema, "type": k}, root, depth) for k in kind), key=len)
    if kind is None:
        kind = "object" if "properties" in schema or "required" in schema else \
            "array" if "items" in schema else "integer"
    return _of_type(kind, schema, root, depth)


def _of_type(kind: Any, schema: dict[str, Any], root: dict[str, Any], depth: int) -> str:
    if kind == "object":
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = [k for k in schema.get("required") or [] if isinstance(k, str)]
        return "{" + ", ".join(f"{_dump(k)}: {shortest_json(props.get(k, {}), root, depth + 1)}"
                               for k in required) + "}"
    if kind == "array":
        n = schema.get("minItems") if type(schema.get("minItems")) is int else 0
        prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
        items = [prefix[i] if i < len(prefix) else schema.get("items", {}) for i in range(n)]
        return "[" + ", ".join(shortest_json(s, root, depth + 1) for s in items) + "]"
    if kind == "string":
        return _dump("a" * _min_length(schema))
    if kind in ("integer", "number"):
        return _number(schema)
    return {"boolean": "true", "null": "null"}.get(kind, "0")


def _min_length(schema: dict[str, Any]) -> int:
    n = schema.get("minLength")
    return n if type(n) is int and n > 0 else 0


def _number(schema: dict[str, Any]) -> str:
    """The shortest number in the schema's bounds: 0 when they allow it, else the bound nearest 0."""
    lo = next((v for k in ("minimum", "exclusiveMinimum") if isinstance(v := schema.get(k), (int, float))), None)
    hi = next((v for k in ("maximum", "exclusiveMaximum") if isinstance(v := schema.get(k), (int, float))), None)
    if lo is not None and lo > 0:
        return str(math.floor(lo) + 1 if "exclusiveMinimum" in schema or lo != math.floor(lo) else int(lo))
    if hi is not None and hi < 0:
        return str(math.ceil(hi) - 1 if "exclusiveMaximum" in schema or hi != math.ceil(hi) else int(hi))
    return "0"


def shortest_tool_call(tool: ChatTool) -> str:
    """The shortest call of `tool` in GLM's format (constraints.py `tool_calls`): its required arguments, string
    values as raw text."""
    call_open, call_close, key_open, key_close, value_open, value_close = TOOL_TAGS
    params = tool.function.parameters or {}
    props = params.get("properties") or {}
    out = call_open + tool.function.name
    for key in [k for k in params.get("required") or [] if k in props]:
        prop = resolve(props[key], params)
        if raw_text(prop):
            enum = prop.get("enum")
            value = min(enum, key=len) if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum) \
                else "a" * _min_length(prop)
        else:
            value = shortest_json(prop, params)
        out += f"{key_open}{key}{key_close}{value_open}{value}{value_close}"
    return out + call_close


def shortest_reply(req: ChatCompletionRequest | CompletionRequest) -> tuple[list[str], str] | None:
    """The candidate shortest texts of the request's constrained part (the caller counts their tokens and takes the
    fewest) and what the part is; None when the output is free."""
    found = source(req)
    if found is not None:
        kind, value, _ = found
        if kind == "json":
            return [shortest_json(value if isinstance(value, dict) else _loads(value))], "JSON value"
        if kind == "choice":
            return list(value), "choice"
        return [""], "constrained output"  # a regex or a grammar: nothing read statically
    if not isinstance(req, ChatCompletionRequest) or not req.tools:
        return None
    if isinstance(req.tool_choice, NamedToolChoice):
        named = [t for t in req.tools if t.function.name == req.tool_choice.function.name]
        return [shortest_tool_call(t) for t in named], "tool call"
    if req.tool_choice == "required":
        return [shortest_tool_call(t) for t in req.tools], "tool call"
    return None


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return {}
