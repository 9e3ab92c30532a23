"""Load a DFlash2 checkpoint (config.json + safetensors, single file or sharded with an index) into a
`DFlashDrafter`, checking every tensor's name and shape against the config before any is used."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import DFlashConfig
from .drafter import DFlashDrafter

INDEX_NAME = "model.safetensors.index.json"
DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class DFlashWeightsError(ValueError):
    """A checkpoint's tensors do not fit its config: missing, unexpected or misshapen tensors, all named."""


def expected_shapes(config: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Published tensor name -> shape for `config` (the module's parameter names are the published names)."""
    with torch.device("meta"):
        drafter = DFlashDrafter(config)
    return {name: tuple(t.shape) for name, t in drafter.state_dict().items()}


def check_shapes(found: dict[str, tuple[int, ...]], config: DFlashConfig, source: str) -> None:
    """Raise DFlashWeightsError naming every tensor of `found` (name -> shape) that is missing, unexpected or of
    the wrong shape for `config`; `source` names the checkpoint in the message."""
    want = expected_shapes(config)
    problems = [f"tensor {n} has shape {list(found[n])}, expected {list(s)}"
                for n, s in want.items() if n in found and tuple(found[n]) != s]
    problems += [f"tensor {n} (shape {list(s)}) is missing" for n, s in want.items() if n not in found]
    problems += [f"tensor {n} (shape {list(found[n])}) is not a DFlash2 drafter tensor"
                 for n in found if n not in want]
    if problems:
        raise DFlashWeightsError(f"{source}: " + "; ".join(problems))


def _weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX_NAME
    if index.exists():
        return sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise DFlashWeightsError(f"{folder}: no safetensors files")
    return files


def load_drafter(folder: str | Path, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> DFlashDrafter:
    """Build the drafter `folder`'s config.json describes and load its safetensors into it, in `dtype`."""
    folder = Path(folder)
    config = DFlashConfig.from_file(folder)
    tensors: dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    check_shapes({n: tuple(t.shape) for n, t in tensors.items()}, config, str(folder))
    with torch.device("meta"):
        drafter = DFlashDrafter(config)
    drafter.load_state_dict({n: t.to(dtype) for n, t in tensors.items()}, strict=True, assign=True)
    return drafter.to(device).eval()


def save_checkpoint(out_dir: str | Path, config: DFlashConfig, tensors: dict[str, torch.Tensor], *,
                    dtype: str = "float32") -> list[Path]:
    """Write a checkpoint `load_drafter` (and the published loaders) read: config.json in the published spellings
    and one model.safetensors of `tensors` (published names) in `dtype`; return the files written. The bytes
    depend only on the arguments."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    check_shapes({n: tuple(t.shape) for n, t in tensors.items()}, config, str(out_dir))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "config.json"
    config_path.write_text(json.dumps({**config.to_dict(), "torch_dtype": dtype}, indent=2, sort_keys=True) + "\n")
    weights_path = out / "model.safetensors"
    save_file({n: t.detach().to(DTYPES[dtype]).contiguous() for n, t in tensors.items()}, str(weights_path),
              metadata={"format": "pt"})
    return [config_path, weights_path]
