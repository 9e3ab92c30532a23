"""Request schemas: OpenAI chat/completions plus vLLM's extra fields and twinspark's own (`background`, `draft`).

Validation is strict (no "1.5" -> 1.5 coercion, no true -> 1) and closed (`extra="forbid"`): an unknown field is a
400 naming it. The gateway drops unknown top-level options before validation unless `--strict-request-fields`
(request_fields.py: ignored as vLLM ignores them, and reported in a response header). Fields we recognise but do
not implement are declared, accepted at their neutral value (length_penalty 1, use_beam_search false, ...) and
refused otherwise by `check_unsupported`, naming the field: a client never believes a setting took effect when it
did not.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator,
                      model_validator)

from kernels.sampling_rules import (FREQUENCY_PENALTY, LOGIT_BIAS, MIN_P, MIN_TOKENS, N, PRESENCE_PENALTY,
                                    PROMPT_LOGPROBS, REPETITION_PENALTY, SEED, TEMPERATURE, TOP_K, TOP_LOGPROBS, TOP_P,
                                    VLLM_TOP_K_OFF)

from .errors import GatewayError, bad_request, unsupported


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


# ---------------------------------------------------------------------------------------------- chat messages

class ImageUrl(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted as OpenAI has it; the processor decides size


class ContentPart(_Strict):
    """A `text` part or an `image_url` part (OpenAI's shapes); images only in user messages."""

    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageUrl | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_type(cls, data: Any) -> Any:
        # Say plainly which part types are served, instead of pydantic's literal / "extra inputs" complaints.
        if isinstance(data, dict) and data.get("type") not in ("text", "image_url"):
            raise ValueError(f"content part type {data.get('type')!r} is not supported; 'text' and 'image_url' "
                             "parts are")
        return data

    @model_validator(mode="after")
    def _fields_of_type(self) -> "ContentPart":
        if self.type == "text" and (self.text is None or self.image_url is not None):
            raise ValueError("a 'text' part has `text` (and no `image_url`)")
        if self.type == "image_url" and (self.image_url is None or self.text is not None):
            raise ValueError("an 'image_url' part has `image_url: {\"url\": ...}` (and no `text`)")
        return self


class FunctionCall(_Strict):
    name: str
    arguments: str | dict[str, Any]


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # Earlier turns' reasoning goes back into the prompt (the template renders it) so the prefix cache holds.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _images_from_users(self) -> "ChatMessage":
        if self.role != "user" and isinstance(self.content, list) and any(p.type == "image_url" for p in self.content):
            raise ValueError("image_url parts are accepted in user messages only")
        return self


# ------------------------------------------------------------------------------------- tools and structure

class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _grammar_keywords(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        """The keywords the tool-call grammar reads itself (constraints.py), type-checked here so a malformed
        schema is a 400 naming them; the rest of the schema is the structured-output library's to judge."""
        if schema is None:
            return None
        props = schema.get("properties", {})
        if not isinstance(props, dict) or not all(isinstance(p, (dict, bool)) for p in props.values()):
            raise ValueError("'properties' must be an object of schemas")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
            raise ValueError("'required' must be an array of property names")
        for key, prop in props.items():
            if not isinstance(prop, dict) or prop.get("type") != "string":
                continue
            for bound in ("minLength", "maxLength"):
                value = prop.get(bound)
                if value is not None and (type(value) is not int or value < 0):
                    raise ValueError(f"properties.{key}.{bound} must be a non-negative integer")
            if not isinstance(prop.get("pattern", ""), str) or not isinstance(prop.get("enum", []), list):
                raise ValueError(f"properties.{key}: 'pattern' must be a string and 'enum' an array")
        return schema


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


class JsonSchemaSpec(_Strict):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object")
        return self


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one of json / regex / choice / grammar / json_object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    backend: str | None = None  # accepted and ignored: llguidance serves every kind

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _one_kind(self) -> "StructuredOutputs":
        kinds = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar or json_object")
        return self


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool | None = False  # vLLM: with include_usage, usage so far in every chunk


# ------------------------------------------------------------------------------------------- neutral values

def _is(*values: Any) -> Any:
    return lambda v: any(v is x or (type(v) is type(x) and v == x) for x in values)


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == {} or v is False


# Recognised, not implemented: field -> the predicate of its accepted (neutral) values; any other value is a 400
# naming the field (check_unsupported). Each table declares its fields, as `Any = None`, on the request types below.
_GENERATION_NEUTRAL: dict[str, Any] = {
    "length_penalty": _is(None, 1, 1.0),
    "priority": _is(None, 0),
    "use_beam_search": _is(None, False),
    "truncate_prompt_tokens": _is(None),
    "bad_words": _empty,
    "allowed_token_ids": _is(None),
    "logits_processors": _empty,
    "return_tokens_as_token_ids": _is(None, False),
    "spaces_between_special_tokens": _is(None, True),
    "cache_salt": _is(None),
    "kv_transfer_params": _is(None),
    "vllm_xargs": _is(None),
    "service_tier": _is(None, "auto", "default"),
    "store": _is(None, False),
    "echo": _is(None, False),  # completions implement it
    "return_hidden_states": _is(None, False),  # SGLang's, written by vllm-router
}
_CHAT_NEUTRAL: dict[str, Any] = {
    "functions": _empty,
    "function_call": _is(None, "none"),
    "chat_template": _is(None),
    "continue_final_message": _is(None, False),
    "documents": _is(None),
    "mm_processor_kwargs": _is(None),
    "audio": _is(None),
    "modalities": lambda v: v is None or v == ["text"],
    "prediction": _is(None),
    "web_search_options": _is(None),
    "verbosity": _is(None),
    "separate_reasoning": _is(None, True),  # SGLang / vllm-router; reasoning is always separated here
    "stream_reasoning": _is(None, True),
    "include_reasoning": _is(None, True),  # vLLM; reasoning is always included
}
_COMPLETION_NEUTRAL: dict[str, Any] = {"suffix": _is(None, ""), "prompt_embeds": _is(None)}
_NEUTRAL: dict[str, Any] = {**_GENERATION_NEUTRAL, **_CHAT_NEUTRAL, **_COMPLETION_NEUTRAL}


def _recognised(base: type[BaseModel], neutral: dict[str, Any]) -> Any:
    """`base` with every field of a neutral table declared `Any = None`: recognised, so a request naming one gets
    check_unsupported's 400 for a non-neutral value rather than the strict models' "unknown field"."""
    return create_model(f"{base.__name__}Recognised", __base__=base, **{name: (Any, None) for name in neutral})


_WHY: dict[str, str] = {
    "priority": "is not supported; send \"background\": true for background priority",
}


# ------------------------------------------------------------------------------------------ generation requests

# Bounds on small fields (the structural limits on any body are in limits.py): a stop string is matched against
# every chunk of output, and identifiers are echoed in errors and logs.
StopString = Annotated[str, Field(max_length=4096)]
Identifier = Annotated[str, Field(max_length=512)]

class _Generation(_recognised(_Strict, _GENERATION_NEUTRAL)):
    """Fields shared by chat and completions."""

    # Fields of `_NEUTRAL` a subclass implements (declared with their own type there): not refused for it.
    implemented: ClassVar[frozenset[str]] = frozenset()
    model: Identifier | None = None  # optional as in vLLM: the one served model
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, **TEMPERATURE.field())
    top_p: float | None = Field(None, **TOP_P.field())
    top_k: int | None = Field(None, ge=VLLM_TOP_K_OFF, le=TOP_K.hi)
    min_p: float | None = Field(None, **MIN_P.field())
    seed: int | None = Field(None, **SEED.field())
    max_tokens: int | None = Field(None, ge=1)
    stop: StopString | Annotated[list[StopString], Field(max_length=64)] | None = None
    stop_token_ids: Annotated[list[int], Field(max_length=1024)] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    background: bool = False  # twinspark: PRIORITY_BACKGROUND, served after every normal request
    draft: bool = True        # twinspark: false turns speculative drafts off for this request
    # vLLM; echoed in the x-request-id header, hence printable ASCII only
    request_id: str | None = Field(None, min_length=1, max_length=200, pattern=r"^[\x20-\x7e]+$")
    # Accepted and ignored: identifiers and cache hints that change nothing in the output.
    user: Identifier | None = None
    metadata: dict[str, Any] | None = None
    prompt_cache_key: Identifier | None = None
    safety_identifier: Identifier | None = None
    n: int = Field(1, **N.field())
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None    # vLLM's older spellings of structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    # Penalties (OpenAI's ranges; repetition_penalty and min_tokens are vLLM's), applied on the ranks before the draw.
    presence_penalty: float | None = Field(None, **PRESENCE_PENALTY.field())
    frequency_penalty: float | None = Field(None, **FREQUENCY_PENALTY.field())
    repetition_penalty: float | None = Field(None, **REPETITION_PENALTY.field())
    logit_bias: dict[str, Annotated[float, Field(**LOGIT_BIAS.field())]] | None = None  # token id -> bias
    min_tokens: int | None = Field(None, **MIN_TOKENS.field())
    # vLLM: tokens the reply may think (inside the think block the prompt opened) before the end of thinking is
    # forced; unset: reasoning_effort's budget, else the server's --reasoning-budget (thinking.py).
    thinking_token_budget: int | None = Field(None, ge=0, lt=1 << 31)
    # vLLM: the logprob, rank and top k of every prompt token after the first (the model's raw distribution).
    prompt_logprobs: int | None = Field(None, **PROMPT_LOGPROBS.field())
    # SGLang's, which vllm-router writes into every request it forwards (with these defaults).
    no_stop_trim: bool = False  # true: keep the stop string and the stopping token in the output
    session_params: dict[str, Any] | None = None  # session ids: accepted and ignored (the prefix cache needs none)


class ChatCompletionRequest(_recognised(_Generation, _CHAT_NEUTRAL)):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the template already writes [gMASK]<sop>
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "max", "xhigh"] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, **TOP_LOGPROBS.field())
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_recognised(_Generation, _COMPLETION_NEUTRAL)):
    implemented: ClassVar[frozenset[str]] = frozenset({"echo"})

    # vLLM: a string, a token-id list, or a list holding one of either (batches of more than one are refused).
    prompt: str | list[int] | list[str] | list[list[int]]
    # OpenAI: the reply's text (and logprobs) start with the prompt's; with max_tokens 0 the prompt is only scored.
    echo: bool = False
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo (prepare.py), as vLLM
    add_special_tokens: bool = True
    logprobs: int | None = Field(None, **TOP_LOGPROBS.field())  # completions: how many top logprobs (0: chosen only)
    best_of: int | None = Field(None, **N.field())


