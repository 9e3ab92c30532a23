"""API keys: several accepted, kept only as sha256 digests, compared in constant time.

`--api-key` / TWINSPARK_API_KEY holds a comma-separated list; an entry `sha256:<64 hex>` is the digest of a key, so
a deployment's settings need not hold the key itself (`printf %s KEY | sha256sum` prints it). A client sends its
key as `Authorization: Bearer <key>` (OpenAI) or `x-api-key: <key>` (Anthropic's header). The gateway hashes what
it is given and compares that digest with every accepted one with `hmac.compare_digest`, never stopping early, so
timing says neither whether nor which key matched. Keys never reach a log line or a span.
"""

from __future__ import annotations

import hashlib
import hmac
import re

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import GatewayError, log_refused

DIGEST_PREFIX = "sha256:"
_HEX64 = re.compile(r"[0-9a-f]{64}")


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def parse_keys(spec: str) -> tuple[bytes, ...]:
    """The accepted digests of a comma-separated list of keys and `sha256:<hex>` digests (blanks ignored)."""
    out: list[bytes] = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        if entry.startswith(DIGEST_PREFIX):
            hexdigest = entry[len(DIGEST_PREFIX):].lower()
            if not _HEX64.fullmatch(hexdigest):
                raise ValueError("an API key entry starting with 'sha256:' must be followed by 64 hex digits")
            out.append(bytes.fromhex(hexdigest))
        else:
            out.append(digest(entry))
    if not out:
        raise ValueError("the API key list is empty")
    return tuple(out)


def presented_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The key a request carries: `Authorization: Bearer <key>`, else `x-api-key`."""
    auth = xkey = None
    for name, value in headers:
        if name == b"authorization":
            auth = value
        elif name == b"x-api-key":
            xkey = value
    if auth is not None and auth[:7].lower() == b"bearer ":
        return auth[7:].strip().decode("latin-1")
    return xkey.strip().decode("latin-1") if xkey is not None else None


def accepted(key: str | None, digests: tuple[bytes, ...]) -> bool:
    given = digest(key) if key is not None else b"\0" * 32
    ok = False
    for d in digests:  # every digest is compared, whatever matched before
        ok |= hmac.compare_digest(given, d)
    return ok and key is not None


class ApiKeyMiddleware:
    """The key check on every HTTP route except `open_paths` (probes and scrapers carry no credentials)."""

    def __init__(self, app: ASGIApp, digests: tuple[bytes, ...], open_paths: frozenset[str]) -> None:
        self.app = app
        self.digests = digests
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            if not accepted(presented_key(scope.get("headers") or []), self.digests):
                err = GatewayError(401, "Incorrect or missing API key (send 'Authorization: Bearer <key>' or "
                                        "'x-api-key: <key>').", type="invalid_request_error", code="invalid_api_key")
                log_refused(scope["method"], scope["path"], err)
                await err.response(scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)
