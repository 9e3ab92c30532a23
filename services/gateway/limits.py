"""Input limits for every HTTP route: header size, body size, and the shape of a JSON body.

One ASGI middleware, in front of every route (so routes added later are covered without doing anything):
- headers: more than `max_headers` fields or `max_header_bytes` bytes in all → 431;
- body: a Content-Length over `max_body_bytes`, or more bytes than that arriving → 413 (the body is read here,
  bounded, and replayed to the route, which then reads it as usual);
- JSON body: nested deeper than `max_json_depth` → 400 (this also turns the RecursionError that the standard
  parser raises on very deep input into a 400); a string longer than `max_string_chars`, an array longer than
  `max_array_items`, NaN / Infinity (not JSON numbers), an integer beyond ±2^64 or a string (or key) with a lone
  surrogate escape (not Unicode) → 400. Every such error names the path of the offending value in `param`
  (`messages[3].content`).
A body that is not JSON at all passes through: the route answers its own `invalid_json` 400.

Field-specific bounds (top_k fits int32, at most so many stop strings, ...) are in the pydantic schemas; these
are the structural limits that no schema can enforce, because the standard parser would already have failed or
used the memory by then.

Hand-written because no maintained library bounds JSON depth and sizes before or during parsing for Python's
`json` (orjson's depth limit is a fixed 1024, deep enough to matter for pydantic and jinja later on).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import GatewayError, bad_request, log_refused

_INT_BOUND = 1 << 64


@dataclass(frozen=True)
class InputLimits:
    # 32 MiB holds a full 1M-token window as text or as a token-id list, with room for JSON escaping.
    max_body_bytes: int = 32 << 20
    max_json_depth: int = 64  # OpenAI-style JSON schemas (tools, response_format) nest far less
    max_string_chars: int = 8 << 20  # ~2M tokens of text in one string
    max_array_items: int = 2 << 20  # a token-id prompt of the whole window, twice over
    max_header_bytes: int = 32 << 10
    max_headers: int = 100

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 1:
                raise ValueError(f"input limit {name} must be >= 1, got {value}")


def _path(parts: list[str | int]) -> str | None:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else ("." if out else "") + p
    return out or None


def check_json_shape(data: Any, limits: InputLimits) -> None:
    """Walk a parsed body iteratively (no recursion, whatever its depth); raise a 400 at the first value over a
    limit, naming its path."""
    stack: list[tuple[Any, list[str | int], int]] = [(data, [], 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if len(value) > limits.max_string_chars:
                raise _limit(path, f"a string of {len(value)} characters is longer than the limit of "
                                   f"{limits.max_string_chars}", "string_too_long")
            _check_unicode(value, path)
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, int):
            if not -_INT_BOUND < value < _INT_BOUND:
                raise _limit(path, "an integer beyond ±2^64 is out of range for every field", "number_out_of_range")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise _limit(path, f"{value} is not a JSON number", "invalid_json")
        elif isinstance(value, (list, dict)):
            if depth > limits.max_json_depth:
                raise _limit(path, f"the JSON body nests deeper than {limits.max_json_depth} levels", "json_too_deep")
            if isinstance(value, list):
                if len(value) > limits.max_array_items:
                    raise _limit(path, f"an array of {len(value)} items is longer than the limit of "
                                       f"{limits.max_array_items}", "array_too_long")
                stack.extend((v, [*path, i], depth + 1) for i, v in enumerate(value) if not _scalar_ok(v))
            else:
                for k, v in value.items():
                    if len(k) > limits.max_string_chars:
                        raise _limit(path, f"a key of {len(k)} characters is longer than the limit of "
                                           f"{limits.max_string_chars}", "string_too_long")
                    _check_unicode(k, path)
                    stack.append((v, [*path, k], depth + 1))


def _check_unicode(text: str, path: list[str | int]) -> None:
    """JSON's \\u escapes can spell a lone surrogate (\\ud800), which is no Unicode text: the tokenizer, the
    template, the grammar library and the JSON writer all fail on one, so it is refused here, once."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _limit(path, f"the string holds a lone surrogate ({text[exc.start]!a}), which is not Unicode text",
                     "invalid_unicode") from None


