"""What a request constrains its output to, as one llguidance grammar (`GenerateRequest.grammar`).

Sources, at most one per request: `response_format` json_object / json_schema, vLLM's `structured_outputs` (json,
regex, choice, grammar — Lark or GBNF — json_object) and its older `guided_*` spellings, and tool calls that
`tool_choice` makes mandatory (`required`: one or more calls of any tool, or one when `parallel_tool_calls` is
false; a named function: exactly one call of it). `auto` is not constrained: the model's own output is parsed.

The grammar covers the whole reply, so it also says where the constrained part starts: after the reasoning when the
prompt opened a think block, else at once — after a newline either way, as history turns render `</think>\\n`, so
a constrained reply sent back as history renders to the very tokens that were generated and the next turn's prompt
matches them in the prefix cache. JSON is compact and single-line unless the request gives a `whitespace_pattern`:
a free-whitespace grammar lets a weak model write whitespace for ever.

The reasoning is any tokens but the ones that end it (`</think>`; a tool call's opening when calls are parsed) and
the stop ids: token ids, not text, so the grammar never holds the thinking to whole UTF-8 characters — a byte-level
token that leaves a character open must not forbid the `</think>` that the model, or the scheduler's thinking
budget, puts next. With a forced tool call, the call may also open straight from the reasoning (that ends it too).

Tool calls follow GLM's format, `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`, with
the arguments typed by the tool's JSON schema: a string argument is raw text (no `<`; `enum`, `pattern`,
`minLength` / `maxLength` honoured), any other value is JSON for its schema. Required properties come first, in the
schema's order, then the optional ones, each at most once — so the parsed arguments validate against the schema.
An argument's schema is read through its `$ref`s (json_schema.py: the reply parser reads it the same way), and a JSON
value's grammar carries the definitions it reaches, as the tool's schema held them in its `$defs`.

Every JSON schema is checked first (json_schema.check): what the library cannot compile is a 400 naming the keyword
and where it is.
"""

from __future__ import annotations

import json
from typing import Any

from llguidance import LLMatcher

from . import json_schema
from .errors import bad_request
from .schemas import ChatCompletionRequest, ChatTool, CompletionRequest, NamedToolChoice

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_TAGS = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _id_ranges(size: int, excluded: set[int]) -> list[tuple[int, int]]:
    """[lo, hi] runs of the ids 0..size-1 outside `excluded`."""
    runs: list[tuple[int, int]] = []
    lo = 0
    for cut in sorted(t for t in excluded if 0 <= t < size) + [size]:
        if lo < cut:
            runs.append((lo, cut - 1))
        lo = cut + 1
    return runs


