"""Reading a rank's weights from an HF safetensors checkpoint (single file or sharded with an index).

Only the slices this rank owns are read (safetensors' lazy slicing), converted to the runtime dtype on the way.
Parameters that the reference model keeps in fp32 (router bias, KDA decay parameters, conv weights, mHC base and
scale) stay fp32 whatever the runtime dtype. Quantised formats plug in here later: a reader that returns dense
slices for a key is all the model needs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from services.rank_worker.model.parallel import Sharding

_KEEP_FP32 = ("e_score_correction_bias", "conv1d.weight", "dt_bias", "A_log", "_base", "_scale")
TEXT_PREFIX = "model.language_model."


class WeightReader:
    def __init__(self, model_dir: str | Path, sharding: Sharding, dtype: torch.dtype, device: torch.device,
                 progress: bool = True) -> None:
        self.dir = Path(model_dir)
        self.sharding = sharding
        self.dtype = dtype
        self.device = device
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            self.files = dict(json.loads(index.read_text())["weight_map"])
        else:
            single = self.dir / "model.safetensors"
            if not single.exists():
                raise FileNotFoundError(f"no model.safetensors(.index.json) in {self.dir}")
            with safe_open(single, "pt") as f:
                self.files = {k: single.name for k in f.keys()}
        self._handles: dict[str, object] = {}
        text_keys = sum(1 for k in self.files if not k.startswith("model.visual."))  # the vision tower is not read
        self._bar = tqdm(total=text_keys, desc=f"loading weights (rank {sharding.rank})", unit="tensor",
                         disable=not progress)

    def _resolve(self, key: str) -> str | None:
        """Text-only checkpoints name text weights `model.layers.*` instead of `model.language_model.layers.*`."""
        if key in self.files:
            return key
        if key.startswith(TEXT_PREFIX):
            flat = "model." + key[len(TEXT_PREFIX):]
            if flat in self.files:
                return flat
        return None

    def has(self, key: str) -> bool:
        return self._resolve(key) is not None

    def _slice(self, key: str):
        stored = self._resolve(key)
        if stored is None:
            raise KeyError(f"checkpoint {self.dir} has no tensor {key}")
        name = self.files[stored]
        if name not in self._handles:
            self._handles[name] = safe_open(self.dir / name, "pt")
        self._bar.update(1)
        return self._handles[name].get_slice(stored)

    def _finish(self, key: str, t: torch.Tensor) -> torch.Tensor:
        dtype = torch.float32 if any(m in key for m in _KEEP_FP32) else self.dtype
        return t.to(device=self.device, dtype=dtype).contiguous()

    def full(self, key: str) -> torch.Tensor:
        """A replicated tensor."""
        return self._finish(key, self._slice(key)[:])

    def split(self, key: str, dim: int) -> list[torch.Tensor]:
        """This rank's virtual-shard slices of `key` along `dim` (0 = output rows, 1 = input columns)."""
        sl = self._slice(key)
        shape = sl.get_shape()
        parts = []
        for s in self.sharding.split(shape[dim], key):
            index = (s,) if dim == 0 else (slice(None), s)
            parts.append(self._finish(key, sl[index]))
        return parts

    def close(self) -> None:
        self._bar.close()
        self._handles.clear()
