"""CUDA graphs for decode rounds: the whole fused forward of a batch of one-row decode steps, captured once per
(batch bucket, block-table width bucket) and replayed with its input buffers refilled.

A batch of B decode rows replays the graph of the smallest bucket >= B; the rows past B are inert padding: token 0
at position 0 of the rank's scratch slot and scratch block (PagedCache), and they take no part in expert routing
(`n_real`). Every kernel of the fast path is row-invariant (docs/design.md §5.1), so a real row's bits are the same in the
graph as in the eager forward of the same batch (tests/gpu checks replay == eager bit for bit). All graphs share one
memory pool. vLLM's name for turning them off is kept: `--enforce-eager`.

When: a capture costs a few hundred ms on a small model and seconds on the release one, and a round that meets a new
shape waits for it — on the H200 a cold stream's tokens came 30x slower than the offline step, the stalls being
these captures. So, as vLLM does, the rank captures before it serves: every batch bucket up to its KDA slot count
(no round has more decode rows than running sequences, each holding a slot) at the narrowest width. That width is
floored at the blocks of `index_topk` tokens: every context up to there (where chats start) shares it, and it costs
nothing there — its k-pools all fit the selection (no indexer scores), and the attention's extra splits are empty
and merge as zeros. Longer contexts capture their width when first seen (the log says what it cost).

Outputs are views into the graph's static buffers: valid until the next replay (the executor samples at once).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from kernels.gpu.seqs import DecodeSeqs
from model.batch import Batch
from model.cache import PagedCache
from model.model import ForwardOutput, Glm5Model
from ops.fused import FusedForward
from ops.fused_rows import GpuRows

log = logging.getLogger("twinspark.rank")

# vLLM's capture sizes: 1, 2, 4, then every 8 up to 256
BATCH_BUCKETS = (1, 2, 4, *range(8, 257, 8))


def _bucket(n: int, sizes: tuple[int, ...]) -> int | None:
    return next((b for b in sizes if b >= n), None)


def _pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def graph_width(table_width: int, *, floor: int, cap: int) -> int:
    """The block-table width a batch's graph is captured at: a power of two, at least `floor`, at most `cap`."""
    return min(cap, max(floor, _pow2(table_width)))


def start_buckets(max_rows: int) -> list[int]:
    """The batch buckets captured before serving: every one up to the bucket of `max_rows` decode rows."""
    top = _bucket(min(max_rows, BATCH_BUCKETS[-1]), BATCH_BUCKETS)
    return [b for b in BATCH_BUCKETS if b <= top]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    packed: torch.Tensor  # int32 device buffer the host-filled inputs are views of (one copy refills them)
    # Pinned int32 staging rows of the same layout, used in turn (`DecodeGraphs.staging`): a replay's copy out of
    # its row may not have run when the host fills the next one.
    hosts: torch.Tensor
    tokens: torch.Tensor  # int64 [B] (refilled on the device from the batch's device tensor)
    tables: torch.Tensor  # int32 [B, W] (likewise)
    out: ForwardOutput
    # What the captured kernels read besides the above (row numbers, per-sequence vectors): the graph holds their
    # addresses, so they must live as long as it does.
    rows: GpuRows
    batch: Batch
    replays: int = 0


