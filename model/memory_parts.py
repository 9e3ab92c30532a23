"""The bytes a loaded model holds on its device, by part of the model: the table a user reads to see where one
GPU's memory went (routed experts, attention, embeddings, ...) beside the KV pool the rest became.

Walks the model's objects rather than asking each block for its size: a block that gains a tensor is counted
without anyone remembering to add it. Each storage is counted once (views, and the stacks that share one buffer),
under the part of the first path that reaches it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

# Parts in the order a report lists them. A tensor belongs to the first rule whose test its path passes.
_HEAD = "weights by part (MiB):"
PARTS = ("routed experts", "shared experts", "dense MLPs", "routers", "KDA attention", "MLA attention + indexer",
         "embeddings", "lm_head", "MTP block", "vision tower", "norms + mHC", "collective buffers")


def _part(path: tuple[tuple[str, str], ...]) -> str:
    """The part of a tensor reached through `path`: (attribute, owner's class name) pairs from the model down."""
    names = [a for a, _ in path]
    owners = [c for _, c in path]
    if names[0] == "vision":
        return "vision tower"
    if names[0] == "mtp":
        return "MTP block"
    if names[0] == "coll":
        return "collective buffers"
    if names[0] == "embed":
        return "embeddings"
    if names[0] == "lm_head":
        return "lm_head"
    if "MoeParams" in owners:  # the MoE's record: its router and bias, the expert stacks
        return "routers" if names[owners.index("MoeParams")] in ("router", "bias") else "routed experts"
    if "Moe" in owners:  # the shared expert run beside the stacks (Moe.shared_apart)
        return "shared experts"
    if "DenseMlp" in owners:
        return "dense MLPs"
    if "KdaAttention" in owners:
        return "KDA attention"
    if "MlaAttention" in owners or "IndexerParams" in owners:
        return "MLA attention + indexer"
    return "norms + mHC"


def children(obj: object) -> Iterator[tuple[str, object]]:
    """The named objects one step inside `obj` that a walk of the model follows (also model/rest_kernel.py's)."""
    if isinstance(obj, (list, tuple)):
        yield from ((str(i), v) for i, v in enumerate(obj))
    elif isinstance(obj, dict):
        yield from ((str(k), v) for k, v in obj.items())
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        yield from ((f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj))
    elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("model", "kernels"):
        yield from vars(obj).items()


def _tensors(obj: object, path: tuple[tuple[str, str], ...], seen: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield _part(path), obj
        return
    if id(obj) in seen:
        return
    seen.add(id(obj))
    for name, child in children(obj):
        yield from _tensors(child, (*path, (name, type(obj).__name__)), seen)


def bytes_by_part(model: object, device: torch.device | None = None) -> dict[str, int]:
    """{part: bytes} of the distinct storages on `device` (every device when None) that `model`'s objects reach,
    in PARTS order, parts holding nothing left out."""
    counted: dict[str, int] = {}
    storages: set[tuple[torch.device, int]] = set()
    for name, obj in vars(model).items():
        for part, t in _tensors(obj, ((name, type(model).__name__),), set()):
            if (device is not None and t.device != device) or t.numel() == 0:
                continue
            key = (t.device, t.untyped_storage().data_ptr())
            if key in storages:
                continue
            storages.add(key)
            counted[part] = counted.get(part, 0) + t.untyped_storage().nbytes()
    return {p: counted[p] for p in PARTS if p in counted}


def line(parts: dict[str, int]) -> str:
    """One log line: `weights by part (MiB): routed experts 113468.2, ...; total 128410.0`, the form bench reads
    back (`parse`)."""
    mib = ", ".join(f"{p} {b / 2**20:.1f}" for p, b in parts.items())
    return f"{_HEAD} {mib}; total {sum(parts.values()) / 2**20:.1f}"


def parse(text: str) -> dict[str, float] | None:
    """{part: MiB, ..., "total": MiB} from the last `line` in a log's text, None when it has none."""
    at = text.rfind(_HEAD)
    if at < 0:
        return None
    body = text[at + len(_HEAD):].split("\n", 1)[0]
    parts, total = body.rsplit("; total ", 1)
    out = {name.strip(): float(v) for name, v in (p.rsplit(" ", 1) for p in parts.split(", ") if p)}
    return {**out, "total": float(total)}
