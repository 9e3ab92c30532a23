"""Helpers for the quantized-checkpoint tests: a dense twin of a quantized checkpoint, logits of a prompt."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kernels.quant import QuantizedWeight, quantized_modules
from model.model import Glm5Model
from model.quant_config import read_quant_configs
from tests.model.reference import fresh_cache, run_chunks

# Blocks / groups of 8: the tiny model's smallest tensor-parallel shard is 8 wide (32 expert channels / 4 shards).
QUANT_BLOCK = 8


def read_tensors(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in `d`."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})
    return out


def write_dequantized(src: Path, dst: Path) -> Path:
    """A dense float32 copy of a quantized checkpoint: each quantized linear replaced by `X.weight` = its
    `QuantizedWeight.dequantize()` (the whole tensor at once), dense tensors copied, no quantization_config."""
    tensors = read_tensors(src)
    qcfgs = read_quant_configs(src)
    out: dict[str, torch.Tensor] = {}
    for module, (codec, names) in quantized_modules(tensors, lambda k: tensors[k].dtype).items():
        stored = {n: tensors.pop(k) for n, k in names.items()}
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
