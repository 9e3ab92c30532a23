"""What bench/soak.py sends: each request drawn from a seeded mix, as a `Plan` (path, body, and whether the client
cuts it short on purpose).

- `DefaultMix` (`--mix default`): chat (text) or completions (token ids), prompts short / medium / long (6:3:1) inside
  the served window, half streamed, 10% cut by the client.
- `GpuMix` (`--mix gpu`, issue 54's GPU soak): prompts of 100 tokens to 32k (log-uniform inside four buckets, 4:3:2:1)
  and one 200,000-token prompt per run, sent first (answered, or a clean 400 when it is past the window); streamed or
  not; 10% cut (streams mid-way); n = 2, logprobs, a function tool or a json_schema response_format with a thinking
  budget on some; conversations whose turn k + 1 starts with turn k and its reply (prefix-cache hits); a small PNG
  when the model reads images (the second request of the run probes: a clean 400 turns images off for the rest).

Completions send token ids (no tokenizer needed); chat sends words. A clean 4xx (OpenAI's error shape) of the GPU mix
counts as refused, not lost: a 32k prompt past a smaller window, a tool schema past a tiny one, are the server's right
answers.
"""

from __future__ import annotations

import base64
import math
import random
import struct
import zlib
from dataclasses import dataclass, field

PROMPT_WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing".split()
LENGTHS = {"short": (4, 24), "medium": (100, 300), "long": (600, 1000)}  # prompt tokens (ids) / words (text)
BUCKETS = ((100, 400), (400, 2_000), (2_000, 8_000), (8_000, 32_768))  # GPU mix: prompt tokens, log-uniform inside
BUCKET_WEIGHTS = (4, 3, 2, 1)
LONG_PROMPT = 200_000  # the one long prompt of a GPU-mix run (not capped by --max-prompt)
TOKENS_PER_WORD = 2  # PROMPT_WORDS in make-tiny's tokenizer: about two tokens a word, a few up to four
CONVERSATION_TURNS = 4
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city on a day.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24}, "day": {"type": "integer", "minimum": 0, "maximum": 6}},
        "required": ["city"], "additionalProperties": False}}}
ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}}}


@dataclass
class Plan:
    path: str
    body: dict
    cut: str = "whole"  # "whole", "cancel" (a stream closed after `cut_after` token chunks) or "disconnect"
    cut_after: int = 3
    kind: str = "chat"  # what the mix drew (long / image / tools / json / turn_first / turn_next / chat / completion;
    # the default mix: short / medium / long): the results count outcomes by it
    refusable: bool = False  # a clean 4xx is a refusal, not a loss


@dataclass
class Outcome:
    """What the mix learns from a request's end (conversations, the image probe)."""

    outcome: str  # reply / cancelled / disconnected / refused_<status> / lost / stream_error_event
    text: str = ""  # choice 0's content, for a conversation's next turn
    message: str = ""  # a refusal's error message


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(PROMPT_WORDS, k=max(1, n)))


def token_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 900) for _ in range(max(1, n))]  # inside any checkpoint's vocabulary


def _cut(rng: random.Random, stream: bool) -> str:
    return "whole" if rng.random() >= 0.1 else ("cancel" if stream else "disconnect")


class DefaultMix:
    """The CPU soak's mix: prompts stay inside the served window (a text word may take up to ~4 tokens; the template
    adds a few more), any 4xx but 429 is a loss."""

    def __init__(self, model: str, window: int) -> None:
        self.model, self.window = model, window

    def next(self, rng: random.Random) -> Plan:
        size = rng.choices(list(LENGTHS), weights=[6, 3, 1])[0]
        n = rng.randint(*LENGTHS[size])
        stream = rng.random() < 0.5
        body: dict = {"model": self.model, "max_tokens": rng.randint(8, 64), "temperature": rng.choice([0, 0.7]),
                      "stream": stream, "ignore_eos": rng.random() < 0.5}
        room = self.window - body["max_tokens"] - 32
        if rng.random() < 0.5:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": words(rng, min(n, room // 4))}]
        else:
            path = "/v1/completions"
            body["prompt"] = token_ids(rng, min(n, room))
        return Plan(path, body, _cut(rng, stream), kind=size)

    def after(self, plan: Plan, out: Outcome) -> None:
        pass


@dataclass
class GpuMixState:
    """Shared by every client's GpuMix: the one long prompt, and whether the model reads images."""

    long_sent: bool = False
    images: bool | None = None  # None: not known yet (one probe in flight at a time)
    probing: bool = False
    image_note: str = ""


@dataclass
class _Conversation:
    messages: list[dict] = field(default_factory=list)
    turns: int = 0

    def tokens(self) -> int:
        """A generous guess of its prompt's size (the template adds a few tokens a message)."""
        return sum(len(m["content"].split()) * TOKENS_PER_WORD + 8 for m in self.messages)


