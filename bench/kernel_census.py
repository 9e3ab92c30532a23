"""Kernel census: every Triton build the runtime chooses at the release's dimensions, compiled for each GPU
architecture it serves on, with its shared memory against that architecture's limit per block.

    python -m bench.kernel_census                       # sm_90 and sm_121, a line per build, fails on any over
    python -m bench.kernel_census --arch 121 --markdown  # the table docs/gpu-engine.md keeps

No GPU: the model is laid out on torch's meta device (shapes, no memory) at the release's widths and runs the
fused forward (ops/fused.py, what a CUDA rank runs) over a few rounds that reach every path: decode rows, a verify
window (alone too: a decode step's own routing launch), a prompt chunk from position 0 (the expanded MLA form) and rows deep in a long context (the DSA scores and
selection, split attention, the latent prompt tile), the MTP layer; for every weight recipe in RECIPES, fp8 and
bf16 KV rows, each virtual-shard width a release rank runs (TP 1 and TP 2 with 4 virtual shards: 4 and 2 shards a
launch; `--virtual-shards 2` at TP 2: 1 of twice the width). Each launch goes through Triton's own JIT binder under
a stand-in driver for the architecture, so its specialization (integers equal to 1 or multiples of 16, pointer
alignment, every constexpr) is the one a GPU launch would build; a compile hook records it and compiles nothing.
Each distinct build is then compiled once per architecture with Triton's compiler (ptxas-blackwell for sm_12x,
bench/triton_build.py): shared memory (what Triton checks against the device before a launch), registers and spills,
and that the build waits for the kernel before it before its first global memory access (the launches are recorded
with programmatic dependent launch on, as a GPU of sm_90 or later makes them: kernels/gpu/pdl.py).

Stand-ins, for what cannot run here: the peer rank of TP 2 (its partials are this rank's, copied), and the CUDA
EXL3 product where the runtime would take it (its outputs are left empty; kernels/gpu/cuda/exl3_grouped.cu is
compiled for each architecture by tests/kernels/test_exl3_cuda_build.py). Without them the runtime's other choice
(TWINSPARK_EXL3_KERNEL=triton, or a rate it is not built for) runs, and is counted too.

Not in the census: fla-core's chunk_kda (prompt chunks' KDA: its own autotuned Triton kernels), humming-kernels'
integer experts (NVRTC kernels, one config pinned per architecture in kernels/gpu/int_moe.py; without humming the
int experts run the Triton INT tile, which is counted; the routing launch that builds humming's tables is launched
on its own at the release's shapes) and the same-host exchange (model/device_exchange.py: a copy
loop, no shared memory).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from bench import flags
from bench.triton_build import compiled_stats
from kernels.gpu import arch as gpu_arch, pdl

META = torch.device("meta")
# Weight recipes (model/quantize/select.py): dense, fp8, W4A16, the int widths on the portable INT tile, and EXL3 at
# the whole-model (2.5) and the seed's (4.0 experts, a 4-bit / fp8 / bf16 rest) rates.
RECIPES: tuple[str, ...] = ("bf16", "fp8", "w4a16+fp8", "int3+int4", "int2+int8", "exl3:2.5+fp8", "exl3:4.0+w4a16",
                            "exl3:4.0+bf16")
# (TP size, virtual shards): a rank's local shards and their width
SHARDINGS: tuple[tuple[int, int], ...] = ((1, 4), (2, 4), (2, 2))
LAYERS = "KKKM"  # a dense layer, KDA + MoE, MLA + DSA + MoE (+ the MTP layer): every kind of block the release has
DENSE_LAYERS = 1
BLOCK = 16
LONG = 200_000  # a context deep enough that the DSA selection keeps 2,048 of its positions
CHUNK = 8192  # the step budget on CUDA (a prompt chunk's rows)


@dataclass(frozen=True)
class Build:
    """One distinct Triton build: what the JIT hands its compiler."""

    kernel: str  # module.function
    fn: Any = field(compare=False, hash=False)  # the JITFunction
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[tuple[int, ...], Any], ...]
    attrs: tuple[tuple[tuple[int, ...], tuple[tuple[str, Any], ...]], ...]
    warps: int
    stages: int

    def named_constexprs(self) -> dict[str, Any]:
        return {self.fn.arg_names[path[0]]: value for path, value in self.constexprs}

    def label(self) -> str:
        """The constexprs by name and the launch options: what tells two builds of a kernel apart."""
        consts = ", ".join(f"{name}={value}" for name, value in self.named_constexprs().items())
        return f"{consts}; {self.warps} warps, {self.stages} stages"


class _Driver:
    """A stand-in for Triton's CUDA driver: a target architecture and nothing else (no device, no launch)."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return self.target.arch  # one JIT cache per architecture

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return META


