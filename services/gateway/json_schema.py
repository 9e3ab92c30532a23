"""JSON Schema as clients write it (pydantic's `model_json_schema`, the SDKs' `pydantic_function_tool` / `parse`
helpers, zod): local `$ref`s into `$defs` / `definitions` (nested, recursive), `allOf` of one ref, `anyOf` with
`null`, `enum` / `const`. Three jobs on one walk of the schema's own nodes:

- `check`: refuse at admission, naming the keyword and where it is, what the structured-output library (llguidance)
  cannot compile — a `$ref` that is not local or points nowhere, the keywords it does not implement, a string
  `format` it does not know, an unknown `type`, nesting past `MAX_DEPTH`. Anything else it refuses still comes back
  as a 400 from the compile check (grammar_check.py), in its own words.
- `resolve`: the schema a node stands for once its `$ref`s are followed (the tool-call grammar and the reply parser
  read an argument's `type` from it: the same answer on both sides).
- `self_contained`: a sub-schema (one tool argument) as a document of its own, every `$ref` it reaches rewritten
  into its own `$defs`, so it compiles apart from the tool's schema that held the definitions.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NoReturn

from .errors import bad_request

# Nesting of schema nodes, and hops of a `$ref` chain, past which a schema is refused: far beyond what clients
# generate, and it keeps every walk here bounded.
MAX_DEPTH = 64
# llguidance 1.9's "Unimplemented keys" (tests/gateway/test_json_schema.py checks each against the library).
UNSUPPORTED = frozenset({
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "uniqueItems", "contains",
    "minContains", "maxContains", "unevaluatedProperties", "unevaluatedItems", "propertyNames", "$dynamicRef",
    "$dynamicAnchor", "$recursiveRef"})
# The string formats llguidance knows (any other is its "Unknown format").
FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uuid",
                     "unknown"})
TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})

# Where a schema holds schemas: a map of them, a list of them, or one (`items` may also be draft 4's list).
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_ONE = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
        "propertyNames", "unevaluatedItems", "unevaluatedProperties")

Path = tuple[str | int, ...]


def children(node: dict[str, Any]) -> Iterator[tuple[Path, Any]]:
    """The schemas directly inside `node`, each with its path below it (keyword, then key or index)."""
    for key in _MAPS:
        if isinstance(node.get(key), dict):
            yield from (((key, name), sub) for name, sub in node[key].items())
    for key in _LISTS + _ONE:
        value = node.get(key)
        if isinstance(value, list) and key in _LISTS + ("items",):
            yield from (((key, i), sub) for i, sub in enumerate(value))
        elif key in _ONE and isinstance(value, (dict, bool)):
            yield (key,), value


def pointer(path: Path) -> str:
    """`path` as a JSON pointer fragment ("#/properties/a~1b")."""
    return "#" + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


def lookup(root: Any, ref: str) -> Any:
    """The node a local `$ref` points at in `root`; None when it is not local or points nowhere."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
    return node


def check(schema: Any, what: str, param: str) -> None:
    """A 400 naming the keyword and where it is (in the message: `what` and a JSON pointer; in `param`: the field
    path under `param`) when llguidance cannot compile `schema` for a reason read off the schema itself."""
    stack: list[tuple[Path, Any, int]] = [((), schema, 0)]
    while stack:
        path, node, depth = stack.pop()
        if not isinstance(node, dict):
            continue
        if depth > MAX_DEPTH:
            refuse(what, param, path, None, f"schemas nested deeper than {MAX_DEPTH} levels are not supported")
        why = _why_not(node, schema)
        if why is not None:
            refuse(what, param, path, *why)
        stack += [(path + sub, child, depth + 1) for sub, child in reversed(list(children(node)))]


