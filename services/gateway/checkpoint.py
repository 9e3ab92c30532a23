"""What the gateway needs to know about the checkpoint: window, vocabulary, EOS ids, default sampling.

The gateway never loads weights; it reads the small JSON files beside them (config.json, generation_config.json,
tokenizer_config.json) so its validation (context length, token-id ranges) matches what the scheduler enforces.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _as_id_list(value: Any) -> list[int]:
    """`eos_token_id` is an int or a list of ints in HF configs."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value if isinstance(v, int)]


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    # Sampling defaults from generation_config.json (vLLM `--generation-config auto`): only the keys present.
    default_sampling: dict[str, float | int] = field(default_factory=dict)
    tokenizer_config: dict[str, Any] = field(default_factory=dict)
    image_token_id: int | None = None  # the placeholder an image's embeddings replace (multimodal configs)

    @classmethod
    def load(cls, model_dir: str | Path, max_model_len: int | None = None) -> "CheckpointInfo":
        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: not a checkpoint directory")
        config = _read_json(path / "config.json")
        text = config.get("text_config") or config  # multimodal configs nest the language model's fields
        gen = _read_json(path / "generation_config.json")
        window = int(text.get("max_position_embeddings") or config.get("max_position_embeddings") or 0)
        if max_model_len:
            window = min(window, max_model_len) if window else max_model_len
        if window <= 0:
            raise ValueError(f"{path}/config.json has no max_position_embeddings; pass --max-model-len")
        eos = set(_as_id_list(text.get("eos_token_id"))) | set(_as_id_list(config.get("eos_token_id")))
        eos |= set(_as_id_list(gen.get("eos_token_id")))
        defaults: dict[str, float | int] = {}
        for key in ("temperature", "top_p", "top_k", "min_p"):
            if isinstance(gen.get(key), (int, float)) and not isinstance(gen.get(key), bool):
                defaults[key] = gen[key]
        return cls(
            path=path,
            max_model_len=window,
            vocab_size=int(text.get("vocab_size") or config.get("vocab_size") or 0),
            eos_token_ids=frozenset(eos),
            default_sampling=defaults,
            tokenizer_config=_read_json(path / "tokenizer_config.json"),
            image_token_id=config.get("image_token_id") if isinstance(config.get("image_token_id"), int) else None,
        )
