"""Helpers for the quantized-checkpoint tests: a dense twin of a quantized checkpoint, logits of a prompt."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kernels.quant import QuantizedWeight, codec_of
from services.rank_worker.model.model import Glm5Model
from services.rank_worker.model.quant_config import read_quant_configs
from tests.model.reference import fresh_cache, run_chunks

# Blocks / groups of 8: the tiny model's smallest tensor-parallel shard is 8 wide (32 expert channels / 4 shards).
QUANT_BLOCK = 8


def write_dequantized(src: Path, dst: Path) -> Path:
    """A dense float32 copy of a quantized checkpoint: each quantized linear replaced by `X.weight` = its
    `QuantizedWeight.dequantize()` (the whole tensor at once), dense tensors copied, no quantization_config."""
    index = json.loads((src / "model.safetensors.index.json").read_text())
    qcfgs = read_quant_configs(src)
    names: dict[str, set[str]] = {}
    for k in index["weight_map"]:
        module, _, name = k.rpartition(".")
        names.setdefault(module, set()).add(name)
    quantized = {m: c for m, n in names.items() if (c := codec_of(n)) is not None}
    tensors = {}
    for f in sorted(set(index["weight_map"].values())):
        with safe_open(src / f, "pt") as h:
            tensors.update({k: h.get_tensor(k) for k in h.keys()})
    out: dict[str, torch.Tensor] = {}
    for module, codec in quantized.items():
        stored = {n: tensors.pop(f"{module}.{n}") for n in names[module]}
        q = QuantizedWeight.from_tensors(codec.name, stored, qcfgs.get(codec.quant_method))
        out[f"{module}.weight"] = q.dequantize(torch.float32)
    out.update(tensors)
    dst.mkdir(parents=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for p in src.iterdir():
        if p.suffix != ".safetensors" and p.name not in ("model.safetensors.index.json", "config.json"):
            shutil.copy2(p, dst / p.name)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def prompt_logits(model: Glm5Model, ids: list[int]) -> torch.Tensor:
    """Logits of every row of `ids`: a 32-token prefill chunk, then one token at a time."""
    return run_chunks(model, fresh_cache(model, len(ids)), ids, [32])
