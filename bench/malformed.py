"""A seeded generator of hostile HTTP requests for the gateway: the same seed gives the same requests, byte for byte.

Kinds, drawn in turn (issue 13's "600 malformed requests"): random types in every field of a valid body, missing
required fields, broken JSON (truncated, stray bytes, invalid UTF-8, not an object), deeply nested JSON (past the
depth limit and past Python's recursion limit), wrong content types, huge strings (past the string limit, past the
body limit), numbers out of range (NaN, ±Infinity, 2^64 and beyond, negative counts), unknown fields, oversized
headers and wrong methods or paths. Every request must get an answer below 500; a few are accidentally valid (a
random value that happens to fit), and those are kept small (`max_tokens` at most 8) so they finish fast.

Used by tests/gateway/test_malformed.py and tests/e2e/test_hardening.py (600 requests) and bench/fuzz.py (10,000+).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

MSG = [{"role": "user", "content": "Say hi."}]
# A valid body per route; mutations start from these.
VALID: dict[str, dict] = {
    "/v1/chat/completions": {"messages": MSG, "max_tokens": 4, "temperature": 0},
    "/v1/completions": {"prompt": "Once upon", "max_tokens": 4, "temperature": 0},
    "/tokenize": {"prompt": "hello"},
    "/detokenize": {"tokens": [5, 6, 7]},
}
REQUIRED = {"/v1/chat/completions": "messages", "/v1/completions": "prompt", "/detokenize": "tokens"}
KINDS = ("types", "missing", "broken_json", "deep_json", "content_type", "huge_string", "numbers", "unknown_field",
         "headers", "method_path")


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


def _random_value(rng: random.Random, depth: int = 0) -> object:
    choices = [lambda: None, lambda: rng.choice([True, False]), lambda: rng.randint(-3, 8),
               lambda: rng.choice([-(2**63), 2**31, 2**64, 10**30]), lambda: rng.uniform(-1e6, 1e6),
               lambda: rng.choice(["", "x", "ü" * 3, "\x00", "<|endoftext|>", "1.5", "true"])]
    if depth < 2:
        choices += [lambda: [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))],
                    lambda: {rng.choice(["a", "role", "content", "type"]): _random_value(rng, depth + 1)}]
    return rng.choice(choices)()


def _leaves(obj: object, path: tuple = ()) -> list[tuple]:
    """Paths of every value in a body (object members and list items, nested)."""
    out = [path] if path else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _leaves(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _leaves(v, (*path, i))
    return out


def _set(obj: dict, path: tuple, value: object) -> dict:
    obj = json.loads(json.dumps(obj))
    target = obj
    for p in path[:-1]:
        target = target[p]
    target[path[-1]] = value
    return obj


def _nested(rng: random.Random, depth: int) -> bytes:
    if rng.random() < 0.5:
        inner = b"[" * depth + b"1" + b"]" * depth
    else:
        inner = b'{"a":' * depth + b"1" + b"}" * depth
    return b'{"messages": ' + inner + b', "max_tokens": 4}'


def case(rng: random.Random, kind: str) -> Case:
    """One request of `kind`."""
    path = rng.choice(list(VALID))
    base = VALID[path]
    if kind == "types":
        where = rng.choice(_leaves(base))
        return Case(kind, "POST", path, _dump(_set(base, where, _random_value(rng))))
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
        where = rng.choice(_leaves(base))
        return Case(kind, "POST", path, _dump(_set(base, where, "a" * size)))
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


def cases(seed: int, n: int) -> Iterator[Case]:
    """`n` requests, the kinds in turn, each drawn from its own seeded stream."""
    rng = random.Random(seed)
    for i in range(n):
        yield case(random.Random(rng.getrandbits(64)), KINDS[i % len(KINDS)])
