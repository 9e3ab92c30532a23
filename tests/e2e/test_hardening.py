"""Hardening against the real stack (`twinspark up`, TP = 2): hostile HTTP (every kind of bench/malformed.py) gets no
5xx, no error outside its API's shape, and restarts nothing; every internal gRPC port listens on loopback and
refuses calls without the run's internal token; secrets stay out of the logs and of up.json."""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
import pytest

from bench.malformed import KINDS, cases, problem
from services.common.internal_auth import metadata
from services.common.tensors import to_proto
from services.gateway.limits import InputLimits
from tests.e2e.stack import Stack, start
from twinspark.v1 import drafter_pb2, drafter_pb2_grpc, generate_pb2, generate_pb2_grpc, rank_pb2, rank_pb2_grpc

TOKEN = "e2e-internal-token-0123456789"
API_KEYS = "e2e-key-one,e2e-key-two"


@pytest.fixture(scope="module")
def stack(tiny_default, tmp_path_factory) -> Stack:
    # A short window keeps the odd accidentally-valid fuzz request short.
    s = start(tiny_default, tmp_path_factory.mktemp("stack_hardening"), tp=2,
              env={"TWINSPARK_INTERNAL_TOKEN": TOKEN, "TWINSPARK_API_KEY": API_KEYS,
                   "TWINSPARK_MAX_MODEL_LEN": "128"})
    yield s
    s.down()


def _children(stack: Stack) -> dict[str, dict]:
    return {c["name"]: c for c in stack.up_json()["children"]}


# /proc/net/tcp{,6} spellings of 127.0.0.1, ::ffff:127.0.0.1 (gRPC's dual-stack socket) and ::1.
LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


def _listening_addresses(port: int) -> set[str]:
    """Local addresses with a socket listening on `port` (from /proc/net/tcp, tcp6)."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.rsplit(":", 1)
            if state == "0A" and int(p, 16) == port:  # LISTEN
                out.add(addr)
    return out


def test_internal_ports_bind_loopback_and_require_the_token(stack):
    children = _children(stack)
    calls = {
        "scheduler": lambda ch, md: generate_pb2_grpc.GeneratorStub(ch).Health(
            generate_pb2.HealthRequest(), metadata=md, timeout=10),
        "rank0": lambda ch, md: rank_pb2_grpc.RankWorkerStub(ch).Describe(
            rank_pb2.DescribeRequest(), metadata=md, timeout=10),
        "rank1": lambda ch, md: rank_pb2_grpc.RankWorkerStub(ch).Describe(
            rank_pb2.DescribeRequest(), metadata=md, timeout=10),
        "drafter": lambda ch, md: drafter_pb2_grpc.DrafterStub(ch).Propose(drafter_pb2.ProposeRequest(sequences=[
            drafter_pb2.DraftSequence(request_id="x", tokens=to_proto([1, 2, 1]), max_draft=2)]),
            metadata=md, timeout=10),
    }
    for name, call in calls.items():
        port = children[name]["port"]
        bound = _listening_addresses(port)
        assert bound and bound <= LOOPBACK, (name, bound)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            for md in (None, metadata("not-the-token")):
                with pytest.raises(grpc.RpcError) as err:
                    call(ch, md)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            call(ch, metadata(TOKEN))  # served
    log = Path(children["rank0"]["log"]).read_text()
    assert "refused /twinspark.v1.RankWorker/Describe" in log


def test_secrets_stay_out_of_logs_and_state(stack):
    key = {"Authorization": "Bearer e2e-key-two"}
    r = httpx.post(stack.v1 + "/completions", json={"prompt": "a secret prompt text", "max_tokens": 2},
                   headers=key, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.post(stack.v1 + "/completions", json={"prompt": "x"}, timeout=10).status_code == 401
    assert httpx.post(stack.v1 + "/completions", json={"prompt": "x", "max_tokens": 1},
                      headers={"x-api-key": "e2e-key-one"}, timeout=60).status_code == 200
    texts = [(stack.state_dir / "up.json").read_text()]
    texts += [p.read_text(errors="replace") for p in (stack.state_dir / "logs").glob("*.log")]
    for text in texts:
        for secret in (TOKEN, "e2e-key-one", "e2e-key-two", "a secret prompt text"):
            assert secret not in text, secret


def test_malformed_requests_restart_nothing(stack):
    pids = {c["name"]: c["pid"] for c in stack.up_json()["children"]}
    headers = {"x-api-key": "e2e-key-one"}
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=stack.url, timeout=60) as client:
        model = client.get("/v1/models", headers=headers).json()["data"][0]["id"]
        for case in cases(seed=2026, n=10 * len(KINDS), model=model):  # every kind, the agent surface's included
            try:
                r = client.request(case.method, case.path, content=case.body, headers={**case.headers, **headers})
            except (httpx.RemoteProtocolError, httpx.WriteError, httpx.ReadError):
                assert len(case.body) > InputLimits().max_body_bytes, case.describe()  # 413 before the body ended
                continue
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert problem(case, r.status_code, r.headers.get("content-type", ""), r.content) is None, \
                (case.describe(), r.text[:300])
        deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        r = client.post("/v1/chat/completions", content=deep, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["code"] == "json_too_deep"
        assert client.get("/health").status_code == 200
    assert {c["name"]: c["pid"] for c in stack.up_json()["children"]} == pids  # no role restarted
    assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0, statuses


def test_twinspark_up_makes_a_token_of_its_own(stack_tp1):
    """Without TWINSPARK_INTERNAL_TOKEN, `twinspark up` makes one: the roles serve each other, outsiders are refused,
    and the token is written nowhere."""
    children = _children(stack_tp1)
    with grpc.insecure_channel(f"127.0.0.1:{children['scheduler']['port']}") as ch:
        with pytest.raises(grpc.RpcError) as err:
            generate_pb2_grpc.GeneratorStub(ch).Health(generate_pb2.HealthRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert httpx.get(stack_tp1.url + "/health", timeout=10).status_code == 200  # the gateway has it
    assert "INTERNAL_TOKEN" not in (stack_tp1.state_dir / "up.json").read_text()


def test_an_idle_keep_alive_connection_outlives_client_pools(stack: Stack) -> None:
    """The gateway keeps an idle connection open past the 5 s after which httpx (and the openai client) drop theirs,
    so a client never sends on a connection the server is closing at that moment (a "Server disconnected" error
    with no retry; it failed a burst of the e2e thinking tests once)."""
    import socket
    import time

    host, port = stack.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        time.sleep(6.5)
        sock.setblocking(False)
        try:
            closed = sock.recv(1, socket.MSG_PEEK) == b""  # b"": the server sent its FIN
        except BlockingIOError:
            closed = False  # nothing to read: still open
        assert not closed, "the gateway closed an idle keep-alive connection within 6.5 s"