class DecodeGraphs:
    def __init__(self, model: Glm5Model, cache: PagedCache, staging: int = 2) -> None:
        """staging: the replays of one graph whose input copies may be queued and not yet run when the host fills
        another: 2 for a rank that queues round n+1 before it waits for round n, times the decode steps a round may
        replay (StepPlan.steps)."""
        self.model = model
        self.cache = cache
        self.staging = staging
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.max_width = cache.num_blocks  # no sequence addresses more blocks than the cache has
        self.min_width = _pow2(-(-model.cfg.index_topk // cache.block_size))  # see the module docstring

    def fits(self, batch: Batch) -> bool:
        """A round of one-row decode steps only (no prompt chunk, no verify window), within the largest bucket."""
        if batch.hidden is not None or batch.num_seqs > BATCH_BUCKETS[-1]:
            return False
        if batch.has_verify:
            return False
        return all(n == 1 and not batch.is_prompt(s) for s, n in enumerate(batch.lengths))

    def width(self, table_width: int) -> int:
        return graph_width(table_width, floor=self.min_width, cap=self.max_width)

    def capture_at_start(self, max_rows: int) -> None:
        """Capture every batch bucket up to `max_rows` decode rows at the narrowest width, before serving. Every rank
        of a group captures the same shapes in the same order (their collectives pair up, as in a round)."""
        buckets = start_buckets(max_rows)
        t0 = time.perf_counter()
        for bucket in tqdm(buckets, desc="capturing CUDA graphs", unit="graph"):
            self._graph(bucket, self.width(1), quiet=True)
        log.info("captured %d CUDA graphs (decode rows %s, block tables of %d) in %.1f s, pool %.2f GiB reserved",
                 len(buckets), ",".join(map(str, buckets)), self.width(1), time.perf_counter() - t0,
                 torch.cuda.memory_reserved(self.model.device) / 2**30)

    def run(self, batch: Batch) -> ForwardOutput:
        b = batch.num_seqs
        bucket = _bucket(b, BATCH_BUCKETS)
        g = self._graph(bucket, self.width(batch.block_tables.shape[1]))
        self._fill(g, batch, bucket)
        g.graph.replay()
        return ForwardOutput(g.out.logits[:b], g.out.hidden[:b])

    def _graph(self, bucket: int, width: int, quiet: bool = False) -> _Graph:
        key = (bucket, width)
        g = self.graphs.get(key)
        if g is None:
            t0 = time.perf_counter()
            g = self._capture(bucket, width)
            self.graphs[key] = g
            if not quiet:  # a capture while serving: what it cost the round that met a new shape (a stall)
                log.info("captured a CUDA graph for %d decode rows, block tables of %d in %.0f ms (%d graphs, pool "
                         "%.2f GiB reserved)", bucket, width, (time.perf_counter() - t0) * 1e3, len(self.graphs),
                         torch.cuda.memory_reserved(self.model.device) / 2**30)
        return g

    # ----- host-filled static inputs: [positions B | slots B | fresh B | n_real 1] -----

    @staticmethod
    def _layout(bucket: int) -> list[int]:
        return [bucket, bucket, bucket, 1]

    def _fill(self, g: _Graph, batch: Batch, bucket: int) -> None:
        """Refill the inputs: the host facts through the pinned buffer (one copy), token ids and block tables
        device to device (the batch holds them on the GPU; reading them back would sync)."""
        b = batch.num_seqs
        pad = bucket - b
        host = g.hosts[g.replays % self.staging]
        g.replays += 1
        positions, slots, fresh, n_real = torch.split(host, self._layout(bucket))
        positions.copy_(torch.tensor(batch.starts + [0] * pad, dtype=torch.int32))
        slots.copy_(torch.tensor(batch.slots + [self.cache.scratch_slot] * pad, dtype=torch.int32))
        fresh.copy_(torch.tensor([int(s == 0) for s in batch.starts] + [1] * pad, dtype=torch.int32))
        n_real[0] = b
        g.packed.copy_(host, non_blocking=True)
        g.tokens[b:].zero_()
        g.tokens[:b].copy_(batch.token_ids)
        g.tables.fill_(self.cache.scratch_block)
        g.tables[:b, : batch.block_tables.shape[1]].copy_(batch.block_tables)

    def _capture(self, bucket: int, width: int) -> _Graph:
        dev = self.model.device
        n = sum(self._layout(bucket))
        packed = torch.zeros(n, dtype=torch.int32, device=dev)
        hosts = torch.zeros(self.staging, n, dtype=torch.int32).pin_memory()
        positions, slots, fresh, n_real = torch.split(packed, self._layout(bucket))
        tokens = torch.zeros(bucket, dtype=torch.int64, device=dev)
        tables = torch.zeros(bucket, width, dtype=torch.int32, device=dev)
        arange = torch.arange(bucket, dtype=torch.int32, device=dev)
        kda = DecodeSeqs(row0=arange, length=torch.ones_like(arange), slot=slots, fresh=fresh,
                         pending=torch.full_like(arange, -1), commit=arange.long())
        cfg = self.model.cfg
        keep = cfg.index_topk // cfg.index_kpool
        max_pools = max(keep, width * self.cache.block_size // cfg.index_kpool)
        rows = GpuRows(n_rows=bucket, decode_rows=bucket, positions=positions, row_seq=arange, tables=tables,
                       n_real=n_real, kda=kda, verify=[], window=0, prompt=None, max_pools=max_pools)
        batch = Batch(token_ids=tokens, starts=[0] * bucket, lengths=[1] * bucket, block_tables=tables,
                      slots=[self.cache.scratch_slot] * bucket, logit_rows=torch.arange(bucket),
                      prompt=[False] * bucket)
        # Inputs as padding while warming up (Triton compiles, cuBLAS-free, allocator settles): scratch only.
        tables.fill_(self.cache.scratch_block)
        slots.fill_(self.cache.scratch_slot)
        fresh.fill_(1)
        n_real.fill_(0)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.model.run(FusedForward(batch, self.cache, rows))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.model.run(FusedForward(batch, self.cache, rows))
        return _Graph(graph, packed, hosts, tokens, tables, out, rows, batch)
