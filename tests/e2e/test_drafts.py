"""Drafts end to end: real stacks (`twinspark up` with the copy drafter — the default — on an "echo" variant of the
tiny checkpoint whose output repeats, and with the MTP drafter on the plain tiny checkpoint).

- copy drafts on a repetitive prompt accept >= 1 token per verify window on average (printed);
- MTP drafts run and are verified (acceptance printed);
- drafted replies equal `draft: false` replies, greedy and seeded (temperature 0.8), for copy and MTP;
- killing the drafter mid-run: requests keep completing (without drafts, same tokens); /health stays 200 with
  status "degraded" and names the drafter in "down" (serving goes on; drafts are only an optimisation).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

from tests.e2e.stack import Stack, start, wait_until

REPETITIVE = [17, 250, 3, 99, 41, 8, 600, 12] * 6


def _echo_checkpoint(src: Path, dst: Path) -> Path:
    """The tiny checkpoint turned into one whose output repeats itself (random tiny weights never repeat, so copy
    drafts would have nothing to find): lm_head = the unit-norm embeddings x 20 and every layer's o_proj / down_proj
    halved, so the next token mostly echoes the current one — runs that prompt lookup predicts."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    emb_key = next(k for k in index if k.endswith("embed_tokens.weight"))
    emb = load_file(dst / index[emb_key])[emb_key].float()
    for shard in sorted(set(index.values())):
        tensors = load_file(dst / shard)
        for k, t in tensors.items():
            if k == "lm_head.weight":
                tensors[k] = (emb / emb.norm(dim=-1, keepdim=True) * 20).to(t.dtype)
            elif ".layers." in k and k.endswith(("o_proj.weight", "down_proj.weight")):
                tensors[k] = (t.float() * 0.5).to(t.dtype)
        save_file(tensors, dst / shard, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def copy_stack(tiny_default, tmp_path_factory):
    base = tmp_path_factory.mktemp("drafts_copy")
    # No restarts: the drafter killed below must stay down for /health to report serving without it.
    stack = start(_echo_checkpoint(tiny_default, base / "echo"), base / "state", tp=2,
                  env={"TWINSPARK_MAX_RESTARTS": "0"})
    yield stack
    stack.down()


@pytest.fixture(scope="module")
def mtp_stack(tiny_default, tmp_path_factory):
    stack = start(tiny_default, tmp_path_factory.mktemp("drafts_mtp"), tp=2, env={"TWINSPARK_DRAFTER": "mtp"})
    yield stack
    stack.down()


def _complete(stack: Stack, prompt, max_tokens: int, *, draft: bool = True, temperature: float = 0.0,
              seed: int | None = None) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "ignore_eos": True,
            "return_token_ids": True, "draft": draft}
    if seed is not None:
        body["seed"] = seed
    r = httpx.post(stack.v1 + "/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _ids(reply: dict) -> list[int]:
    return reply["choices"][0]["token_ids"]


def _drafter_figures(stack: Stack) -> tuple[int, int, int]:
    """(accepted, drafted, windows) totals from the scheduler's drafter component in /health."""
    h = httpx.get(stack.url + "/health", timeout=30).json()
    d = next(c for c in h["components"] if c["name"] == "drafter")
    m = re.search(r"accepted (\d+) of (\d+) drafts in (\d+) windows", d["detail"])
    assert m, d
    return int(m[1]), int(m[2]), int(m[3])


def _same_with_and_without(stack: Stack, prompt, max_tokens: int) -> list[dict]:
    replies = []
    for temperature, seed in ((0.0, None), (0.8, 1234)):
        on = _complete(stack, prompt, max_tokens, temperature=temperature, seed=seed)
        off = _complete(stack, prompt, max_tokens, draft=False, temperature=temperature, seed=seed)
        assert _ids(on) == _ids(off) and on["token_sha"] == off["token_sha"]
        assert on["choices"][0]["text"] == off["choices"][0]["text"]
        assert off["usage"]["twinspark"] == {"drafted": 0, "accepted": 0}
        replies.append(on)
    return replies


def test_copy_drafts_accept_and_equal_no_draft(copy_stack):
    before = _drafter_figures(copy_stack)
    first = _complete(copy_stack, REPETITIVE, 64)
    acc, drafted, windows = (a - b for a, b in zip(_drafter_figures(copy_stack), before))
    u = first["usage"]["twinspark"]
    assert u == {"drafted": drafted, "accepted": acc}
    per_window = acc / max(1, windows)
    print(f"copy drafts, repetitive prompt: {acc} of {drafted} drafts accepted in {windows} windows "
          f"({per_window:.2f} accepted per window; {first['usage']['completion_tokens']} tokens)")
    assert windows > 0 and per_window >= 1.0
    replies = _same_with_and_without(copy_stack, REPETITIVE, 64)
    print("copy usage (greedy, seeded):", [r["usage"]["twinspark"] for r in replies])
    m = copy_stack.metrics()
    assert m["vllm:spec_decode_num_draft_tokens_total"] >= drafted > 0
    assert m["vllm:spec_decode_num_accepted_tokens_total"] >= acc > 0


def test_mtp_drafts_verified_and_equal_no_draft(mtp_stack):
    before = _drafter_figures(mtp_stack)
    replies = _same_with_and_without(mtp_stack, REPETITIVE, 48)
    replies += _same_with_and_without(mtp_stack, [5, 77, 123, 9, 400], 32)
    acc, drafted, windows = (a - b for a, b in zip(_drafter_figures(mtp_stack), before))
    print(f"mtp drafts: {acc} of {drafted} drafts accepted in {windows} windows "
          f"({acc / max(1, windows):.2f} per window, acceptance {acc / max(1, drafted):.1%})")
    assert drafted > 0 and windows > 0
    assert sum(r["usage"]["twinspark"]["drafted"] for r in replies) > 0


def test_killing_the_drafter_keeps_serving(copy_stack):
    expected = {i: _ids(_complete(copy_stack, REPETITIVE[i:] + REPETITIVE[:i], 48, draft=False)) for i in range(4)}
    drafter = next(c for c in copy_stack.up_json()["children"] if c["name"] == "drafter")
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            got[i] = _ids(_complete(copy_stack, REPETITIVE[i:] + REPETITIVE[:i], 48))
        except BaseException as exc:  # noqa: BLE001 — reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    before = _drafter_figures(copy_stack)[2]
    wait_until(lambda: _drafter_figures(copy_stack)[2] > before, 30, 0.02)  # drafts are flowing
    os.kill(drafter["pid"], signal.SIGKILL)
    for t in threads:
        t.join(300)
    assert not errors and got == expected
    # New requests complete too, and the health reply names the drafter as down while serving stays healthy.
    assert _ids(_complete(copy_stack, REPETITIVE, 16)) == _ids(_complete(copy_stack, REPETITIVE, 16, draft=False))
    assert wait_until(lambda: "drafter" in httpx.get(copy_stack.url + "/health", timeout=30).json()["down"], 30)
    r = httpx.get(copy_stack.url + "/health", timeout=30)
    print("health after the drafter died:", r.status_code, r.json()["status"], r.json()["down"])
    assert r.status_code == 200 and r.json()["status"] == "degraded"
