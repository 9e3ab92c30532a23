"""A checkpoint's `quantization_config` (config.json): which formats it declares and each one's settings.

The format of each linear is read from its stored tensors (weights.py), so one checkpoint may mix formats and keep
some modules in bf16; this file only supplies each format's settings (fp8 `weight_block_size`, w4a16 and int
`group_size`, exl3 `bits`) and refuses methods twinspark cannot read. A converter that re-quantizes a quantized
checkpoint keeps the earlier config under `original_quantization_config` (exllamav3 does the same), so nested
configs are read too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kernels.quant import BY_METHOD

NESTED = "original_quantization_config"


def read_quant_configs(model_dir: str | Path) -> dict[str, dict[str, Any]]:
    """quant_method -> its config dict, for every config in the checkpoint's config.json ({} = not quantized)."""
    path = Path(model_dir) / "config.json"
    raw = json.loads(path.read_text())
    found = by_method(raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config"))
    for method in found:
        if method not in BY_METHOD:
            raise ValueError(f"{path}: quantization_config.quant_method {method!r} is not supported (twinspark reads "
                             f"{', '.join(sorted(BY_METHOD))})")
    return found


def by_method(qcfg: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """quant_method -> its config, for `qcfg` and every config nested in it (the outermost one of a method wins)."""
    found: dict[str, dict[str, Any]] = {}
    while qcfg:
        found.setdefault(qcfg.get("quant_method"), qcfg)
        qcfg = qcfg.get(NESTED)
    return found


def nest(new: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
    """`new` with an earlier config `old` kept under `original_quantization_config`; an `old` of new's own method
    (the int format quantized in two runs, e.g. int3 experts, then int4 for the rest) gives way to `new`, which
    keeps what `old` nested."""
    if old and old.get("quant_method") == new.get("quant_method"):
        old = old.get(NESTED)
    return {**new, NESTED: old} if old else new
