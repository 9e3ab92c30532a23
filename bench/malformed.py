"""A seeded generator of hostile HTTP requests for the gateway: the same seed gives the same requests, byte for byte.

Kinds, drawn in turn: issue 13's "600 malformed requests" — random types in every field of a valid body, missing
required fields, broken JSON (truncated, stray bytes, invalid UTF-8, not an object), deeply nested JSON (past the
depth limit and past Python's recursion limit), wrong content types, huge strings (past the string limit, past the
body limit), numbers out of range (NaN, ±Infinity, 2^64 and beyond, negative counts), unknown fields, oversized
headers and wrong methods or paths — over every route, Responses and Anthropic Messages included; then the agent
surface's own (bench/hostile.py: input items, content blocks, schemas, grammars, images, sampling extremes). Every
request must get an answer below 500, errors in its API's shape (`problem`); a few are accidentally valid (a
random value that happens to fit), and those are kept small (`max_tokens` at most 8) so they finish fast.

Used by tests/gateway/test_malformed.py and tests/e2e/test_hardening.py and bench/fuzz.py (10,000+).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from bench import hostile

MSG = [{"role": "user", "content": "Say hi."}]
MODEL = "glm-tiny"  # the served model name the requests give where the route requires one


def valid(model: str = MODEL) -> dict[str, dict]:
    """A valid body per route; mutations start from these."""
    return {"/v1/chat/completions": {"messages": MSG, "max_tokens": 4, "temperature": 0},
            "/v1/completions": {"prompt": "Once upon", "max_tokens": 4, "temperature": 0},
            "/v1/responses": {"model": model, "input": "Say hi.", "max_output_tokens": 4},
            "/v1/messages": {"model": model, "messages": MSG, "max_tokens": 4},
            "/tokenize": {"prompt": "hello"},
            "/detokenize": {"tokens": [5, 6, 7]}}


REQUIRED = {"/v1/chat/completions": "messages", "/v1/completions": "prompt", "/v1/responses": "input",
            "/v1/messages": "messages", "/detokenize": "tokens"}
KINDS = ("types", "missing", "broken_json", "deep_json", "content_type", "huge_string", "numbers", "unknown_field",
         "headers", "method_path", *hostile.KINDS)
# What an answer's error (or a streamed reply's error event) must not say: ours, not the client's, fault.
SERVER_ERRORS = ('"server_error"', '"internal_error"', '"service_unavailable"', '"api_error"', '"overloaded_error"')


@dataclass
class Case:
    kind: str
    method: str
    path: str
    body: bytes
    headers: dict[str, str] = field(default_factory=lambda: {"content-type": "application/json"})

    def describe(self) -> str:
        return f"{self.kind}: {self.method} {self.path} ({len(self.body)} bytes) {self.body[:80]!r}"


def _dump(obj: object) -> bytes:
    return json.dumps(obj, allow_nan=True).encode()


def problem(case: "Case", status: int, content_type: str, body: bytes) -> str | None:
    """What is wrong with an answer to `case`, or None: a 5xx, an error outside its API's shape (Anthropic's on
    /v1/messages*, OpenAI's elsewhere), or a 200 stream that ended in an error of ours."""
    if status >= 500:
        return f"{status}"
    if status >= 400 and content_type.startswith("application/json"):
        err = json.loads(body)
        if case.path.startswith("/v1/messages"):
            ok = err.get("type") == "error" and set(err.get("error", {})) == {"type", "message"}
        else:
            ok = set(err.get("error", {})) == {"message", "type", "param", "code"}
        return None if ok else "wrong_error_shape"
    if content_type.startswith("text/event-stream") and any(e.encode() in body for e in SERVER_ERRORS):
        return "stream_server_error"
    return None


def _random_value(rng: random.Random, depth: int = 0) -> object:
    choices = [lambda: None, lambda: rng.choice([True, False]), lambda: rng.randint(-3, 8),
               lambda: rng.choice([-(2**63), 2**31, 2**64, 10**30]), lambda: rng.uniform(-1e6, 1e6),
               lambda: rng.choice(["", "x", "ü" * 3, "\x00", "<|endoftext|>", "1.5", "true", "a\ud800"])]
    if depth < 2:
        choices += [lambda: [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))],
                    lambda: {rng.choice(["a", "role", "content", "type"]): _random_value(rng, depth + 1)}]
    return rng.choice(choices)()


