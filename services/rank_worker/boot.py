"""A rank worker's boot sequence over its settings: join the TP group, check the group's settings, arm the peer
watchdog, load this rank's shard, size the KV pool, capture CUDA graphs, warm up (on a GPU), serve StepPlans.

Exit codes that mean "this group cannot go on" (a supervisor restarts the whole group): 3 a bad plan (server.py),
4 the ranks' settings differ (fingerprint.py; or their --collective, distributed.py), 5 a peer was lost or never
reached the watchdog (peer_watch.py); 2 is a setting this rank cannot honour.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import torch

from model.row_store import KV_CACHE_DTYPES
from services.common.step_budget import step_budget
from services.rank_worker import fingerprint as fp
from services.rank_worker import pool_size
from services.rank_worker.settings import RankSettings

if TYPE_CHECKING:  # imported where used: `twinspark --help` loads no model code
    from torch.distributed import ProcessGroup

    from model.cache import PagedCache
    from model.model import Glm5Model
    from model.parallel import Exchange, Sharding
    from model.quantize.select import Recipe
    from model.vision import VisionConfig
    from services.rank_worker.kv_tiers import TierStore
    from twinspark.v1.rank_pb2 import DescribeReply

log = logging.getLogger("twinspark.rank")


@dataclass
class Loaded:
    """What the boot has built so far, for the steps after loading."""

    model: Glm5Model
    group: ProcessGroup | None
    device: torch.device
    fingerprint_settings: dict[str, str]  # fingerprint.settings(): what the group agreed on
    vision: VisionConfig | None  # None: no tower (a text-only checkpoint, or random weights)


def _leave(code: int) -> NoReturn:
    """End a rank that joined the group but refuses to go on. Not a normal return: the interpreter's exit then runs
    torch.distributed's C++ teardown, which now and then aborts ("terminate called without an active exception",
    SIGABRT instead of `code`) when the peers leave at the same moment. The log handlers flush every record."""
    os._exit(code)


def serve_rank(s: RankSettings) -> int:
    """Boot a rank and serve until SIGTERM. Returns an exit code (the group-fatal ones leave at once)."""
    from services.common.role_start import start_role

    if not start_role(f"rank{s.rank}", s, listen=s.host,
                      log_format=f"%(asctime)s rank{s.rank} %(levelname)s %(message)s"):
        return 2
    # Autotuning results (fla-core's KDA kernels) persist in Triton's cache dir beside the compiled kernels, so a
    # restart on this machine (or a container with that dir on a volume) skips them.
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    recipe = None
    if s.random_weights:
        from model.quantize.select import Recipe

        try:
            recipe = Recipe.parse(s.random_weights, block=s.random_block_size)
        except ValueError as exc:
            log.error("--random-weights %s", exc)
            return 2
    if s.rest_fp8_kernel == "humming":
        from kernels.gpu import int_moe

        if not int_moe.available():  # refused, not run on ours: the setting changes a decode row's bits
            log.error("--rest-fp8-kernel humming: humming-kernels cannot be imported (pip install -e '.[gpu]')")
            return 2
    from services.rank_worker.distributed import backend_for

    try:
        backend_for(s.collective, s.device)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    if s.device == "cpu" and s.world > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // s.world))
    loaded = _load(s, recipe, *_join(s))
    try:
        num_blocks = s.num_blocks or _sized_pool(s, loaded)
    except ValueError as exc:
        log.error("%s", exc)
        _leave(2)
    _serve(s, loaded, num_blocks)
    return 0


def _join(s: RankSettings) -> tuple[Sharding, ProcessGroup | None, Exchange | None, dict[str, str]]:
    """Join the group, check that every rank has the same settings and arm the peer watchdog: (sharding, group,
    the same-host exchange if the collective runs through one, the agreed settings)."""
    from services.common.internal_auth import group_digest
    from services.rank_worker.distributed import join_group
    from services.rank_worker.peer_watch import EXIT_PEER_LOST, PeerWatch

    log.info("joining group as rank %d of %d via %s:%d", s.rank, s.world, s.master_addr, s.master_port)
    try:
        sharding, group, exchange = join_group(s.rank, s.world, master_addr=s.master_addr,
                                               master_port=s.master_port, device=s.device, virtual=s.virtual_shards,
                                               collective=s.collective, slot_bytes=s.collective_slot_bytes)
    except RuntimeError as exc:  # the ranks chose different collectives, or ipc where a rank cannot map the region
        log.error("%s", exc)
        _leave(4)
    settings = fp.settings(model_dir=s.model, world=s.world, dtype=getattr(torch, s.compute_dtype), device=s.device,
                           virtual_shards=s.virtual_shards, num_blocks=s.num_blocks or "auto",
                           block_size=s.block_size, num_slots=s.num_slots,
                           kv_dtype=KV_CACHE_DTYPES[s.kv_cache_dtype], rest_fp8_kernel=s.rest_fp8_kernel,
                           random_weights=f"{s.random_weights} block {s.random_block_size}"
                           if s.random_weights else "")
    try:
        fp.check_group(settings, s.rank, s.world, token_digest=group_digest(s.internal_token))
    except RuntimeError as exc:
        log.error("%s", exc)
        _leave(4)
    try:
        PeerWatch(s.rank, s.world, master_addr=s.master_addr, port=s.watchdog_port, timeout_s=s.peer_timeout).start()
    except (OSError, ValueError) as exc:  # TimeoutError is an OSError
        log.error("%s", exc)
        _leave(EXIT_PEER_LOST)
    return sharding, group, exchange, settings


def _load(s: RankSettings, recipe: Recipe | None, sharding: Sharding, group: ProcessGroup | None,
          exchange: Exchange | None, settings: dict[str, str]) -> Loaded:
    """This rank's shard: read from the checkpoint, or drawn at random in `recipe`'s formats."""
    from model import memory_parts
    from model.model import Glm5Model
    from model.vision import VisionConfig
    from services.rank_worker.distributed import rank_device

    dtype = getattr(torch, s.compute_dtype)
    device = rank_device(s.device, s.rank)
    # Random weights draw the text model only: no vision tower, so image requests are refused as for a text-only
    # checkpoint.
    vision = (VisionConfig.from_hf_dict(json.loads((Path(s.model) / "config.json").read_text()))
              if recipe is None else None)
    if recipe is not None:
        log.info("drawing random %s weights for %s's config (%s, %s)", s.random_weights, s.model, dtype, s.device)
        model = _random_model(s.model, recipe, sharding, group, exchange, dtype, device)
    else:
        log.info("loading %s (%s, %s)", s.model, dtype, s.device)
        model = Glm5Model.load(s.model, sharding=sharding, group=group, exchange=exchange, dtype=dtype, device=device,
                               progress=True, load_vision=vision is not None and s.rank == 0)
    if s.rest_fp8_kernel != "triton":
        from model import rest_kernel

        log.info("%s", rest_kernel.prepare(model, s.rest_fp8_kernel, sharding.virtual, dtype))
    log.info("%s", memory_parts.line(memory_parts.bytes_by_part(model, device)))
    if device.type == "cuda":
        from kernels.gpu import arch as gpu_arch

        gpu_arch.log_facts(device)  # read once: the tile tables' row and the pool sizing's unified memory use them
        # Loading leaves freed staging memory in torch's caching allocator (per-shard tensors stacked into one,
        # dequantized copies): hand it back, or the pool sizing counts it as in use and the pool comes out that
        # much smaller (vLLM does the same after its load).
        gc.collect()
        torch.cuda.empty_cache()
    return Loaded(model, group, device, settings, vision)


def _random_model(model_dir: str, recipe: Recipe, sharding: Sharding, group: ProcessGroup | None,
                  exchange: Exchange | None, dtype: torch.dtype, device: torch.device) -> Glm5Model:
    """The model of `model_dir`'s config over weights drawn on the device (`--random-weights`)."""
    from model.config import ModelConfig
    from model.model import Glm5Model
    from model.parallel import Collective
    from model.random_weights import RandomWeightReader, spec_from_config

    cfg = ModelConfig.from_pretrained(model_dir)
    reader = RandomWeightReader(spec_from_config(cfg), sharding, dtype, device, recipe=recipe, log=log.info)
    model = Glm5Model(cfg, reader, Collective(sharding, group, exchange))
    log.info("random weights: %.2f GiB drawn (whole tensors, before this rank's cut; %d tensors, %d quantized)",
             reader.bytes_made / 2**30, reader.tensors_made, reader.quantized_made)
    return model