class GpuMix:
    """One client's draws of the GPU mix (its conversation is its own; `state` is every client's)."""

    def __init__(self, model: str, window: int, state: GpuMixState, max_prompt: int | None = None) -> None:
        self.model, self.window, self.state = model, window, state
        self.max_prompt = max_prompt or BUCKETS[-1][1]
        self.talk = _Conversation()

    def prompt_tokens(self, rng: random.Random) -> int:
        lo, hi = rng.choices(BUCKETS, weights=BUCKET_WEIGHTS)[0]
        n = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        return max(1, min(n, self.max_prompt))

    def _base(self, rng: random.Random, prompt_tokens: int, stream: bool) -> dict:
        """Sampling and length: max_tokens kept inside the window where the prompt's size is known (a text prompt's
        tokens are guessed generously), so only the prompts themselves can be past it."""
        room = self.window - prompt_tokens - prompt_tokens // 4 - 32
        return {"model": self.model, "stream": stream, "max_tokens": max(1, min(rng.randint(16, 128), room)),
                "temperature": rng.choice([0, 0.7, 1.0])}

    def next(self, rng: random.Random) -> Plan:
        if not self.state.long_sent:
            self.state.long_sent = True
            return Plan("/v1/completions", {"model": self.model, "prompt": token_ids(rng, LONG_PROMPT),
                                            "max_tokens": 16, "temperature": 0}, kind="long", refusable=True)
        if self.state.images is None and not self.state.probing:
            self.state.probing = True  # this request probes for images; the others send none until it ends
            probe = self._image(rng)
            probe.cut = "whole"
            return probe
        draw = rng.random()
        if draw < 0.05 and self.state.images:
            return self._image(rng)
        if draw < 0.2:
            return self._turn(rng)
        return self._chat(rng) if rng.random() < 0.5 else self._completion(rng)

    def _completion(self, rng: random.Random) -> Plan:
        n = self.prompt_tokens(rng)
        stream = rng.random() < 0.5
        body = {**self._base(rng, n, stream), "prompt": token_ids(rng, n), "ignore_eos": rng.random() < 0.5}
        if rng.random() < 0.15:
            body["n"] = 2
        if rng.random() < 0.15:
            body["logprobs"] = rng.randint(0, 5)
        return self._plan("/v1/completions", body, rng, "completion")

    def _chat(self, rng: random.Random) -> Plan:
        n = self.prompt_tokens(rng)
        stream = rng.random() < 0.5
        body = {**self._base(rng, n, stream),
                "messages": [{"role": "user", "content": words(rng, n // TOKENS_PER_WORD)}]}
        kind, extra = rng.random(), "chat"
        if kind < 0.1:
            extra = "tools"
            body.update(tools=[WEATHER_TOOL], tool_choice=rng.choice(["auto", "required"]))
        elif kind < 0.2:
            extra = "json"
            body["response_format"] = ANSWER_FORMAT
        if extra != "chat":
            # The reply thinks first, then the end of thinking is forced at the budget: max_tokens leaves room for
            # the shortest tool call / JSON value after it (else the gateway's 400 says what it needs).
            budget = rng.randint(8, 48)
            body.update(chat_template_kwargs={"enable_thinking": True}, thinking_token_budget=budget,
                        max_tokens=budget + 64)
        else:
            body["ignore_eos"] = rng.random() < 0.5
        if rng.random() < 0.15:
            body["n"] = 2
        if rng.random() < 0.15:
            body.update(logprobs=True, top_logprobs=rng.randint(0, 5))
        return self._plan("/v1/chat/completions", body, rng, extra)

    def _turn(self, rng: random.Random) -> Plan:
        """The next turn of this client's conversation: its messages so far (turn k and its reply) and a new user
        message, so its prompt starts with the last one's (the prefix cache's case); a fresh one after the last."""
        ask = {"role": "user", "content": words(rng, rng.randint(10, 60))}
        if self.talk.turns >= CONVERSATION_TURNS or not self.talk.messages \
                or self.talk.tokens() + len(ask["content"].split()) * TOKENS_PER_WORD + 64 > self.window:
            first = self.prompt_tokens(rng) // 2
            self.talk = _Conversation([{"role": "system", "content": words(rng, first // TOKENS_PER_WORD)}])
        self.talk.messages.append(ask)
        self.talk.turns += 1
        stream = rng.random() < 0.5
        body = {**self._base(rng, self.talk.tokens(), stream), "messages": list(self.talk.messages)}
        return self._plan("/v1/chat/completions", body, rng, "turn_first" if self.talk.turns == 1 else "turn_next")

    def _image(self, rng: random.Random) -> Plan:
        stream = rng.random() < 0.5
        content = [{"type": "image_url", "image_url": {"url": png_data_url(rng)}},
                   {"type": "text", "text": words(rng, rng.randint(8, 40))}]
        body = {**self._base(rng, 128, stream), "messages": [{"role": "user", "content": content}]}  # text + image
        return self._plan("/v1/chat/completions", body, rng, "image")

    def _plan(self, path: str, body: dict, rng: random.Random, kind: str) -> Plan:
        cut = _cut(rng, body["stream"])
        return Plan(path, body, cut, cut_after=rng.randint(1, max(1, body["max_tokens"] // 2)), kind=kind,
                    refusable=True)

    def after(self, plan: Plan, out: Outcome) -> None:
        if plan.kind.startswith("turn"):
            if out.outcome == "reply":
                self.talk.messages.append({"role": "assistant", "content": out.text or "ok"})
            else:  # cut or refused (past the window): start a fresh conversation next time
                self.talk = _Conversation()
        elif plan.kind == "image" and self.state.images is None:
            self.state.probing = False
            if out.outcome == "reply":
                self.state.images = True
            elif out.outcome == "refused_400":
                self.state.images = False
                self.state.image_note = out.message


def png_data_url(rng: random.Random, width: int = 48, height: int = 32) -> str:
    """A small random RGB PNG as a data URL (written by hand: no imaging library on the client's side)."""
    rows = b"".join(b"\x00" + rng.randbytes(width * 3) for _ in range(height))  # filter byte 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) \
        + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(png).decode()
