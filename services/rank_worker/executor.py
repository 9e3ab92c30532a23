"""StepPlan -> one forward of this rank's shard -> the sampled token of every sample row.

Every rank runs the same plan on its shard and ends in the same state. A plan is checked before anything runs;
since every rank checks the same plan the same way, they all refuse it together instead of one entering the
collective alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kernels import gpu
from kernels.gpu import to_device
from kernels.penalties import Penalties, apply_penalties
from kernels.sampling import Filters, SamplingParams, apply_token_bitmask, processed_logprobs, sample
from kernels.sampling_rules import (FREQUENCY_PENALTY, LOGIT_BIAS, MIN_P, PRESENCE_PENALTY, REPETITION_PENALTY,
                                    TEMPERATURE, TOP_K, TOP_LOGPROBS, TOP_P)
from services.common.tensors import from_proto
from services.rank_worker.encoder_cache import EncoderCache
from services.rank_worker.kv_tiers import TierStore
from model.batch import Batch
from model.cache import PagedCache
from model.model import ForwardOutput, Glm5Model, accept_drafts
from model.vision import VisionConfig
from twinspark.v1 import rank_pb2
from twinspark.v1.rank_pb2 import StepPlan


# A token id of StepPlan.token_ids meaning "the token this rank sampled last for this sequence's slot".
PENDING_TOKEN = -1


class PlanError(ValueError):
    """The plan is malformed or addresses memory this rank does not have."""


class ImagePart(NamedTuple):
    """One image of a plan, validated: its embeddings [first, first + count) go to packed rows row.."""
    row: int
    first: int
    count: int
    pixels: torch.Tensor
    grid: tuple[int, int, int]
    digest: bytes  # the request's sha256 of the pixels (empty: not known, the tower's output is not kept)


@dataclass
class StepOutput:
    sampled: list[int]
    forward_ms: float
    sample_ms: float
    accepted: list[int] | None = None  # per sequence, when the plan has verify windows
    hidden: torch.Tensor | None = None  # [R, D] fp32, when the plan wants hidden states
    logprobs: "RowLogprobs | None" = None  # when the plan asks for logprobs
    tier_bad: list[bytes] | None = None  # tier entries that failed their checksum on some rank (dropped on all)


@dataclass
class RowLogprobs:
    """Per sample row: the sampled token's logprob [R], and the top-K ids / logprobs [R, K] (rows that asked
    for fewer than K, or none, carry the same K columns; the scheduler reads only what each row asked for)."""

    chosen: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


@dataclass
class Launched:
    """A round whose work is queued on the device (`Executor.launch`): what `Executor.finish` reads back. On a GPU
    the results are copied to pinned host memory behind the round's kernels; `done` passes when they are there."""

    batch: Batch | None  # in class order; None for a plan of tier moves only
    order: list[int]  # batch sequence -> plan sequence
    rows: torch.Tensor  # host int64 sample rows in the batch's row order
    sampled: torch.Tensor  # int64 [R], on the host once `done` has passed
    logprobs: RowLogprobs | None
    hidden: torch.Tensor | None
    tier_bad: list[bytes] | None
    forward_ms: float
    t1: float  # perf_counter when the forward had been queued
    done: torch.cuda.Event | None  # None: the work ran synchronously (CPU)

    def ready(self) -> bool:
        """Whether reading this round back would not wait."""
        return self.done is None or self.done.query()

    @property
    def overlappable(self) -> bool:
        """Whether the next round may be launched before this one is read back: on a device that runs
        asynchronously, and without verify windows (accepting drafts changes the KDA state the next round starts
        from, and the acceptance is decided on the host)."""
        return self.done is not None and not (self.batch is not None and self.batch.has_verify)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """Start copying a device result to the host without waiting: valid once the round's event has passed."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def _flags(plan: StepPlan, name: str, n: int) -> list[bool] | None:
    """A per-sequence int32 flag vector of the plan; None when the plan leaves it empty."""
    msg = getattr(plan, name)
    if not plan.HasField(name) or not msg.shape or not msg.shape[0]:
        return None
    flags = _vec(msg, name, torch.int64, n)
    if bool(((flags != 0) & (flags != 1)).any()):
        raise PlanError(f"{name} flags must be 0 or 1")
    return [bool(f) for f in flags.tolist()]


# ------------------------------------------------------------------------------------------------- validation
# A plan is checked whole before anything runs (PlanError): every rank refuses the same plan alike. Beyond shapes and
# ranges, counts are bounded by what the cache can hold, so no plan makes a rank allocate or loop without end.

_INT_DTYPES = (torch.int32, torch.int64)


def _tensor(msg, name: str, dtype: torch.dtype) -> torch.Tensor:
    """Unpack a plan tensor whose wire dtype is of `dtype`'s kind (integers for ids, float32 for sampling values:
    a float token id or an integer temperature is a malformed plan, not something to round)."""
    try:
        t = from_proto(msg)
    except ValueError as exc:
        raise PlanError(f"{name}: {exc}") from exc
    ok = t.dtype in _INT_DTYPES if dtype in _INT_DTYPES else t.dtype == torch.float32
    if not ok:
        raise PlanError(f"{name}: {msg.dtype} is not a valid dtype here (expected "
                        f"{'int32 or int64' if dtype in _INT_DTYPES else 'float32'})")
    return t.to(dtype)


def _vec(msg, name: str, dtype: torch.dtype, length: int | None = None) -> torch.Tensor:
    t = _tensor(msg, name, dtype)
    if t.dim() != 1 or (length is not None and t.numel() != length):
        raise PlanError(f"{name}: expected a vector of {length if length is not None else 'n'} values, got {list(t.shape)}")
    return t


def check_counts(tokens: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor, cache: PagedCache) -> None:
    """Sizes no honest plan exceeds: rows that fit the cache, tables no wider than the cache, and at most one sample
    per row."""
    capacity = cache.num_blocks * cache.block_size
    if tokens.numel() > capacity:
        raise PlanError(f"{tokens.numel()} token rows exceed the cache's {capacity} positions")
    if tables.shape[1] > cache.num_blocks:
        raise PlanError(f"block tables of width {tables.shape[1]} exceed the cache's {cache.num_blocks} blocks")
    if rows.numel() > tokens.numel():
        raise PlanError(f"{rows.numel()} sample rows for {tokens.numel()} token rows")


def check_positions(starts: torch.Tensor, lengths: torch.Tensor, max_positions: int) -> None:
    """Every row inside the model's window (starts first: near the int64 limit, starts + lengths would wrap)."""
    if bool((starts > max_positions).any()) or bool(((starts + lengths) > max_positions).any()):
        raise PlanError(f"a sequence runs past the model's {max_positions} positions")


