"""The seeded hostile set (bench/malformed.py, bench/hostile.py) against the real gateway in front of a STAND-IN
scheduler: 0 5xx, every error in its API's shape, and the limits' own answers (413, 431, 400 naming the field)."""

from __future__ import annotations

import json

import httpx
import pytest

from bench.malformed import KINDS, cases, problem
from services.gateway.limits import InputLimits, check_json_shape, deep_path
from services.gateway.errors import GatewayError

from .conftest import GatewayServer


def send(client: httpx.Client, case) -> httpx.Response | None:
    """The gateway's answer, or None when it closed the connection while the client was still sending a body
    past the limit (it answered 413 first; the client could not read it)."""
    try:
        return client.request(case.method, case.path, content=case.body, headers=case.headers)
    except (httpx.RemoteProtocolError, httpx.WriteError, httpx.ReadError):
        if len(case.body) > InputLimits().max_body_bytes:
            return None
        raise


def test_960_hostile_requests_get_no_5xx(gateway: GatewayServer) -> None:
    seen: dict[int, int] = {}
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        for case in cases(seed=13, n=60 * len(KINDS)):
            r = send(client, case)
            if r is None:
                seen[413] = seen.get(413, 0) + 1
                continue
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert problem(case, r.status_code, r.headers.get("content-type", ""), r.content) is None, \
                (case.describe(), r.text[:300])
        assert client.get("/health").status_code == 200
    assert {200, 400, 413, 431} <= set(seen), seen


def test_deeply_nested_json_is_a_400_naming_where(gateway: GatewayServer) -> None:
    for depth in (65, 3_000, 200_000):
        body = b'{"messages": [{"role": "user", "content": ' + b"[" * depth + b"]" * depth + b"}]}"
        r = httpx.post(gateway.url + "/v1/chat/completions", content=body, timeout=30)
        assert r.status_code == 400, r.text[:200]
        err = r.json()["error"]
        assert err["code"] == "json_too_deep" and err["param"].startswith("messages[0].content"), err


@pytest.mark.parametrize("body,param,code", [
    ({"prompt": "a" * (8 << 20) + "b"}, "prompt", "string_too_long"),
    ({"prompt": [1] * ((2 << 20) + 1)}, "prompt", "array_too_long"),
    ({"prompt": [1, 2 ** 64]}, "prompt[1]", "number_out_of_range"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ["s"] * 65}, "stop", None),
    ({"prompt": "x", "top_k": 2 ** 31}, "top_k", None),
    ({"prompt": "x", "model": "m" * 600}, "model", None),
    # a lone surrogate escape (\ud800 in the JSON text) reached the tokenizer, the grammar library, ...: 500s
    ({"messages": [{"role": "user", "content": "a\ud800"}]}, "messages[0].content", "invalid_unicode"),
    ({"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"regex": "\udfff"}},
     "structured_outputs.regex", "invalid_unicode"),
    ({"prompt": "x", "metadata": {"a\ud800": 1}}, "metadata", "invalid_unicode"),
])
def test_limits_name_the_field(gateway: GatewayServer, body, param, code) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(gateway.url + path, content=json.dumps(body), timeout=30)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == param and (code is None or err["code"] == code), err


def test_body_and_header_limits(gateway: GatewayServer) -> None:
    r = httpx.post(gateway.url + "/v1/completions", content=b" " * ((32 << 20) + 1),
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(gateway.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                   headers={f"x-h{i}": "v" for i in range(120)}, timeout=30)
    assert r.status_code == 431 and r.json()["error"]["code"] == "request_header_fields_too_large"


def test_shape_walk_and_deep_path_units() -> None:
    limits = InputLimits(max_json_depth=3, max_string_chars=4, max_array_items=2)
    for data, param in [({"a": {"b": {"c": {}}}}, "a.b.c"), ({"a": ["xxxxx"]}, "a[0]"), ({"a": [1, 2, 3]}, "a"),
                        ({"a": [1, {"b": float("nan")}]}, "a[1].b")]:
        with pytest.raises(GatewayError) as err:
            check_json_shape(data, limits)
        assert err.value.param == param
    check_json_shape({"a": [1, 2], "b": "xx", "c": {"d": True}}, limits)
    assert deep_path(b'{"a": [1, {"b": "x,[", "c": [[[[', 3) == ["a", 1, "c"]
    assert deep_path(b'[0, [1, 2, [3, [', 3) == [1, 2, 1]