class TokenizeRequest(_Strict):
    model: Identifier | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # default: true for `prompt`, false for `messages` (vLLM)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None  # rendered into the prompt as chat requests render them (vLLM)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


class DetokenizeRequest(_Strict):
    model: Identifier | None = None
    tokens: list[int]


def check_unsupported(req: BaseModel) -> None:
    """Raise a 400 naming the first recognised-but-unimplemented field set to a non-neutral value."""
    for name in type(req).model_fields:
        accepts = None if name in getattr(req, "implemented", ()) else _NEUTRAL.get(name)
        if accepts is not None and not accepts(getattr(req, name)):
            raise unsupported(name, _WHY.get(name, "is not supported by this server"))


# ------------------------------------------------------------------------------------------------ parsing

# pydantic adds union-member tags ("str", "list[int]", "function-after[...]") to error locations; a client's
# `param` should only name the path in its own JSON.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "nullable", "union"}


def _param_of(loc: tuple[Any, ...]) -> str | None:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out or None


# A translated API's names for chat fields: (regex on the chat path, replacement), the first match wins.
Renames = list[tuple[str, str]]


def rename(param: str | None, renames: Renames) -> str | None:
    for pattern, replacement in renames:
        if param is not None and re.match(pattern, param):
            return re.sub(pattern, replacement, param, count=1)
    return param


