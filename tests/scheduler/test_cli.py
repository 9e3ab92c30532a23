"""serve-scheduler's settings (services/scheduler/cli.py) from flags and the environment."""

from __future__ import annotations

import pytest

from services.common.flags import parse
from services.scheduler.cli import SchedulerSettings


def test_defaults_environment_and_toggles():
    s = parse(SchedulerSettings, ["--ranks", "h:1"], {})
    assert (s.host, s.port, s.max_num_seqs, s.max_num_batched_tokens, s.max_snapshots, s.drafter) == \
        ("127.0.0.1", 50051, 16, None, None, None)  # the round budget: unset, the ranks' device decides
    assert s.enable_prefix_caching and s.reply_reuse and not s.draft_hidden and s.rank_timeout == 300.0
    env = {"TWINSPARK_RANKS": "a:1,b:2", "TWINSPARK_SCHEDULER_PORT": "6000", "TWINSPARK_ENABLE_PREFIX_CACHING": "no",
           "TWINSPARK_DRAFT_HIDDEN": "1", "TWINSPARK_DRAFTER_ADDRESS": "", "TWINSPARK_MAX_SNAPSHOTS": "3"}
    s = parse(SchedulerSettings, ["--reply-reuse"], env)
    assert (s.ranks, s.port, s.enable_prefix_caching, s.draft_hidden, s.drafter, s.max_snapshots) == \
        ("a:1,b:2", 6000, False, True, None, 3)
    assert not parse(SchedulerSettings, ["--no-reply-reuse"], env).reply_reuse


def test_bounds_and_required_ranks():
    with pytest.raises(SystemExit):
        parse(SchedulerSettings, [], {})
    with pytest.raises(SystemExit):
        parse(SchedulerSettings, ["--ranks", "h:1", "--max-num-seqs", "0"], {})