def _scalar_ok(v: Any) -> bool:
    """Values that need no check (the common case of a long token-id list: skip them without a stack entry)."""
    return isinstance(v, int) and not isinstance(v, bool) and -_INT_BOUND < v < _INT_BOUND


def _limit(path: list[str | int], what: str, code: str) -> GatewayError:
    param = _path(path)
    return bad_request(f"{param}: {what}" if param else what, param=param, code=code)


# A string (escapes included) or one structural character: enough to follow nesting without parsing values.
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{},]', re.S)


@dataclass
class _Frame:
    array: bool
    key: str | int | None  # the member or index being read in this container
    expect_key: bool = False


def deep_path(raw: bytes, max_depth: int) -> list[str | int]:
    """The path at which `raw` first nests deeper than `max_depth`, for a body the parser could not read (it
    raised RecursionError). Stops there, so it costs only as much as the body up to that point."""
    frames: list[_Frame] = []
    for m in _TOKENS.finditer(raw):
        tok = m.group()
        top = frames[-1] if frames else None
        if tok in (b"[", b"{"):
            if len(frames) >= max_depth:
                break
            frames.append(_Frame(array=tok == b"[", key=0 if tok == b"[" else None, expect_key=tok == b"{"))
        elif tok in (b"]", b"}"):
            if frames:
                frames.pop()
        elif top is None:
            continue
        elif tok == b",":
            if top.array:
                top.key = int(top.key or 0) + 1
            else:
                top.expect_key = True
        elif not top.array and top.expect_key:  # a member name
            try:
                top.key = json.loads(tok)
            except ValueError:
                top.key = "?"
            top.expect_key = False
    return [f.key for f in frames if f.key is not None]


def check_json_body(raw: bytes, limits: InputLimits) -> None:
    """The structural checks of a JSON body; silent for a body that is not JSON (the route reports that)."""
    if not raw.strip():
        return
    try:
        data = json.loads(raw)
    except RecursionError:
        raise _limit(deep_path(raw, limits.max_json_depth),
                     f"the JSON body nests deeper than {limits.max_json_depth} levels", "json_too_deep") from None
    except (ValueError, UnicodeDecodeError):
        return
    check_json_shape(data, limits)


class InputLimitsMiddleware:
    """Applies `InputLimits` to every HTTP request before any route sees it (see the module docstring)."""

    def __init__(self, app: ASGIApp, limits: InputLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._check_headers(scope)
            body = await self._read_body(scope, receive)
            if body is None:
                return  # the client left before sending the whole body: nobody to answer
            check_json_body(body, self.limits)
        except GatewayError as err:
            log_refused(scope["method"], scope["path"], err)
            await err.response(scope["path"])(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    def _check_headers(self, scope: Scope) -> None:
        headers = scope.get("headers") or []
        size = sum(len(k) + len(v) for k, v in headers)
        if len(headers) > self.limits.max_headers or size > self.limits.max_header_bytes:
            raise GatewayError(431, f"request headers too large: {len(headers)} fields, {size} bytes (limits "
                                    f"{self.limits.max_headers} fields, {self.limits.max_header_bytes} bytes)",
                               code="request_header_fields_too_large")

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        cap = self.limits.max_body_bytes
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > cap:
            raise _too_large(int(length), cap)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cap:
                raise _too_large(size, cap)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


def _too_large(size: int, cap: int) -> GatewayError:
    return GatewayError(413, f"the request body ({size} bytes or more) is larger than the limit of {cap} bytes",
                        code="request_too_large")


def _replay(body: bytes, receive: Receive) -> Receive:
    """The route's `receive`: the body read above, once, then the real channel (to see a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