class GrammarBuilder:
    """Builds grammars for the checkpoint's tokenizer (tags that are single added tokens are referenced as tokens,
    which is how llguidance sees them); grammar_check.py compiles and checks them."""

    def __init__(self, added_tokens: set[str], token_ids: dict[str, int] | None = None, vocab: int = 0,
                 stop_ids: frozenset[int] = frozenset()) -> None:
        """`token_ids`: the ids of the tags that are single tokens; `vocab`: the ids the tokenizer knows; `stop_ids`:
        the checkpoint's EOS ids (never inside the reasoning)."""
        self._added = added_tokens
        self._ids = token_ids or {}
        self._vocab = vocab
        self._stops = stop_ids

    def tag(self, text: str) -> str:
        """A literal tag in Lark: the token itself when the vocabulary has it as one added token."""
        return text if text in self._added else json.dumps(text)

    # -- the body: what the constrained part of the reply is -----------------------------------------------------
    def reply(self, body: dict[str, Any], reasoning: bool, calls: bool = False, tools_parsed: bool = False) -> str:
        """The whole reply: [reasoning `</think>`] or [newline], then the body grammar (named "body"). With
        `calls` (the body is tool calls) a call may also open straight from the reasoning: a tool call's opening
        ends thinking (the scheduler's thinking budget counts it so too, and never forces `</think>` into it).
        `tools_parsed`: the reply's tool calls are parsed, so a call's opening is never reasoning."""
        head = "start: NL @body\n"
        if reasoning:
            think, rules = self._reasoning(tools_parsed or calls)
            head = f"start: {think} {self.tag(THINK_CLOSE)} NL @body" + (f" | {think} @body" if calls else "") + \
                "\n" + rules
        top = {"name": "reply", "lark_grammar": head + "NL: /\\n/\n"}
        return json.dumps({"grammars": [top, {**body, "name": "body"}]})

    def _reasoning(self, calls_parsed: bool) -> tuple[str, str]:
        """(the reasoning's symbol, its rules): any tokens but the stop ids and those that end the reasoning."""
        if THINK_CLOSE not in self._ids:  # </think> is not one token: the reasoning is text up to it
            return "THINK", "THINK: /(?s:.*)/\n"
        ends = {self._ids[THINK_CLOSE]}
        if calls_parsed and TOOL_TAGS[0] in self._ids:
            ends.add(self._ids[TOOL_TAGS[0]])
        ranges = " | ".join(f"<[{lo}-{hi}]>" for lo, hi in _id_ranges(self._vocab, set(self._stops) | ends))
        return "think", f"think: token*\ntoken: {ranges}\n"

    @staticmethod
    def _first(grammar_json: str) -> dict[str, Any]:
        return json.loads(grammar_json)["grammars"][0]

    def json_schema(self, schema: dict[str, Any] | str, whitespace_pattern: str | None = None,
                    param: str = "response_format") -> dict[str, Any]:
        try:
            parsed = json.loads(schema) if isinstance(schema, str) else schema
        except ValueError:
            parsed = None  # not JSON: the library's message below says so
        json_schema.check(parsed, "the JSON schema", param)
        options = dict(_JSON_OPTIONS)
        if whitespace_pattern is not None:
            options = {"whitespace_flexible": True, "whitespace_pattern": whitespace_pattern}
        try:
            return self._first(LLMatcher.grammar_from_json_schema(schema, defaults=options))
        except (ValueError, TypeError) as exc:
            raise bad_request(f"invalid JSON schema: {exc}", param=param, code="invalid_grammar") from None

    def lark(self, text: str) -> dict[str, Any]:
        return {"lark_grammar": text}

    def regex(self, pattern: str) -> dict[str, Any]:
        return self._first(LLMatcher.grammar_from_regex(pattern))

    def choice(self, options: list[str]) -> dict[str, Any]:
        return {"lark_grammar": "start: " + " | ".join(json.dumps(o) for o in options)}

    def grammar(self, text: str, param: str = "structured_outputs.grammar") -> dict[str, Any]:
        """vLLM `grammar`: Lark (llguidance's dialect) or GBNF, told apart the way llguidance does."""
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            return {"lark_grammar": any_to_lark(text)}
        except Exception as exc:  # noqa: BLE001 — the converter raises plain Exceptions on bad input
            raise bad_request(f"invalid grammar: {exc}", param=param, code="invalid_grammar") from None

    def tool_calls(self, tools: list[tuple[ChatTool, str]], one: bool) -> dict[str, Any]:
        """One call (`one`) or one or more calls of the given tools, in GLM's format; each tool with the field
        path of its parameters (errors name it)."""
        lines = [f"start: call{'' if one else '+'}", "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
        for i, (tool, param) in enumerate(tools):
            lines += self._tool_rules(i, tool, param)
        lines.append("FREE_STR: /[^<]*/")
        return {"lark_grammar": "\n".join(lines)}

    def _tool_rules(self, i: int, tool: ChatTool, param: str) -> list[str]:
        params = tool.function.parameters or {}
        what = f"the parameters of tool {tool.function.name!r}"
        json_schema.check(params, what, param)
        props: dict[str, Any] = params.get("properties") or {}
        required = [k for k in params.get("required") or [] if k in props]
        optional = [k for k in props if k not in required]
        t = self.tag
        rules: list[str] = []
        parts: list[str] = []
        for j, key in enumerate(required + optional):
            rule = f"arg_{i}_{j}"
            value = self._value(props[key], params, f"{rule}_v", rules, (what, param, ("properties", key)))
            rules.append(f"{rule}: {t('<arg_key>')} {json.dumps(key)} {t('</arg_key>')} {t('<arg_value>')} "
                         f"{value} {t('</arg_value>')}")
            parts.append(rule if key in required else f"{rule}?")
        if not props and params.get("additionalProperties", True) is not False:
            rules.append(f"arg_{i}_any: {t('<arg_key>')} /[^<]+/ {t('</arg_key>')} {t('<arg_value>')} FREE_STR "
                         f"{t('</arg_value>')}")
            parts.append(f"arg_{i}_any*")
        head = f"call_{i}: {t('<tool_call>')} {json.dumps(tool.function.name)} {' '.join(parts)} {t('</tool_call>')}"
        return [head] + rules

    @staticmethod
    def _value(prop: Any, root: dict[str, Any], name: str, rules: list[str],
               where: tuple[str, str, json_schema.Path]) -> str:
        """The grammar of one argument value (`prop`, in the tool's schema `root`; `where`: the schema's name, its
        field and the argument's path in it, for errors): raw text for strings, JSON for everything else."""
        if not isinstance(prop, dict):
            return "FREE_STR"
        schema = json_schema.resolve(prop, root)
        if schema is None:  # check() found every reference's target: this is a chain of them going round
            json_schema.refuse(*where, "$ref", f"references lead on past {json_schema.MAX_DEPTH} hops (a cycle)")
        if raw_text(schema):
            for bound in ("minLength", "maxLength"):  # schemas.py checks them in `properties`, not behind a $ref
                if bound in schema and (type(schema[bound]) is not int or schema[bound] < 0):
                    json_schema.refuse(*where, bound, "must be a non-negative integer")
            if isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
                rules.append(f"{name}: " + " | ".join(json.dumps(v) for v in schema["enum"]))
                return name
            if isinstance(schema.get("pattern"), str):
                pattern = schema["pattern"].removeprefix("^").removesuffix("$").replace("/", "\\/")
                rules.append(f"{name.upper()}: /{pattern}/")
                return name.upper()
            lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
            if lo or hi is not None:
                rules.append(f"{name.upper()}: /[^<]{{{lo},{'' if hi is None else int(hi)}}}/")
                return name.upper()
            return "FREE_STR"
        doc = json_schema.self_contained(prop, root, *where)
        # Compact JSON, as a response format's (`json_schema`'s defaults): the schema's own x-guidance wins.
        doc["x-guidance"] = {**_JSON_OPTIONS, **(doc.get("x-guidance") or {})}
        rules.append(f"{name}: %json {json.dumps(doc)}")
        return name


def raw_text(schema: dict[str, Any] | None) -> bool:
    """A tool argument written as raw text (a string without `const`), not as JSON: `schema` is the argument's,
    resolved (json_schema.resolve)."""
    return isinstance(schema, dict) and schema.get("type") == "string" and "const" not in schema


def opens_thinking(prompt_text: str) -> bool:
    """The prompt opened a think block: the reply starts with reasoning, ended by </think>."""
    return prompt_text.rstrip().endswith(THINK_OPEN)


def source(req: ChatCompletionRequest | CompletionRequest) -> tuple[str, Any, str] | None:
    """(kind, value, field) of what constrains the request's output: kind is json / regex / choice / grammar."""
    so, rf = req.structured_outputs, req.response_format
    legacy = [(k, getattr(req, f"guided_{k}")) for k in ("json", "regex", "choice", "grammar")
              if getattr(req, f"guided_{k}") is not None]
    given = [name for name, on in (("response_format", rf is not None and rf.type != "text"),
                                   ("structured_outputs", so is not None), ("guided_*", bool(legacy))) if on]
    if len(given) > 1:
        raise bad_request(f"give only one of {', '.join(given)}", param=given[1])
    if rf is not None and rf.type == "json_object":
        return "json", {"type": "object"}, "response_format"
    if rf is not None and rf.type == "json_schema":
        assert rf.json_schema is not None
        return "json", rf.json_schema.schema_, "response_format.json_schema.schema"
    if so is not None:
        if so.json_object:
            return "json", {"type": "object"}, "structured_outputs.json_object"
        # exactly one is set (StructuredOutputs checks)
        kind, value = next((k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                                ("grammar", so.grammar)) if v is not None)
        return kind, value, f"structured_outputs.{kind}"
    if legacy:
        kind, value = legacy[0]
        return kind, value, f"guided_{kind}"
    return None


def request_body(b: GrammarBuilder, req: ChatCompletionRequest | CompletionRequest
                 ) -> tuple[dict[str, Any], str] | None:
    """(body grammar, the field it came from), or None when the output is free."""
    found = source(req)
    if found is None:
        return None
    kind, value, param = found
    ws = req.guided_whitespace_pattern
    if req.structured_outputs is not None and req.structured_outputs.whitespace_pattern is not None:
        ws = req.structured_outputs.whitespace_pattern
    if kind == "json":
        return b.json_schema(value, ws, param), param
    if kind == "regex":
        return b.regex(value), param
    if kind == "choice":
        return b.choice(value), param
    return b.grammar(value, param), param


def tool_body(b: GrammarBuilder, req: ChatCompletionRequest) -> tuple[dict[str, Any], str] | None:
    """The forced tool call(s) of `tool_choice` required / named; None for auto / none / no tools."""
    choice, tools = req.tool_choice, req.tools or []
    if isinstance(choice, NamedToolChoice):
        named = [(t, f"tools[{i}].function.parameters") for i, t in enumerate(tools)
                 if t.function.name == choice.function.name]
        if not named:
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not in tools",
                              param="tool_choice")
        return b.tool_calls(named, one=True), "tool_choice"
    if choice == "required":
        if not tools:
            raise bad_request("tool_choice 'required' needs tools", param="tool_choice")
        return b.tool_calls([(t, f"tools[{i}].function.parameters") for i, t in enumerate(tools)],
                            one=req.parallel_tool_calls is False), "tool_choice"
    return None


def build_grammar(b: GrammarBuilder, req: ChatCompletionRequest | CompletionRequest, reasoning: bool | None
                  ) -> tuple[str, str] | None:
    """(the request's grammar as llguidance JSON, the field it came from), not checked yet; None when
    unconstrained. `reasoning`: the prompt opened a think block (the grammar starts after it); None for a completion
    that did not (its grammar is the whole output)."""
    body = request_body(b, req)
    forced = None
    if isinstance(req, ChatCompletionRequest):
        forced = tool_body(b, req)
        if forced is not None and body is not None:
            raise bad_request("a forced tool call (tool_choice) cannot be combined with a response format",
                              param="tool_choice")
        body = body or forced
    if body is None:
        return None
    grammar, param = body
    if reasoning is None:
        return json.dumps({"grammars": [grammar]}), param
    tools_parsed = isinstance(req, ChatCompletionRequest) and bool(req.tools) and req.tool_choice != "none"
    return b.reply(grammar, reasoning, calls=forced is not None, tools_parsed=tools_parsed), param