def check_sampling(params: SamplingParams) -> None:
    """The ranges the scheduler validates requests against (kernels/sampling_rules.py)."""
    for rule, t in ((TEMPERATURE, params.temperature), (TOP_P, params.top_p), (TOP_K, params.top_k),
                    (MIN_P, params.min_p)):
        if not rule.holds(t):
            raise PlanError(f"{rule.name} must be {rule}")


def _matrix(msg, name: str, dtype: torch.dtype, rows: int) -> torch.Tensor:
    t = _tensor(msg, name, dtype)
    if t.dim() != 2 or t.shape[0] != rows:
        raise PlanError(f"{name}: expected [{rows}, n], got {list(t.shape)}")
    return t


def _id_lists(msg, name: str, rows: int, vocab: int) -> torch.Tensor:
    """int64 [rows, n] token ids padded with -1, distinct within each row (a scatter of repeated ids would depend
    on its order on a GPU)."""
    t = _matrix(msg, name, torch.int64, rows)
    if t.shape[1] > vocab:
        raise PlanError(f"{name}: {t.shape[1]} ids per row for a vocabulary of {vocab}")
    if bool((t < -1).any()) or bool((t >= vocab).any()):
        raise PlanError(f"{name}: ids must be in [0, {vocab}) or -1 (padding)")
    s = t.sort(dim=1).values
    if bool(((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any()):
        raise PlanError(f"{name}: an id is listed twice in one row")
    return t


def row_penalties(plan: StepPlan, r: int, vocab: int, max_positions: int) -> Penalties | None:
    """The plan's penalties (StepPlan.penalties), validated, on the host; None when no row uses any. Ranges are
    the gateway's and the scheduler's (kernels/sampling_rules.py)."""
    if not plan.HasField("penalties"):
        return None
    p = plan.penalties
    rows = _vec(p.rows, "penalties.rows", torch.int64)
    q = rows.numel()
    if q == 0:
        return None
    if bool((rows < 0).any()) or bool((rows >= r).any()) or bool((rows[1:] <= rows[:-1]).any()):
        raise PlanError(f"penalties.rows must be ascending sample rows in [0, {r})")
    presence = _vec(p.presence, "penalties.presence", torch.float32, q)
    frequency = _vec(p.frequency, "penalties.frequency", torch.float32, q)
    repetition = _vec(p.repetition, "penalties.repetition", torch.float32, q)
    for rule, t in ((PRESENCE_PENALTY, presence), (FREQUENCY_PENALTY, frequency), (REPETITION_PENALTY, repetition)):
        if not rule.holds(t):
            raise PlanError(f"{rule.name} must be {rule}")
    seen = _id_lists(p.seen_ids, "penalties.seen_ids", q, vocab)
    counts = _matrix(p.seen_counts, "penalties.seen_counts", torch.int64, q)
    if counts.shape != seen.shape or bool((counts < 0).any()) or bool((counts > max_positions).any()) \
            or bool(((seen < 0) & (counts != 0)).any()):
        raise PlanError(f"penalties.seen_counts must be [Q, P] like seen_ids, in [0, {max_positions}], 0 at padding")
    bias_ids = _id_lists(p.bias_ids, "penalties.bias_ids", q, vocab)
    bias = _matrix(p.bias_values, "penalties.bias_values", torch.float32, q)
    if bias.shape != bias_ids.shape or not LOGIT_BIAS.holds(bias):
        raise PlanError(f"penalties.bias_values must be [Q, B] like bias_ids, {LOGIT_BIAS}")
    banned = _id_lists(p.banned_ids, "penalties.banned_ids", q, vocab)
    return Penalties(rows, presence, frequency, repetition, seen, counts, bias_ids, bias, banned)


MAX_KEY = 64  # bytes of a tier key (the scheduler's are 16)


class Executor:
    def __init__(self, model: Glm5Model, cache: PagedCache, *, cuda_graphs: bool = True,
                 tiers: TierStore | None = None, vision: VisionConfig | None = None,
                 encoder_cache_tokens: int = 0) -> None:
        """cuda_graphs: replay decode rounds from CUDA graphs on a GPU (vLLM's `--enforce-eager` turns it off).
        tiers: this rank's host-RAM / disk KV tiers (None: tier moves are refused). vision: the checkpoint's vision
        tower geometry, on every rank (rank 0 runs the tower; every rank checks image rows alike).
        encoder_cache_tokens: tower output rows rank 0 keeps for the later chunks of an image's prompt."""
        self.model = model
        self.cache = cache
        self.tiers = tiers
        self.vision = vision
        self.encoder_cache = EncoderCache(encoder_cache_tokens)
        # slot -> the token sampled for it last, on the device (a PENDING_TOKEN is filled from it there, so a round
        # can be launched before the previous one is read back; see `_fill_pending`), and on the host the position
        # after the rows of that sampling round (set when the round is launched, or read back for verify windows).
        self.next_token = torch.zeros(cache.num_slots, dtype=torch.int64, device=model.device)
        self.slot_end: dict[int, int] = {}
        self.graphs = None
        if cuda_graphs and gpu.active(model.embed):
            from model.cuda_graphs import DecodeGraphs
            self.graphs = DecodeGraphs(model, cache)

    def forward(self, batch: Batch) -> ForwardOutput:
        """One forward of the (class-ordered) batch: a CUDA graph replay for decode rounds when enabled."""
        if self.graphs is not None and self.graphs.fits(batch):
            return self.graphs.run(batch)
        return self.model.forward(batch, self.cache)

    # -- structured output and logprobs (StepPlan.mask_index / bitmask / logprobs_k) -----------------------------
    @staticmethod
    def row_masks(plan: StepPlan, r: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The plan's grammar masks, validated: (mask_index int64 [R], bitmask int32 [M, W]); None when unmasked."""
        if not plan.HasField("mask_index") or not plan.mask_index.shape or not plan.mask_index.shape[0]:
            return None
        index = _vec(plan.mask_index, "mask_index", torch.int64, r)
        try:
            bitmask = from_proto(plan.bitmask)
        except ValueError as exc:
            raise PlanError(f"bitmask: {exc}") from exc
        if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
            raise PlanError(f"bitmask must be int32 [M, W], got {bitmask.dtype}{list(bitmask.shape)}")
        if bool((index >= bitmask.shape[0]).any()) or bool((index < -1).any()):
            raise PlanError(f"mask_index must be in [-1, {bitmask.shape[0]})")
        return index, bitmask

    @staticmethod
    def logprobs_k(plan: StepPlan, r: int) -> torch.Tensor | None:
        """int64 [R]: per sample row -1 (no logprobs) or the number of top logprobs wanted; None when none asks."""
        if not plan.HasField("logprobs_k") or not plan.logprobs_k.shape or not plan.logprobs_k.shape[0]:
            return None
        k = _vec(plan.logprobs_k, "logprobs_k", torch.int64, r)
        if not TOP_LOGPROBS.holds(k[k != -1]):  # -1: no logprobs for that row
            raise PlanError(f"logprobs_k must be -1 or {TOP_LOGPROBS}")
        return k if bool((k >= 0).any()) else None

    @staticmethod
    def row_logprobs(logits: torch.Tensor, params: SamplingParams, filters: Filters, sampled: torch.Tensor,
                     k: torch.Tensor) -> RowLogprobs:
        """Logprobs from the same fp32 (masked) logits and sampling parameters the draw used (host copies started;
        valid once the round is read back)."""
        chosen, top_ids, top_lp = processed_logprobs(logits, params, sampled, int(k.max()), filters)
        return RowLogprobs(_to_host(chosen), _to_host(top_ids.to(torch.int32)), _to_host(top_lp))

    def _pending_rows(self, tokens: torch.Tensor, starts: list[int], lengths: list[int], slots: list[int],
                      prompt: list[bool] | None, verify: list[bool] | None) -> tuple[list[int], list[int]]:
        """The rows holding PENDING_TOKEN and their slots. A scheduler that plans round n+1 before round n's result
        has come back sends a decode step whose input is the token this rank sampled last for the sequence's slot
        (rounds run in order on a stream, so that token is on the device by then). It must continue exactly where
        the slot's last sampling round ended: after a refused round it does not, and every rank refuses the plan."""
        if not bool((tokens == PENDING_TOKEN).any()):
            return [], []
        rows: list[int] = []
        pending_slots: list[int] = []
        row = 0
        for s, (start, n, slot) in enumerate(zip(starts, lengths, slots)):
            if bool((tokens[row : row + n] == PENDING_TOKEN).any()):
                if n != 1 or (prompt is not None and prompt[s]) or (verify is not None and verify[s]):
                    raise PlanError(f"sequence {s}: a pending token id is only valid as a decode step's one row")
                if self.slot_end.get(slot) != start:
                    raise PlanError(f"sequence {s}: a pending token id at position {start}, but slot {slot}'s last "
                                    f"sampling round ended at {self.slot_end.get(slot)}")
                rows.append(row)
                pending_slots.append(slot)
            row += n
        return rows, pending_slots

    def _remember(self, slots: list[int], ends: list[int], sampled: torch.Tensor, index: list[int]) -> None:
        """Each given slot's next input token (`sampled[index[i]]`, on the device) and where its round ended."""
        if not slots:
            return
        dev = self.next_token.device
        self.next_token.index_copy_(0, to_device(torch.tensor(slots), dev),
                                    sampled.index_select(0, to_device(torch.tensor(index), dev)))
        self.slot_end.update(zip(slots, ends))

    def to_batch(self, plan: StepPlan) -> tuple[Batch, SamplingParams, SamplingParams, torch.Tensor]:
        """The plan, checked, as a batch on the device: (batch, sampling settings on the device, the same on the
        host, sample rows on the host). Nothing here waits for the device."""
        dev = self.model.device
        tokens = _vec(plan.token_ids, "token_ids", torch.int64)
        lengths = _vec(plan.lengths, "lengths", torch.int64)
        b = lengths.numel()
        starts = _vec(plan.starts, "starts", torch.int64, b)
        slots = _vec(plan.slots, "slots", torch.int64, b)
        tables = _tensor(plan.block_tables, "block_tables", torch.int64)
        if b == 0 or tables.dim() != 2 or tables.shape[0] != b:
            raise PlanError(f"block_tables must be [{b}, W] for {b} sequences, got {list(tables.shape)}")
        if int(lengths.sum()) != tokens.numel() or bool((lengths < 1).any()) or bool((starts < 0).any()):
            raise PlanError("lengths must be >= 1 and sum to the number of token ids; starts must be >= 0")
        verify = _flags(plan, "verify", b)
        prompt = _flags(plan, "prompt", b)
        if verify is not None and prompt is not None and any(v and p for v, p in zip(verify, prompt)):
            raise PlanError("a sequence cannot be both a verify window and a prompt chunk")
        pending, pending_slots = self._pending_rows(tokens, starts.tolist(), lengths.tolist(), slots.tolist(),
                                                    prompt, verify)
        if pending:
            tokens = tokens.clone()
            tokens[pending] = 0  # filled on the device below
        if bool((tokens < 0).any()) or bool((tokens >= self.model.cfg.vocab_size).any()):
            raise PlanError("a token id is outside the vocabulary")
        if bool((slots < 0).any()) or bool((slots >= self.cache.num_slots).any()) or len(set(slots.tolist())) != b:
            raise PlanError(f"slots must be distinct and in [0, {self.cache.num_slots})")
        if bool((tables < 0).any()) or bool((tables >= self.cache.num_blocks).any()):
            raise PlanError(f"block ids must be in [0, {self.cache.num_blocks})")
        if bool(((starts + lengths) > tables.shape[1] * self.cache.block_size).any()):
            raise PlanError("a sequence runs past the end of its block table")
        check_positions(starts, lengths, self.model.cfg.max_position_embeddings)
        rows = _vec(plan.sample_rows, "sample_rows", torch.int64)
        check_counts(tokens, tables, rows, self.cache)
        r = rows.numel()
        if bool((rows < 0).any()) or bool((rows >= tokens.numel()).any()):
            raise PlanError("a sample row is outside the batch")
        params = SamplingParams(
            temperature=_vec(plan.temperature, "temperature", torch.float32, r),
            top_k=_vec(plan.top_k, "top_k", torch.int64, r),
            top_p=_vec(plan.top_p, "top_p", torch.float32, r),
            min_p=_vec(plan.min_p, "min_p", torch.float32, r),
            seed=_vec(plan.seed, "seed", torch.int64, r),
        )
        check_sampling(params)  # on the host copies: checks on device tensors would each wait for the GPU
        host_params = params
        params = SamplingParams(*(to_device(t, dev) for t in (params.temperature, params.top_k, params.top_p,
                                                               params.min_p, params.seed)))
        token_ids = to_device(tokens, dev)
        if pending:
            token_ids.index_copy_(0, to_device(torch.tensor(pending), dev),
                                  self.next_token.index_select(0, to_device(torch.tensor(pending_slots), dev)))
        batch = Batch(token_ids=token_ids, starts=starts.tolist(), lengths=lengths.tolist(),
                      block_tables=to_device(tables, dev), slots=slots.tolist(), logit_rows=rows, verify=verify,
                      prompt=prompt)
        if verify is not None:
            wanted = set(rows.tolist())
            for s, (o, n) in enumerate(zip(batch.offsets, batch.lengths)):
                if verify[s] and not all(o + i in wanted for i in range(n)):
                    raise PlanError(f"sequence {s} is a verify window but not all its rows are sample rows")
        return batch, params, host_params, rows

    def state_copies(self, plan: StepPlan) -> list[tuple[int, int]]:
        """The plan's (source slot, target slot) KDA state copies, validated; an empty tensor means none."""
        if not plan.HasField("state_copies") or not plan.state_copies.dtype:
            return []
        t = _tensor(plan.state_copies, "state_copies", torch.int64)
        if t.numel() == 0:
            return []
        if t.dim() != 2 or t.shape[1] != 2:
            raise PlanError(f"state_copies must be [K, 2] (source slot, target slot), got {list(t.shape)}")
        if t.shape[0] > 2 * self.cache.num_slots:  # a take and a resume per slot at most
            raise PlanError(f"{t.shape[0]} state copies for {self.cache.num_slots} slots")
        if bool((t < 0).any()) or bool((t >= self.cache.num_slots).any()):
            raise PlanError(f"state_copies: slots must be in [0, {self.cache.num_slots})")
        return [(int(a), int(b)) for a, b in t.tolist()]

    def tier_moves(self, plan: StepPlan) -> list[tuple[rank_pb2.TierMove, list[int]]]:
        """The plan's KV tier moves with their pool blocks, validated (nothing runs before every move checks out)."""
        out = []
        for m in plan.tier_moves:
            if self.tiers is None:
                raise PlanError("a KV tier move, but this rank has no tiers (--kv-host-bytes / --kv-disk-dir)")
            if (m.to_disk or m.kind == rank_pb2.TIER_SPILL) and self.tiers.dir is None:
                raise PlanError("a disk tier move, but this rank has no --kv-disk-dir")
            keys = list(m.block_keys) + ([m.state_key] if m.state_key else [])
            if any(not 0 < len(k) <= MAX_KEY for k in keys):
                raise PlanError(f"tier keys must be 1..{MAX_KEY} bytes")
            blocks: list[int] = []
            if m.kind in (rank_pb2.TIER_SAVE, rank_pb2.TIER_LOAD):
                blocks = _vec(m.blocks, "tier_moves.blocks", torch.int64, len(m.block_keys)).tolist() \
                    if m.block_keys else []
                if any(not 0 <= b < self.cache.num_blocks for b in blocks):
                    raise PlanError(f"tier_moves: blocks must be in [0, {self.cache.num_blocks})")
                if m.state_key and not 0 <= m.slot < self.cache.num_slots:
                    raise PlanError(f"tier_moves: slot must be in [0, {self.cache.num_slots})")
            out.append((m, blocks))
        return out

    def image_rows(self, plan: StepPlan, n_rows: int) -> list[ImagePart]:
        """The plan's images, validated."""
        if not plan.images:
            return []
        vc = self.vision
        if vc is None or (self.model.coll.sharding.rank == 0 and self.model.vision is None):
            raise PlanError("images, but this checkpoint has no vision tower")
        out = []
        for i, im in enumerate(plan.images):
            try:
                pixels = from_proto(im.pixel_values)
            except ValueError as exc:
                raise PlanError(f"images[{i}].pixel_values: {exc}") from exc
            t, h, w = _vec(im.grid_thw, f"images[{i}].grid_thw", torch.int64, 3).tolist()
            m = vc.spatial_merge_size
            if min(t, h, w) < 1 or h % m or w % m:
                raise PlanError(f"images[{i}]: grid {t}x{h}x{w} is not whole {m}x{m} merge blocks")
            if pixels.dtype != torch.float32 or list(pixels.shape) != [t * h * w, vc.patch_dim]:
                raise PlanError(f"images[{i}]: pixel_values must be float32 [{t * h * w}, {vc.patch_dim}]")
            tokens = t * h * w // m ** 2
            if im.count < 1 or im.first < 0 or im.first + im.count > tokens or im.row < 0 \
                    or im.row + im.count > n_rows:
                raise PlanError(f"images[{i}]: embeddings [{im.first}, {im.first + im.count}) of {tokens} at rows "
                                f"{im.row}.. do not fit")
            if len(im.digest) > MAX_KEY:
                raise PlanError(f"images[{i}].digest: at most {MAX_KEY} bytes")
            out.append(ImagePart(im.row, im.first, im.count, pixels, (t, h, w), bytes(im.digest)))
        return out

    def embed_images(self, images: list[ImagePart]) -> list[tuple[int, torch.Tensor]] | None:
        """Rank 0 runs the vision tower (or finds its output for an image an earlier chunk encoded); every rank
        gets the embeddings of its rows (the same bits everywhere)."""
        if not images:
            return None
        m = self.model
        out = []
        for im in images:
            if m.coll.sharding.rank == 0:
                e = self._tower(im)[im.first : im.first + im.count].contiguous()
            else:
                e = torch.empty(im.count, m.cfg.hidden_size, dtype=m.dtype, device=m.device)
            out.append((im.row, m.coll.from_first(e)))
        return out

    def _tower(self, im: ImagePart) -> torch.Tensor:
        """The image's whole tower output in the model's dtype, kept under its digest for the prompt's next chunks."""
        m = self.model
        assert m.vision is not None
        key = (im.digest, im.grid)
        e = self.encoder_cache.get(key) if im.digest else None
        if e is None:
            e = m.vision.forward(im.pixels, [im.grid]).to(m.dtype)
            if im.digest:
                self.encoder_cache.put(key, e)
        return e

    def run_tier_moves(self, moves: list[tuple[rank_pb2.TierMove, list[int]]]) -> list[bytes]:
        """Run the moves in order; the keys whose load failed on any rank (every rank drops them)."""
        if not moves:
            return []
        assert self.tiers is not None
        t, cache = self.tiers, self.cache
        bad: set[bytes] = set()
        loaded = False
        for m, blocks in moves:
            if m.kind == rank_pb2.TIER_SAVE:
                for key, b in zip(m.block_keys, blocks):
                    t.save(key, cache.block_views(b), {}, m.to_disk)
                if m.state_key:
                    t.save(m.state_key, cache.state_views(m.slot),
                           {"state": True, "pos": m.pos, "chain": m.chain.hex()}, m.to_disk)
            elif m.kind == rank_pb2.TIER_LOAD:
                loaded = True
                for key, b in zip(m.block_keys, blocks):
                    if not t.load(key, cache.block_views(b)):
                        bad.add(key)
                if m.state_key and not t.load(m.state_key, cache.state_views(m.slot)):
                    bad.add(m.state_key)
            else:
                for key in list(m.block_keys) + ([m.state_key] if m.state_key else []):
                    t.spill(key) if m.kind == rank_pb2.TIER_SPILL else t.drop(key)
        if not loaded:
            return []
        bad = self.model.coll.union(bad)  # one rank's bad copy is every rank's: never use it anywhere
        for key in bad:
            t.drop(key)
        return sorted(bad)

    def execute(self, plan: StepPlan) -> StepOutput:
        """Run one plan and read its results back."""
        return self.finish(self.launch(plan))

    def launch(self, plan: StepPlan) -> Launched:
        """Check the plan, then queue its work: tier moves, state copies, the forward, sampling, logprobs and hidden
        gathers, and the copies of the results to the host. On a GPU nothing here waits for the device (besides
        tier moves and prompt chunks that need host facts), so the rank can queue round n+1 while round n runs."""
        if not plan.HasField("lengths") or not plan.lengths.shape or not plan.lengths.shape[0]:
            # No sequences: a plan of tier moves only (a load a request waits for; saving the pool at shutdown).
            if not plan.tier_moves:
                raise PlanError("a plan without sequences must carry tier moves")
            if plan.HasField("token_ids") and plan.token_ids.shape and plan.token_ids.shape[0]:
                raise PlanError("token ids without sequences")
            bad = self.run_tier_moves(self.tier_moves(plan))
            empty = torch.zeros(0, dtype=torch.int64)
            return Launched(None, [], empty, empty, None, None, bad, 0.0, time.perf_counter(), None)
        batch, params, host_params, rows = self.to_batch(plan)
        copies = self.state_copies(plan)  # validated with the rest before anything changes
        moves = self.tier_moves(plan)
        batch.embeds = self.embed_images(self.image_rows(plan, batch.token_ids.numel()))
        # Decode-class sequences first: the GPU path runs each row class with its own fixed schedule over a
        # contiguous run of rows. Sample rows keep the plan's order; `order` maps results back per sequence.
        order = batch.class_order()
        if order != list(range(batch.num_seqs)):
            batch, row_map = batch.permuted(order)
            rows = row_map[rows]
        masks = self.row_masks(plan, rows.numel())
        pen = row_penalties(plan, rows.numel(), self.model.cfg.vocab_size, self.model.cfg.max_position_embeddings)
        want_k = self.logprobs_k(plan, rows.numel())
        t0 = time.perf_counter()
        # Tier moves first (a save reads blocks and slots the scheduler freed this round before anything reuses
        # them), then state copies: a snapshot is taken from a slot as the previous round left it, and a resumed
        # sequence starts this round's rows from the copied state.
        tier_bad = self.run_tier_moves(moves)
        self.cache.copy_states(copies)
        out = self.forward(batch)
        t1 = time.perf_counter()
        dev = out.logits.device
        sampled = torch.zeros(0, dtype=torch.int64, device=dev)
        logprobs = hidden = None
        if rows.numel():
            # The token sampled from the row at absolute position p sits at position p + 1: that is its key.
            positions = to_device(batch.host_positions()[rows] + 1, dev)
            logits = out.logits if masks is None else apply_token_bitmask(out.logits, masks[1], masks[0])
            if pen is not None:  # after the grammar mask, before the draw and the logprobs (vLLM's order)
                logits = apply_penalties(logits, pen.to(dev))
            filters = Filters.of(host_params, logits.shape[-1])  # from the host copy: no read of the device
            sampled = sample(logits, positions, params, filters)
            if want_k is not None:
                logprobs = self.row_logprobs(logits, params, filters, sampled, want_k)
            if plan.want_hidden:
                hidden = _to_host(out.hidden[to_device(rows, out.hidden.device)].float())
            # Decode steps and prompt chunks whose last row is sampled: that sample is the slot's next input.
            index_of = {r: i for i, r in enumerate(rows.tolist())}
            ends = [(slot, start + n, index_of[o + n - 1])
                    for s, (o, start, n, slot) in enumerate(zip(batch.offsets, batch.starts, batch.lengths,
                                                                batch.slots))
                    if not batch.is_verify(s) and o + n - 1 in index_of]
            self._remember([e[0] for e in ends], [e[1] for e in ends], sampled, [e[2] for e in ends])
        sampled = _to_host(sampled)
        done = None
        if dev.type == "cuda":  # recorded after every copy to the host: when it has passed, they are all there
            done = torch.cuda.Event()
            done.record()
        return Launched(batch, order, rows, sampled, logprobs, hidden, tier_bad, (t1 - t0) * 1e3, t1, done)

    def finish(self, run: Launched) -> StepOutput:
        """Wait for a launched round and read its results: sampled ids, accepted drafts (verify windows are
        decided here, then their KDA states committed), logprobs, hidden states."""
        if run.done is not None:
            run.done.synchronize()
        sampled = run.sampled.tolist()
        batch = run.batch
        accepted = None
        if batch is not None and batch.has_verify:
            # Accept the longest draft prefix equal to our own samples, then keep the KDA state of that row only.
            by_row = dict(zip(run.rows.tolist(), sampled))
            mine = [0] * batch.num_seqs
            for s, (o, n) in enumerate(zip(batch.offsets, batch.lengths)):
                if batch.verify[s]:
                    window = batch.token_ids[o : o + n].tolist()
                    mine[s] = accept_drafts(window, [by_row[o + i] for i in range(n)])
            self.model.commit_verify(batch, self.cache, {s: a for s, a in enumerate(mine) if batch.verify[s]})
            accepted = [0] * batch.num_seqs  # in the plan's sequence order
            for s, a in zip(run.order, mine):
                accepted[s] = a
            # A verify window's next input is its sample after the last accepted draft.
            index_of = {r: i for i, r in enumerate(run.rows.tolist())}
            kept = [(slot, start + mine[s] + 1, index_of[o + mine[s]])
                    for s, (o, start, slot) in enumerate(zip(batch.offsets, batch.starts, batch.slots))
                    if batch.verify[s]]
            self._remember([k[0] for k in kept], [k[1] for k in kept],
                           to_device(run.sampled, self.next_token.device), [k[2] for k in kept])
        t2 = time.perf_counter()
        return StepOutput(sampled, run.forward_ms, (t2 - run.t1) * 1e3, accepted, run.hidden, run.logprobs,
                          run.tier_bad)