def _first_error(exc: ValidationError, renames: Renames | None = None, at: str = "") -> GatewayError:
    errors = exc.errors(include_url=False)
    head = _param_of(errors[0]["loc"]) if errors else None
    # Of the errors about the first bad field, the one deepest inside it is usually the real cause: for a union
    # (content: str | list[parts]) pydantic reports every member's failure.
    same = [e for e in errors if (_param_of(e["loc"]) or "").startswith(head or "")] or errors
    err = max(same, key=lambda e: len(_param_of(e["loc"]) or ""))
    param = rename(_param_of(err["loc"]), renames or [])
    if at:
        param = at + (("" if param.startswith("[") else ".") + param if param else "")
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = f"Unrecognized request argument supplied: {param}"
    elif param:
        msg = f"{param}: {msg}"
    return bad_request(msg, param=param)


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 saying why not."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"malformed JSON body: {exc}", code="invalid_json") from None
    except RecursionError:  # limits.py refuses deep bodies first; this keeps parse() safe on its own
        raise bad_request("the JSON body nests too deeply", code="json_too_deep") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    return data


def validated(model: type[BaseModel], data: Any, *, at: str = "", renames: Renames | None = None) -> Any:
    """`model` from `data` that is part of a body (`at`: its path there) or that a translation layer built
    (Anthropic Messages or Responses -> chat: `renames` maps chat's paths back to the caller's fields); any problem
    becomes a 400 naming the caller's field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _first_error(exc, renames, at) from None


def parse(model: type[_Strict], raw: bytes) -> Any:
    """Validate a JSON body into `model`; any problem becomes a 400 with `param` naming the field."""
    return parse_data(model, parse_json(raw))


def parse_data(model: type[_Strict], data: dict[str, Any]) -> Any:
    """`parse` of a body already read as JSON (the gateway drops unknown options from it first)."""
    try:
        req = model.model_validate(data)
    except ValidationError as exc:
        raise _first_error(exc) from None
    if isinstance(req, _Generation):
        check_unsupported(req)
    return req


__all__ = [
    "ChatCompletionRequest", "ChatMessage", "ChatTool", "CompletionRequest", "NamedToolChoice", "ResponseFormat",
    "StructuredOutputs", "DetokenizeRequest", "GatewayError", "Renames",
    "TokenizeRequest", "check_unsupported", "parse", "parse_data", "parse_json", "rename", "validated",
]
