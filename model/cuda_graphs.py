"""CUDA graphs for decode rounds: the whole fused forward of a batch of decode-class rows, captured once per
(sequence bucket, row bucket, block-table width bucket, verify windows or not) and replayed with its input buffers
refilled.

A batch of B one-row decode steps replays the graph of the smallest bucket >= B; the rows past B are inert padding:
token 0 at position 0 of the rank's scratch slot and scratch block (PagedCache), and they take no part in expert
routing (`n_real`). A round with verify windows (drafts) replays a window graph: its sequences' kinds, lengths and
first rows are inputs like their positions (the kernels already take them as data), so one graph serves any mix of
windows and decode steps of up to its rows; its padding rows belong to padding sequences after the real ones. Each
window row leaves its KDA state in pending buffers shared by every window graph (the next round waits for the
commit, so one set is enough), and after a replay they are handed to the cache for the commit as an eager forward
would leave them. Without it every verify round ran eagerly, several graph steps' time in host launches alone
(docs/gpu-engine.md, "CUDA graphs"). Every kernel of the fast path is row-invariant (docs/design.md §5.1), so a
real row's bits are the same in the graph as in the eager forward of the same batch (tests/gpu checks replay ==
eager bit for bit). All graphs share one memory pool. vLLM's name for turning them off is kept: `--enforce-eager`.

When: a capture costs a few hundred ms on a small model and seconds on the release one, and a round that meets a new
shape waits for it — a cold stream's tokens came many times slower than the offline step, the stalls being these
captures (same section). So, as vLLM does, the rank captures before it serves: every batch bucket up to its KDA
slot count (no round has more decode rows than running sequences, each holding a slot) at the narrowest width.
That width is floored at the blocks of `index_topk` tokens: every context up to there (where chats start) shares
it, and it costs nothing there — its k-pools all fit the selection (no indexer scores), and the attention's extra
splits are empty and merge as zeros. Longer contexts capture their width when first seen (the log says what it cost).

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
from model.cache import PagedCache, PendingStates
from model.model import ForwardOutput, Glm5Model
from ops.fused import FusedForward
from ops.fused_rows import GpuRows

log = logging.getLogger("twinspark.rank")

# vLLM's capture sizes: 1, 2, 4, then every 8 up to 256
BATCH_BUCKETS = (1, 2, 4, *range(8, 257, 8))
# Rounds with verify windows replay a graph up to this many rows (one sequence with 16 drafts needs 17): each row
# keeps its KDA state until the commit, 4 MiB a KDA layer at the release's widths (64 heads of 128 x 128 fp32).
WINDOW_ROWS = 24


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
    tokens: torch.Tensor  # int64 [R] (refilled on the device from the batch's device tensor)
    tables: torch.Tensor  # int32 [B, W] (likewise)
    out: ForwardOutput
    # What the captured kernels read besides the above (row numbers, per-sequence vectors): the graph holds their
    # addresses, so they must live as long as it does.
    rows: GpuRows
    batch: Batch
    replays: int = 0


def _layout(seqs: int, rows: int) -> list[int]:
    """The host-filled inputs: [positions R | row_seq R | row0 B | length B | slot B | fresh B | pending B |
    n_real 1] (the per-row and per-sequence vectors of `GpuRows` and `DecodeSeqs`)."""
    return [rows, rows, seqs, seqs, seqs, seqs, seqs, 1]


def _padding_lengths(pad_seqs: int, pad_rows: int) -> list[int]:
    """Rows of each padding sequence: one each while they last, the last one takes the rest (a decode graph has a
    padding sequence per padding row; a window graph has at least one, which may be empty)."""
    lengths = [0] * pad_seqs
    for i in range(pad_rows):
        lengths[min(i, pad_seqs - 1)] += 1
    return lengths


def graph_inputs(batch: Batch, seqs: int, rows: int, scratch_slot: int) -> list[int]:
    """The host-filled inputs of a replay (`_layout`) for a batch of decode-class rows in a graph of `seqs`
    sequences and `rows` rows. Padding sequences come after the real ones, on the scratch slot (and block), from
    position 0, as decode steps."""
    b, n = batch.num_seqs, sum(batch.lengths)
    pad_lengths = _padding_lengths(seqs - b, rows - n)
    lengths = batch.lengths + pad_lengths
    starts = batch.starts + [0] * len(pad_lengths)
    offsets = [sum(lengths[:s]) for s in range(seqs)]
    verify = [batch.is_verify(s) for s in range(b)] + [False] * len(pad_lengths)
    vectors = [[st + r for st, n_s in zip(starts, lengths) for r in range(n_s)],
               [s for s, n_s in enumerate(lengths) for _ in range(n_s)], offsets, lengths,
               batch.slots + [scratch_slot] * len(pad_lengths), [int(st == 0) for st in starts],
               [o if v else -1 for o, v in zip(offsets, verify)], [n]]
    return [x for v in vectors for x in v]


def warmup_inputs(seqs: int, rows: int, window: bool, scratch_slot: int) -> list[int]:
    """The host-filled inputs (`_layout`) a graph is warmed up and captured with: padding on the scratch slot, one
    sequence holding every row (a window when `window`), the others empty, no row routed."""
    vectors = [[0] * rows, [0] * rows, [0] * seqs, [rows] + [0] * (seqs - 1), [scratch_slot] * seqs, [1] * seqs,
               [0 if window else -1] + [-1] * (seqs - 1), [0]]
    return [x for v in vectors for x in v]


class DecodeGraphs:
    def __init__(self, model: Glm5Model, cache: PagedCache, staging: int = 2, window_rows: int = WINDOW_ROWS
                 ) -> None:
        """staging: the replays of one graph whose input copies may be queued and not yet run when the host fills
        another: 2 for a rank that queues round n+1 before it waits for round n, times the decode steps a round may
        replay (StepPlan.steps). window_rows: the most rows a round with verify windows replays (0: such rounds
        run eagerly)."""
        self.model = model
        self.cache = cache
        self.staging = staging
        self.window_rows = window_rows
        # (sequences, rows, width, verify windows, layers whose outputs it returns) -> graph
        self.graphs: dict[tuple[int, int, int, bool, tuple[int, ...]], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.max_width = cache.num_blocks  # no sequence addresses more blocks than the cache has
        self.min_width = _pow2(-(-model.cfg.index_topk // cache.block_size))  # see the module docstring
        # The window graphs' pending buffers (KDA layer -> (state, conv), `pending_rows` rows each): one set for all
        # of them, as only one round with verify windows is in flight (the next waits for its commit).
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pending_rows = 0
        # The layers whose outputs replays return besides logits: the first set a round asked for (a drafter's
        # target layers do not change while it serves); a round asking for another set runs eagerly, so no plan
        # can make the rank capture graph after graph.
        self.layers: tuple[int, ...] | None = None

    def fits(self, batch: Batch, layers: tuple[int, ...] = ()) -> bool:
        """A round of one-row decode steps, or of decode steps and verify windows of `window_rows` rows in all (no
        prompt chunk), within the largest bucket (a window graph keeps one padding sequence), asking for no layer
        outputs or for the set the graphs return."""
        if batch.hidden is not None or any(batch.is_prompt(s) for s in range(batch.num_seqs)):
            return False
        if layers and self.layers not in (None, layers):
            return False
        if batch.has_verify:
            return sum(batch.lengths) <= self.window_rows and batch.num_seqs < BATCH_BUCKETS[-1]
        return batch.num_seqs <= BATCH_BUCKETS[-1] and all(n == 1 for n in batch.lengths)

    def width(self, table_width: int) -> int:
        return graph_width(table_width, floor=self.min_width, cap=self.max_width)

    def capture_at_start(self, max_rows: int) -> None:
        """Capture every batch bucket up to `max_rows` decode rows at the narrowest width, before serving. Every rank
        of a group captures the same shapes in the same order (their collectives pair up, as in a round)."""
        buckets = start_buckets(max_rows)
        t0 = time.perf_counter()
        for bucket in tqdm(buckets, desc="capturing CUDA graphs", unit="graph"):
            self._graph(bucket, bucket, self.width(1), False, quiet=True)
        log.info("captured %d CUDA graphs (decode rows %s, block tables of %d) in %.1f s, pool %.2f GiB reserved",
                 len(buckets), ",".join(map(str, buckets)), self.width(1), time.perf_counter() - t0,
                 torch.cuda.memory_reserved(self.model.device) / 2**30)

    def run(self, batch: Batch, layers: tuple[int, ...] = ()) -> ForwardOutput:
        """The batch's forward by a replay (`fits` holds). layers: also these layers' outputs (a drafter that reads
        the target's hidden states, DFlash2, asks for the same ones every round: its graphs are captured with them)."""
        b, n = batch.num_seqs, sum(batch.lengths)
        if layers:
            self.layers = layers
        if batch.has_verify:  # one padding sequence at least, to own the padding rows (and stand in for commits)
            seqs, rows = _bucket(b + 1, BATCH_BUCKETS), _bucket(n, BATCH_BUCKETS)
        else:
            seqs = rows = _bucket(b, BATCH_BUCKETS)
        g = self._graph(seqs, rows, self.width(batch.block_tables.shape[1]), batch.has_verify, tuple(layers))
        self._fill(g, batch, seqs, rows)
        g.graph.replay()
        if batch.has_verify:  # the windows' states wait in the shared buffers for the commit, as in an eager forward
            verify = [s for s in range(b) if batch.is_verify(s)]
            first = [batch.offsets[s] for s in verify]
            for layer, (state, conv) in self.pending.items():
                self.cache.pending[layer] = PendingStates(verify, first, state, conv)
        wanted = batch.logit_rows.cpu()
        logits = g.out.logits[:n] if torch.equal(wanted, torch.arange(n)) else \
            g.out.logits[wanted.to(g.out.logits.device)]
        return ForwardOutput(logits, g.out.hidden[:n], None if g.out.layers is None else g.out.layers[:n])

    def _graph(self, seqs: int, rows: int, width: int, window: bool, layers: tuple[int, ...] = (),
               quiet: bool = False) -> _Graph:
        key = (seqs, rows, width, window, layers)
        g = self.graphs.get(key)
        if g is None:
            t0 = time.perf_counter()
            g = self._capture(seqs, rows, width, window, layers)
            self.graphs[key] = g
            if not quiet:  # a capture while serving: what it cost the round that met a new shape (a stall)
                log.info("captured a CUDA graph for %d %s rows of %d sequences, block tables of %d in %.0f ms (%d "
                         "graphs, pool %.2f GiB reserved)", rows, "verify" if window else "decode", seqs, width,
                         (time.perf_counter() - t0) * 1e3, len(self.graphs),
                         torch.cuda.memory_reserved(self.model.device) / 2**30)
        return g

    def _fill(self, g: _Graph, batch: Batch, seqs: int, rows: int) -> None:
        """Refill the inputs: the host facts through the pinned buffer (one copy), token ids and block tables
        device to device (the batch holds them on the GPU; reading them back would sync)."""
        b, n = batch.num_seqs, sum(batch.lengths)
        host = g.hosts[g.replays % self.staging]
        g.replays += 1
        host.copy_(torch.tensor(graph_inputs(batch, seqs, rows, self.cache.scratch_slot), dtype=torch.int32))
        g.packed.copy_(host, non_blocking=True)
        g.tokens[n:].zero_()
        g.tokens[:n].copy_(batch.token_ids)
        g.tables.fill_(self.cache.scratch_block)
        g.tables[:b, : batch.block_tables.shape[1]].copy_(batch.block_tables)

    def _pending_buffers(self, rows: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The shared pending buffers, at least `rows` rows. Growing them drops the window graphs captured over the
        smaller ones (they hold its addresses; their next round captures them again)."""
        if rows > self.pending_rows:
            self.graphs = {k: g for k, g in self.graphs.items() if not g.rows.verify}
            self.pending = {}  # before the new ones are allocated: the old memory can serve them
            c = self.cache
            self.pending = {layer: (torch.empty(rows, *state.shape[1:], dtype=state.dtype, device=state.device),
                                    torch.empty(rows, *c.conv_state[layer].shape[1:], dtype=c.conv_state[layer].dtype,
                                                device=state.device))
                            for layer, state in c.kda_state.items()}
            self.pending_rows = rows
            log.info("verify windows in CUDA graphs: pending KDA states for %d rows, %.2f GiB", rows,
                     sum(s.nbytes + h.nbytes for s, h in self.pending.values()) / 2**30)
        return self.pending

    def _capture(self, seqs: int, rows: int, width: int, window: bool, layers: tuple[int, ...]) -> _Graph:
        """The graph of a bucket: `rows` decode-class rows of `seqs` sequences, with verify windows or one-row decode
        steps only (a window graph takes every sequence's kind and length as inputs: one graph serves any mix)."""
        dev = self.model.device
        layout = _layout(seqs, rows)
        packed = torch.zeros(sum(layout), dtype=torch.int32, device=dev)
        hosts = torch.zeros(self.staging, sum(layout), dtype=torch.int32).pin_memory()
        positions, row_seq, row0, length, slot, fresh, pending, n_real = torch.split(packed, layout)
        tokens = torch.zeros(rows, dtype=torch.int64, device=dev)
        tables = torch.zeros(seqs, width, dtype=torch.int32, device=dev)
        kda = DecodeSeqs(row0=row0, length=length, slot=slot, fresh=fresh, pending=pending)
        cfg = self.model.cfg
        keep = cfg.index_topk // cfg.index_kpool
        max_pools = max(keep, width * self.cache.block_size // cfg.index_kpool)
        # a window graph always has verify windows to the kernels (which rows are is data): its pending buffers
        # are the shared ones, so no graph allocates its own
        verify = [0] if window else []
        gpu_rows = GpuRows(n_rows=rows, decode_rows=rows, positions=positions, row_seq=row_seq, tables=tables,
                           n_real=n_real, kda=kda, verify=verify, verify_rows=verify, prompt=None, max_pools=max_pools,
                           pending=self._pending_buffers(rows) if window else None)
        batch = Batch(token_ids=tokens, starts=[0] * rows, lengths=[1] * rows, block_tables=tables,
                      slots=[self.cache.scratch_slot] * rows, logit_rows=torch.arange(rows), prompt=[False] * rows)
        # Inputs as padding while warming up (Triton compiles, cuBLAS-free, allocator settles): scratch only, one
        # sequence of every row (a window), the others empty.
        packed.copy_(torch.tensor(warmup_inputs(seqs, rows, window, self.cache.scratch_slot), dtype=torch.int32))
        tables.fill_(self.cache.scratch_block)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.model.run(FusedForward(batch, self.cache, gpu_rows), layers)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.model.run(FusedForward(batch, self.cache, gpu_rows), layers)
        for layer in self.pending:  # what the capture's windows left for a commit that will not come
            self.cache.pending.pop(layer, None)
        return _Graph(graph, packed, hosts, tokens, tables, out, gpu_rows, batch)
