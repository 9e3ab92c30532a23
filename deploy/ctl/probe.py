"""Talking to the running stack over HTTP: wait for /health, the smoke test, and how many requests are running."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

SMOKE_PROMPT = "Reply with OK."


def plain_key(spec: str) -> str | None:
    """A key the probes can send from API_KEY's list: its first entry that is not a `sha256:` digest ("" when the
    list is empty: no key needed; None when it holds digests only)."""
    entries = [e.strip() for e in spec.split(",") if e.strip()]
    if not entries:
        return ""
    return next((e for e in entries if not e.startswith("sha256:")), None)


def _headers(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _get(url: str, timeout: float = 5.0, api_key: str = "") -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=_headers(api_key)), timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def wait_healthy(base: str, timeout_s: float, say=print) -> None:
    """Poll <base>/health until 200; raise RuntimeError with the last answer on timeout."""
    deadline = time.monotonic() + timeout_s
    last, next_say = "no answer", 0.0
    while time.monotonic() < deadline:
        try:
            status, body = _get(base + "/health", timeout=3.0)
            if status == 200:
                return
            last = f"{status} {body.strip()[:300]}"
        except OSError as e:
            last = f"no answer ({e})"
        if time.monotonic() >= next_say:
            say(f"  waiting for {base}/health: {last}")
            next_say = time.monotonic() + 15.0
        time.sleep(1.0)
    raise RuntimeError(f"{base}/health did not answer 200 within {timeout_s:.0f} s; last: {last}")


def degenerate(text: str) -> str | None:
    """Why a smoke reply is unusable (empty, or one character repeated), or None when it is fine."""
    core = "".join(text.split())
    if not core:
        return "the reply is empty"
    if len(set(core)) == 1 and len(core) > 1:
        return f"the reply is one character repeated ({core[:20]!r}…)"
    return None


def smoke_test(base: str, api_key: str = "", timeout_s: float = 300.0) -> str:
    """One greedy chat request through every rank; returns the reply or raises RuntimeError naming the fault."""
    headers = {"Content-Type": "application/json", **_headers(api_key)}
    status, models = _get(base + "/v1/models", api_key=api_key)
    if status != 200:
        raise RuntimeError(f"smoke test: GET /v1/models answered {status}: {models[:300]}")
    model = json.loads(models)["data"][0]["id"]
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": SMOKE_PROMPT}],
                       "temperature": 0, "max_tokens": 16}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            reply = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"smoke test: HTTP {e.code}: {e.read().decode(errors='replace')[:500]}") from None
    message = reply["choices"][0]["message"]
    text = message.get("content") or message.get("reasoning_content") or ""  # thinking on: the reply is reasoning
    why = degenerate(text)
    if why:
        raise RuntimeError(f"smoke test failed: {why}; the ranks load or compute wrongly (check the rank logs)")
    return text


def running_requests(base: str) -> int | None:
    """vllm:num_requests_running from /metrics; None when the gateway does not answer."""
    try:
        status, text = _get(base + "/metrics", timeout=3.0)
    except OSError:
        return None
    if status != 200:
        return None
    total = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)
