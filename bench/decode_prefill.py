"""Decode-step latency and prefill throughput of our model runtime at real GLM-5.3-Flash layer dimensions.

Random bf16 weights for L layers (default 4: 3 KDA + 1 MLA/DSA, 1 dense + 3 MoE FFNs, plus embeddings and lm_head)
are drawn directly on the GPU, so nothing is downloaded or read from disk. Measured in one run (docs/reference.md §5):
- the two ceilings: HBM copy bandwidth and the bf16 matmul rate;
- decode: one forward of B single-token rows, each sequence with `--context` tokens already in the cache (the
  contexts are prefilled once, untimed, as part of the setup); positions advance by one per step;
- prefill: one sequence, one forward over the whole prompt (chunked only if it runs out of memory, or with
  `--prefill-chunk`);
- roofline fractions: decode = ideal bytes / bandwidth / measured time, prefill = FLOPs / matmul rate / time;
- with `--schedule ours,library`, each decode batch and prefill length timed again on the same model with the
  fixed-schedule products and experts swapped for the M-dependent library kernels a non-exact engine would call
  (bench/library_schedule.py: cuBLAS, cuBLASLt's fp8 GEMM, grouped GEMMs): the price of exactness, ours / library
  per config, and which op kinds were swapped (docs/exactness.md, "The price of exactness").
Random-token prompts, greedy logits (no sampling, no drafts). CUDA events, warm-up, median of N.

    python -m bench.decode_prefill --out $OUT             # on a GPU
    python -m bench.decode_prefill --schedule ours,library --prefill 8192 --peer none --out $OUT
    python -m bench.decode_prefill --tiny                 # CPU smoke test with make-tiny dimensions
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench import flags, roofline
from bench.library_schedule import SwapRecord, library_schedule
from bench.model_run import (BLOCK, Setup, add_flags, add_step_flags, experts_per_layer, finish, free, is_oom,
                             random_tokens, setup, si)
from bench.output import RunFiles
from bench.random_weights import build_model
from bench.timing import log, median, sync, time_calls
from services.common import shared_flags as shared
from model.batch import Batch
from model.quantize.select import Recipe
from model.row_store import KV_CACHE_DTYPES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = flags.parser("bench.decode_prefill", __doc__)
    p.add_argument("--batches", type=flags.ints, default=[1, 8, 64], help="decode batch sizes (default 1,8,64)")
    p.add_argument("--prefill", type=flags.ints, default=[2048, 8192], help="prefill lengths (default 2048,8192)")
    p.add_argument("--context", type=int, default=512, help="tokens in the cache per decode sequence (default 512)")
    p.add_argument("--iters", type=int, default=5, help="timed iterations per config (default 5)")
    p.add_argument("--slow-iters", type=int, default=3,
                   help="timed iterations when the warm-up call took longer than --slow-s (default 3)")
    p.add_argument("--slow-s", type=float, default=1.0, help="warm-up seconds above which a config is 'slow'")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls before timing (default 1)")
    p.add_argument("--prefill-chunk", type=int, default=0,
                   help="prefill in chunks of this many tokens (default 0: whole prompt; chunks of 2048 on OOM)")
    flags.add(p, flags.BUDGET_S, "skip configs not started after this many seconds (default 360)", default="360")
    p.add_argument("--ceiling-iters", type=int, default=20, help="timed iterations of each ceiling (default 20)")
    p.add_argument("--copy-gib", type=float, default=4.0, help="bytes per copy in the bandwidth test (default 4 GiB)")
    p.add_argument("--matmul-n", type=int, default=8192, help="matmul size for the FLOP-rate test (default 8192)")
    p.add_argument("--peer", choices=("transformers", "none"), default=None,
                   help="also time transformers' Glm5Next on the same shapes in this run (default on a GPU: "
                        "transformers; none: skip)")
    p.add_argument("--peer-iters", type=int, default=3, help="timed iterations per peer config (default 3)")
    p.add_argument("--profile", action="store_true",
                   help="after timing, run one eager forward of each decode batch and prefill length under "
                        "torch.profiler and record the kernel launches per step, their GPU time and the names that take the most (the "
                        "results' 'profile' section; every launch in order in <name>-profile-*.tsv)")
    p.add_argument("--schedule", type=schedules, default=["ours"], metavar="ours[,library]",
                   help="the products' schedules each decode batch and prefill length is timed under, in this run: "
                        "ours (the fixed schedules; default) and library (the same forward with the products and "
                        "experts swapped for cuBLAS / cuBLASLt / grouped-GEMM library kernels that choose their "
                        "algorithm by the row count: bench/library_schedule.py; not row-invariant, for comparison "
                        "only)")
    add_step_flags(p)
    flags.add(p, shared.REST_FP8_KERNEL)
    add_flags(p, "decode_prefill", "make-tiny dimensions on the CPU, small ceilings: a smoke test of this script")
    return p.parse_args(argv)


SCHEDULES = ("ours", "library")


def schedules(text: str) -> list[str]:
    """--schedule: "ours" or "ours,library" (library alone has nothing to be compared with), ours first."""
    names = {x.strip() for x in text.split(",") if x.strip()}
    if not names <= set(SCHEDULES) or "ours" not in names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected ours or ours,library")
    return [s for s in SCHEDULES if s in names]


class Results(RunFiles):
    """Everything measured so far; written out after every config so a timeout still leaves what was done."""

    def __init__(self, args: argparse.Namespace, run: Setup) -> None:
        super().__init__(run.out_dir, run.stem, {"meta": run.meta, "ceilings": {}, "decode": [], "prefill": [],
                                                 "notes": []})
        self.args = args
        # the library twins' record (--schedule ours,library), kept in the results as "price_of_exactness"
        self.record = SwapRecord() if "library" in args.schedule else None

    def write(self) -> None:
        if self.record is not None:
            self.data["price_of_exactness"] = {"rows": price_rows(self.data), **self.record.as_dict()}
        super().write()

    def sibling(self, suffix: str) -> Path:
        """A further file of this run's results: `<stem>-<suffix>` beside the JSON."""
        return self.json_path.with_name(f"{self.json_path.stem}-{suffix}")

    def markdown(self) -> str:
        d, m = self.data, self.data["meta"]
        c = d["ceilings"]
        lines = [f"# decode / prefill — {m['date']}", "",
                 f"- device: {m['device_name']} ({m['device']}), torch {m['torch']}, CUDA {m['cuda']}, "
                 f"Python {m['python']}",
                 f"- model: random {m['dtype']} weights at {'make-tiny' if m['tiny'] else 'real GLM-5.3-Flash'} "
                 f"dims, {m['layers']} layers `{m['layer_pattern']}` (K = KDA, M = MLA+DSA), FFNs "
                 f"`{m['mlp_pattern']}`, lm_head; {si(m['text_params'])} params stored "
                 f"({si(m['text_bytes'], 'B')}), built in {m.get('build_s', float('nan')):.1f} s"
                 + (f"; quantize recipe {m['random_weights']} (packed linears drawn as such: the size above "
                    f"counts them at {m['dtype']}, the decode rooflines below at the bytes they are held in)"
                    if m.get("random_weights") else ""),
                 f"- dims: hidden {m['dims']['hidden_size']}, inter {m['dims']['intermediate_size']}, moe_inter "
                 f"{m['dims']['moe_intermediate_size']}, {m['dims']['n_routed_experts']} experts top-"
                 f"{m['dims']['num_experts_per_tok']} + {m['dims']['n_shared_experts']} shared, MLA "
                 f"{m['dims']['num_attention_heads']} heads q_lora {m['dims']['q_lora_rank']} kv_lora "
                 f"{m['dims']['kv_lora_rank']} nope/v {m['dims']['qk_nope_head_dim']}/{m['dims']['v_head_dim']}, "
                 f"KDA {m['dims']['linear_num_heads']}x{m['dims']['linear_head_dim']}, indexer "
                 f"{m['dims']['index_n_heads']}x{m['dims']['index_head_dim']} kpool {m['dims']['index_kpool']} "
                 f"topk {m['dims']['index_topk']}, vocab {m['dims']['vocab_size']}; virtual shards {m['virtual']}",
                 "- prompts: random tokens; logits only (no sampling, no drafts); timing: "
                 f"{m['timer']}, {self.args.warmup} warm-up call(s), median of the timed iterations", ""]
        if c:
            bw, mm = c.get("hbm_copy"), c.get("matmul")
            lines += ["## Ceilings (measured in this run)", "", "| ceiling | value | median ms |", "|---|---:|---:|"]
            if bw:
                lines.append(f"| HBM copy ({si(bw['bytes_per_copy'], 'B')}, read+write) | "
                             f"{si(bw['bytes_per_s'], 'B/s', 4)} | {bw['median_ms']:.3f} |")
            if mm:
                lines.append(f"| {mm['dtype']} matmul {mm['n']}^3 | {si(mm['flops_per_s'], 'FLOP/s', 4)} | "
                             f"{mm['median_ms']:.3f} |")
            lines.append("")
        if d["decode"]:
            lines += [f"## Decode (one step of B single-token rows; each sequence has ~{self.args.context} tokens "
                      "in the cache, prefilled once during setup)", "",
                      "| batch | context | median ms | tok/s | iters | experts hit / MoE layer (real rows; all rows) "
                      "| weight params read | ideal bytes | ideal ms | roofline | transformers ms | speed-up |",
                      "|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
            peer = d.get("peer", {}).get("decode", {})
            for r in d["decode"]:
                if r.get("status") != "ok":
                    lines.append(f"| {r['batch']} | | {r.get('status')} | | | | | | | | | |")
                    continue
                hit = "/".join(str(x) for x in r["experts_hit"]) + "; " + "/".join(str(x) for x in r["experts_hit_all_rows"])
                lines.append(f"| {r['batch']} | {r['context']} | {r['median_ms']:.2f} | {r['tok_per_s']:.1f} | "
                             f"{r['iters']} | {hit} | {si(r['weight_params'], '', 4)} | "
                             f"{si(r['ideal_bytes'], 'B')} | {r['ideal_ms']:.3f} | {r['roofline_fraction']:.2%} | "
                             f"{_peer_cell(peer.get(str(r['batch'])), r['median_ms'])} |")
            lines.append("")
        if d["prefill"]:
            lines += ["## Prefill (one sequence, one forward over the prompt unless chunked)", "",
                      "| tokens | chunk | median ms | tok/s | iters | FLOPs | ideal ms | roofline | transformers ms "
                      "| speed-up |",
                      "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
            peer = d.get("peer", {}).get("prefill", {})
            for r in d["prefill"]:
                if r.get("status") != "ok":
                    lines.append(f"| {r['tokens']} | | {r.get('status')} | | | | | | | |")
                    continue
                lines.append(f"| {r['tokens']} | {r['chunk'] or 'whole'} | {r['median_ms']:.1f} | "
                             f"{r['tok_per_s']:.0f} | {r['iters']} | {si(r['flops'])} | "
                             f"{r['ideal_ms']:.2f} | {r['roofline_fraction']:.2%} | "
                             f"{_peer_cell(peer.get(str(r['tokens'])), r['median_ms'])} |")
            lines.append("")
        if d.get("price_of_exactness"):
            lines += price_markdown(d["price_of_exactness"])
        lines += [f"- {n}" for n in d["notes"]]
        return "\n".join(lines) + "\n"


def price_rows(data: dict) -> list[dict]:
    """Per decode batch and prefill length timed under both schedules: ours, library, ours / library (> 1: the
    fixed schedules are slower), the kinds the library pass swapped."""
    rows = []
    for kind, key, label in (("decode", "batch", "decode batch"), ("prefill", "tokens", "prefill")):
        for r in data[kind]:
            lib = r.get("library")
            if lib is None:
                continue
            ok = r.get("status") == "ok" and lib.get("status") == "ok"
            rows.append({"config": f"{label} {r[key]}", kind: r[key], "ours_ms": r.get("median_ms"),
                         "library_ms": lib.get("median_ms"),
                         "ours_over_library": r["median_ms"] / lib["median_ms"] if ok else None,
                         "status": "ok" if ok else f"ours {r.get('status')}, library {lib.get('status')}",
                         "swapped": lib.get("swapped", []), "kept": lib.get("kept", [])})
    return rows


def price_markdown(price: dict) -> list[str]:
    """The results' "ours / library" table and the swapped / kept op kinds."""
    lines = ["## The price of exactness (ours / library)", "",
             "The same model, run and configs: our fixed-schedule products against the same forward with them "
             "swapped for M-dependent library kernels (bench/library_schedule.py; not row-invariant). "
             "ours / library > 1: the fixed schedules are slower.", "",
             "| config | ours ms | library ms | ours / library | swapped in this config |", "|---|---:|---:|---:|---|"]
    for r in price["rows"]:
        if r["ours_over_library"] is None:
            lines.append(f"| {r['config']} | | | {r['status']} | |")
            continue
        lines.append(f"| {r['config']} | {r['ours_ms']:.2f} | {r['library_ms']:.2f} | {r['ours_over_library']:.3f} | "
                     f"{', '.join(r['swapped']) or 'none'} |")
    lines.append("")
    swapped = price.get("swapped", {})
    diffs = price.get("first_call_difference", {})
    if swapped:
        lines += [f"- swapped: {k} → {v['library']}"
                  + (f" (first call vs ours: {diffs[k]:.2e} normwise)" if k in diffs else "")
                  for k, v in swapped.items()]
    else:
        lines.append("- swapped: none (no call reached a patched entry point)")
    lines += [f"- kept ours: {k}: {v['why']}" for k, v in price.get("kept", {}).items()]
    lines += [f"- never swapped: {k}: {why}" for k, why in price.get("never_swapped", {}).items()]
    lines.append("")
    return lines


def _peer_cell(peer: dict | None, ours_ms: float) -> str:
    """'peer ms | peer / ours' table cells, or the peer's status."""
    if not peer:
        return " | "
    if peer.get("status") != "ok":
        return f"{peer.get('status')} | "
    return f"{peer['median_ms']:.2f} | {peer['median_ms'] / ours_ms:.1f}x"


def measure_ceilings(res: Results, device: torch.device, args: argparse.Namespace) -> None:
    nbytes = int((64 << 20) if args.tiny else args.copy_gib * (1 << 30))
    n = 256 if args.tiny else args.matmul_n
    iters = 3 if args.tiny else args.ceiling_iters
    log(f"ceiling: HBM copy of {si(nbytes, 'B')} x {iters}")
    res.data["ceilings"]["hbm_copy"] = bw = roofline.hbm_copy_bandwidth(device, nbytes=nbytes, iters=iters)
    log(f"  {si(bw['bytes_per_s'], 'B/s', 4)}")
    log(f"ceiling: bf16 matmul {n}^3 x {iters}")
    res.data["ceilings"]["matmul"] = mm = roofline.matmul_rate(device, n=n, iters=iters)
    log(f"  {si(mm['flops_per_s'], 'FLOP/s', 4)}")
    free(device)
    res.write()


def bench_decode(res: Results, model, spec, device: torch.device, dtype: torch.dtype, args: argparse.Namespace,
                 t_start: float, stored: dict[str, int] | None = None) -> None:
    """stored: the weights' bytes per key as drawn (a packed recipe's), for the ideal bytes of a step."""
    batches = sorted(set(args.batches))
    if not batches:
        return
    nmax = max(batches)
    steps_max = len(batches) * len(args.schedule) * (args.warmup + max(args.iters, args.slow_iters) + 3)
    cap = args.context + steps_max
    nb = -(-cap // BLOCK)
    gen = torch.Generator().manual_seed(args.seed + 1)
    log(f"decode setup: cache for {nmax} sequences x {cap} positions; prefilling {nmax} x {args.context} tokens "
        "(untimed)")
    try:
        cache = model.new_cache(num_blocks=nmax * nb, block_size=BLOCK, num_slots=nmax,
                                kv_dtype=KV_CACHE_DTYPES[args.kv_cache_dtype])
        tables = torch.arange(nmax * nb, dtype=torch.long, device=device).view(nmax, nb)
        per = max(1, 8192 // max(args.context, 1))
        t0 = time.perf_counter()
        for first in range(0, nmax, per):
            seqs = list(range(first, min(first + per, nmax)))
            ids = [t for _ in seqs for t in random_tokens(args.context, spec.vocab_size, gen)]
            batch = Batch(token_ids=torch.tensor(ids, dtype=torch.long, device=device), starts=[0] * len(seqs),
                          lengths=[args.context] * len(seqs), block_tables=tables[seqs], slots=seqs,
                          logit_rows=torch.tensor([(i + 1) * args.context - 1 for i in range(len(seqs))]))
            model.forward(batch, cache)
            sync(device)
            log(f"  prefilled sequences {seqs[0]}..{seqs[-1]} ({time.perf_counter() - t0:.1f} s)")
    except Exception as e:  # noqa: BLE001 - OOM in the setup: record it for every batch size
        if not is_oom(e):
            raise
        log(f"  OOM in decode setup: {e}")
        res.data["decode"] += [{"batch": b, "status": "OOM (setup)"} for b in batches]
        free(device)
        res.write()
        return
    pos = [args.context] * nmax
    graphs = lib_graphs = None
    if device.type == "cuda" and not args.enforce_eager:
        from model.cuda_graphs import DecodeGraphs
        graphs = DecodeGraphs(model, cache)
        if res.record is not None:  # the library pass captures its own graphs, under the swap
            lib_graphs = DecodeGraphs(model, cache)

    def step(batch: Batch, graphs=graphs) -> None:
        if graphs is not None and graphs.fits(batch):
            graphs.run(batch)
        else:
            model.forward(batch, cache)

    for b in batches:
        if time.perf_counter() - t_start > args.budget_s:
            log(f"decode batch {b}: skipped (time budget {args.budget_s:.0f} s spent)")
            res.data["decode"].append({"batch": b, "status": "skipped (time budget)"})
            res.write()
            continue
        log(f"decode batch {b}: warm-up")
        seqs = list(range(b))
        row = {"batch": b}
        try:
            def make(offset: int) -> Batch:
                """The decode batch `offset` steps after the sequences' current positions."""
                ids = random_tokens(b, spec.vocab_size, gen)
                return Batch(token_ids=torch.tensor(ids, dtype=torch.long, device=device),
                             starts=[pos[s] + offset for s in seqs], lengths=[1] * b, block_tables=tables[:b],
                             slots=seqs, logit_rows=torch.arange(b))

            def advance(steps: int) -> None:
                for s in seqs:
                    pos[s] += steps

            warmup = max(args.warmup, 1)
            # one eager step counts the experts the router picks
            last = experts_per_layer(spec, b, lambda: model.forward(make(0), cache))
            advance(1)
            t0 = time.perf_counter()
            for _ in range(warmup):  # (captures the CUDA graph of this batch size)
                step(make(0))
                advance(1)
            sync(device)
            warm_s = (time.perf_counter() - t0) / warmup
            iters = args.iters if warm_s <= args.slow_s else min(args.iters, args.slow_iters)
            contexts = [pos[s] for s in seqs]
            batches_timed = [make(i) for i in range(iters)]  # built before timing, positions already advanced
            log(f"decode batch {b}: warm-up {warm_s:.2f} s/step; timing {iters} steps")
            times = time_calls(lambda i: step(batches_timed[i]), warmup=0, iters=iters, device=device)
            advance(iters)
            med = median(times)
            experts_hit = [h["real"] for h in last]
            need = roofline.decode_bytes(spec, dtype, contexts, experts_hit, KV_CACHE_DTYPES[args.kv_cache_dtype],
                                         stored)
            bw = res.data["ceilings"]["hbm_copy"]["bytes_per_s"]
            ideal_ms = need["total_bytes"] / bw * 1e3
            row.update(status="ok", context=contexts[0], cuda_graphs=graphs is not None, median_ms=med, times_ms=times, iters=iters,
                       tok_per_s=b / (med / 1e3), experts_hit=experts_hit,
                       experts_hit_all_rows=[h["all_rows"] for h in last], weight_params=need["weight_params"],
                       weight_bytes=need["weight_bytes"], state_bytes=need["state_bytes"],
                       cache_bytes=need["cache_bytes"], ideal_bytes=need["total_bytes"], ideal_ms=ideal_ms,
                       roofline_fraction=ideal_ms / med,
                       weights_only_fraction=need["weight_bytes"] / bw * 1e3 / med)
            log(f"decode batch {b}: median {med:.2f} ms ({b / (med / 1e3):.1f} tok/s), ideal {ideal_ms:.3f} ms -> "
                f"{ideal_ms / med:.2%} of roofline; experts hit {experts_hit}")
            if args.profile and device.type == "cuda":
                profiles = res.data.setdefault("profile", {})
                profiles[f"decode {b}"] = profile_kernels(
                    lambda: model.forward(make(0), cache), sequence=res.sibling(f"profile-decode{b}.tsv"))
                advance(1)
                if graphs is not None:
                    # The same step replayed from its CUDA graph, as timed: kernels back to back, each placed
                    # while the one before drains (programmatic launch), so a kernel's own cost is its end minus
                    # the previous kernel's end, not its duration (which includes its wait).
                    profiles[f"decode {b} graph"] = profile_kernels(
                        lambda: step(make(0)), sequence=res.sibling(f"profile-decode{b}-graph.tsv"))
                    advance(1)
            if res.record is not None:
                row["library"] = library_pass(
                    res.record, f"decode batch {b}", med, device, args,
                    eager=lambda: model.forward(make(0), cache), call=lambda: step(make(0), lib_graphs),
                    calls=lambda n: [make(i) for i in range(n)], timed=lambda bt: step(bt, lib_graphs),
                    advance=advance, rows=b, extra=lambda: {"context": pos[0], "cuda_graphs": lib_graphs is not None})
        except Exception as e:  # noqa: BLE001
            if not is_oom(e):
                raise
            log(f"decode batch {b}: OOM ({e})")
            row["status"] = "OOM"
            free(device)
        res.data["decode"].append(row)
        res.write()
    del cache
    free(device)


def bench_prefill(res: Results, model, spec, device: torch.device, dtype: torch.dtype, args: argparse.Namespace,
                  t_start: float) -> None:
    gen = torch.Generator().manual_seed(args.seed + 2)
    for n in args.prefill:
        if time.perf_counter() - t_start > args.budget_s:
            log(f"prefill {n}: skipped (time budget {args.budget_s:.0f} s spent)")
            res.data["prefill"].append({"tokens": n, "status": "skipped (time budget)"})
            res.write()
            continue
        row = {"tokens": n}
        ids = random_tokens(n, spec.vocab_size, gen)
        chunks = [args.prefill_chunk] if args.prefill_chunk else [0, 2048]
        for chunk in chunks:
            size = chunk or n
            cache = None
            try:
                nb = -(-n // BLOCK)
                cache = model.new_cache(num_blocks=nb, block_size=BLOCK, num_slots=1,
                                        kv_dtype=KV_CACHE_DTYPES[args.kv_cache_dtype])
                table = list(range(nb))

                def step(i: int) -> None:
                    for s in range(0, n, size):
                        model.forward(Batch.single(ids[s : s + size], s, table, slot=0, device=device), cache)

                log(f"prefill {n}: warm-up ({'whole prompt' if not chunk else f'chunks of {chunk}'})")
                t0 = time.perf_counter()
                for i in range(args.warmup):
                    step(i)
                sync(device)
                warm_s = (time.perf_counter() - t0) / max(args.warmup, 1)
                iters = args.iters if warm_s <= args.slow_s else min(args.iters, args.slow_iters)
                log(f"prefill {n}: warm-up {warm_s:.2f} s; timing {iters}")
                times = time_calls(step, warmup=0, iters=iters, device=device)
                med = median(times)
                fl = roofline.prefill_flops(spec, dtype, n)
                ideal_ms = fl["total_flops"] / res.data["ceilings"]["matmul"]["flops_per_s"] * 1e3
                row.update(status="ok", chunk=chunk, median_ms=med, times_ms=times, iters=iters,
                           tok_per_s=n / (med / 1e3), flops=fl["total_flops"], linear_flops=fl["linear_flops"],
                           attention_flops=fl["attention_flops"],
                           active_params_per_token=fl["active_params_per_token"], ideal_ms=ideal_ms,
                           roofline_fraction=ideal_ms / med)
                log(f"prefill {n}: median {med:.1f} ms = {n / (med / 1e3):.0f} tok/s, ideal {ideal_ms:.2f} ms -> "
                    f"{ideal_ms / med:.2%} of roofline")
                if args.profile and device.type == "cuda":
                    res.data.setdefault("profile", {})[f"prefill {n}"] = profile_kernels(
                        lambda: step(0), sequence=res.sibling(f"profile-prefill{n}.tsv"))
                    profile_host(lambda: step(0), res.sibling(f"profile-prefill{n}-host.txt"))
                if res.record is not None:  # the same chunking and cache as ours
                    row["library"] = library_pass(
                        res.record, f"prefill {n}", med, device, args, eager=lambda: step(0), call=lambda: step(0),
                        calls=lambda k: list(range(k)), timed=step, rows=n,
                        extra=lambda: {"chunk": chunk})
                break
            except Exception as e:  # noqa: BLE001
                if not is_oom(e):
                    raise
                log(f"prefill {n} ({'whole' if not chunk else chunk}): OOM ({str(e).splitlines()[0][:200]})")
                row["status"] = "OOM"
                cache = None
                free(device)
        res.data["prefill"].append(row)
        res.write()
        free(device)


def library_pass(record: SwapRecord, label: str, ours_ms: float, device: torch.device, args: argparse.Namespace, *,
                 eager: Callable[[], object], call: Callable[[], object], calls: Callable[[int], list],
                 timed: Callable[[object], object], rows: int, advance: Callable[[int], None] = lambda n: None,
                 extra: Callable[[], dict] = dict) -> dict:
    """One config timed again under the library twins (bench/library_schedule.py), as ours was: an eager call
    first (each twin's first call is checked against ours there, before any CUDA graph capture), the warm-up calls
    (`call`, capturing the library's own graph of a decode batch), then `timed` over the `calls(iters)` built
    beforehand. `advance(n)`: the decode positions move on by n steps. A failure is the row's status, not the
    run's end."""
    lib: dict = {}
    before_swapped, before_kept = dict(record.swapped), {k: v["calls"] for k, v in record.kept.items()}
    try:
        with library_schedule(record):
            log(f"{label} [library]: warm-up")
            eager()
            advance(1)
            t0 = time.perf_counter()
            warmup = max(args.warmup, 1)
            for _ in range(warmup):
                call()
                advance(1)
            sync(device)
            warm_s = (time.perf_counter() - t0) / warmup
            iters = args.iters if warm_s <= args.slow_s else min(args.iters, args.slow_iters)
            lib.update(extra())
            inputs = calls(iters)
            times = time_calls(lambda i: timed(inputs[i]), warmup=0, iters=iters, device=device)
            advance(iters)
        med = median(times)
        lib.update(status="ok", median_ms=med, times_ms=times, iters=iters, tok_per_s=rows / (med / 1e3))
        log(f"{label} [library]: median {med:.2f} ms; ours / library = {ours_ms / med:.3f}")
    except Exception as e:  # noqa: BLE001 - the library pass is a comparison: ours' figures stand without it
        first = str(e).splitlines()[0][:200] if str(e) else ""
        lib["status"] = "OOM" if is_oom(e) else f"failed: {type(e).__name__}: {first}"
        log(f"{label} [library]: {lib['status']}")
        free(device)
    lib["swapped"] = sorted(k for k, n in record.swapped.items() if n > before_swapped.get(k, 0))
    lib["kept"] = sorted(k for k, v in record.kept.items() if v["calls"] > before_kept.get(k, 0))
    return lib


def bench_peer(res: Results, spec, device: torch.device, dtype: torch.dtype, args: argparse.Namespace) -> None:
    """transformers on the same shapes (bench/peer_transformers.py): decode at each batch size after the same
    context, prefill at each length; OOM or an unsupported version is recorded, not raised."""
    from bench import peer_transformers
    peer: dict = {"decode": {}, "prefill": {}}
    res.data["peer"] = peer
    gen = torch.Generator().manual_seed(args.seed + 3)
    log("peer: building transformers' Glm5NextForConditionalGeneration on the same shapes")
    try:
        model = peer_transformers.build(spec, device, dtype)
        import transformers
        peer["meta"] = {"transformers": transformers.__version__}
    except Exception as e:  # noqa: BLE001 - a version without glm5_next, or OOM: say so in the results
        log(f"peer: cannot build ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
        peer["meta"] = {"status": f"not built: {type(e).__name__}"}
        res.write()
        return
    kw = dict(warmup=1, iters=args.peer_iters, device=device, gen=gen)
    cases = [("decode", b, lambda b=b: peer_transformers.decode_ms(model, b, args.context, spec.vocab_size, **kw))
             for b in sorted(set(args.batches))]
    cases += [("prefill", n, lambda n=n: peer_transformers.prefill_ms(model, n, spec.vocab_size, **kw))
              for n in args.prefill]
    for kind, size, fn in cases:
        try:
            ms = fn()
            peer[kind][str(size)] = {"status": "ok", "median_ms": ms}
            log(f"peer {kind} {size}: {ms:.2f} ms")
        except Exception as e:  # noqa: BLE001
            peer[kind][str(size)] = {"status": "OOM" if is_oom(e) else f"failed: {type(e).__name__}"}
            log(f"peer {kind} {size}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            free(device)
        res.write()
    del model
    free(device)


def profile_kernels(fn, top: int = 25, sequence: Path | None = None) -> dict:
    """GPU time per kernel name over one call of `fn` (torch.profiler): the step's kernel count and GPU total, the
    `top` most expensive names first, and (when `sequence` is given) every launch in order written there as
    tab-separated `start_us  gpu_us  kernel`, to see which part of a layer each kernel belongs to."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    from torch.autograd import DeviceType
    # The launches are the GPU-side events in time order (kernels, copies, memsets). key_averages' counts are not:
    # with torch 2.11 they summed to 248 for a step whose GPU ran 117 launches (rows without GPU time among them).
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    rows = sorted((e for e in prof.key_averages() if e.device_time_total > 0), key=lambda e: -e.device_time_total)
    total_ms = sum(e.device_time_total for e in kernels) / 1e3
    launches = len(kernels)
    span_ms = (max(e.time_range.end for e in kernels) - kernels[0].time_range.start) / 1e3 if kernels else 0.0
    own = own_times(kernels)
    out = {"kernels": launches, "gpu_ms": total_ms, "span_ms": span_ms,
           "top": [{"kernel": e.key[:120], "calls": e.count, "gpu_ms": e.device_time_total / 1e3,
                    "own_ms": own.get(e.key, 0.0) / 1e3} for e in rows[:top]]}
    log(f"  profile: {launches} kernel launches, {total_ms:.3f} ms of GPU time, {span_ms:.3f} ms first start to "
        "last end")
    for r in out["top"]:
        log(f"  profile: {r['gpu_ms']:9.3f} ms ({r['own_ms']:.3f} own)  x{r['calls']:<4d} {r['kernel']}")
    if sequence is not None:
        t0 = kernels[0].time_range.start if kernels else 0
        sequence.write_text("".join(f"{e.time_range.start - t0:.1f}\t{e.device_time_total:.1f}\t{e.name[:160]}\n"
                                    for e in kernels))
    return out


def own_times(kernels: list) -> dict[str, float]:
    """Microseconds each kernel name adds to the GPU's timeline: a kernel's end minus the latest end before it (0
    when it ends earlier). Launched back to back with programmatic launch, a kernel starts before the one before it
    ends and waits, so its duration counts that wait; its own time does not, and the own times of a step sum to its
    busy span (`kernels`: profiler events in start order)."""
    own: dict[str, float] = {}
    last = kernels[0].time_range.start if kernels else 0.0
    for e in kernels:
        own[e.name] = own.get(e.name, 0.0) + max(0.0, e.time_range.end - max(last, e.time_range.start))
        last = max(last, e.time_range.end)
    return own


def profile_host(fn: Callable[[], object], out: Path, top: int = 30) -> None:
    """Where one call of `fn` spends its host time (cProfile, by own and by cumulative time), written to `out`: the
    Python work before and between launches, and the host syncs (time in .item / .tolist / synchronize is waiting
    for the GPU). An 8,192-token prefill's GPU sat idle ~5 ms before its first kernel (profile-prefill8192.tsv of
    decode_prefill-20261205-0224): this says what the host did then."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the GPU work it queued counts as the wait at the end
    prof.disable()
    buf = io.StringIO()
    for order in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=buf).sort_stats(order).print_stats(top)
    out.write_text(buf.getvalue())
    log(f"  host profile: {out.name}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = setup(args, "decode_prefill")
    if run is None:
        return 2
    device, dtype, spec, meta = run.device, run.dtype, run.spec, run.meta
    pc = roofline.param_counts(spec, dtype)
    meta.update(mlp_pattern="".join("D" if m == "dense" else "E" for m in spec.mlp_layer_types),
                text_params=pc.total, text_bytes=pc.total_bytes,
                timer="CUDA events" if device.type == "cuda" else "perf_counter")
    res = Results(args, run)
    res.data["notes"] += [
        "decode: each sequence's context is prefilled once before timing (setup); every timed step advances "
        "positions by one; the row's context is the cached length at the first timed step.",
        "decode ideal bytes = weights the step touches, at the bytes they are held in (packed with "
        "--random-weights) (all non-expert weights + lm_head + the distinct routed "
        "experts the real rows chose, per MoE layer + one embedding row per sequence) + KDA fp32 state and conv "
        "history read+written + MLA latent / indexer-key rows read; ideal ms = ideal bytes / measured HBM copy "
        "bandwidth; roofline = ideal ms / measured ms.",
        "experts hit 'all rows' includes the zero-token padding rows the runtime adds to reach a multiple of 64 rows "
        "(they are routed too; the ideal counts only real rows).",
        "prefill FLOPs = 2 x active params x tokens (top-k + shared experts; lm_head for the last row) + MLA "
        "2·h·(dn+dv) per attended (query, key) pair under the DSA selection + indexer 2·h·d per scored pool + KDA "
        "6·dk·dv per head and token; ideal ms = FLOPs / measured matmul rate.",
        "transformers: its own random initialisation on the same shapes (timings depend on values only through "
        "routing), fla-core's KDA kernels when they import, its own cache; speed-up = transformers ms / ours.",
    ]
    if res.record is not None:
        res.data["notes"].append(
            "library: each config timed again right after ours with the products and experts swapped for library "
            "kernels that choose their algorithm by the row count (bench/library_schedule.py): an eager step "
            "(each op kind's first call checked against ours), warm-up (a decode batch captures its own CUDA graph "
            "under the swap), then the same timing; decode positions keep advancing, so its context is a few "
            "tokens longer. Not row-invariant: for comparison only.")
        if device.type != "cuda":
            res.data["notes"].append(
                "on the CPU the model runs the torch reference ops (ops/reference.py), which call none of the "
                "patched entry points: the library column re-times the same forward (a smoke test of the bench).")
            log("--schedule library on the CPU: the reference ops call no patched entry point; the library pass "
                "re-times the same forward (a smoke test of the plumbing only)")
    log(f"device {meta['device_name']} ({device}), torch {torch.__version__}; results -> {res.json_path}")
    log(f"spec: {spec.num_hidden_layers} layers {spec.layer_pattern}, hidden {spec.hidden_size}, "
        f"{spec.n_routed_experts} experts; {si(pc.total)} params ({si(pc.total_bytes, 'B')} {meta['dtype']})")

    measure_ceilings(res, device, args)

    log("building the model from random weights on the device")
    t0 = time.perf_counter()
    recipe = Recipe.parse(args.random_weights) if args.random_weights else None
    meta["random_weights"] = args.random_weights
    model, reader = build_model(spec, device=device, dtype=dtype, seed=args.seed, virtual=args.virtual,
                                recipe=recipe, log=log)
    if args.rest_fp8_kernel != "triton":  # as serve-rank does after its load (model/rest_kernel.py)
        from model import rest_kernel
        log(rest_kernel.prepare(model, args.rest_fp8_kernel, args.virtual, dtype))
    sync(device)
    meta["build_s"] = time.perf_counter() - t0
    meta["bytes_drawn"] = reader.bytes_made
    if device.type == "cuda":
        meta["gpu_mem_after_build_gib"] = torch.cuda.memory_allocated(device) / 2**30
    log(f"built in {meta['build_s']:.1f} s ({si(reader.bytes_made, 'B')} drawn)")
    res.write()

    bench_decode(res, model, spec, device, dtype, args, run.started, reader.stored_bytes)
    bench_prefill(res, model, spec, device, dtype, args, run.started)
    if (args.peer or ("transformers" if device.type == "cuda" else "none")) == "transformers":
        del model
        free(device)
        bench_peer(res, spec, device, dtype, args)
    if device.type == "cuda":
        meta["gpu_peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return finish(res, run)


if __name__ == "__main__":
    sys.exit(main())
