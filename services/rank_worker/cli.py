"""`twinspark serve-rank`: one rank worker — join the TP group, check the group's settings, arm the peer watchdog,
load this rank's shard, serve StepPlans.

Exit codes that mean "this group cannot go on" (a supervisor restarts the whole group): 3 a bad plan (server.py),
4 the ranks' settings differ (fingerprint.py), 5 a peer was lost or never reached the watchdog (peer_watch.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import uuid
from pathlib import Path
from typing import NoReturn

import torch

from services.common.env import add_internal_token_flag, env
from services.rank_worker import pool_size
from model.quantize.select import RECIPE_HELP
from model.row_store import KV_CACHE_DTYPES

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
log = logging.getLogger("twinspark.rank")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve-rank", help="run one rank worker (one per GPU / machine)",
                       description="Join the tensor-parallel group, load this rank's shard and serve StepPlans over "
                                   "gRPC. Flags default from TWINSPARK_* environment variables.")
    p.add_argument("--model", default=env("MODEL"), required=env("MODEL") is None, help="checkpoint dir (TWINSPARK_MODEL)")
    p.add_argument("--rank", type=int, default=int(env("RANK", "0")), help="this rank (TWINSPARK_RANK)")
    p.add_argument("--world", type=int, default=int(env("TP", "1")), help="number of ranks (TWINSPARK_TP)")
    p.add_argument("--master-addr", default=env("MASTER_ADDR", "127.0.0.1"), help="rank 0's address for the collective")
    p.add_argument("--master-port", type=int, default=int(env("MASTER_PORT", "29500")))
    peer_port = env("PEER_PORT")
    p.add_argument("--peer-port", type=int, default=int(peer_port) if peer_port else None,
                   help="rank 0's port for the peer watchdog's heartbeat connections (TWINSPARK_PEER_PORT, default "
                        "--master-port + 1)")
    p.add_argument("--peer-timeout", type=float, default=float(env("PEER_TIMEOUT", "3")),
                   help="seconds a peer may stay silent before this rank leaves the group with exit code 5 "
                        "(TWINSPARK_PEER_TIMEOUT, default 3)")
    p.add_argument("--host", default=env("RANK_HOST", "127.0.0.1"),
                   help="gRPC listen address (TWINSPARK_RANK_HOST; default loopback; another address needs "
                        "--internal-token)")
    p.add_argument("--port", type=int, default=int(env("RANK_PORT", "50061")), help="gRPC port")
    p.add_argument("--device", default=env("DEVICE", "cpu"), choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=env("DTYPE"), choices=sorted(_DTYPES),
                   help="compute dtype (default float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--kv-cache-dtype", default=env("KV_CACHE_DTYPE", "auto"), choices=sorted(KV_CACHE_DTYPES),
                   help="storage of the MLA latent + indexer cache rows: auto = the compute dtype; fp8 (= fp8_e4m3) = "
                        "e4m3 with a per-row fp32 scale, about half the bf16 bytes (TWINSPARK_KV_CACHE_DTYPE)")
    p.add_argument("--enforce-eager", action="store_true", default=env("ENFORCE_EAGER", "0") == "1",
                   help="on a GPU, run decode rounds eagerly instead of replaying CUDA graphs (vLLM's flag; the "
                        "same bits either way, graphs only save launch time) (TWINSPARK_ENFORCE_EAGER=1)")
    p.add_argument("--num-blocks", type=int, default=int(env("NUM_BLOCKS", "0")),
                   help="KV cache blocks (TWINSPARK_NUM_BLOCKS; 0 = sized from memory by the two flags below, the "
                        "group taking its smallest rank's figure); the served window is min(the checkpoint's "
                        "max_position_embeddings, blocks x block size)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=int(env("KV_CACHE_MEMORY_BYTES", "0")),
                   help="bytes of this rank's KV pool, blocks and KDA slots together, when --num-blocks is 0 "
                        "(vLLM's flag; TWINSPARK_KV_CACHE_MEMORY_BYTES; 0 = on CUDA by --gpu-memory-utilization, on "
                        "the CPU 1 GiB or half the available RAM if less)")
    p.add_argument("--gpu-memory-utilization", type=float, default=float(env("GPU_MEMORY_UTILIZATION", "0.9")),
                   help="on CUDA with --num-blocks 0 and no --kv-cache-memory-bytes: the share of the GPU's memory "
                        "this rank may fill; the pool gets it less what is in use once the weights are loaded "
                        "(vLLM's flag; TWINSPARK_GPU_MEMORY_UTILIZATION, default 0.9)")
    p.add_argument("--block-size", type=int, default=int(env("BLOCK_SIZE", "16")), help="positions per block")
    p.add_argument("--num-slots", type=int, default=int(env("NUM_SLOTS", "32")), help="KDA state slots")
    p.add_argument("--kv-host-bytes", type=int, default=int(env("KV_HOST_BYTES", "0")),
                   help="host-RAM KV tier behind the pool, bytes on this rank: evicted prefix blocks and KDA "
                        "snapshots wait here (TWINSPARK_KV_HOST_BYTES; 0 = off)")
    p.add_argument("--kv-disk-dir", default=env("KV_DISK_DIR"),
                   help="disk KV tier directory (TWINSPARK_KV_DISK_DIR; unset = off): entries pushed out of host RAM "
                        "land here, checksummed, and survive a restart with the same checkpoint and settings")
    p.add_argument("--kv-disk-bytes", type=int, default=int(env("KV_DISK_BYTES", str(64 << 30))),
                   help="disk KV tier size on this rank in bytes (TWINSPARK_KV_DISK_BYTES, default 64 GiB)")
    p.add_argument("--encoder-cache-tokens", type=int, default=int(env("ENCODER_CACHE_TOKENS", "16384")),
                   help="vision-tower output rows rank 0 keeps (LRU, keyed by the image's digest) so an image prompt "
                        "prefilled in several chunks is encoded once (TWINSPARK_ENCODER_CACHE_TOKENS, default 16384: "
                        "two of the largest images; 0 = off)")
    p.add_argument("--virtual-shards", type=int, default=int(env("VIRTUAL_SHARDS", "4")),
                   help="virtual shards per sharded dim (a multiple of --world; the same on every rank)")
    p.add_argument("--random-weights", default=env("RANDOM_WEIGHTS"), metavar="FORMAT",
                   help="draw random weights on the device instead of reading shards (--model still gives the config "
                        f"and the tokenizer): {RECIPE_HELP}; quantized linears are drawn packed "
                        "(TWINSPARK_RANDOM_WEIGHTS)")
    p.add_argument("--random-block-size", type=int, default=int(env("RANDOM_BLOCK_SIZE", "128")), metavar="N",
                   help="with --random-weights: fp8 block edge and w4a16 group size (TWINSPARK_RANDOM_BLOCK_SIZE)")
    add_internal_token_flag(p)
    p.add_argument("--log-level", default=env("LOG_LEVEL", "INFO"))
    p.set_defaults(func=run)


def _random_model(args: argparse.Namespace, recipe, sharding, group, dtype: torch.dtype, device):
    """The model of --model's config over weights drawn on the device (`--random-weights`)."""
    from model.config import ModelConfig
    from model.model import Glm5Model
    from model.parallel import Collective
    from model.random_weights import RandomWeightReader, spec_from_config

    cfg = ModelConfig.from_pretrained(args.model)
    reader = RandomWeightReader(spec_from_config(cfg), sharding, dtype, device, recipe=recipe, log=log.info)
    model = Glm5Model(cfg, reader, Collective(sharding, group))
    log.info("random weights: %.2f GiB drawn (whole tensors, before this rank's cut; %d tensors, %d quantized)",
             reader.bytes_made / 2**30, reader.tensors_made, reader.quantized_made)
    return model