def _nested(rng: random.Random, depth: int) -> bytes:
    if rng.random() < 0.5:
        inner = b"[" * depth + b"1" + b"]" * depth
    else:
        inner = b'{"a":' * depth + b"1" + b"}" * depth
    return b'{"messages": ' + inner + b', "max_tokens": 4}'


def case(rng: random.Random, kind: str, model: str = MODEL) -> Case:
    """One request of `kind`."""
    if kind in hostile.KINDS:
        path, body = hostile.case_body(rng, kind, model, lambda: _random_value(rng))
        return Case(kind, "POST", path, _dump(body))
    routes = valid(model)
    path = rng.choice(list(routes))
    base = routes[path]
    if kind == "types":
        where = rng.choice(hostile.leaves(base))
        return Case(kind, "POST", path, _dump(hostile.set_at(base, where, _random_value(rng))))
    if kind == "missing":
        body = dict(base)
        body.pop(REQUIRED.get(path, "prompt"), None)
        if rng.random() < 0.5:
            body = {}
        return Case(kind, "POST", path, _dump(body))
    if kind == "broken_json":
        raw = _dump(base)
        return Case(kind, "POST", path, rng.choice([
            raw[: rng.randint(0, len(raw) - 1)], raw + b"}", raw.replace(b'"', b"'"), b"", b"null", b"[1, 2]",
            b'"a string"', raw[:5] + b"\xff\xfe" + raw[5:], bytes(rng.getrandbits(8) for _ in range(64))]))
    if kind == "deep_json":
        return Case(kind, "POST", path, _nested(rng, rng.choice([65, 200, 1_000, 5_000, 100_000])))
    if kind == "content_type":
        body = rng.choice([_dump(base), b"prompt=hi&max_tokens=4", b"<xml/>"])
        ctype = rng.choice(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                            "application/xml", "", "application/json; charset=latin-1"])
        return Case(kind, "POST", path, body, {"content-type": ctype} if ctype else {})
    if kind == "huge_string":
        # Mostly below the limits; one in five past the string limit (8 Mi chars) or the body limit (32 MiB).
        size = rng.choices([10_000, 200_000, 9_000_000, 34_000_000], weights=[4, 4, 1, 1])[0]
        where = rng.choice(hostile.leaves(base))
        return Case(kind, "POST", path, _dump(hostile.set_at(base, where, "a" * size)))
    if kind == "numbers":
        where = rng.choice(["max_tokens", "temperature", "top_p", "top_k", "seed", "min_p"])
        value = rng.choice(["NaN", "Infinity", "-Infinity", "1e999", str(2**64), str(-(2**64) - 1),
                            "9" * 5000, "-1", "0", "1e-400", str(2**31)])
        raw = _dump(base)[:-1] + f', "{where}": {value}}}'.encode()
        return Case(kind, "POST", path, raw)
    if kind == "unknown_field":
        name = rng.choice(["wat", "", "x" * 10_000, "messages ", "__proto__"])
        return Case(kind, "POST", path, _dump({**base, name: _random_value(rng)}))
    if kind == "headers":
        if rng.random() < 0.5:
            headers = {"content-type": "application/json", "x-big": "v" * rng.choice([20_000, 40_000])}
        else:
            headers = {"content-type": "application/json", **{f"x-h{i}": "v" for i in range(150)}}
        return Case(kind, "POST", path, _dump(base), headers)
    method, where = rng.choice([("GET", path), ("PUT", path), ("DELETE", "/v1/models"), ("POST", "/v1/models"),
                                ("POST", "/v1/nope"), ("GET", "/" + "a" * 2000), ("POST", "/health")])
    return Case("method_path", method, where, _dump(base))


def cases(seed: int, n: int, model: str = MODEL) -> Iterator[Case]:
    """`n` requests, the kinds in turn, each drawn from its own seeded stream."""
    rng = random.Random(seed)
    for i in range(n):
        yield case(random.Random(rng.getrandbits(64)), KINDS[i % len(KINDS)], model)
