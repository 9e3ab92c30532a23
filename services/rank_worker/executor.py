"""StepPlan -> one forward of this rank's shard -> the sampled token of every sample row.

Every rank runs the same plan on its shard and ends in the same state. The plan is checked whole first
(plan_checks.py), so the ranks refuse a bad one together; what runs here is a checked plan. A round is launched (its
work queued on the device) and later finished (read back), so that on a GPU the next round can be queued while
this one runs.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from kernels import gpu
from kernels.gpu import to_device
from kernels.penalties import Penalties, apply_penalties
from kernels.sampling import (Filters, SamplingParams, apply_token_bitmask, processed_logprobs, prompt_logprobs,
                              sample)
from model.batch import Batch
from model.cache import PagedCache
from model.model import ForwardOutput, Glm5Model, accept_drafts
from model.vision import VisionConfig
from services.rank_worker import plan_checks as checks
from services.rank_worker.encoder_cache import EncoderCache
from services.rank_worker.kv_tiers import TierStore
from services.rank_worker.plan_checks import ImagePart, Limits, ScoreRows
from services.rank_worker.rounds import Launched, RoundResult, RowLogprobs, RowScores, to_host
from twinspark.v1 import rank_pb2
from twinspark.v1.rank_pb2 import StepPlan


class PlannedBatch(NamedTuple):
    """A checked plan as a batch on the device (`Executor.to_batch`)."""
    batch: Batch  # its logit rows are the sample rows, then the score rows
    params: SamplingParams  # per sample row, on the device
    host_params: SamplingParams  # the same on the host
    rows: torch.Tensor  # host int64 sample rows
    scores: ScoreRows | None  # the prompt rows to score
    steps: int  # decode steps (StepPlan.steps)


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
        self.limits = Limits(num_blocks=cache.num_blocks, block_size=cache.block_size, num_slots=cache.num_slots,
                             vocab_size=model.cfg.vocab_size, max_positions=model.cfg.max_position_embeddings)
        self.encoder_cache = EncoderCache(encoder_cache_tokens)
        # slot -> the token sampled for it last, on the device (a PENDING_TOKEN is filled from it there, so a round
        # can be launched before the previous one is read back), and on the host the position after the rows of
        # that sampling round (set when the round is launched, or read back for verify windows).
        self.next_token = torch.zeros(cache.num_slots, dtype=torch.int64, device=model.device)
        self.slot_end: dict[int, int] = {}
        self.graphs = None
        if cuda_graphs and gpu.active(model.embed):
            from model.cuda_graphs import DecodeGraphs
            # Round n+1 is queued before round n is waited for, each replaying a graph up to MAX_STEPS times.
            self.graphs = DecodeGraphs(model, cache, staging=2 * checks.MAX_STEPS)

    def forget_slots(self) -> None:
        """Drop what is known of every slot's last round (after the warm-up: the scheduler hands slots out fresh)."""
        self.slot_end.clear()
        self.next_token.zero_()

    def forward(self, batch: Batch, layers: tuple[int, ...] = ()) -> ForwardOutput:
        """One forward of the (class-ordered) batch: a CUDA graph replay for decode rounds (and verify windows) when
        enabled, with the layer outputs a DFlash2 drafter reads when the round asks for them."""
        if self.graphs is not None and self.graphs.fits(batch, layers):
            return self.graphs.run(batch, layers)
        return self.model.forward(batch, self.cache, layers=layers)

    def _remember(self, slots: list[int], ends: list[int], sampled: torch.Tensor, index: list[int]) -> None:
        """Each given slot's next input token (`sampled[index[i]]`, on the device) and where its round ended."""
        if not slots:
            return
        dev = self.next_token.device
        self.next_token.index_copy_(0, to_device(torch.tensor(slots), dev),
                                    sampled.index_select(0, to_device(torch.tensor(index), dev)))
        self.slot_end.update(zip(slots, ends))

    def to_batch(self, plan: StepPlan) -> PlannedBatch:
        """The plan, checked, as a batch on the device. Nothing here waits for the device."""
        seqs = checks.check_sequences(plan, self.limits, self.slot_end)
        scores = checks.score_rows(plan, seqs.prompt, seqs.lengths.tolist(), self.limits.vocab_size)
        steps = checks.decode_steps(plan, seqs, self.limits)
        dev = self.model.device
        host = seqs.params
        params = SamplingParams(*(to_device(t, dev) for t in (host.temperature, host.top_k, host.top_p, host.min_p,
                                                               host.seed)))
        token_ids = to_device(seqs.tokens, dev)
        if seqs.pending:
            token_ids.index_copy_(0, to_device(torch.tensor(seqs.pending), dev),
                                  self.next_token.index_select(0, to_device(torch.tensor(seqs.pending_slots), dev)))
        batch = Batch(token_ids=token_ids, starts=seqs.starts.tolist(), lengths=seqs.lengths.tolist(),
                      block_tables=to_device(seqs.tables, dev), slots=seqs.slots.tolist(),
                      logit_rows=seqs.rows if scores is None else torch.cat([seqs.rows, scores.rows]),
                      verify=seqs.verify, prompt=seqs.prompt)
        return PlannedBatch(batch, params, host, seqs.rows, scores, steps)

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

    def execute(self, plan: StepPlan) -> RoundResult:
        """Run one plan and read its results back."""
        return self.finish(self.launch(plan))

    def launch(self, plan: StepPlan) -> Launched:
        """Check the plan, then queue its work: tier moves, state copies, the forward, sampling, logprobs and hidden
        gathers, and the copies of the results to the host. On a GPU nothing here waits for the device (besides
        tier moves and prompt chunks that need host facts), so the rank can queue round n+1 while round n runs."""
        if not checks.has_sequences(plan):
            checks.tier_moves_only(plan)
            bad = self.run_tier_moves(checks.tier_moves(plan, self.tiers, self.limits))
            empty = torch.zeros(0, dtype=torch.int64)
            return Launched(batch=None, order=[], rows=empty, sampled=empty, logprobs=None, hidden=None, tier_bad=bad,
                            forward_ms=0.0, t1=time.perf_counter(), done=None)
        batch, params, host_params, rows, scores, steps = self.to_batch(plan)
        copies = checks.state_copies(plan, self.cache.num_slots)  # validated with the rest before anything changes
        moves = checks.tier_moves(plan, self.tiers, self.limits)
        layers = checks.hidden_layers(plan, len(self.model.layers))
        can_encode = not (self.model.coll.sharding.rank == 0 and self.model.vision is None)
        batch.embeds = self.embed_images(checks.image_rows(plan, batch.token_ids.numel(), self.vision, can_encode))
        # Decode-class sequences first: the GPU path runs each row class with its own fixed schedule over a
        # contiguous run of rows. Sample rows keep the plan's order; `order` maps results back per sequence.
        order = batch.class_order()
        row_map = None  # plan row -> batch row, when the batch is reordered
        if order != list(range(batch.num_seqs)):
            batch, row_map = batch.permuted(order)
            rows = row_map[rows]
        masks = checks.row_masks(plan, rows.numel())
        pen = checks.row_penalties(plan, rows.numel(), self.limits.vocab_size, self.limits.max_positions)
        want_k = checks.logprobs_k(plan, rows.numel())
        t0 = time.perf_counter()
        begin = None
        if self.next_token.is_cuda:  # timing events for the rank's round stats (round_stats.py)
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
        # Tier moves first (a save reads blocks and slots the scheduler freed this round before anything reuses
        # them), then state copies: a snapshot is taken from a slot as the previous round left it, and a resumed
        # sequence starts this round's rows from the copied state.
        tier_bad = self.run_tier_moves(moves)
        self.cache.copy_states(copies)
        out = self.forward(batch, layers)
        t1 = time.perf_counter()
        layer_hidden = None
        if out.layers is not None:  # back in the plan's row order, which the scheduler reads them in
            layer_hidden = to_host((out.layers if row_map is None else
                                    out.layers[to_device(row_map, out.layers.device)]).float())
        sampled = torch.zeros(0, dtype=torch.int64, device=out.logits.device)
        logprobs = hidden = None
        # Sample rows first, then score rows (to_batch); a score row is never masked, penalised or filtered.
        sample_logits = out.logits[: rows.numel()] if scores is not None else out.logits
        if rows.numel():
            logits = sample_logits if masks is None else apply_token_bitmask(sample_logits, masks[1], masks[0])
            sampled, logprobs = self._sample(batch, rows, logits, pen, params, host_params, want_k)
            if steps > 1:
                sampled, logprobs = self._more_steps(batch, rows, params, host_params, want_k, steps, sampled,
                                                     logprobs)
            if plan.want_hidden:
                hidden = to_host(out.hidden[to_device(rows, out.hidden.device)].float())
        sampled = to_host(sampled)
        if logprobs is not None:
            logprobs = RowLogprobs(to_host(logprobs.chosen), to_host(logprobs.top_ids), to_host(logprobs.top_logprobs))
        scored = self._score(out.logits[rows.numel():], scores) if scores is not None else None
        done = None
        if out.logits.device.type == "cuda":  # recorded after every copy to the host: when it has passed, all are
            done = torch.cuda.Event(enable_timing=True)
            done.record()
        return Launched(batch=batch, order=order, rows=rows, sampled=sampled, logprobs=logprobs, hidden=hidden,
                        tier_bad=tier_bad, forward_ms=(t1 - t0) * 1e3, t1=t1, done=done, scores=scored,
                        layer_hidden=layer_hidden, begin=begin, steps=steps)

    @staticmethod
    def _score(logits: torch.Tensor, scores: ScoreRows) -> RowScores:
        """Prompt logprobs of the score rows: the raw log-softmax of their fp32 logits at the next prompt token,
        its rank and the top k (kernels/sampling.py `prompt_logprobs`)."""
        chosen, ranks, top_ids, top_lp = prompt_logprobs(logits, to_device(scores.next_ids, logits.device), scores.k)
        return RowScores(to_host(chosen), to_host(ranks.to(torch.int32)), to_host(top_ids.to(torch.int32)),
                         to_host(top_lp))

    def _sample(self, batch: Batch, rows: torch.Tensor, logits: torch.Tensor, pen: Penalties | None,
                params: SamplingParams, host_params: SamplingParams,
                want_k: torch.Tensor | None) -> tuple[torch.Tensor, RowLogprobs | None]:
        """Draw each sample row's token (and its logprobs when asked, on the device) from the (masked) logits, and
        remember the slots' next inputs."""
        dev = logits.device
        # The token sampled from the row at absolute position p sits at position p + 1: that is its key.
        positions = to_device(batch.host_positions()[rows] + 1, dev)
        if pen is not None:  # after the grammar mask, before the draw and the logprobs (vLLM's order)
            logits = apply_penalties(logits, pen.to(dev))
        filters = Filters.of(host_params, logits.shape[-1])  # from the host copy: no read of the device
        sampled = sample(logits, positions, params, filters)
        logprobs = None
        if want_k is not None:
            # From the same fp32 logits and sampling parameters the draw used.
            chosen, top_ids, top_lp = processed_logprobs(logits, params, sampled, int(want_k.max()), filters)
            logprobs = RowLogprobs(chosen, top_ids.to(torch.int32), top_lp)
        # Decode steps and prompt chunks whose last row is sampled: that sample is the slot's next input.
        index_of = {r: i for i, r in enumerate(rows.tolist())}
        ends = [(slot, start + n, index_of[o + n - 1])
                for s, (o, start, n, slot) in enumerate(zip(batch.offsets, batch.starts, batch.lengths, batch.slots))
                if not batch.is_verify(s) and o + n - 1 in index_of]
        self._remember([e[0] for e in ends], [e[1] for e in ends], sampled, [e[2] for e in ends])
        return sampled, logprobs

    def _more_steps(self, batch: Batch, rows: torch.Tensor, params: SamplingParams, host_params: SamplingParams,
                    want_k: torch.Tensor | None, steps: int, first: torch.Tensor,
                    first_logprobs: RowLogprobs | None) -> tuple[torch.Tensor, RowLogprobs | None]:
        """Steps 1.. of a multi-step plan (StepPlan.steps, checked: one-row decode steps, every row sampled, no
        mask or penalty). Each step feeds every slot the token it sampled the step before (on the device) one
        position on, and runs the forward and draw a one-step round of those rows would run, so its samples are
        that round's bits. Returns the samples (and logprobs) row after row: row r's `steps` samples together."""
        slots = to_device(torch.tensor(batch.slots), self.next_token.device)
        samples, logprobs = [first], [first_logprobs]
        for i in range(1, steps):
            step = Batch(token_ids=self.next_token.index_select(0, slots), starts=[s + i for s in batch.starts],
                         lengths=batch.lengths, block_tables=batch.block_tables, slots=batch.slots,
                         logit_rows=batch.logit_rows, prompt=batch.prompt)
            sampled, lp = self._sample(step, rows, self.forward(step).logits, None, params, host_params, want_k)
            samples.append(sampled)
            logprobs.append(lp)

        def by_row(parts: list[torch.Tensor]) -> torch.Tensor:  # [steps, R, ...] -> [R * steps, ...]
            return torch.stack(parts, 1).flatten(0, 1)

        if first_logprobs is None:
            return by_row(samples), None
        return by_row(samples), RowLogprobs(*(by_row([getattr(lp, f) for lp in logprobs])
                                              for f in ("chosen", "top_ids", "top_logprobs")))

    def finish(self, run: Launched) -> RoundResult:
        """Wait for a launched round and read its results: sampled ids, accepted drafts (verify windows are
        decided here, then their KDA states committed), logprobs, hidden states."""
        if run.done is not None:
            run.done.synchronize()
        sampled = run.sampled.tolist()
        accepted = None
        if run.batch is not None and run.batch.has_verify:
            accepted = self._accept(run, sampled)
        t2 = time.perf_counter()
        return RoundResult(sampled, run.forward_ms, (t2 - run.t1) * 1e3, accepted=accepted, hidden=run.hidden,
                           logprobs=run.logprobs, tier_bad=run.tier_bad, scores=run.scores,
                           layer_hidden=run.layer_hidden)

    def _accept(self, run: Launched, sampled: list[int]) -> list[int]:
        """Per plan sequence, the drafts accepted: the longest draft prefix equal to our own samples; then keep the
        KDA state of that row only, and the sample after it is the slot's next input."""
        batch = run.batch
        assert batch is not None and batch.verify is not None
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
        index_of = {r: i for i, r in enumerate(run.rows.tolist())}
        kept = [(slot, start + mine[s] + 1, index_of[o + mine[s]])
                for s, (o, start, slot) in enumerate(zip(batch.offsets, batch.starts, batch.slots))
                if batch.verify[s]]
        self._remember([k[0] for k in kept], [k[1] for k in kept],
                       to_device(run.sampled, self.next_token.device), [k[2] for k in kept])
        return accepted