def _sized_pool(args: argparse.Namespace, model, group, device: torch.device) -> int:
    """--num-blocks 0: the blocks this rank's memory holds beside its slots, the smallest over the group."""
    cost = pool_size.pool_cost(model.cfg, model.coll.sharding, block_size=args.block_size, dtype=model.dtype,
                               kv_dtype=KV_CACHE_DTYPES[args.kv_cache_dtype], with_mtp=model.mtp is not None)
    budget = pool_size.budget_bytes(device, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                                    gpu_memory_utilization=args.gpu_memory_utilization)
    mine = pool_size.blocks_for_budget(budget, cost, args.num_slots)
    log.info("kv pool budget %d bytes: %d per block of %d positions (%d per position), %d per KDA slot -> %d blocks",
             budget, cost.block_bytes, args.block_size, cost.block_bytes // args.block_size, cost.slot_bytes, mine)
    return pool_size.agree(mine, group, device)


def _leave(code: int) -> NoReturn:
    """End a rank that joined the group but refuses to go on. Not a normal return: the interpreter's exit then runs
    torch.distributed's C++ teardown, which now and then aborts ("terminate called without an active exception",
    SIGABRT instead of `code`) when the peers leave at the same moment. The log handlers flush every record."""
    os._exit(code)


def run(args: argparse.Namespace) -> int:
    from services.common.internal_auth import check_bind, group_digest
    from services.common.telemetry import setup_tracing
    from services.rank_worker import fingerprint as fp
    from services.rank_worker.distributed import join_group, rank_device
    from services.rank_worker.executor import Executor
    from services.rank_worker.kv_tiers import TierStore
    from model.model import Glm5Model
    from model.vision import VisionConfig
    from services.rank_worker.peer_watch import EXIT_PEER_LOST, PeerWatch
    from services.rank_worker.server import RankService, serve
    from twinspark.v1 import rank_pb2

    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s rank{args.rank} %(levelname)s %(message)s")
    try:
        check_bind(args.host, args.internal_token)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    setup_tracing(f"twinspark-rank{args.rank}")
    dtype = _DTYPES[args.dtype or ("bfloat16" if args.device == "cuda" else "float32")]
    recipe = None
    if args.random_weights:
        from model.quantize.select import Recipe

        try:
            recipe = Recipe.parse(args.random_weights, block=args.random_block_size)
        except ValueError as exc:
            log.error("--random-weights %s", exc)
            return 2
    if args.device == "cpu" and args.world > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    log.info("joining group as rank %d of %d via %s:%d", args.rank, args.world, args.master_addr, args.master_port)
    sharding, group = join_group(args.rank, args.world, master_addr=args.master_addr, master_port=args.master_port,
                                 device=args.device, virtual=args.virtual_shards)
    settings = fp.settings(model_dir=args.model, world=args.world, dtype=dtype, device=args.device,
                           virtual_shards=args.virtual_shards, num_blocks=args.num_blocks or "auto",
                           block_size=args.block_size, num_slots=args.num_slots,
                           kv_dtype=KV_CACHE_DTYPES[args.kv_cache_dtype],
                           random_weights=f"{args.random_weights} block {args.random_block_size}"
                           if args.random_weights else "")
    try:
        fp.check_group(settings, args.rank, args.world, token_digest=group_digest(args.internal_token))
    except RuntimeError as exc:
        log.error("%s", exc)
        _leave(4)
    try:
        PeerWatch(args.rank, args.world, master_addr=args.master_addr,
                  port=args.peer_port if args.peer_port is not None else args.master_port + 1,
                  timeout_s=args.peer_timeout).start()
    except (OSError, ValueError) as exc:  # TimeoutError is an OSError
        log.error("%s", exc)
        _leave(EXIT_PEER_LOST)
    device = rank_device(args.device, args.rank)
    # Random weights draw the text model only: no vision tower, so image requests are refused as for a text-only
    # checkpoint.
    vision = (VisionConfig.from_hf_dict(json.loads((Path(args.model) / "config.json").read_text()))
              if recipe is None else None)
    if recipe is not None:
        log.info("drawing random %s weights for %s's config (%s, %s)", args.random_weights, args.model, dtype,
                 args.device)
        model = _random_model(args, recipe, sharding, group, dtype, device)
    else:
        log.info("loading %s (%s, %s)", args.model, dtype, args.device)
        model = Glm5Model.load(args.model, sharding=sharding, group=group, dtype=dtype, device=device, progress=True,
                               load_vision=vision is not None and args.rank == 0)
    if device.type == "cuda":
        # Loading leaves freed staging memory in torch's caching allocator (per-shard tensors stacked into one,
        # dequantized copies): hand it back, or the pool sizing below counts it as in use and the pool comes out
        # that much smaller (vLLM does the same after its load).
        gc.collect()
        torch.cuda.empty_cache()
    try:
        num_blocks = args.num_blocks or _sized_pool(args, model, group, device)
    except ValueError as exc:
        log.error("%s", exc)
        _leave(2)
    window = pool_size.max_model_len(model.cfg, num_blocks, args.block_size)
    cache = model.new_cache(num_blocks=num_blocks, block_size=args.block_size, num_slots=args.num_slots,
                            kv_dtype=KV_CACHE_DTYPES[args.kv_cache_dtype])
    log.info("kv pool: %d blocks x %d positions, %d slots: max_model_len %d", num_blocks, args.block_size,
             args.num_slots, window)
    log.info("kv cache %s: %d bytes per block (%d as %s)", args.kv_cache_dtype, cache.kv_bytes_per_block(),
             cache.kv_bytes_per_block(dtype), str(dtype).removeprefix("torch."))
    tiers = None
    if args.kv_host_bytes > 0 or args.kv_disk_dir:
        tiers = TierStore(cache, host_bytes=max(0, args.kv_host_bytes), disk_dir=args.kv_disk_dir,
                          disk_bytes=max(0, args.kv_disk_bytes), rank=args.rank,
                          cache_key=fp.cache_key(settings, args.model))
        log.info("kv tiers: host %d bytes, disk %s (%d bytes, %d entries there); %d bytes per block, %d per state",
                 tiers.host_bytes, tiers.dir or "off", tiers.disk_bytes, len(tiers.listing()), tiers.block_bytes,
                 tiers.state_bytes)
    cfg = model.cfg
    describe = rank_pb2.DescribeReply(
        rank=args.rank, world=args.world, fingerprint=fp.fingerprint(settings), settings=settings,
        num_blocks=num_blocks, block_size=args.block_size, num_slots=args.num_slots, vocab_size=cfg.vocab_size,
        eos_token_ids=list(cfg.eos_token_id), max_model_len=window,
        model=os.path.basename(os.path.normpath(args.model)),
        instance_id=uuid.uuid4().hex,  # tells the scheduler a restarted group from the one it connected to
        tier_host_bytes=tiers.host_bytes if tiers else 0, tier_disk_bytes=tiers.disk_bytes if tiers else 0,
        block_bytes=tiers.block_bytes if tiers else 0, state_bytes=tiers.state_bytes if tiers else 0)
    executor = Executor(model, cache, cuda_graphs=not args.enforce_eager, tiers=tiers, vision=vision,
                        encoder_cache_tokens=args.encoder_cache_tokens if args.rank == 0 else 0)
    if executor.graphs is not None:  # before serving, as vLLM does: a lazy capture stalls the round that needs it
        # the same buckets on every rank (their collectives pair up), even if a rank was started with other slots
        executor.graphs.capture_at_start(pool_size.agree(args.num_slots, group, device))
    server = serve(RankService(executor, describe), args.host, args.port, args.internal_token)
    log.info("rank %d serving on %s:%d (cache: %d blocks x %d, %d slots)", args.rank, args.host, args.port,
             num_blocks, args.block_size, args.num_slots)
    # A few seconds' grace: a stopping scheduler sends one last plan saving its prefix cache to the disk KV tier.
    signal.signal(signal.SIGTERM, lambda *_: server.stop(grace=5 if tiers is not None else 1))
    server.wait_for_termination()
    return 0

