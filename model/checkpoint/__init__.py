"""`make-tiny`: a tiny GLM-5.3-Flash checkpoint with the real architecture, key names and file layout.

Tests, CI and local development need a checkpoint that every loader (ours, transformers, exllamav3) reads like the
real one but that loads in a second on a CPU. This package writes one from scratch, with no transformers import:
config.json + generation_config.json (release spellings), processor_config.json, sharded safetensors + index, a
small byte-level BPE tokenizer with GLM's special tokens, and a GLM-5 chat template. Everything is deterministic in
`seed`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from model.quantize import exl3_config
from model.quantize.select import Recipe

from .config_builder import generation_config, model_config, preprocessor_config, processor_config, round_up
from .presets import PRESETS
from .quantized import Packing, dims_for, make_tensors
from .shards import INDEX_NAME, plan_shards, write_shards
from .spec import TinySpec, default_layer_pattern
from .tensor_spec import TensorSpec
from .tokenizer_builder import PAD_TOKEN, STOP_TOKENS, build_tokenizer, token_ids, write_tokenizer
from .weights import TEXT, all_tensors

__all__ = ["DTYPES", "PRESETS", "TinyCheckpoint", "TinySpec", "default_layer_pattern", "make_tiny",
           "write_tiny"]

DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}
VOCAB_MULTIPLE = 64  # embedding rows are padded like the release's (154,880 rows > tokens in use)
SHARDS_TARGET = 3  # default: about 3 shards, so even the default checkpoint takes the multi-shard loading path


@dataclass(frozen=True)
class TinyCheckpoint:
    """What `write_tiny` produced, for the CLI to report and tests to inspect."""

    path: Path
    spec: TinySpec
    files: tuple[Path, ...]
    num_params: int  # every stored tensor, vision tower and MTP block included
    num_text_params: int  # the text model without MTP and vision (what a forward pass uses)
    dtype: str
    format: str = "dense"  # or the quantize recipe it was written in
    preset: str = "default"
    group: int | None = None  # the int formats' group size


def write_tiny(out_dir: str | Path, *, seed: int = 0, layers: int = 8, experts: int = 8, index_topk: int = 64,
               layer_pattern: str | None = None, indexer_pattern: str | None = None, dtype: str = "bfloat16",
               max_shard_bytes: int | None = None, progress: bool = True, format: str = "dense",
               exl3_bits: float = 4, exl3_codebook: str = "mul1", int_group: int | None = None,
               preset: str = "default") -> TinyCheckpoint:
    """Write a tiny checkpoint into `out_dir` (created if missing) and describe what was written.

    format: "dense" (every tensor in `dtype`), "exl3" (wider MLPs stored as random EXL3 trellises at an average of
    `exl3_bits` bits per weight, each linear's rate by quantize/bits.py, with codebook `exl3_codebook`), an int
    format, "int2" / "int3" / "int4" / "int8" (wider experts, every linear that fits stored as random codes in
    groups of `int_group`, None: quantize's choice), or any quantize recipe of them and fp8 / w4a16 ("int3+fp8+fp8");
    see quantized.py. preset: a named set of dimensions (presets.py), e.g. "exllamav3" for the smallest model
    exllamav3 runs whole."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    recipe = None if format == "dense" else Recipe.parse(format, exl3_bits=exl3_bits, exl3_codebook=exl3_codebook,
                                                         group=int_group)
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    torch_dtype = DTYPES[dtype]
    # Validate the options (TinySpec and the packing plan raise ValueError) before touching the output folder.
    spec = TinySpec.tiny(num_hidden_layers=layers, n_routed_experts=experts, index_topk=index_topk,
                    layer_pattern=layer_pattern or "", indexer_pattern=indexer_pattern or "",
                    **{**dims_for(recipe), **PRESETS[preset]})
    tok = build_tokenizer()
    spec = dataclasses.replace(spec, vocab_size=round_up(tok.get_vocab_size(), VOCAB_MULTIPLE))
    specs = all_tensors(spec)
    packing = Packing.plan(recipe, specs) if recipe is not None else None

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Remove shards from an earlier run into the same folder: a stale model-0000k-of-0000n would confuse loaders.
    for old in [*out.glob("model*.safetensors"), out / INDEX_NAME, out / exl3_config.STORAGE_FILE]:
        if old.exists():
            old.unlink()
    qcfg = packing.quantization_config() if packing is not None else None
    files = write_model_files(out, spec, tok, dtype=dtype, quantization_config=qcfg)
    if packing is not None and packing.exl3 is not None:
        shapes = {s.key: s.shape for s in specs}
        storage = exl3_config.tensor_storage(packing.exl3, shapes, exl3_codebook)
        files.append(exl3_config.write_storage(out, qcfg, storage))

    total = sum(s.nbytes(torch_dtype) for s in specs)
    if max_shard_bytes is None:
        # total/3 plus one largest tensor: greedy packing then fills every shard but the last past total/3,
        # so there are 2-3 shards and no sliver of a last shard.
        max_shard_bytes = -(-total // SHARDS_TARGET) + max(s.nbytes(torch_dtype) for s in specs)
    shards = plan_shards(specs, torch_dtype, max_shard_bytes)
    files += write_shards(out, shards, torch_dtype, lambda s: make_tensors(s, seed, torch_dtype, packing),
                          progress=progress)

    return TinyCheckpoint(
        path=out,
        spec=spec,
        files=tuple(files),
        num_params=sum(s.numel for s in specs),
        num_text_params=sum(s.numel for s in specs if _is_text(s, spec)),
        dtype=dtype,
        format=format,
        preset=preset,
        group=packing.group if packing is not None else None,
    )


def write_model_files(out: Path, spec: TinySpec, tok: Tokenizer, *, dtype: str,
                      quantization_config: dict | None = None) -> list[Path]:
    """Everything of a checkpoint but its weights: config.json (+ `quantization_config`), generation and processor
    configs, the tokenizer and chat template. Also what a `--random-weights` model directory holds."""
    ids = token_ids(tok)
    pad_id = ids[PAD_TOKEN]
    eos_ids = [ids[t] for t in STOP_TOKENS]
    cfg = model_config(spec, token_ids=ids, pad_token_id=pad_id, eos_token_ids=eos_ids, dtype=dtype)
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    return [_write_json(out / "config.json", cfg),
            _write_json(out / "generation_config.json", generation_config(pad_token_id=pad_id, eos_token_ids=eos_ids)),
            _write_json(out / "preprocessor_config.json", preprocessor_config(spec)),
            _write_json(out / "processor_config.json", processor_config(spec)),
            *write_tokenizer(tok, out)]


def make_tiny(out_dir: str | Path, *, seed: int = 0, layers: int = 8, experts: int = 8, index_topk: int = 64,
              layer_pattern: str | None = None, indexer_pattern: str | None = None, dtype: str = "bfloat16",
              max_shard_bytes: int | None = None, progress: bool = False, format: str = "dense",
              exl3_bits: float = 4, exl3_codebook: str = "mul1", int_group: int | None = None,
              preset: str = "default") -> Path:
    """Write a tiny GLM-5.3-Flash checkpoint to `out_dir` and return its path.

    layer_pattern: one letter per layer, K = KDA linear attention, M = MLA with DSA indexer (default: M iff i % 4 == 3).
    indexer_pattern: one letter per layer, F = full indexer, S = reuse the nearest earlier full layer's selection
    (default: all F). max_shard_bytes: shard cap (default: about a third of the total, so the default checkpoint
    has 2-3 shards). format / exl3_bits / exl3_codebook / int_group / preset: see `write_tiny`.
    """
    return write_tiny(out_dir, seed=seed, layers=layers, experts=experts, index_topk=index_topk,
                      layer_pattern=layer_pattern, indexer_pattern=indexer_pattern, dtype=dtype,
                      max_shard_bytes=max_shard_bytes, progress=progress, format=format, exl3_bits=exl3_bits,
                      exl3_codebook=exl3_codebook, int_group=int_group, preset=preset).path


def _is_text(t: TensorSpec, spec: TinySpec) -> bool:
    """True for the tensors a plain forward pass uses: not the vision tower, not the MTP block(s) after the last layer."""
    if t.key.startswith("model.visual."):
        return False
    if t.key.startswith(f"{TEXT}layers."):
        return int(t.key[len(f"{TEXT}layers."):].split(".", 1)[0]) < spec.mtp_layer_index
    return True


def _write_json(path: Path, obj: dict) -> Path:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    return path