def _why_not(node: dict[str, Any], root: Any) -> tuple[str, str] | None:
    """(keyword, why) of the first thing in `node` itself that llguidance cannot compile."""
    for key in node:
        if key in UNSUPPORTED:
            return key, "this keyword is not supported for structured output"
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return "$ref", f"{ref!r} is not a local reference: only '#/...' pointers into this schema are supported"
    if isinstance(ref, str) and lookup(root, ref) is None:
        return "$ref", f"{ref!r} points at nothing in this schema"
    kinds = node.get("type")
    names = kinds if isinstance(kinds, list) else [kinds] if kinds is not None else []
    unknown = [k for k in names if k not in TYPES]
    if unknown:
        return "type", f"{unknown[0]!r} is not a JSON Schema type ({', '.join(sorted(TYPES))})"
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt not in FORMATS and (kinds is None or "string" in names):
        return "format", f"the string format {fmt!r} is not supported ({', '.join(sorted(FORMATS))} are)"
    return None


def refuse(what: str, param: str, path: Path, keyword: str | None, why: str) -> NoReturn:
    """The 400 for `keyword` at `path` in the schema that `what` names and the field `param` holds."""
    where = path + ((keyword,) if keyword else ())
    field = param + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in where)
    named = f"'{keyword}' at {pointer(path)}" if keyword else f"at {pointer(path)}"
    raise bad_request(f"{what}: {named}: {why}", param=field, code="invalid_grammar")


def resolve(node: Any, root: Any) -> dict[str, Any] | None:
    """What `node` stands for: its `$ref` (or `allOf` of one schema) followed, the node's other keywords laid over
    the target's; None for a reference that points nowhere or a chain of references longer than MAX_DEPTH (a
    cycle)."""
    merged: dict[str, Any] = {}
    for _ in range(MAX_DEPTH):
        if not isinstance(node, dict):
            return merged or None
        if isinstance(node.get("$ref"), str):
            target = lookup(root, node["$ref"])
        elif isinstance(node.get("allOf"), list) and len(node["allOf"]) == 1:
            target = node["allOf"][0]
        else:
            return {**node, **merged}
        merged = {**{k: v for k, v in node.items() if k not in ("$ref", "allOf")}, **merged}
        node = target
        if node is None:
            return None
    return None


def self_contained(node: Any, root: Any, what: str, param: str, at: Path) -> Any:
    """`node` (the schema at `at` in `root`) with every `$ref` it reaches, through others too, rewritten to a
    definition of its own: `{..., "$defs": {"ref0": target, ...}}`. A recursive schema stays recursive; references
    nested past MAX_DEPTH are a 400 (`what`, `param`: as `check`'s)."""
    names: dict[str, str] = {}  # a reference -> its definition's name here ("ref0", "ref1", ...)
    defs: dict[str, Any] = {}

    def rewrite(sub: Any, path: Path, depth: int) -> Any:
        if not isinstance(sub, dict):
            return sub
        if depth > MAX_DEPTH:
            refuse(what, param, path, None, f"schemas nested deeper than {MAX_DEPTH} levels, through their "
                    "references, are not supported")
        out = {k: v for k, v in sub.items() if k not in ("$defs", "definitions")}
        ref = sub.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            if ref not in names:
                name = names[ref] = f"ref{len(names)}"  # named before the target is rewritten: a recursive
                defs[name] = rewrite(lookup(root, ref), path + ("$ref",), depth + 1)  # reference ends here
            out["$ref"] = "#/$defs/" + names[ref]
        for sub_path, child in children(sub):
            key = sub_path[0]
            if key in ("$defs", "definitions"):
                continue  # definitions come along through the references that use them
            if len(sub_path) == 1:
                out[key] = rewrite(child, path + sub_path, depth + 1)
                continue
            if out[key] is sub[key]:
                out[key] = list(sub[key]) if isinstance(sub[key], list) else dict(sub[key])
            out[key][sub_path[1]] = rewrite(child, path + sub_path, depth + 1)
        return out

    doc = rewrite(node, at, 0)
    if isinstance(doc, dict) and defs:
        doc["$defs"] = defs
    return doc
