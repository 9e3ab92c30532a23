"""What changes bits, hashed: ranks compare it at start and refuse to run a group whose members differ."""

from __future__ import annotations

import hashlib
import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
import torch.distributed as dist


def _file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.exists() else "missing"


def settings(*, model_dir: str | Path, world: int, dtype: torch.dtype, device: str, virtual_shards: int,
             num_blocks: int | str, block_size: int, num_slots: int, kv_dtype: torch.dtype | None,
             random_weights: str = "", rest_fp8_kernel: str = "triton") -> dict[str, str]:
    """Every setting that changes a rank's arithmetic or memory layout, by name. random_weights: how the weights
    are drawn when they are not read from the checkpoint ("" = they are read). num_blocks: the flag's count, or
    "auto" when each rank sizes its pool from its own memory (the ranks then agree on one count, pool_size.agree)."""
    d = Path(model_dir)
    try:
        ours = version("twinspark")
    except PackageNotFoundError:
        ours = "source"
    return {
        "config.json": _file_hash(d / "config.json"),
        "weights index": _file_hash(d / "model.safetensors.index.json"),
        "random weights": random_weights or "no",
        "dtype": str(dtype).removeprefix("torch."),
        # Resolved storage, so aliases (fp8 / fp8_e4m3, auto / the compute dtype) that store the same bits agree.
        "kv cache dtype": str(kv_dtype or dtype).removeprefix("torch."),
        "rest fp8 kernel": rest_fp8_kernel,
        "device": device.split(":")[0],
        "tp world": str(world),
        "virtual shards": str(virtual_shards),
        "cache blocks": str(num_blocks),
        "block size": str(block_size),
        "state slots": str(num_slots),
        "twinspark": ours,
        "torch": torch.__version__,
    }


def fingerprint(values: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()


# Settings that size the pool but leave every cached row's bits alone: a disk KV tier survives changing them.
_POOL_SIZING = ("cache blocks", "state slots")
_SAMPLE = 1 << 16


def weights_sample(model_dir: str | Path) -> str:
    """A cheap digest of the weight files' contents: each file's name, size and first and last 64 KiB. Two
    checkpoints with the same config and tensor names (e.g. make-tiny with another seed) differ here, and reading
    it costs milliseconds even for a 600 GB checkpoint."""
    h = hashlib.sha256()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            h.update(f.read(_SAMPLE))
            f.seek(max(0, size - _SAMPLE))
            h.update(f.read(_SAMPLE))
    return h.hexdigest()


def cache_key(values: dict[str, str], model_dir: str | Path) -> str:
    """What a cached block's bits depend on (the KV disk tier's directory name): the settings fingerprint without
    the pool's size, plus the weights' contents."""
    kept = {k: v for k, v in values.items() if k not in _POOL_SIZING}
    return fingerprint({**kept, "weights sample": weights_sample(model_dir)})


def check_group(values: dict[str, str], rank: int, world: int, token_digest: str = "") -> None:
    """All-gather every rank's settings; raise naming each setting that differs (on every rank alike).
    `token_digest` (internal_auth.group_digest) is compared too, and never printed: a rank started with another
    internal token is refused like one with other settings."""
    if world == 1:
        return
    pairs: list[tuple[dict[str, str], str] | None] = [None] * world
    dist.all_gather_object(pairs, (values, token_digest))
    gathered = [p[0] for p in pairs if p is not None]
    others = [r for r, p in enumerate(pairs) if p is not None and p[1] != token_digest]
    if others:
        raise RuntimeError(f"rank {rank} and rank(s) {others} were started with different internal tokens; refusing "
                           "to start (give every role the same --internal-token / TWINSPARK_INTERNAL_TOKEN)")
    diffs = []
    for key in sorted(values):
        seen = {r: g.get(key) for r, g in enumerate(gathered) if g is not None}
        if len(set(seen.values())) > 1:
            diffs.append(f"{key}: " + ", ".join(f"rank {r}={v}" for r, v in seen.items()))
    if diffs:
        raise RuntimeError("ranks disagree on settings that change results; refusing to start:\n  " + "\n  ".join(diffs))
