"""OpenAI response bodies (`chat.completion`, `chat.completion.chunk`, `text_completion`) with vLLM's extras.

vLLM placement of the id lists: chat replies carry `prompt_token_ids` at the top level, completions in the choice
(we also put it at the top level of completions, so one client path reads both); `token_ids` is per choice.
`token_sha` (sha256 of the completion's ids, int32 little-endian) is at the top level of every full reply (the first
choice's; with n > 1 each choice carries its own too) and of the streamed chunk that carries a `finish_reason`.

A chat reply is split by `reply_parser.ReplyParser` into reasoning (`reasoning_content`, and vLLM's newer
`reasoning`), content and tool calls; streamed replies are cut by the same parser, so they add up to the full one.
Logprobs: OpenAI's shapes (chat: `logprobs.content[]` with `bytes` and `top_logprobs`; completions: `tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`); a token outside the sampler's kept set has logprob -inf, sent as
-9999.0 (JSON has no infinity; vLLM does the same). Prompt logprobs (prompt_scores.py): vLLM's `prompt_logprobs`
in a completions choice (chat: at the top level), and with completions' `echo` the prompt's text and logprobs ahead
of the reply's in the same fields (streamed: in each choice's first chunk).
"""

from __future__ import annotations

import math
import time
from typing import Any

from .generation import Final
from .output import Delta, TokenLogprob
from .prepare import Prepared
from .prompt_scores import echo_logprobs, vllm_prompt_logprobs
from .reply_parser import ContentDelta, ParsedReply, ReasoningDelta, ReplyEvent, ReplyParser, ToolCall
from .tokenizer import TextTokenizer

_NEG = -9999.0


def _lp(value: float) -> float:
    return value if math.isfinite(value) else _NEG


def token_text(tok: TextTokenizer, token_id: int) -> str:
    return tok.token_bytes(token_id).decode("utf-8", errors="replace")


