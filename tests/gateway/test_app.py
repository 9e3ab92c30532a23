"""In-process app tests (Starlette TestClient): API key, an unreachable scheduler, and the CLI's flags."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from services.gateway import cli
from services.gateway.app import GatewaySettings, create_app

from .standin_scheduler import StandinServer

MSG = [{"role": "user", "content": "hi"}]


def test_api_key(tiny_default: Path, standin: StandinServer) -> None:
    app = create_app(GatewaySettings(model_dir=str(tiny_default), scheduler=standin.target, api_key="s3cret"))
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                        headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                        headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200, r.text
        assert client.get("/health").status_code == 200  # probes need no key
        # the checkpoint directory's name is accepted as the model name too
        r = client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert r.json()["data"][0]["id"] == tiny_default.name


def test_unreachable_scheduler(tiny_default: Path) -> None:
    app = create_app(GatewaySettings(model_dir=str(tiny_default), scheduler="127.0.0.1:1", health_timeout_s=1.0))
    with TestClient(app) as client:
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["down"] == ["scheduler"]
        for stream in (False, True):
            r = client.post("/v1/chat/completions", json={"messages": MSG, "stream": stream})
            assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        assert "twinspark:scheduler_up" in client.get("/metrics").text
        # what needs no scheduler still works
        assert client.post("/tokenize", json={"prompt": "hi"}).json()["count"] == 2


def test_cli_flags(monkeypatch: pytest.MonkeyPatch, tiny_default: Path) -> None:
    monkeypatch.setenv("TWINSPARK_PORT", "9999")
    monkeypatch.delenv("TWINSPARK_MODEL", raising=False)
    parser = argparse.ArgumentParser(prog="twinspark")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve-gateway", "--model", str(tiny_default)])
    assert (args.scheduler, args.host, args.port, args.keepalive_s) == ("127.0.0.1:50051", "0.0.0.0", 9999, 1.0)
    assert args.served_model_name is None and args.api_key is None and args.generation_config == "auto"
    assert callable(args.func)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["serve-gateway", "--help"])
    assert exc.value.code == 0


def test_several_api_keys_as_digests_and_x_api_key(tiny_default: Path, standin: StandinServer, caplog) -> None:
    import hashlib
    import logging

    from services.gateway.api_keys import parse_keys

    second = hashlib.sha256(b"second-key").hexdigest()
    app = create_app(GatewaySettings(model_dir=str(tiny_default), scheduler=standin.target,
                                     api_key=f"first-key, sha256:{second}"))
    body = {"prompt": "hi", "max_tokens": 1}
    caplog.set_level(logging.DEBUG, logger="twinspark")
    with TestClient(app) as client:
        for headers in ({"Authorization": "Bearer first-key"}, {"authorization": "bearer second-key"},
                        {"x-api-key": "first-key"}, {"x-api-key": "second-key"}):
            assert client.post("/v1/completions", json=body, headers=headers).status_code == 200, headers
        for headers in ({"x-api-key": "third"}, {"Authorization": "Bearer " + second}, {"Authorization": "first-key"},
                        {"x-api-key": f"sha256:{second}"}):
            assert client.post("/v1/completions", json=body, headers=headers).status_code == 401, headers
        assert client.get("/openapi.json").status_code == 200  # the API's description is public
    assert "first-key" not in caplog.text and "second-key" not in caplog.text
    assert parse_keys("a,,b") == parse_keys(" a , b ")
    with pytest.raises(ValueError):
        parse_keys("sha256:nothex")