def _sized_pool(s: RankSettings, loaded: Loaded) -> int:
    """--num-blocks 0: the blocks this rank's memory holds beside its slots, the smallest over the group."""
    model = loaded.model
    cost = pool_size.pool_cost(model.cfg, model.coll.sharding, block_size=s.block_size, dtype=model.dtype,
                               kv_dtype=KV_CACHE_DTYPES[s.kv_cache_dtype], with_mtp=model.mtp is not None)
    sized = pool_size.budget_bytes(loaded.device, kv_cache_memory_bytes=s.kv_cache_memory_bytes,
                                   gpu_memory_utilization=s.gpu_memory_utilization,
                                   sharers=pool_size.device_sharers(loaded.group, loaded.device))
    log.info("kv pool budget %.2f GiB: %s", sized.bytes / 2**30, sized.rule)
    budget = sized.bytes
    if loaded.device.type == "cuda" and s.kv_cache_memory_bytes <= 0:  # room for the step's activations first
        from services.rank_worker.warmup import activation_peak

        budget -= activation_peak(model, step_budget(s.max_num_batched_tokens, s.device), block_size=s.block_size,
                                  kv_dtype=KV_CACHE_DTYPES[s.kv_cache_dtype])
    mine = pool_size.blocks_for_budget(budget, cost, s.num_slots)
    log.info("kv pool budget %d bytes: %d per block of %d positions (%d per position), %d per KDA slot -> %d blocks",
             budget, cost.block_bytes, s.block_size, cost.block_bytes // s.block_size, cost.slot_bytes, mine)
    return pool_size.agree(mine, loaded.group, loaded.device)


def _tiers(s: RankSettings, cache: PagedCache, settings: dict[str, str]) -> TierStore | None:
    """The host-RAM / disk KV tiers behind the pool, when either is on."""
    from services.rank_worker.kv_tiers import TierStore

    if s.kv_host_bytes <= 0 and not s.kv_disk_dir:
        return None
    tiers = TierStore(cache, host_bytes=max(0, s.kv_host_bytes), disk_dir=s.kv_disk_dir,
                      disk_bytes=max(0, s.kv_disk_bytes), rank=s.rank, cache_key=fp.cache_key(settings, s.model))
    log.info("kv tiers: host %d bytes, disk %s (%d bytes, %d entries there); %d bytes per block, %d per state",
             tiers.host_bytes, tiers.dir or "off", tiers.disk_bytes, len(tiers.listing()), tiers.block_bytes,
             tiers.state_bytes)
    return tiers


def _serve(s: RankSettings, loaded: Loaded, num_blocks: int) -> None:
    """Make the cache, capture the decode graphs, and serve until SIGTERM."""
    from services.rank_worker.executor import Executor
    from services.rank_worker.server import RankService, serve

    model = loaded.model
    window = pool_size.max_model_len(model.cfg, num_blocks, s.block_size)
    cache = model.new_cache(num_blocks=num_blocks, block_size=s.block_size, num_slots=s.num_slots,
                            kv_dtype=KV_CACHE_DTYPES[s.kv_cache_dtype])
    log.info("kv pool: %d blocks x %d positions, %d slots: max_model_len %d", num_blocks, s.block_size,
             s.num_slots, window)
    log.info("kv cache %s: %d bytes per block (%d as %s)", s.kv_cache_dtype, cache.kv_bytes_per_block(),
             cache.kv_bytes_per_block(getattr(torch, s.compute_dtype)), s.compute_dtype)
    tiers = _tiers(s, cache, loaded.fingerprint_settings)
    executor = Executor(model, cache, cuda_graphs=not s.enforce_eager, tiers=tiers, vision=loaded.vision,
                        encoder_cache_tokens=s.encoder_cache_tokens if s.rank == 0 else 0)
    if executor.graphs is not None:  # before serving, as vLLM does: a lazy capture stalls the round that needs it
        # the same buckets on every rank (their collectives pair up), even if a rank was started with other slots
        executor.graphs.capture_at_start(pool_size.agree(s.num_slots, loaded.group, loaded.device))
    if loaded.device.type == "cuda":  # compile before serving, not on a user's request (warmup.py)
        from services.rank_worker.warmup import warm_up

        warm_up(executor, step_budget(s.max_num_batched_tokens, s.device))
    describe = _describe(s, loaded, num_blocks, window, tiers)
    service = RankService(executor, describe, stats_interval_s=s.stats_interval,
                          watch_compiles=loaded.device.type == "cuda")
    server = serve(service, s.host, s.port, s.internal_token)
    log.info("rank %d serving on %s:%d (cache: %d blocks x %d, %d slots)", s.rank, s.host, s.port, num_blocks,
             s.block_size, s.num_slots)
    # A few seconds' grace: a stopping scheduler sends one last plan saving its prefix cache to the disk KV tier.
    signal.signal(signal.SIGTERM, lambda *_: server.stop(grace=5 if tiers is not None else 1))
    server.wait_for_termination()


def _describe(s: RankSettings, loaded: Loaded, num_blocks: int, window: int,
              tiers: TierStore | None) -> DescribeReply:
    """The Describe answer: what the scheduler learns of this rank."""
    from twinspark.v1 import rank_pb2

    cfg = loaded.model.cfg
    settings = loaded.fingerprint_settings
    return rank_pb2.DescribeReply(
        rank=s.rank, world=s.world, fingerprint=fp.fingerprint(settings), settings=settings,
        num_blocks=num_blocks, block_size=s.block_size, num_slots=s.num_slots, vocab_size=cfg.vocab_size,
        eos_token_ids=list(cfg.eos_token_id), max_model_len=window,
        model=os.path.basename(os.path.normpath(s.model)),
        instance_id=uuid.uuid4().hex,  # tells the scheduler a restarted group from the one it connected to
        tier_host_bytes=tiers.host_bytes if tiers else 0, tier_disk_bytes=tiers.disk_bytes if tiers else 0,
        block_bytes=tiers.block_bytes if tiers else 0, state_bytes=tiers.state_bytes if tiers else 0,
        max_num_batched_tokens=step_budget(s.max_num_batched_tokens, s.device))