def _entry(tok: TextTokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    raw = tok.token_bytes(token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": _lp(logprob), "bytes": list(raw)}


def chat_logprobs(tok: TextTokenizer, lps: list[TokenLogprob]) -> list[dict[str, Any]]:
    return [{**_entry(tok, lp.token_id, lp.logprob), "top_logprobs": [_entry(tok, i, v) for i, v in lp.top]}
            for lp in lps]


def completion_logprobs(tok: TextTokenizer, lps: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    tokens = [token_text(tok, lp.token_id) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    tops = []
    for lp in lps:  # a dict by token text: when two tokens read the same (partial UTF-8), the likelier is kept
        top: dict[str, float] = {}
        for i, v in lp.top:
            top.setdefault(token_text(tok, i), _lp(v))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [_lp(lp.logprob) for lp in lps], "top_logprobs": tops,
            "text_offset": offsets}


def _joined(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two parts of a completions `logprobs` object, one after the other."""
    return {key: first[key] + then[key] for key in first}


def echo_text_and_logprobs(prep: Prepared, tok: TextTokenizer, text: str, lp: dict[str, Any] | None
                           ) -> tuple[str, dict[str, Any] | None]:
    """A completion's text and logprobs with the prompt's ahead (`echo`); `lp`'s offsets already count from the
    end of the prompt's text."""
    if not prep.echo:
        return text, lp
    if lp is not None:
        lp = _joined(echo_logprobs(tok, prep.prompt_ids, prep.prompt_scores), lp)
    return prep.prompt_text + text, lp


def new_parser(prep: Prepared, index: int = 0) -> ReplyParser:
    return ReplyParser(reasoning=prep.reasoning, tools=prep.tools)


def parse_reply(prep: Prepared, text: str) -> ParsedReply:
    parser = new_parser(prep)
    reply = ParsedReply()
    reply.add(parser.feed(text))
    reply.add(parser.finish())
    return reply


def reasoning_tokens(prep: Prepared, final: Final) -> int:
    """Tokens of the reasoning: those before the token that ended it (`</think>`, or a tool call's opening when
    calls are parsed); all of them while none came. A forced message counts as the model's own text; the ending
    token is not counted, forced or not."""
    if not prep.reasoning:
        return 0
    return next((i for i, t in enumerate(final.token_ids) if t in prep.think_end_ids), len(final.token_ids))


def finish_reason(final: Final, calls: int) -> str:
    return "tool_calls" if calls and final.finish_reason == "stop" else final.finish_reason


def tool_call_json(call: ToolCall, with_index: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments}}
    return {"index": call.index, **body} if with_index else body


def usage(prep: Prepared, finals: list[Final]) -> dict[str, Any]:
    """One usage for all choices: the prompt once, every choice's completion tokens."""
    first = finals[0]
    completion = sum(f.completion_tokens for f in finals)
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
            "total_tokens": first.prompt_tokens + completion,
            # image_tokens: the prompt tokens that are image placeholders (counted in prompt_tokens too)
            "prompt_tokens_details": {"cached_tokens": first.cached_tokens,
                                      **({"image_tokens": prep.image_tokens} if prep.image_tokens else {})},
            "completion_tokens_details": {"reasoning_tokens": sum(reasoning_tokens(prep, f) for f in finals)},
            "twinspark": {"drafted": sum(f.drafted_tokens for f in finals),
                          "accepted": sum(f.accepted_tokens for f in finals)}}


def _choice_extras(prep: Prepared, final: Final) -> dict[str, Any]:
    extras: dict[str, Any] = {"stop_reason": final.stop_reason}
    if prep.return_token_ids:
        extras["token_ids"] = final.token_ids
    return extras


def chat_message(prep: Prepared, text: str) -> tuple[dict[str, Any], int]:
    """The assistant message of a full chat reply, and its number of tool calls."""
    reply = parse_reply(prep, text)
    message: dict[str, Any] = {"role": "assistant", "content": reply.content if reply.content or not
                               reply.tool_calls else None}
    if reply.reasoning is not None:
        message["reasoning_content"] = message["reasoning"] = reply.reasoning
    message["tool_calls"] = [tool_call_json(c) for c in reply.tool_calls]
    return message, len(reply.tool_calls)


def full_response(prep: Prepared, model: str, tok: TextTokenizer, texts: dict[int, str], finals: list[Final],
                  created: int) -> dict[str, Any]:
    """The non-streamed reply; `finals` are the returned choices (re-indexed in order), `texts` by choice index."""
    choices = []
    for index, final in enumerate(finals):
        text = texts[final.index]
        if prep.kind == "chat":
            message, calls = chat_message(prep, text)
            lp = {"content": chat_logprobs(tok, final.logprobs or [])} if prep.logprobs is not None else None
            choice: dict[str, Any] = {"index": index, "message": message, "logprobs": lp,
                                      "finish_reason": finish_reason(final, calls)}
        else:
            lp = completion_logprobs(tok, final.logprobs or [], len(prep.prompt_text) if prep.echo else 0) \
                if prep.logprobs is not None else None
            text, lp = echo_text_and_logprobs(prep, tok, text, lp)
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": final.finish_reason}
            if prep.return_token_ids:
                choice["prompt_token_ids"] = prep.prompt_ids
            if prep.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(tok, prep.prompt_scores)
        choice.update(_choice_extras(prep, final))
        if len(finals) > 1:
            choice["token_sha"] = final.token_sha
        choices.append(choice)
    body: dict[str, Any] = {"id": prep.response_id, "object": "chat.completion" if prep.kind == "chat" else
                            "text_completion", "created": created, "model": model, "choices": choices,
                            "usage": usage(prep, finals), "token_sha": finals[0].token_sha}
    if prep.return_token_ids:
        body["prompt_token_ids"] = prep.prompt_ids
    if prep.kind == "chat" and prep.prompt_logprobs is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(tok, prep.prompt_scores)
    return body


class ChunkWriter:
    """Builds the streamed chunks of one reply, in order (choices interleaved as their tokens come)."""

    def __init__(self, prep: Prepared, model: str, tok: TextTokenizer) -> None:
        self.prep = prep
        self.model = model
        self.tok = tok
        self.created = int(time.time())
        self._sent_prompt_ids = False
        self._object = "chat.completion.chunk" if prep.kind == "chat" else "text_completion"
        self._parsers = {i: new_parser(prep, i) for i in range(prep.n)}
        self._calls = dict.fromkeys(range(prep.n), 0)
        # Where each choice's next text starts in its reply (echo: after the prompt, sent with its first chunk).
        self._offsets = dict.fromkeys(range(prep.n), len(prep.prompt_text) if prep.echo else 0)
        self._echo = set(range(prep.n)) if prep.echo else set()  # choices whose prompt is still to be echoed
        self._generated = dict.fromkeys(range(prep.n), 0)  # tokens so far per choice (continuous usage)

    def _chunk(self, choice: dict[str, Any] | None) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.prep.response_id, "object": self._object, "created": self.created,
                                "model": self.model, "choices": [choice] if choice is not None else []}
        if self.prep.include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last when usage is requested
        if self.prep.continuous_usage and choice is not None:
            # vLLM's continuous_usage_stats: the usage so far of this chunk's choice, on every chunk.
            prompt, done = len(self.prep.prompt_ids), self._generated[choice["index"]]
            body["usage"] = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
        if self.prep.return_token_ids and not self._sent_prompt_ids and choice is not None:
            self._sent_prompt_ids = True
            body["prompt_token_ids"] = self.prep.prompt_ids
            if self.prep.kind != "chat":
                choice["prompt_token_ids"] = self.prep.prompt_ids
        return body

    def first(self) -> list[dict[str, Any]]:
        """Chat opens each choice with the assistant role (sent at once, which also flushes the 200)."""
        if self.prep.kind != "chat":
            return []
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}) for i in range(self.prep.n)]

    def _chat_delta(self, index: int, e: ReplyEvent) -> dict[str, Any]:
        if isinstance(e, ReasoningDelta):
            return {"reasoning_content": e.text, "reasoning": e.text}
        if isinstance(e, ContentDelta):
            return {"content": e.text}
        self._calls[index] += 1
        return {"tool_calls": [tool_call_json(e, with_index=True)]}

    def _chat_chunks(self, index: int, events: list[ReplyEvent], d: Delta | None) -> list[dict[str, Any]]:
        deltas = [self._chat_delta(index, e) for e in events]
        lps = d.logprobs if d is not None and self.prep.logprobs is not None else []
        ids = d.token_ids if d is not None and self.prep.return_token_ids else []
        if not deltas and (lps or ids):
            deltas = [{"content": ""}]  # tokens whose text is held back still report their logprobs / ids
        out = []
        for j, delta in enumerate(deltas):
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
            if j == 0 and lps:
                choice["logprobs"] = {"content": chat_logprobs(self.tok, lps)}
            if self.prep.return_token_ids:
                choice["token_ids"] = ids if j == 0 else []
            out.append(self._chunk(choice))
        return out

    def delta(self, index: int, d: Delta) -> list[dict[str, Any]]:
        self._generated[index] += len(d.token_ids)
        if self.prep.kind == "chat":
            return self._chat_chunks(index, self._parsers[index].feed(d.text), d)
        if not d.text and not (self.prep.return_token_ids and d.token_ids) and not d.logprobs \
                and index not in self._echo:
            return []
        choice: dict[str, Any] = {"index": index, "text": d.text, "logprobs": None, "finish_reason": None}
        if self.prep.logprobs is not None:
            choice["logprobs"] = completion_logprobs(self.tok, d.logprobs, self._offsets[index])
        self._offsets[index] += len(d.text)
        if index in self._echo:  # the prompt's scores are whole by now (generation.py)
            self._echo.discard(index)
            choice["text"], choice["logprobs"] = echo_text_and_logprobs(self.prep, self.tok, d.text,
                                                                        choice["logprobs"])
        if self.prep.return_token_ids:
            choice["token_ids"] = d.token_ids
        return [self._chunk(choice)]

    def finish(self, index: int, final: Final) -> list[dict[str, Any]]:
        self._generated[index] = final.completion_tokens  # the hidden stopping token counts, as in `usage`
        out: list[dict[str, Any]] = []
        if self.prep.kind == "chat":
            out = self._chat_chunks(index, self._parsers[index].finish(), None)
            choice: dict[str, Any] = {"index": index, "delta": {}, "logprobs": None,
                                      "finish_reason": finish_reason(final, self._calls[index])}
        else:
            if index in self._echo:  # nothing was generated (max_tokens 0, or a reply held back whole)
                out = self.delta(index, Delta())
            choice = {"index": index, "text": "", "logprobs": None, "finish_reason": final.finish_reason}
        choice["stop_reason"] = final.stop_reason
        if self.prep.return_token_ids:
            choice["token_ids"] = []
        body = self._chunk(choice)
        body["token_sha"] = final.token_sha
        return out + [body]

    def usage(self, finals: list[Final]) -> dict[str, Any]:
        body = self._chunk(None)
        body["usage"] = usage(self.prep, sorted(finals, key=lambda f: f.index))
        body["token_sha"] = finals[0].token_sha
        return body
