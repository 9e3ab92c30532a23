"""What the offline model benches (bench.decode_prefill, bench.drafts_cost, bench.long_context) share: their common
flags, the device / dtype / spec a run builds the bench model at and the facts every results file states about it,
running out of memory as a result rather than a crash, the experts a step routes to, and the run's last words."""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import flags
from bench.output import RESULTS, RunFiles, args_record
from bench.random_weights import bench_spec, spec_dims
from bench.timing import log
from kernels import moe
from model.checkpoint.spec import TinySpec
from services.common import shared_flags as shared

try:
    from kernels.gpu import moe as gpu_moe
except ImportError:  # no Triton: the CPU path only
    gpu_moe = None

BLOCK = 16  # KV block size of the benches' caches
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def add_flags(p: argparse.ArgumentParser, bench: str, tiny: str) -> None:
    """The flags every model bench takes: the bench model's shape, device, dtypes and seed, and where it writes
    (`tiny`: this bench's help for --tiny)."""
    for spec in (flags.LAYERS, flags.LAYER_PATTERN, flags.DTYPE, flags.DEVICE, flags.KV_CACHE_DTYPE, flags.VIRTUAL,
                 flags.SEED):
        flags.add(p, spec)
    flags.add(p, flags.TINY, tiny)
    flags.add(p, flags.OUT)
    p.add_argument("--name", default=None, help=f"file stem (default {bench}-<date>)")


def add_step_flags(p: argparse.ArgumentParser) -> None:
    """How the bench model's steps run, for the benches that time decode steps: packed weights, CUDA graphs."""
    flags.add(p, shared.RANDOM_WEIGHTS, "draw the linears a quantize recipe selects packed (e.g. w4a16+bf16, "
              "exl3:2.5+fp8; see serve-rank --help)", metavar="RECIPE")
    flags.add(p, shared.ENFORCE_EAGER, "time decode steps eagerly only (on a GPU they are timed as CUDA graph "
              "replays by default, as serve-rank runs them)")


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def random_tokens(n: int, vocab: int, gen: torch.Generator) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


def si(x: float, unit: str = "", digits: int = 3) -> str:
    """1.23 G / 45.6 M / 789 k style numbers, so tiny and real runs both print readably."""
    for div, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.{digits}g} {prefix}{unit}"
    return f"{x:.{digits}g} {unit}".rstrip()


@contextmanager
def count_experts(real_rows: int, record: list[dict]) -> Iterator[list[dict]]:
    """Record, per MoE call, the distinct routed experts chosen by the batch's real rows (and by all rows: the CPU
    path pads batch-wide tensors to 64 rows and routes the padding too; the GPU path never routes padding). Patches
    both routers; the GPU one lists the shared expert (index E) last and padding pairs as E + 1."""
    original, original_gpu = moe.route, gpu_moe.route if gpu_moe is not None else None

    def route(x, *args, **kwargs):
        ids, w = original(x, *args, **kwargs)
        record.append({"real": int(torch.unique(ids[:real_rows]).numel()), "all_rows": int(torch.unique(ids).numel())})
        return ids, w

    def route_gpu(logits, *args, **kwargs):
        ids, w = original_gpu(logits, *args, **kwargs)
        routed = ids[:, :-1]
        n = int(torch.unique(routed[:real_rows]).numel())
        record.append({"real": n, "all_rows": int(torch.unique(routed[routed < logits.shape[1]]).numel())})
        return ids, w

    moe.route = route
    if gpu_moe is not None:
        gpu_moe.route = route_gpu
    try:
        yield record
    finally:
        moe.route = original
        if gpu_moe is not None:
            gpu_moe.route = original_gpu


def experts_per_layer(spec: TinySpec, real_rows: int, forward: Callable[[], object]) -> list[dict]:
    """Per MoE layer, the distinct routed experts one call of `forward` picks (`count_experts`' records)."""
    hits: list[dict] = []
    with count_experts(real_rows, hits):
        forward()
    moe_layers = sum(1 for m in spec.mlp_layer_types if m == "sparse")
    return hits[-moe_layers:] if moe_layers else []


@dataclass
class Setup:
    device: torch.device
    dtype: torch.dtype
    spec: TinySpec
    meta: dict  # what every bench's results say about the run
    started: float  # perf_counter at the start: time budgets and the run's total
    out_dir: Path
    stem: str  # the results files' name: --name, else <bench>-<start time>


def setup(args: argparse.Namespace, bench: str) -> Setup | None:
    """The bench model's device, dtype and spec (--device, --dtype, --tiny, --layers, --layer-pattern, --seed), the
    run's common facts and its results files; None (after saying why) for real dimensions on the CPU."""
    started, now = time.perf_counter(), dt.datetime.now()
    device = torch.device(args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda"))
    if device.type == "cpu" and not args.tiny:
        print("refusing to build real-dimension weights on the CPU (tens of GB); use --tiny or a GPU",
              file=sys.stderr)
        return None
    dtype = DTYPES[args.dtype or ("float32" if args.tiny else "bfloat16")]
    torch.manual_seed(args.seed)
    spec = bench_spec(layers=args.layers, layer_pattern=args.layer_pattern, tiny=args.tiny)
    meta = {
        "date": now.isoformat(timespec="seconds"),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "tiny": args.tiny,
        "dtype": str(dtype).removeprefix("torch."),
        "kv_cache_dtype": args.kv_cache_dtype,
        "layers": spec.num_hidden_layers,
        "layer_pattern": spec.layer_pattern,
        "virtual": args.virtual,
        "seed": args.seed,
        "dims": spec_dims(spec),
        "args": args_record(args),
    }
    return Setup(device, dtype, spec, meta, started, args.out or RESULTS, args.name or f"{bench}-{now:%Y%m%d-%H%M%S}")


def finish(res: RunFiles, run: Setup) -> int:
    """The end of a run: its total time, the results written and printed."""
    run.meta["total_s"] = time.perf_counter() - run.started
    res.write()
    print()
    print(res.markdown())
    log(f"wrote {res.json_path} and {res.md_path} ({run.meta['total_s']:.0f} s)")
    return 0
