"""Write a quantized copy of a checkpoint, one safetensors shard at a time (memory: one output shard).

Same shard files and key names as the input; a quantized linear `X.weight` becomes its format's tensors
(`X.weight` + `X.weight_scale_inv` for fp8, `X.weight_packed` + `X.weight_scale` for w4a16 and int, `X.trellis` /
`X.suh` / `X.svh` / marker for EXL3), everything else is copied byte for byte, modules already quantized included (so
fp8 on top of a `--experts-only` w4a16 checkpoint gives W4A16 experts + FP8 attention, and int4 on top of
`--experts-only` int3 gives int3 experts + int4 for the rest: the int formats may run twice on one checkpoint, with
the group size of the first run). One run may also write a whole recipe (int3+fp8+fp8: int3 experts, fp8 for the
rest and lm_head). config.json gets the `quantization_config` (one per format, nested; an earlier one is kept
nested too), the index is rewritten, and the other files (tokenizer, chat template, generation config) are copied;
an EXL3 output also gets exllamav3's quantization_config.json.

Everything is planned from the shard headers before a tensor is read: which linears the recipe packs (each one
whole tiles on every virtual shard, select.py), the fp8 block / w4a16 or int group when it is chosen from that
shard plan (`auto_block`), and EXL3's bits per linear for the target average (bits.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from kernels.quant import CODECS, quantize, quantized_modules
from kernels.quant import fp8 as fp8_format
from kernels.quant import intn
from kernels.quant import w4a16 as w4a16_format
from model.quant_config import by_method, nest
from model.quantize import bits as exl3_bits
from model.quantize import exl3_config
from model.quantize.select import BLOCKS, INT_CODEC, Recipe, auto_block, codec_format, tile_shape
from model.weights import header_dtype

INDEX = "model.safetensors.index.json"


@dataclass
class Summary:
    quantized: Counter = field(default_factory=Counter)  # format -> linears quantized now
    kept: int = 0  # dense tensors copied as they were
    already: int = 0  # modules that were quantized in the input (copied as they were)
    bytes_in: int = 0
    bytes_out: int = 0


def quant_config(fmt: str, block: int | None) -> dict[str, Any]:
    """The `quantization_config` a checkpoint in `fmt` carries (see kernels/quant/{fp8,w4a16,intn}.py); block: the
    recipe's `block_for(fmt)`."""
    if fmt == "fp8":
        cfg: dict[str, Any] = {"quant_method": fp8_format.CODEC.quant_method, "fmt": "e4m3",
                               "activation_scheme": "dynamic"}
        return {**cfg, "weight_block_size": [block, block]} if block else cfg
    if fmt == "w4a16":
        return {"quant_method": w4a16_format.QUANT_METHOD, "bits": 4, "group_size": block or w4a16_format.DEFAULT_GROUP,
                "symmetric": True, "pack": "int32: 8 nibbles along in, lowest first, q + 8"}
    if codec_format(fmt)[0] == INT_CODEC:
        return intn.quant_config(block or intn.DEFAULT_GROUP)
    raise ValueError(f"no quantization_config of its own for {fmt!r} (EXL3's: exl3_config.py)")


