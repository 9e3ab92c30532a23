"""Replicas behind vllm-router (issue 27): `twinspark up --replicas 2` on the tiny checkpoint — two whole stacks and
the real router on loopback, one set for the module — driven with the official openai client.

- through the router, chat, completion and a streamed chat succeed, and their token ids equal a direct request to
  either replica (the router adds fields of its own to every body: the gateway must take them);
- cache_aware affinity: 8 prompts sharing a ~600-token prefix land on one replica, whose prefix cache serves
  the shared part of the 7 after the first (`usage.prompt_tokens_details.cached_tokens`);
- failover: one replica's whole stack killed under load -> requests keep succeeding through the other once the
  router's health check has marked it down; the run's supervisor restarts it and the router takes it back.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.fleet import Fleet, start_fleet
from tests.e2e.stack import wait_until

pytestmark = pytest.mark.timeout(600)

OFF = {"enable_thinking": False}  # replies are content, not reasoning


@pytest.fixture(scope="module")
def fleet(tiny_default: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = start_fleet(tiny_default, tmp_path_factory.mktemp("fleet"))
    yield f
    f.down()


def _client(base_v1: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_v1, api_key="unused", max_retries=0, timeout=120)


def _ids_of(client: openai.OpenAI, model: str) -> dict[str, list[int]]:
    """Token ids of a chat completion, a completion and a streamed chat (greedy and seeded sampling)."""
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Reply with OK."}],
                                          max_tokens=8, temperature=0,
                                          extra_body={"return_token_ids": True, "chat_template_kwargs": OFF})
    completion = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0.8,
                                           seed=7, extra_body={"return_token_ids": True})
    streamed: list[int] = []
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count to 5."}],
                                                max_tokens=8, temperature=0, stream=True,
                                                extra_body={"return_token_ids": True, "chat_template_kwargs": OFF}):
        for choice in chunk.choices:
            streamed += (choice.model_extra or {}).get("token_ids") or []
    out = {"chat": chat.choices[0].model_extra["token_ids"], "completion": completion.choices[0].model_extra["token_ids"],
           "stream": streamed}
    assert all(len(ids) == 8 for ids in out.values()), out
    return out


def test_openai_client_through_the_router_equals_each_replica(fleet: Fleet) -> None:
    client = _client(fleet.v1)
    model = client.models.list().data[0].id
    routed = _ids_of(client, model)
    for replica in fleet.replicas:
        assert _ids_of(_client(replica["url"] + "/v1"), model) == routed, replica["url"]
    # The fields the router writes into every body are known; an unknown one passes the router and is reported.
    r = httpx.post(fleet.v1 + "/completions", json={"prompt": "hi", "max_tokens": 1, "zzz_trace": 1}, timeout=60)
    assert r.status_code == 200 and r.headers["x-twinspark-ignored-fields"] == "zzz_trace"


def test_cache_aware_sends_a_shared_prefix_to_one_replica(fleet: Fleet) -> None:
    prefix = " ".join(f"Clause {i}: the tenant keeps the garden tidy and reports leaks within {i % 7 + 1} days."
                      for i in range(17))
    prefix_tokens = httpx.post(fleet.url + "/tokenize", json={"prompt": prefix}, timeout=30).json()["count"]
    assert 580 <= prefix_tokens <= 650, prefix_tokens
    client = _client(fleet.v1)
    model = client.models.list().data[0].id
    cached = []
    for i in range(8):
        reply = client.completions.create(model=model, prompt=f"{prefix} Question {i}: what does clause {i} say?",
                                          max_tokens=4, temperature=0)
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
    print(f"\ncache_aware, 8 prompts sharing a {prefix_tokens}-token prefix: cached_tokens {cached}")
    assert cached[0] == 0 and sum(c >= 512 for c in cached[1:]) >= 6, cached


def _served(url: str) -> float:
    """Requests a replica's gateway has finished (its vllm:request_success_total, all finish reasons)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


class Load:
    """Requests sent back to back through the router from `threads` threads, each outcome with its start time."""

    def __init__(self, url: str, threads: int = 2) -> None:
        self.url, self.results, self._stop = url, [], threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(t,), daemon=True) for t in range(threads)]

    def _run(self, t: int) -> None:
        i = 0
        with httpx.Client(timeout=120) as http:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    r = http.post(self.url + "/v1/completions",
                                  json={"prompt": f"load {t}.{i} " * (i % 4 + 1), "max_tokens": 4})
                    self.results.append((started, r.status_code, "" if r.status_code == 200 else r.text[:200]))
                except httpx.HTTPError as exc:
                    self.results.append((started, 0, repr(exc)[:200]))
                i += 1

    def __enter__(self) -> "Load":
        for th in self._threads:
            th.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for th in self._threads:
            th.join(150)


def _kill_stack(replica: dict) -> None:
    """SIGKILL a replica's supervisor and every one of its roles' process groups: the replica is gone at once, as
    if its machine had died."""
    inner = json.loads((Path(replica["state_dir"]) / "up.json").read_text())
    os.kill(inner["supervisor_pid"], signal.SIGKILL)
    for child in inner["children"]:
        try:
            os.killpg(child["pgid"], signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_failover_then_the_killed_replica_rejoins(fleet: Fleet) -> None:
    assert all(fleet.workers().values())
    with Load(fleet.url) as load:
        time.sleep(2)
        # The router puts a miss on the least loaded replica, the first on a tie: kill the one serving most.
        victim = max(fleet.replicas, key=lambda r: _served(r["url"]))
        killed = time.monotonic()
        _kill_stack(victim)
        assert wait_until(lambda: not fleet.workers()[victim["url"]], timeout=30, step=0.2)
        marked_down = time.monotonic()
        time.sleep(4)
    before = [r for r in load.results if r[0] < marked_down]
    after = [r for r in load.results if r[0] >= marked_down]
    failed_before = [r for r in before if r[1] != 200 and r[0] >= killed]
    print(f"\nkilled {victim['url']}: marked down after {marked_down - killed:.1f} s; {len(before)} requests before "
          f"({len(failed_before)} failed after the kill: {failed_before}), {len(after)} after, all answered")
    assert len(after) >= 4 and all(status == 200 for _, status, _ in after), after

    # The run's supervisor restarts the replica's stack (same port); the router's health check takes it back.
    restarted = time.monotonic()
    assert wait_until(lambda: fleet.workers()[victim["url"]], timeout=180, step=0.5), fleet.workers()
    print(f"rejoined {time.monotonic() - restarted:.1f} s after being marked down")
    assert _served(victim["url"]) == 0  # a new process
    with Load(fleet.url, threads=4) as load:  # concurrent: the least-loaded rule spreads them over both
        assert wait_until(lambda: _served(victim["url"]) > 0, timeout=60, step=0.2)
    assert all(status == 200 for _, status, _ in load.results), load.results
