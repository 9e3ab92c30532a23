"""Incremental detokenization that never splits a character.

Byte-level BPE tokens can end in the middle of a UTF-8 character (one CJK character or emoji is often 2-4 tokens),
so decoding token by token would emit U+FFFD replacement characters. Like vLLM, we keep two offsets into the
output ids: text is decoded from `prefix_offset`, and only the part past what `ids[prefix_offset:read_offset]`
already produced is new. While the decoded window ends in U+FFFD the character is incomplete and nothing is
emitted; once it completes, the whole character goes out at once. Decoding from a short window (not from the
start) keeps each step O(window), and starting the window at a character boundary keeps its decode exact.
"""

from __future__ import annotations

from .tokenizer import TextTokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TextTokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window (a character boundary)
        self._read_offset = 0    # ids before this have been emitted as text

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes ("" while a character is still incomplete)."""
        self.ids.append(token_id)
        window = self.ids[self._prefix_offset:]
        prefix_text = self._tok.decode(self.ids[self._prefix_offset:self._read_offset], self._skip)
        new_text = self._tok.decode(window, self._skip)
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
            return new_text[len(prefix_text):]
        if len(new_text) <= len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            # The id produced no text (a skipped special token); move on so the window stays short.
            self._prefix_offset = self._read_offset = len(self.ids)
            return new_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """At the end of output: whatever is still held (a truly invalid byte sequence decodes with U+FFFD)."""
        prefix_text = self._tok.decode(self.ids[self._prefix_offset:self._read_offset], self._skip)
        new_text = self._tok.decode(self.ids[self._prefix_offset:], self._skip)
        self._prefix_offset = self._read_offset = len(self.ids)
        return new_text[len(prefix_text):]
