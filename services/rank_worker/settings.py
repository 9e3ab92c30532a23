"""`twinspark serve-rank`'s settings: every flag of a rank worker, read once from the command line and the
TWINSPARK_* environment, then handed to the boot sequence (boot.py) as one frozen object."""

from __future__ import annotations

from dataclasses import dataclass

from services.common import shared_flags as shared
from services.common.flags import flag
from services.common.role_start import RoleSettings


@dataclass(frozen=True, kw_only=True)
class RankSettings(RoleSettings):
    model: str = flag(shared.MODEL, required=True)
    rank: int = flag("rank", "this rank", default="0", type=int)
    world: int = flag("world", "number of ranks", default="1", type=int, env="TP")
    master_addr: str = flag("master-addr", "rank 0's address for the collective", default="127.0.0.1")
    master_port: int = flag("master-port", "rank 0's port for the collective", default="29500", type=int)
    collective: str = flag(shared.COLLECTIVE)
    collective_slot_bytes: int = flag(
        "collective-slot-bytes", "--collective ipc: bytes of a rank's slot. CPU: the largest single exchange (a "
        "round's fp32 partials or logits columns; larger is refused), the region holds 2 x --world slots in /dev/shm, "
        "pages taken as they are first written. CUDA: each rank holds 2 slots of device memory and a larger "
        "exchange goes in several calls", default=str(64 << 20), type=int, metavar="BYTES")
    peer_port: int | None = flag("peer-port", "rank 0's port for the peer watchdog's heartbeat connections "
                                 "(default --master-port + 1)", type=int)
    peer_timeout: float = flag(shared.PEER_TIMEOUT)
    host: str = flag("host", "gRPC listen address (default loopback; another address needs --internal-token)",
                     default="127.0.0.1", env="RANK_HOST")
    port: int = flag("port", "gRPC port", default="50061", type=int, env="RANK_PORT")
    device: str = flag(shared.DEVICE)
    dtype: str | None = flag(shared.DTYPE)
    kv_cache_dtype: str = flag(shared.KV_CACHE_DTYPE)
    rest_fp8_kernel: str = flag(shared.REST_FP8_KERNEL)
    enforce_eager: bool = flag(shared.ENFORCE_EAGER)
    num_blocks: int = flag(shared.NUM_BLOCKS)
    kv_cache_memory_bytes: int = flag(shared.KV_CACHE_MEMORY_BYTES)
    gpu_memory_utilization: float = flag(shared.GPU_MEMORY_UTILIZATION)
    block_size: int = flag(shared.BLOCK_SIZE)
    num_slots: int = flag(shared.NUM_SLOTS)
    kv_host_bytes: int = flag(shared.KV_HOST_BYTES)
    kv_disk_dir: str | None = flag(shared.KV_DISK_DIR)
    kv_disk_bytes: int = flag(shared.KV_DISK_BYTES)
    encoder_cache_tokens: int = flag(
        "encoder-cache-tokens", "vision-tower output rows rank 0 keeps (LRU, keyed by the image's digest) so an image "
        "prompt prefilled in several chunks is encoded once (default 16384: two of the largest images; 0 = off)",
        default="16384", type=int)
    max_num_batched_tokens: int | None = flag(
        shared.MAX_NUM_BATCHED_TOKENS, "the scheduler's round budget: on a GPU the rank warms up at it before serving "
        "(compiles every kernel a round of that size needs; default: 8192 on CUDA)")
    virtual_shards: int = flag("virtual-shards", "virtual shards per sharded dim (a multiple of --world; the same on "
                               "every rank)", default="4", type=int)
    stats_interval: float = flag(
        "stats-interval", "seconds between the log lines that say where the serving loop's time went (GPU per round, "
        "GPU idle between rounds, host launch, read-back and plan waits; services/rank_worker/round_stats.py); "
        "0 = no lines", default="10", type=float, metavar="S")
    random_weights: str | None = flag(shared.RANDOM_WEIGHTS)
    random_block_size: int = flag(shared.RANDOM_BLOCK_SIZE)

    @property
    def compute_dtype(self) -> str:
        return shared.compute_dtype(self.dtype, self.device)

    @property
    def watchdog_port(self) -> int:
        return self.peer_port if self.peer_port is not None else self.master_port + 1
