"""Gateway fixtures: the tiny checkpoint's tokenizer/template, a stand-in scheduler, and a real gateway on loopback."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.gateway.app import GatewaySettings, create_app
from services.gateway.checkpoint import CheckpointInfo
from services.gateway.template import ChatTemplate
from services.gateway.tokenizer import TextTokenizer

from .standin_scheduler import StandinServer

WINDOW = 256  # the test gateway's --max-model-len, so context-length tests need no long prompts
KEEPALIVE_S = 0.3


@pytest.fixture(scope="session")
def tokenizer(tiny_default: Path) -> TextTokenizer:
    return TextTokenizer(tiny_default)


@pytest.fixture(scope="session")
def template(tiny_default: Path) -> ChatTemplate:
    return ChatTemplate.load(tiny_default, CheckpointInfo.load(tiny_default).tokenizer_config)


@pytest.fixture(scope="session")
def standin() -> Iterator[StandinServer]:
    server = StandinServer().start()
    yield server
    server.stop()


class GatewayServer:
    """A real gateway (uvicorn) on a loopback port, in a thread."""

    def __init__(self, settings: GatewaySettings) -> None:
        import uvicorn

        self.app = create_app(settings)
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self) -> "GatewayServer":
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("gateway did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)


@pytest.fixture(scope="session")
def gateway(tiny_default: Path, standin: StandinServer) -> Iterator[GatewayServer]:
    server = GatewayServer(GatewaySettings(model_dir=str(tiny_default), scheduler=standin.target,
                                           served_model_name="glm-tiny", keepalive_s=KEEPALIVE_S,
                                           max_model_len=WINDOW)).start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _clean_scripts(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that fails half-way must not leave scripted replies for the next one."""
    yield
    if "standin" in request.fixturenames:
        request.getfixturevalue("standin").generator.scripts.clear()
