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
