"""Write tensors as sharded safetensors plus `model.safetensors.index.json`, the layout HF checkpoints use.

The tiny checkpoint is split even though it is small, so every loader is exercised on the multi-shard path the real
640 GB checkpoint needs. Output is byte-deterministic: shard assignment depends only on tensor order and sizes, the
only file metadata is {"format": "pt"}, and JSON is written with sorted keys.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from .tensor_spec import TensorSpec

INDEX_NAME = "model.safetensors.index.json"


def plan_shards(specs: list[TensorSpec], dtype: torch.dtype, max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Greedy split in key order: start a new shard when the next tensor would push this one past the cap."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        n = spec.nbytes(dtype)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n
    return shards


def shard_name(i: int, n: int) -> str:
    return "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def write_shards(out_dir: Path, shards: list[list[TensorSpec]], dtype: torch.dtype,
                 make: Callable[[TensorSpec], dict[str, torch.Tensor]], *, progress: bool = True) -> list[Path]:
    """Materialise each shard's tensors with `make` (the stored tensors of one spec: itself, or a quantized linear's
    tensors), save it, then write the index; returns the files written."""
    out_dir = Path(out_dir)
    n = len(shards)
    weight_map: dict[str, str] = {}
    total_size = 0
    written: list[Path] = []
    bar = tqdm(total=sum(len(s) for s in shards), desc="writing tiny weights", unit="tensor", disable=not progress)
    try:
        for i, shard in enumerate(shards):
            name = shard_name(i, n)
            tensors: dict[str, torch.Tensor] = {}
            for spec in shard:
                made = make(spec)
                t = made.get(spec.key)
                if t is not None and tuple(t.shape) != spec.shape:  # the generator and the spec must agree
                    raise RuntimeError(f"{spec.key}: made shape {tuple(t.shape)}, spec says {spec.shape}")
                tensors.update(made)
                weight_map.update(dict.fromkeys(made, name))
                total_size += sum(v.numel() * v.element_size() for v in made.values())
                bar.update(1)
            path = out_dir / name
            save_file(tensors, str(path), metadata={"format": "pt"})
            written.append(path)
    finally:
        bar.close()
    if n > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        path = out_dir / INDEX_NAME
        path.write_text(json.dumps(index, indent=2) + "\n")
        written.append(path)
    return written
