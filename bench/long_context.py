"""Long-context prefill of our model runtime: TTFT and prefill tok/s from 8k to 1M tokens, with the memory it takes.

Random weights at the real GLM-5.3-Flash layer dimensions (bench/random_weights.py; default 4 layers: 3 KDA + 1
MLA/DSA), drawn on the device. For each prompt length, one sequence is prefilled in grid-aligned chunks of `--chunk`
tokens (as the scheduler cuts a long prompt) into a pool sized for it, and timed from the first chunk to the first
token's logits (TTFT at the runtime, without HTTP or queueing). Measured per length:
- TTFT and prefill tok/s;
- the pool's bytes, and the peak memory beyond the weights and the pool ("working" memory: activations, indexer
  scores, selections): flat in the prompt length when no buffer grows with the context. On a GPU: the allocator's
  peak (torch.cuda.max_memory_allocated), reset per length. On the CPU: the C heap in use (glibc's mallinfo2, where
  torch's CPU tensors live), sampled every 5 ms during the prefill, less what it was before.
Also: the pool's bytes per token by KV dtype, for the bench model and for the whole model (45 layers, 11 MLA).
Results (json + md) go to --out, written after every length so a timeout keeps what was measured.

    python -m bench.long_context --out $OUT          # on a GPU: 8k, 64k, 256k, 1M
    python -m bench.long_context --tiny              # CPU smoke test with make-tiny dimensions (1k, 4k, 16k)
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import threading
import time
from collections.abc import Callable

import torch

from bench import flags
from bench.model_run import BLOCK, Setup, add_flags, finish, is_oom, random_tokens, setup, si
from bench.output import RunFiles
from bench.random_weights import bench_config, bench_spec, build_model
from bench.timing import log, sync
from model.batch import Batch
from model.parallel import Sharding
from model.row_store import KV_CACHE_DTYPES
from services.rank_worker.pool_size import pool_cost

KDA_GRID = 64  # prefill chunks start on this grid (docs/design.md §5.5), as the scheduler cuts prompts
RELEASE_LAYERS = 45


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = flags.parser("bench.long_context", __doc__)
    p.add_argument("--lengths", type=flags.ints, default=None,
                   help="prompt lengths (default 8192,65536,262144,1048576; with --tiny 1024,4096,16384)")
    p.add_argument("--chunk", type=int, default=None,
                   help=f"prefill chunk in tokens, a multiple of {KDA_GRID} (default 4096; with --tiny 1024)")
    flags.add(p, flags.BUDGET_S, "skip lengths not started after this many seconds (default 540)", default="540")
    add_flags(p, "long_context", flags.TINY.help)
    args = p.parse_args(argv)
    args.lengths = args.lengths or ([1024, 4096, 16384] if args.tiny else [8192, 65536, 262144, 1048576])
    args.chunk = args.chunk or (1024 if args.tiny else 4096)
    if args.chunk % KDA_GRID:
        p.error(f"--chunk must be a multiple of {KDA_GRID} (the KDA prefill grid)")
    return args


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_in_use() -> Callable[[], int]:
    """Bytes the C heap has handed out (glibc's mallinfo2: small blocks + mmapped ones), which is where torch's CPU
    tensors live; the resident set where glibc has no mallinfo2 (it also counts freed memory glibc keeps)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        def rss() -> int:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * 4096
        return rss

    def in_use() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd
    return in_use


class PeakMemory:
    """Peak memory beyond what is held when it starts: the CUDA allocator's peak on a GPU, the C heap in use sampled
    every 5 ms on the CPU (torch keeps no CPU allocator statistics)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._used = _heap_in_use()

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base = self.peak = self._used()
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._used())

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self._used())

    @property
    def working(self) -> int:
        return self.peak - self.base


def pool_bytes_per_token(spec, dtype: torch.dtype, virtual: int, tiny: bool) -> list[dict]:
    """The pool's bytes per position (latent + indexer rows + pooled keys, every MLA layer of one rank at TP 1) and
    per KDA state slot, by KV dtype, for the bench model and the whole model (its layer layout, without MTP)."""
    rows = []
    whole = bench_spec(layers=RELEASE_LAYERS, tiny=tiny)
    for label, s in (("bench model", spec), (f"whole model ({RELEASE_LAYERS} layers)", whole)):
        cfg = bench_config(s)
        for name in ("auto", "fp8"):
            cost = pool_cost(cfg, Sharding(virtual=virtual), block_size=BLOCK, dtype=dtype,
                             kv_dtype=KV_CACHE_DTYPES[name], with_mtp=False)
            rows.append({"model": label, "mla_layers": len(cfg.mla_layers), "kv_cache_dtype": name,
                         "stored_as": str(KV_CACHE_DTYPES[name] or dtype).removeprefix("torch."),
                         "bytes_per_token": cost.block_bytes / BLOCK, "bytes_per_kda_slot": cost.slot_bytes,
                         "gib_per_1m_tokens": cost.block_bytes / BLOCK * 2**20 / 2**30})
    return rows


def prefill(model, ids: list[int], chunk: int, kv_dtype, device: torch.device) -> dict:
    """One sequence prefilled chunk by chunk into its own pool; TTFT = first chunk to the last chunk's logits."""
    n = len(ids)
    blocks = -(-n // BLOCK)
    cache = model.new_cache(num_blocks=blocks, block_size=BLOCK, num_slots=1, kv_dtype=kv_dtype)
    pool = sum(t.nbytes for t in cache.block_views(0)) * (blocks + 1) + sum(t.nbytes for t in cache.state_views(0)) * 2
    table = list(range(blocks))
    with PeakMemory(device) as mem:
        t0 = time.perf_counter()
        for s in range(0, n, chunk):
            out = model.forward(Batch.single(ids[s : s + chunk], s, table, slot=0, device=device), cache)
        first = int(out.logits[-1].argmax())
        sync(device)
        ttft = time.perf_counter() - t0
    del cache
    return {"ttft_s": ttft, "tok_per_s": n / ttft, "first_token": first, "pool_bytes": pool,
            "working_peak_bytes": mem.working, "peak_bytes": mem.peak}


class Results(RunFiles):
    def __init__(self, run: Setup) -> None:
        super().__init__(run.out_dir, run.stem, {"meta": run.meta, "pool_bytes_per_token": [], "prefill": [],
                                                 "notes": []})

    def markdown(self) -> str:
        m = self.data["meta"]
        lines = [f"# long-context prefill — {m['date']}", "",
                 f"- device: {m['device_name']} ({m['device']}), torch {m['torch']}, CUDA {m['cuda']}",
                 f"- model: random {m['dtype']} weights at {'make-tiny' if m['tiny'] else 'real GLM-5.3-Flash'} "
                 f"dims, {m['layers']} layers `{m['layer_pattern']}`; indexer kpool {m['dims']['index_kpool']} "
                 f"topk {m['dims']['index_topk']}; KV cache {m['kv_cache_dtype']}; weights "
                 f"{si(m['weight_bytes'], 'B')}",
                 f"- one sequence, chunks of {m['chunk']} tokens; TTFT = first chunk to the first token's logits "
                 f"(runtime only: no HTTP, no queue); memory: {m['memory_probe']}", "",
                 "## Prefill", "",
                 "| tokens | TTFT s | prefill tok/s | pool | working peak (beyond weights + pool) | peak |",
                 "|---:|---:|---:|---:|---:|---:|"]
        for r in self.data["prefill"]:
            if r.get("status") != "ok":
                lines.append(f"| {r['tokens']} | {r['status']} | | | | |")
                continue
            lines.append(f"| {r['tokens']} | {r['ttft_s']:.2f} | {r['tok_per_s']:.0f} | {si(r['pool_bytes'], 'B')} "
                         f"| {si(r['working_peak_bytes'], 'B')} | {si(r['peak_bytes'], 'B')} |")
        lines += ["", "## Pool bytes per token (one rank, TP 1)", "",
                  "| model | MLA layers | --kv-cache-dtype | stored as | bytes / token | GiB / 1M tokens "
                  "| bytes / KDA slot |", "|---|---:|---|---|---:|---:|---:|"]
        for r in self.data["pool_bytes_per_token"]:
            lines.append(f"| {r['model']} | {r['mla_layers']} | {r['kv_cache_dtype']} | {r['stored_as']} | "
                         f"{r['bytes_per_token']:.0f} | {r['gib_per_1m_tokens']:.2f} | "
                         f"{si(r['bytes_per_kda_slot'], 'B')} |")
        lines += [""] + [f"- {n}" for n in self.data["notes"]]
        return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = setup(args, "long_context")
    if run is None:
        return 2
    device, spec, meta = run.device, run.spec, run.meta
    meta.update(chunk=args.chunk, memory_probe="CUDA allocator peak, reset per length" if device.type == "cuda"
                else "C heap in use (glibc mallinfo2) sampled every 5 ms")
    res = Results(run)
    res.data["pool_bytes_per_token"] = pool_bytes_per_token(spec, run.dtype, args.virtual, args.tiny)
    res.data["notes"] += [
        "pool = the latent + indexer rows + pooled keys of every MLA layer for the prompt's blocks (+ one scratch "
        "block) and two KDA state slots (the sequence's and the scratch one).",
        "working peak = peak memory during the prefill less what was held when it started (weights, the pool): "
        "activations, indexer scores, selections. It should not grow with the prompt length.",
        "bytes per token: one rank at TP 1 (the MLA latent and indexer rows are replicated on every rank, not split).",
    ]
    log(f"device {meta['device_name']} ({device}); results -> {res.json_path}")
    for r in res.data["pool_bytes_per_token"]:
        log(f"pool: {r['model']}, {r['kv_cache_dtype']}: {r['bytes_per_token']:.0f} B/token, "
            f"{r['gib_per_1m_tokens']:.2f} GiB per 1M tokens, {si(r['bytes_per_kda_slot'], 'B')} per KDA slot")
    t0 = time.perf_counter()
    model, reader = build_model(spec, device=device, dtype=run.dtype, seed=args.seed, virtual=args.virtual, log=log)
    sync(device)
    meta["build_s"], meta["weight_bytes"] = time.perf_counter() - t0, reader.bytes_made
    log(f"built in {meta['build_s']:.1f} s ({si(reader.bytes_made, 'B')})")
    res.write()

    gen = torch.Generator().manual_seed(args.seed + 1)
    kv_dtype = KV_CACHE_DTYPES[args.kv_cache_dtype]
    # Untimed warm-up: the first chunks compile Triton's kernels and autotune fla-core's (~100 s on an H200), which
    # would otherwise be counted in the first length's TTFT.
    t0 = time.perf_counter()
    prefill(model, random_tokens(2 * args.chunk, spec.vocab_size, gen), args.chunk, kv_dtype, device)
    meta["warmup_s"] = time.perf_counter() - t0
    log(f"warm-up prefill of {2 * args.chunk} tokens (compiles, autotuning): {meta['warmup_s']:.1f} s")
    res.data["notes"].append(f"an untimed warm-up prefill of {2 * args.chunk} tokens ran first "
                             f"({meta['warmup_s']:.1f} s: kernel compiles and autotuning).")
    for n in args.lengths:
        row: dict = {"tokens": n}
        if time.perf_counter() - run.started > args.budget_s:
            row["status"] = "skipped (time budget)"
        else:
            try:
                row.update(prefill(model, random_tokens(n, spec.vocab_size, gen), args.chunk, kv_dtype, device),
                           status="ok")
                log(f"{n} tokens: TTFT {row['ttft_s']:.2f} s, {row['tok_per_s']:.0f} tok/s; pool "
                    f"{si(row['pool_bytes'], 'B')}, working peak {si(row['working_peak_bytes'], 'B')}")
            except Exception as e:  # noqa: BLE001 - an OOM is a result; anything else is a bug
                if not is_oom(e):
                    raise
                row["status"] = "OOM"
                log(f"{n} tokens: OOM ({str(e).splitlines()[0][:200]})")
            if device.type == "cuda":
                torch.cuda.empty_cache()
        res.data["prefill"].append(row)
        res.write()
    return finish(res, run)


if __name__ == "__main__":
    sys.exit(main())
