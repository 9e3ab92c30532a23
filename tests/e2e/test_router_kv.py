"""kv_aware routing fed by twinspark's own KV events (issue 27): `twinspark up --replicas 2 --router-policy kv_aware`
— each replica's scheduler publishes its prefix cache's blocks in vLLM's KV event format, the real vllm-router
subscribes and asks the gateways' /render routes for prompts' token ids.

- 8 prompts sharing a ~600-token prefix: the 7 after the first resume from the replica that holds it;
- what the router never saw: a different prefix warmed on each replica *directly* (not through the router); then
  prompts of both prefixes, interleaved, through the router each land on the replica holding their prefix —
  something a router that only remembers its own routing (cache_aware) cannot know.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.fleet import Fleet, start_fleet

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def fleet(tiny_default: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = start_fleet(tiny_default, tmp_path_factory.mktemp("fleet_kv"), "--router-policy", "kv_aware")
    yield f
    f.down()


def _prefix(tag: str, clauses: int = 17) -> str:
    return " ".join(f"{tag} rule {i}: keep the {tag} files sorted and report gaps within {i % 5 + 2} days."
                    for i in range(clauses))


def _cached(url: str, prompt: str) -> int:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_shared_prefix_resumes_on_the_replica_that_holds_it(fleet: Fleet) -> None:
    prefix = _prefix("charlie")
    tokens = httpx.post(fleet.url + "/tokenize", json={"prompt": prefix}, timeout=30).json()["count"]
    assert 560 <= tokens <= 680, tokens
    cached = [_cached(fleet.url, f"{prefix} Question {i}?") for i in range(8)]
    print(f"\nkv_aware, 8 prompts sharing a {tokens}-token prefix: cached_tokens {cached}")
    assert cached[0] == 0 and sum(c >= 512 for c in cached[1:]) >= 6, cached


def test_prompts_go_where_the_events_say_their_blocks_are(fleet: Fleet) -> None:
    prefixes = [_prefix("alpha", 18), _prefix("bravo", 18)]
    for replica, prefix in zip(fleet.replicas, prefixes):  # behind the router's back
        assert _cached(replica["url"], prefix + " Warm up.") == 0
    cached = [_cached(fleet.url, f"{prefixes[i % 2]} Q{i}?") for i in range(8)]
    print(f"\nkv_aware, two prefixes warmed directly on one replica each, 8 interleaved prompts through the router: "
          f"cached_tokens {cached}")
    assert all(c >= 512 for c in cached), cached
