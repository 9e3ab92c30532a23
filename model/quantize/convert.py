"""Write a quantized copy of a checkpoint, one safetensors shard at a time (memory: one output shard).

Same shard files and key names as the input; a quantized linear `X.weight` becomes its format's tensors
(`X.weight` + `X.weight_scale_inv` for fp8, `X.weight_packed` + `X.weight_scale` for w4a16), everything else is
copied byte for byte, modules already quantized included (so fp8 on top of a `--experts-only` w4a16 checkpoint gives
W4A16 experts + FP8 attention). config.json gets the `quantization_config` (an earlier one is kept nested), the index
is rewritten, and the other files (tokenizer, chat template, generation config) are copied.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from kernels.quant import quantize, quantized_modules
from kernels.quant import fp8 as fp8_format
from kernels.quant import w4a16 as w4a16_format
from model.quant_config import nest
from model.quantize.select import Recipe

INDEX = "model.safetensors.index.json"


@dataclass
class Summary:
    quantized: Counter = field(default_factory=Counter)  # format -> linears quantized now
    kept: int = 0  # dense tensors copied as they were
    already: int = 0  # modules that were quantized in the input (copied as they were)
    bytes_in: int = 0
    bytes_out: int = 0


def quant_config(fmt: str, block: int | None) -> dict[str, Any]:
    """The `quantization_config` a checkpoint in `fmt` carries (see kernels/quant/{fp8,w4a16}.py)."""
    if fmt == "fp8":
        cfg: dict[str, Any] = {"quant_method": fp8_format.CODEC.quant_method, "fmt": "e4m3",
                               "activation_scheme": "dynamic"}
        return {**cfg, "weight_block_size": [block, block]} if block else cfg
    if fmt == "w4a16":
        return {"quant_method": w4a16_format.QUANT_METHOD, "bits": 4, "group_size": block or w4a16_format.DEFAULT_GROUP,
                "symmetric": True, "pack": "int32: 8 nibbles along in, lowest first, q + 8"}
    raise ValueError(f"twinspark quantize writes fp8 or w4a16, not {fmt!r}")


def _source_files(src: Path) -> dict[str, list[str]]:
    """Shard file -> its tensor keys, in the index's order."""
    index = src / INDEX
    if index.exists():
        by_file: dict[str, list[str]] = {}
        for k, f in json.loads(index.read_text())["weight_map"].items():
            by_file.setdefault(f, []).append(k)
        return dict(sorted(by_file.items()))
    single = src / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"no model.safetensors(.index.json) in {src}")
    with safe_open(single, "pt") as f:
        return {single.name: list(f.keys())}


def quantize_checkpoint(src: str | Path, dst: str | Path, recipe: Recipe, *, device: str = "cpu",
                        progress: bool = True) -> Summary:
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise ValueError("--out must differ from --model (the input is read while the output is written)")
    fmt = recipe.other or recipe.experts
    if fmt is None or len(recipe.formats) != 1:
        raise ValueError("one format per run: quantize the experts and the rest in two runs")
    config = json.loads((src / "config.json").read_text())
    old = config.get("quantization_config")
    if old and old.get("quant_method") == quant_config(fmt, recipe.block)["quant_method"]:
        raise ValueError(f"{src} is already {fmt}; quantize its dense original instead")
    files = _source_files(src)
    done = set(quantized_modules(k for keys in files.values() for k in keys))  # across every shard
    dst.mkdir(parents=True, exist_ok=True)
    for stale in [*dst.glob("*.safetensors"), dst / INDEX]:
        stale.unlink(missing_ok=True)

    summary = Summary(already=len(done))
    weight_map: dict[str, str] = {}
    bar = tqdm(total=sum(len(k) for k in files.values()), desc=f"quantizing to {fmt}", unit="tensor",
               disable=not progress)
    try:
        for name, keys in files.items():
            out: dict[str, torch.Tensor] = {}
            with safe_open(src / name, "pt") as f:
                for key in keys:
                    t = f.get_tensor(key)
                    summary.bytes_in += t.numel() * t.element_size()
                    was_quantized = key.rpartition(".")[0] in done
                    target = None if was_quantized else recipe.format_for(key, tuple(t.shape))
                    if target is None:
                        out[key] = t
                        summary.kept += not was_quantized
                    else:
                        q = quantize(t.to(device), target, block=recipe.block)
                        module = key.removesuffix(".weight")
                        out.update({f"{module}.{n}": v.cpu().contiguous() for n, v in q.tensors.items()})
                        summary.quantized[target] += 1
                    bar.update(1)
            save_file(out, str(dst / name), metadata={"format": "pt"})
            summary.bytes_out += sum(v.numel() * v.element_size() for v in out.values())
            weight_map.update(dict.fromkeys(out, name))
    finally:
        bar.close()

    if (src / INDEX).exists():
        index = {"metadata": {"total_size": summary.bytes_out}, "weight_map": dict(sorted(weight_map.items()))}
        (dst / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    config["quantization_config"] = nest(quant_config(fmt, recipe.block), old)
    (dst / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    for p in src.iterdir():  # tokenizer, chat template, generation config, ...
        if p.is_file() and p.name not in ("config.json", INDEX) and p.suffix != ".safetensors":
            shutil.copy2(p, dst / p.name)
    return summary
