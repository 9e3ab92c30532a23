"""OpenAI response bodies (`chat.completion`, `chat.completion.chunk`, `text_completion`) with vLLM's extras.

vLLM placement of the id lists: chat replies carry `prompt_token_ids` at the top level, completions in the choice
(we also put it at the top level of completions, so one client path reads both); `token_ids` is per choice.
`token_sha` (sha256 of the completion's ids, int32 little-endian) is at the top level of every full reply and of
the streamed chunk that carries `finish_reason` (and of the usage chunk).
"""

from __future__ import annotations

import time
from typing import Any

from .generation import Final
from .output import Delta
from .prepare import Prepared


def _choice_extras(prep: Prepared, final: Final) -> dict[str, Any]:
    extras: dict[str, Any] = {"stop_reason": final.stop_reason}
    if prep.return_token_ids:
        extras["token_ids"] = final.token_ids
    return extras


def full_response(prep: Prepared, model: str, text: str, final: Final, created: int) -> dict[str, Any]:
    """The non-streamed reply."""
    if prep.kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": final.finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": final.finish_reason}
        if prep.return_token_ids:
            choice["prompt_token_ids"] = prep.prompt_ids
        obj = "text_completion"
    choice.update(_choice_extras(prep, final))
    body: dict[str, Any] = {"id": prep.response_id, "object": obj, "created": created, "model": model,
                            "choices": [choice], "usage": final.usage(), "token_sha": final.token_sha}
    if prep.return_token_ids:
        body["prompt_token_ids"] = prep.prompt_ids
    return body


class ChunkWriter:
    """Builds the streamed chunks of one reply, in order."""

    def __init__(self, prep: Prepared, model: str) -> None:
        self.prep = prep
        self.model = model
        self.created = int(time.time())
        self._sent_prompt_ids = False
        self._object = "chat.completion.chunk" if prep.kind == "chat" else "text_completion"

    def _chunk(self, choice: dict[str, Any] | None) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.prep.response_id, "object": self._object, "created": self.created,
                                "model": self.model, "choices": [choice] if choice is not None else []}
        if self.prep.include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last when usage is requested
        if self.prep.return_token_ids and not self._sent_prompt_ids and choice is not None:
            self._sent_prompt_ids = True
            body["prompt_token_ids"] = self.prep.prompt_ids
            if self.prep.kind != "chat":
                choice["prompt_token_ids"] = self.prep.prompt_ids
        return body

    def first(self) -> dict[str, Any] | None:
        """Chat opens with the assistant role (sent at once, which also flushes the 200 to the client)."""
        if self.prep.kind != "chat":
            return None
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})

    def delta(self, d: Delta) -> dict[str, Any] | None:
        if not d.text and not (self.prep.return_token_ids and d.token_ids):
            return None
        if self.prep.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {"content": d.text}, "logprobs": None,
                                      "finish_reason": None}
        else:
            choice = {"index": 0, "text": d.text, "logprobs": None, "finish_reason": None}
        if self.prep.return_token_ids:
            choice["token_ids"] = d.token_ids
        return self._chunk(choice)

    def finish(self, final: Final) -> dict[str, Any]:
        if self.prep.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": final.finish_reason}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": final.finish_reason}
        choice["stop_reason"] = final.stop_reason
        if self.prep.return_token_ids:
            choice["token_ids"] = []
        body = self._chunk(choice)
        body["token_sha"] = final.token_sha
        return body

    def usage(self, final: Final) -> dict[str, Any]:
        body = self._chunk(None)
        body["usage"] = final.usage()
        body["token_sha"] = final.token_sha
        return body
