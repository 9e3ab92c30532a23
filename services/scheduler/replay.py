"""Reply reuse: a finished request's prompt + reply recomputed in the background, for the conversation's next turn.

The reply's rows were decoded (recurrent KDA, decode arithmetic), so its blocks and state are not what a prompt
computes; the next turn resumed from them would differ in the last bits from the same prompt computed fresh. Instead
a background prefill (a "replay") recomputes the tokens from the deepest snapshot on their chain up to the last
64-token grid point E <= len(tokens) in the request's own blocks and slot, with prompt arithmetic, and snapshots E:
exactly what a fresh prefill of the next turn computes, so resuming there keeps every exactness promise. A replay
samples nothing and streams nothing. The scheduler creates one only when nothing waits, plans it only once no
request has run or waited for `--reply-reuse-delay` seconds (so it never stretches users' rounds, and a request
that comes at once does not queue behind it), and ends it for any request that needs its slot or blocks
(round_scheduler.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from services.scheduler.kv_cache import KVCacheManager
from services.scheduler.prefix import block_hashes
from services.scheduler.request import Request, State
from twinspark.v1 import generate_pb2

log = logging.getLogger("twinspark.scheduler")


def reply_replay(req: Request, kv: KVCacheManager, order: Iterator[int]) -> Request | None:
    """The replay of `req` (just finished, still holding its reservation), which takes that reservation over;
    None when the reply reaches no grid point that the prefix index lacks."""
    prefix = kv.prefix
    if prefix is None or req.reservation is None:
        return None
    g = prefix.granule
    end = len(req.tokens) // g * g
    if end <= (req.prompt_len - 1) // g * g:
        return None  # the reply reaches no grid point past the prompt's own snapshot
    hashes = block_hashes(req.tokens, kv.pool.block_size, end, req.image_spans)
    m = prefix.match(hashes, end + 1)
    if m.pos >= end:
        return None
    rep = Request(request_id=f"{req.id}:reply", prompt=req.tokens[:end], max_tokens=1, sampling=req.sampling,
                  stop_ids=frozenset(), eos_ids=frozenset(), priority=generate_pb2.PRIORITY_BACKGROUND,
                  order=next(order), max_model_len=req.max_model_len, images=req.images)
    rep.replay, rep.state, rep.block_hashes = True, State.RUNNING, hashes
    rep.reservation, req.reservation = req.reservation, None
    rep.num_cached = m.pos
    rep.after = req  # its rows still in flight (a decode row past EOS) come back before the replay is planned
    if m.snapshot is not None:
        prefix.pin(m.snapshot)
        rep.resume = m.snapshot
    rep.snap_points = [(end, False)]
    log.info("replaying %s's reply: positions %d..%d for the prefix cache (a background prefill)", req.id, m.pos, end)
    return rep