@contextlib.contextmanager
def recording(arch: int) -> Iterator[set[Build]]:
    """Inside the block, every Triton launch is recorded as the build it needs on sm_<arch> and runs nothing; the
    runtime's per-architecture tables take sm_<arch>'s row."""
    from triton import knobs
    from triton.runtime.driver import driver

    builds: set[Build] = set()

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled) -> bool:
        attrs = compile["configs"][0]
        builds.add(Build(f"{fn.module}.{fn.name}", fn.jit_function, tuple(compile["signature"].items()),
                         tuple(sorted(compile["constants"].items())),
                         tuple(sorted((k, tuple(map(tuple, v))) for k, v in attrs.items())),
                         compile["num_warps"], compile["num_stages"]))
        return True  # compiled: nothing to build, nothing to launch

    previous, enabled = knobs.runtime.jit_cache_hook, pdl.enabled
    active = driver._active  # None without CUDA: reset_active() would look for a driver and find none
    driver.set_active(_Driver(arch))
    knobs.runtime.jit_cache_hook = hook
    pdl.enabled = lambda: arch >= pdl.MIN_CAPABILITY  # the launches as a GPU makes them (programmatic launch on)
    try:
        with gpu_arch.assume(arch):
            yield builds
    finally:
        knobs.runtime.jit_cache_hook, pdl.enabled = previous, enabled
        driver.set_active(active)


def _attrs(build: Build) -> dict[tuple[int, ...], list[list[Any]]]:
    """The argument attributes as Triton's binder makes them (lists; kept as tuples in a Build to hash it)."""
    return {path: [list(a) for a in attrs] for path, attrs in build.attrs}


class _Loader:
    """The random-weight reader on the meta device, telling the loader it is a GPU so quantized linears stay packed
    as a CUDA rank holds them (model/projection.py, model/ffn.py ask `reader.device.type`)."""

    def __init__(self, reader: Any) -> None:
        self._reader = reader
        self.device = SimpleNamespace(type="cuda")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)


def _peer_copies(sharding: Any) -> Any:
    """The collective of a rank whose peers' partials are its own (TP 2 on one process: the same launches)."""
    from model.parallel import Collective

    class PeerCopies(Collective):
        def _all_gather(self, local: torch.Tensor, dim: int) -> torch.Tensor:
            return torch.cat([local] * self.sharding.world, dim=dim)

    return PeerCopies(sharding)


def release_model(recipe: str, world: int, virtual: int) -> Any:
    """The release's widths (LAYERS: one block of each kind, and the MTP layer) on the meta device, rank 0 of
    `world`, its weights as `recipe` packs them."""
    from model.checkpoint.spec import TinySpec
    from model.config import ModelConfig
    from model.model import Glm5Model
    from model.parallel import Sharding
    from model.quantize.select import Recipe
    from model.random_weights import RandomWeightReader

    spec = TinySpec(num_hidden_layers=len(LAYERS), dense_layers=DENSE_LAYERS, layer_pattern=LAYERS)
    cfg = ModelConfig(**{name: getattr(spec, name) for name in ModelConfig.__dataclass_fields__
                         if name in TinySpec.__dataclass_fields__ and ModelConfig.__dataclass_fields__[name].init})
    sharding = Sharding(rank=0, world=world, virtual=virtual)
    parsed = None if recipe == "bf16" else Recipe.parse(recipe)
    reader = RandomWeightReader(spec, sharding, torch.bfloat16, META, recipe=parsed)
    model = Glm5Model(cfg, _Loader(reader), _peer_copies(sharding))
    model.device = META  # its caches too (the loader's "cuda" only kept the linears packed)
    return model


def _batch(seqs: list[tuple[int, int, bool, bool]], table: int, with_hidden: int = 0) -> Any:
    """seqs: (start, rows, prompt, verify) per sequence, decode-class first; each its own slot and block table."""
    from model.batch import Batch

    rows = sum(n for _, n, _, _ in seqs)
    return Batch(token_ids=torch.zeros(rows, dtype=torch.long, device=META),
                 starts=[s for s, _, _, _ in seqs], lengths=[n for _, n, _, _ in seqs],
                 block_tables=torch.zeros(len(seqs), table, dtype=torch.long, device=META),
                 slots=list(range(len(seqs))), logit_rows=torch.arange(rows),
                 verify=[v for *_, v in seqs], prompt=[p for _, _, p, _ in seqs],
                 hidden=torch.zeros(rows, with_hidden, dtype=torch.bfloat16, device=META) if with_hidden else None)


