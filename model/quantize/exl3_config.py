"""What an EXL3 checkpoint says about itself, in exllamav3's spellings (its converter writes both files; its loader
reads neither: each linear's rate comes from its trellis' last dim, 16 x bits words, and the codebook from the
`mcg` / `mul1` marker tensor beside it).

- config.json `quantization_config`: {"quant_method": "exl3", "bits": the average over the EXL3 linears, "head_bits":
  16 (lm_head stays dense), "codebook", "calibration": null (twinspark's encoder uses none)}.
- quantization_config.json: the same dict plus "tensor_storage": per EXL3 module its stored tensors (shape, bytes,
  dtype), "quant_format": "exl3", "bits_per_weight" and the codebook's multiplier, so what each linear got is
  readable without opening the shards.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from kernels.quant import exl3
from model.quantize.bits import BitPlan

STORAGE_FILE = "quantization_config.json"
HEAD_BITS = 16  # exllamav3's "stored unquantized"


def quant_config(plan: BitPlan, codebook: str) -> dict[str, Any]:
    avg = round(plan.average, 2)
    return {"quant_method": exl3.QUANT_METHOD, "bits": int(avg) if avg.is_integer() else avg, "head_bits": HEAD_BITS,
            "codebook": codebook, "calibration": None}


def tensor_storage(plan: BitPlan, shapes: dict[str, tuple[int, int]], codebook: str) -> dict[str, dict[str, Any]]:
    """Module -> its exllamav3 `tensor_storage` entry, from each planned weight key's [out, in] (no tensor read)."""
    storage = {}
    for key, bits in sorted(plan.bits.items()):
        module = key.removesuffix(".weight")
        out, inp = shapes[key]
        stored = {"trellis": ((inp // exl3.TILE, out // exl3.TILE, int(exl3.TILE * bits)), torch.int16),
                  "suh": ((inp,), torch.float16), "svh": ((out,), torch.float16),
                  **{name: ((), torch.int32) for name in exl3.marker(codebook)}}
        tensors = {f"{module}.{name}": {"shape": list(shape), "n_bytes": math.prod(shape) * dtype.itemsize,
                                        "dtype": str(dtype)} for name, (shape, dtype) in stored.items()}
        entry: dict[str, Any] = {"stored_tensors": tensors, "quant_format": "exl3", "bits_per_weight": bits}
        if codebook in exl3.MARKERS:
            entry[f"{codebook}_multiplier"] = exl3.MARKERS[codebook]
        storage[module] = entry
    return storage


def write_storage(out_dir: Path, qcfg: dict[str, Any], storage: dict[str, dict[str, Any]]) -> Path:
    path = Path(out_dir) / STORAGE_FILE
    path.write_text(json.dumps({**qcfg, "tensor_storage": storage}, indent=2) + "\n")
    return path