def recipe_quant_config(recipe: Recipe, formats: Iterable[str], exl3: exl3_bits.BitPlan | None,
                        old: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The `quantization_config` of a checkpoint whose linears `recipe` stores in `formats`: each format's own,
    nested in recipe order around `old` (an earlier run's); EXL3's from its bit plan."""
    qcfg = old
    for fmt in reversed(recipe.formats):
        if fmt in formats:
            own = exl3_config.quant_config(exl3, recipe.exl3_codebook) if fmt == "exl3" else \
                quant_config(fmt, recipe.block_for(fmt))
            qcfg = nest(own, qcfg)
    return qcfg


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


@dataclass(frozen=True)
class Plan:
    """What a run will write, decided from the shard headers alone."""

    recipe: Recipe  # with the block actually used
    targets: dict[str, str]  # weight key -> the format it is quantized to now
    exl3: exl3_bits.BitPlan | None  # EXL3's bits per linear
    shapes: dict[str, tuple[int, ...]]  # every stored tensor's
    done: set[str]  # modules quantized in the input (copied as they are)

    def lines(self, block_chosen: bool) -> list[str]:
        """What the plan chose and why, one line each (the CLI prints them before quantizing)."""
        r = self.recipe
        tps = ", ".join(str(t) for t in range(1, r.virtual + 1) if r.virtual % t == 0)
        out = [f"planned for {r.virtual} virtual shards: every packed linear is whole tiles on each, so the output "
               f"loads at TP {tps}"]
        # (an int format with its own group, int3:g64 or an earlier run's, is not stored in the chosen block)
        if block_chosen and any(f != "exl3" and r.block_for(f) == r.block for f in self.targets.values()):
            tried = r.blocks_to_try(BLOCKS)
            out.append(f"block size {r.block}, from that plan: the largest of {'/'.join(map(str, tried))} that "
                       f"leaves no linear dense that {tried[-1]} would pack")
        if self.exl3 is not None:
            out.append(f"EXL3 at {r.exl3_bits:g} bits per weight ({r.exl3_codebook}): {self.exl3.summary()}")
        return out


def plan_checkpoint(files: dict[str, list[str]], src: Path, recipe: Recipe, *, choose_block: bool) -> Plan:
    """The run's plan over `files` (shard -> keys). choose_block: pick the fp8 block / w4a16 or int group with
    `auto_block` instead of recipe.block."""
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for name, keys in files.items():
        with safe_open(src / name, "pt") as f:
            for k in keys:
                header = f.get_slice(k)
                shapes[k], dtypes[k] = tuple(header.get_shape()), header_dtype(header)
    done = set(quantized_modules(shapes, dtypes.__getitem__))  # modules quantized in the input: copied as they are
    free = [(k, s) for k, s in shapes.items() if k.rpartition(".")[0] not in done]
    if choose_block and recipe.block is not None:
        recipe = dataclasses.replace(recipe, block=auto_block(recipe, free))
    targets = {k: fmt for k, s in free if (fmt := recipe.format_for(k, s)) is not None}
    if not targets:
        raise ValueError(_nothing_fits(recipe))
    exl3 = [k for k, fmt in targets.items() if fmt == "exl3"]
    bits = exl3_bits.plan({k: shapes[k][0] * shapes[k][1] for k in exl3}, recipe.exl3_bits,
                          recipe.exl3_codebook) if exl3 else None
    return Plan(recipe, targets, bits, shapes, done)


def _nothing_fits(recipe: Recipe) -> str:
    tiles = " / ".join(f"{f} {'x'.join(map(str, tile_shape(f, recipe.block_for(f))))}" for f in recipe.formats)
    hint = (" (the default make-tiny model is 64 wide; `make-tiny --preset exl3` writes one whose MLPs are 128 and "
            "512 wide)" if "exl3" in recipe.formats else "")
    return (f"no linear fits {'+'.join(recipe.formats)}: a linear is packed only when it is whole tiles ({tiles}) "
            f"and so is each of its {recipe.virtual} virtual shards{hint}")


def _generator(key: str) -> torch.Generator:
    """A per-key generator (EXL3's sign vectors): the output depends on the key, not on the order of the run."""
    seed = int.from_bytes(hashlib.sha256(f"twinspark-quantize/{key}".encode()).digest()[:8], "little") >> 1
    return torch.Generator().manual_seed(seed)


def _earlier_runs(src: Path, recipe: Recipe, old: dict[str, Any] | None, group_fixed: bool) -> tuple[Recipe, bool]:
    """`recipe` against the formats `src` already stores (its quantization_config `old`): one it has is refused, but
    for the int formats, which take the group size of the int linears `src` has (a checkpoint has one), e.g. int4 for
    the rest of an `--experts-only` int3 checkpoint (a different group asked for, `group_fixed`, is refused). Also
    whether that group was taken."""
    earlier = by_method(old)
    ints = [f for f in recipe.formats if codec_format(f)[0] == INT_CODEC]
    for fmt in recipe.formats:
        if fmt not in ints and CODECS[codec_format(fmt)[0]].quant_method in earlier:
            raise ValueError(f"{src} is already {fmt}; quantize its dense original instead")
    int_config = earlier.get(CODECS[INT_CODEC].quant_method)
    if not ints or int_config is None:
        return recipe, False
    group = int(int_config["group_size"])
    if group_fixed and recipe.block_for(ints[0]) != group:
        raise ValueError(f"{src} stores its int linears in groups of {group}, and a checkpoint has one group size: "
                         f"quantize with --block-size {group} (or --format {ints[0]}:g{group}), or give neither and "
                         f"its group is used")
    return dataclasses.replace(recipe, group=group), True


def quantize_checkpoint(src: str | Path, dst: str | Path, recipe: Recipe, *, device: str = "cpu",
                        progress: bool = True, choose_block: bool = False,
                        log: Callable[[str], None] | None = None) -> Summary:
    """Store `src`'s linears in `recipe`'s formats (one or several: a recipe in one run) into `dst`. choose_block:
    the fp8 block / w4a16 or int group from the shard plan (select.auto_block) instead of recipe.block (an input that
    has int linears already sets the int group). log: gets the plan's lines before any tensor is quantized."""
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise ValueError("--out must differ from --model (the input is read while the output is written)")
    config = json.loads((src / "config.json").read_text())
    old = config.get("quantization_config")
    recipe, int_earlier = _earlier_runs(src, recipe, old, recipe.group is not None or not choose_block)
    files = _source_files(src)
    plan = plan_checkpoint(files, src, recipe, choose_block=choose_block)
    recipe = plan.recipe
    for line in plan.lines(choose_block) if log else ():
        log(line)
    if int_earlier and log:
        log(f"groups of {recipe.group}: the group size of the int linears {src} already has (one per checkpoint)")
    dst.mkdir(parents=True, exist_ok=True)
    for stale in [*dst.glob("*.safetensors"), dst / INDEX, dst / exl3_config.STORAGE_FILE]:
        stale.unlink(missing_ok=True)

    summary = Summary(already=len(plan.done))
    weight_map: dict[str, str] = {}
    bar = tqdm(total=sum(len(k) for k in files.values()), desc=f"quantizing to {'+'.join(recipe.formats)}",
               unit="tensor", disable=not progress)
    try:
        for name, keys in files.items():
            out: dict[str, torch.Tensor] = {}
            with safe_open(src / name, "pt") as f:
                for key in keys:
                    t = f.get_tensor(key)
                    summary.bytes_in += t.numel() * t.element_size()
                    target = plan.targets.get(key)
                    if target is None:
                        out[key] = t
                        summary.kept += key.rpartition(".")[0] not in plan.done
                    else:
                        codec, int_bits = codec_format(target)
                        q = quantize(t.to(device), codec, block=recipe.block_for(target),
                                     codebook=recipe.exl3_codebook,
                                     bits=plan.exl3.bits[key] if codec == "exl3" else int_bits,
                                     generator=_generator(key))
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
    if plan.exl3 is not None:
        exl3_config.write_storage(dst, exl3_config.quant_config(plan.exl3, recipe.exl3_codebook),
                                  exl3_config.tensor_storage(plan.exl3, plan.shapes, recipe.exl3_codebook))
    config["quantization_config"] = recipe_quant_config(recipe, set(plan.targets.values()), plan.exl3, old)
    (dst / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    for p in src.iterdir():  # tokenizer, chat template, generation config, ...
        if p.is_file() and p.name not in ("config.json", INDEX) and p.suffix != ".safetensors":
            shutil.copy2(p, dst / p.name)
    return summary