def _fla_stand_in(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g_raw: torch.Tensor, beta_raw: torch.Tensor,
                  init: torch.Tensor, *rest: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """fla-core's chunk_kda's outputs, empty (its kernels are not ours; the torch twin that runs in its place off
    CUDA would take a minute a round over an 8k chunk on meta tensors)."""
    return torch.empty_like(v), torch.empty_like(init, dtype=torch.float32)


def run_rounds(model: Any) -> None:
    """The rounds that reach every path of the fused forward (module docstring), over bf16 and fp8 KV rows."""
    from ops import fused

    fused._chunk_kda, chunk_kda = _fla_stand_in, fused._chunk_kda
    try:
        _rounds(model)
        _humming_routing(model)
    finally:
        fused._chunk_kda = chunk_kda


def _humming_routing(model: Any) -> None:
    """The routing launch that builds the humming experts' tables (kernels/gpu/moe.py, Grouping "int"): humming's
    experts have no meta-device layout, so no round reaches it; it is launched here at the release's shapes."""
    from kernels.gpu import arch as gpu_arch, int_moe, moe
    from kernels.gpu.gemm import RowClass

    cfg = model.cfg
    e, shards = cfg.n_routed_experts, model.layers[-1].ffn.params.shards
    block_m = int_moe.tile(RowClass.DECODE, gpu_arch.row(META)).block_m
    for rows in (1, 5):
        logits = torch.empty(rows, e, dtype=torch.float32, device=META)
        moe.route(logits, torch.empty(e, device=META), top_k=cfg.num_experts_per_tok, norm_topk_prob=True,
                  scaling=cfg.routed_scaling_factor, n_real=rows, grouping=moe.Grouping(e + 1, block_m, shards, "int"))


def _rounds(model: Any) -> None:
    table = (LONG + CHUNK) // BLOCK + 1
    short = [(10, 1, False, False), (20, 4, False, True), (0, CHUNK, True, False)]
    deep = [(LONG, 1, False, False), (LONG, 4, False, True), (LONG, CHUNK, True, False)]
    decode_only = deep[:2]  # no prompt row: a decode step's own launches (the MoE's routing and grouping in one)
    for kv in (None, torch.float8_e4m3fn):
        cache = model.new_cache(num_blocks=len(short) * table, block_size=BLOCK, num_slots=len(short), kv_dtype=kv)
        for seqs in (short, deep, decode_only):
            model.forward(_batch(seqs, table), cache, fused=True)
        model.forward_mtp(_batch(deep, table, model.cfg.hidden_size), cache, fused=True)


@contextlib.contextmanager
def cuda_exl3_product() -> Iterator[None]:
    """The runtime as it is where the CUDA EXL3 product is built: it takes the products it covers (their outputs
    left empty here), so the Triton launches around them are the ones a GPU runs."""
    from kernels.gpu import exl3_cuda

    def runs(device: torch.device, dtype: torch.dtype, w: Any, block_m: int) -> bool:
        return original_runs(torch.device("cuda") if device == META else device, dtype, w, block_m)

    def product(a: torch.Tensor, w: Any, *rest: Any) -> torch.Tensor:
        return torch.empty(*a.shape[:-1], w.n, dtype=torch.float32, device=a.device)

    original_runs = exl3_cuda.runs
    saved = {name: getattr(exl3_cuda, name) for name in ("runs", "grouped", "grouped_pair", "dense")}
    exl3_cuda.runs = runs  # `covers` asks it too
    exl3_cuda.grouped = exl3_cuda.grouped_pair = exl3_cuda.dense = product
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(exl3_cuda, name, value)


def census_builds(archs: tuple[int, ...], recipes: tuple[str, ...] = RECIPES,
                  shardings: tuple[tuple[int, int], ...] = SHARDINGS) -> dict[int, set[Build]]:
    """Every distinct build the fused forward launches, per architecture."""
    out: dict[int, set[Build]] = {a: set() for a in archs}
    for recipe in recipes:
        for world, virtual in shardings:
            model = release_model(recipe, world, virtual)
            products = (False, True) if recipe.startswith("exl3") else (False,)
            for arch in archs:
                for cuda_product in products:
                    with recording(arch) as builds, (cuda_exl3_product() if cuda_product
                                                     else contextlib.nullcontext()):
                        run_rounds(model)
                    out[arch] |= builds
    return out


@dataclass(frozen=True)
class Row:
    arch: int
    build: Build
    stats: dict[str, int]

    @property
    def fits(self) -> bool:
        return self.stats["shared_bytes"] <= gpu_arch.SHARED_PER_BLOCK[self.arch]


def compile_all(builds: dict[int, set[Build]]) -> list[Row]:
    """Each build compiled once for its architecture (bench/triton_build.py), sorted by kernel and label."""
    rows = []
    for arch, found in builds.items():
        for b in sorted(found, key=lambda b: (b.kernel, b.label())):
            sig = dict(b.signature)
            rows.append(Row(arch, b, compiled_stats(b.fn, sig, dict(b.constexprs), _attrs(b), num_warps=b.warps,
                                                    num_stages=b.stages, arch=arch)))
    return rows


def markdown(rows: list[Row]) -> str:
    """A table per architecture: each kernel's builds, the largest shared memory and register count among them."""
    lines = ["| arch | kernel | builds | shared memory, largest (limit) | registers, most | spills |",
             "|---|---|---:|---|---:|---:|"]
    by: dict[tuple[int, str], list[Row]] = {}
    for r in rows:
        by.setdefault((r.arch, r.build.kernel), []).append(r)
    for (arch, kernel), group in sorted(by.items()):
        shared = max(r.stats["shared_bytes"] for r in group)
        regs = max(r.stats["registers"] for r in group)
        spills = max(r.stats["spill_bytes"] for r in group)
        limit = gpu_arch.SHARED_PER_BLOCK[arch]
        lines.append(f"| sm_{arch} | `{kernel.split('.')[-1]}` | {len(group)} | {shared / 1024:.1f} KiB "
                     f"({limit // 1024}) | {regs} | {spills} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = flags.parser("bench.kernel_census", __doc__)
    ap.add_argument("--arch", default=",".join(map(str, gpu_arch.ROWS)),
                    help="compute capabilities x 10, comma-separated (default: every table row, 90,121)")
    ap.add_argument("--recipes", default=",".join(RECIPES), help="weight recipes, comma-separated")
    ap.add_argument("--shardings", default=",".join(f"{w}x{v}" for w, v in SHARDINGS),
                    help="TPxVIRTUAL pairs, comma-separated (default: every width a release rank runs)")
    ap.add_argument("--markdown", action="store_true", help="print the per-kernel table instead of a line a build")
    ap.add_argument("--json", type=Path, help="also write every build's counts here (tests/bench read it)")
    args = ap.parse_args(argv)
    archs = tuple(int(a) for a in args.arch.split(","))
    shardings = tuple(tuple(int(x) for x in pair.split("x")) for pair in args.shardings.split(","))
    rows = compile_all(census_builds(archs, tuple(args.recipes.split(",")), shardings))
    if args.json:
        args.json.write_text(json.dumps([{"arch": r.arch, "kernel": r.build.kernel, "label": r.build.label(),
                                          "constexprs": r.build.named_constexprs(), "fits": r.fits, **r.stats}
                                         for r in rows], indent=1))
    if args.markdown:
        print(markdown(rows))
    else:
        for r in rows:
            s = r.stats
            print(f"sm_{r.arch} {r.build.kernel} [{r.build.label()}]: shared {s['shared_bytes']} "
                  f"(limit {gpu_arch.SHARED_PER_BLOCK[r.arch]}), registers {s['registers']}, spills "
                  f"{s['spill_bytes']}{'' if r.fits else '  OVER'}")
    over = [r for r in rows if not r.fits]
    early = [r for r in rows if r.stats["waits_first"] != 1]
    for r in early:
        print(f"sm_{r.arch} {r.build.kernel} [{r.build.label()}]: "
              f"{'no programmatic-launch wait' if r.stats['waits_first'] < 0 else 'touches memory before its wait'}",
              file=sys.stderr)
    print(f"{len(rows)} builds, {len(over)} over their architecture's shared memory a block, {len(early)} touching "
          f"memory before the wait for the kernel before them", file=sys.stderr)
    return 1 if over or early else 0


if __name__ == "__main__":
    sys.exit(main())
