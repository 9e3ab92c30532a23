"""Request fields the gateway does not know: ignored and reported (vLLM's behaviour), or refused (OpenAI's).

The ecosystem's routers and clients add fields of their own to every request (vllm-router re-serialises each body
with SGLang's defaults — `no_stop_trim`, `separate_reasoning`, ...; benchmark clients send vLLM extensions), and
vLLM accepts any field it does not know with a logged warning. So by default the gateway does the same: an unknown
*option* — a top-level field of a request body, or a key inside `stream_options` — is dropped before validation,
logged once per field name for the life of the process, and listed in the `x-twinspark-ignored-fields` response
header so the client can see that it had no effect. With `--strict-request-fields` nothing is dropped and the
schema's `extra="forbid"` answers OpenAI's 400 ("Unrecognized request argument supplied: NAME").

Unknown keys inside content (messages, content parts, tools, schemas) are refused in both modes: dropping one
would silently lose part of what the model is asked. Known fields are validated as before either way — a bad
value of a field we know is still a 400 naming it.
"""

from __future__ import annotations

import logging
import urllib.parse
from typing import Any

from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .schemas import StreamOptions

log = logging.getLogger("twinspark.gateway")

HEADER = "x-twinspark-ignored-fields"
_STATE_KEY = "ignored_fields"  # where a handler leaves the names for the header (the request's scope state)
# Nested objects whose keys are options too (not content): their unknown keys are ignored like top-level ones.
_OPTION_OBJECTS: dict[str, type[BaseModel]] = {"stream_options": StreamOptions}
# Bounds, since every name comes from the client: how much of a name is echoed, how many names one header or log
# line lists, and how many distinct names the process remembers (past that, new names are no longer logged).
_NAME_CHARS = 64
_LISTED = 16
_REMEMBERED = 1024


def known_names(model: type[BaseModel]) -> frozenset[str]:
    """The keys `model` accepts: its field names and their aliases."""
    return frozenset(n for name, f in model.model_fields.items() for n in (name, f.alias) if n)


def printable(name: str) -> str:
    """A client's field name as it may appear in a header or a log line: at most 64 characters, percent-escaped
    outside letters, digits and `_.-~` (no control characters, no header injection, latin-1 safe); the empty name
    as `""` (a header value may not end in a separator)."""
    if not name:
        return '""'
    return urllib.parse.quote(name[:_NAME_CHARS], safe="") + ("..." if len(name) > _NAME_CHARS else "")


def listing(names: list[str]) -> str:
    """Names as one comma-separated line: the first 16, then how many more."""
    shown = ", ".join(names[:_LISTED])
    return shown + (f", +{len(names) - _LISTED} more" if len(names) > _LISTED else "")


class UnknownFields:
    """What the gateway does with fields it does not know: `strict` refuses them (400), otherwise they are
    dropped, logged once per name and reported per response."""

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self._seen: set[str] = set()
        self._full = False

    def accept(self, model: type[BaseModel], data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """`data` without the unknown options (unchanged in strict mode) and the dropped names, as printable paths
        (`no_stop_trim`, `stream_options.include_obfuscation`)."""
        if self.strict:
            return data, []
        known = known_names(model)
        ignored = [key for key in data if key not in known]
        kept = {k: v for k, v in data.items() if k in known} if ignored else data
        for key, option in _OPTION_OBJECTS.items():
            inner = kept.get(key)
            if key in known and isinstance(inner, dict):
                names = known_names(option)
                dropped = [k for k in inner if k not in names]
                if dropped:
                    kept = {**kept, key: {k: v for k, v in inner.items() if k in names}}
                    ignored += [f"{key}.{k}" for k in dropped]
        names = [printable(n) for n in ignored]
        if names:
            self._log_new(names)
        return kept, names

    def describe(self, document: dict[str, Any]) -> dict[str, Any]:
        """The OpenAPI document as this policy serves it: unless strict, the request bodies (and the option
        objects) accept properties beyond those listed (pydantic wrote `additionalProperties: false`)."""
        if self.strict:
            return document
        schemas = document.get("components", {}).get("schemas", {})
        bodies = {op["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
                  for path in document.get("paths", {}).values() for op in path.values() if "requestBody" in op}
        for name in bodies | {m.__name__ for m in _OPTION_OBJECTS.values()}:
            if name in schemas:
                schemas[name].pop("additionalProperties", None)
        return document

    def _log_new(self, names: list[str]) -> None:
        """One warning per request that brings names not seen before (vLLM warns on every request; once per name
        keeps a router that adds the same fields to every request from filling the log)."""
        if self._full:
            return
        new = [n for n in dict.fromkeys(names) if n not in self._seen]
        if not new:
            return
        self._seen.update(new)
        log.warning("ignoring request fields this server does not know (each name is logged once; the response "
                    "header %s lists them per request): %s", HEADER, listing(new))
        if len(self._seen) >= _REMEMBERED:
            self._full = True
            log.warning("%d distinct unknown request field names seen: new ones are no longer logged",
                        len(self._seen))


def report(scope: Scope, names: list[str]) -> None:
    """Leave the ignored names of this request for `IgnoredFieldsHeader` (a handler calls this)."""
    if names:
        scope.setdefault("state", {})[_STATE_KEY] = names


class IgnoredFieldsHeader:
    """Adds `x-twinspark-ignored-fields: a, b` to the response of a request whose handler reported ignored fields
    (full replies, streams and errors alike: the header goes out with the status line, whatever the body)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})  # the handler's Request.state writes into this same dict

        async def send_with_header(message: Message) -> None:
            names = state.get(_STATE_KEY) if isinstance(state, dict) else None
            if message["type"] == "http.response.start" and names:
                headers = list(message.get("headers", []))
                headers.append((HEADER.encode("latin-1"), listing(names).encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_header)


__all__ = ["HEADER", "IgnoredFieldsHeader", "UnknownFields", "known_names", "listing", "printable", "report"]
