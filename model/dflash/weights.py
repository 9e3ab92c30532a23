"""Load a DFlash2 checkpoint (config.json + safetensors, single file or sharded with an index) into a
`DFlashDrafter`, checking every tensor's name and shape against the config before any is used."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from .config import DFlashConfig
from .drafter import DFlashDrafter

INDEX_NAME = "model.safetensors.index.json"


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
