"""The checkpoint's tokenizer (`tokenizer.json` through HF `tokenizers`): text <-> token ids.

The gateway is the only place text exists; the scheduler and ranks see ids only.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from tokenizers import Tokenizer

# Encoding a long prompt (hundreds of thousands of characters) takes long enough to stall every other stream on
# the event loop; above this size it runs in a worker thread (`tokenizers` releases the GIL while encoding).
_THREAD_ABOVE_CHARS = 32_768


class TextTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: the gateway needs the checkpoint's tokenizer.json")
        self._tok = Tokenizer.from_file(str(path))
        self.json = path.read_text(encoding="utf-8")  # llguidance builds its own view of the vocabulary from it
        # Ids the tokenizer knows; the model's vocab may be padded past it (those ids decode to nothing).
        self.size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    async def encode_async(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) <= _THREAD_ABOVE_CHARS:
            return self.encode(text, add_special_tokens)
        return await asyncio.to_thread(self.encode, text, add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def added_tokens(self) -> set[str]:
        """Texts of the added tokens (special or not): each is one id, never split by the BPE."""
        return {t.content for t in self._tok.get_added_tokens_decoder().values()}

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (what OpenAI's logprobs `bytes` hold): byte-level BPE pieces mapped back
        through GPT-2's byte alphabet; added tokens as their UTF-8 text."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if piece in self.added_tokens or any(ch not in _BYTE_OF for ch in piece):
            return piece.encode("utf-8")
        return bytes(_BYTE_OF[ch] for ch in piece)


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable character map (what byte-level BPE vocabularies are written in)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_OF = _byte_alphabet()
