"""serve-scheduler's settings become its config by field name (SchedulerConfig / EngineConfig.from_settings), with
no field-by-field mapping: every flag reaches the config field of its name."""

from __future__ import annotations

from dataclasses import fields

import pytest

from services.common.flags import parse
from services.scheduler.cli import SchedulerSettings
from services.scheduler.engine import EngineConfig
from services.scheduler.server import SchedulerConfig


def test_every_flag_reaches_the_field_of_its_name():
    s = parse(SchedulerSettings, [
        "--ranks", "a:1, b:2", "--port", "7", "--max-waiting", "3", "--max-num-seqs", "5",
        "--max-num-batched-tokens", "64", "--num-scheduler-steps", "4", "--no-enable-prefix-caching",
        "--no-reply-reuse", "--reply-reuse-delay", "-1", "--max-snapshots", "2", "--startup-timeout", "9",
        "--rank-timeout", "0", "--drafter", "d:3", "--num-draft-tokens", "-2", "--draft-timeout", "0.25",
        "--draft-hidden", "--draft-layers", "1, 3", "--tokenizer", "/t", "--kv-events-endpoint", "tcp://x",
        "--internal-token", "tok"], {})
    assert SchedulerConfig.from_settings(s) == SchedulerConfig(
        ranks=["a:1", "b:2"], host="127.0.0.1", port=7, startup_timeout=9.0, rank_timeout=None, drafter="d:3",
        draft_timeout=0.25, tokenizer="/t", internal_token="tok",
        engine=EngineConfig(max_waiting=3, max_num_seqs=5, max_num_batched_tokens=64, num_scheduler_steps=4,
                            enable_prefix_caching=False, max_snapshots=2, reply_reuse=False, reply_reuse_delay=0.0,
                            num_draft_tokens=0, draft_hidden=True, draft_layers=(1, 3), kv_events_endpoint="tcp://x"))


def test_every_config_field_is_a_flag():
    """A config field that no flag names would keep its default whatever the command line says."""
    flags = {f.name for f in fields(SchedulerSettings)}
    assert {f.name for f in fields(EngineConfig)} <= flags
    assert {f.name for f in fields(SchedulerConfig)} - flags == {"engine", "progress_interval_s"}


def test_settings_that_cannot_work_are_refused_by_flag():
    with pytest.raises(ValueError, match="--draft-layers takes comma-separated layer numbers, got '1,x'"):
        SchedulerConfig.from_settings(SchedulerSettings(ranks="a:1", draft_layers="1,x"))
    with pytest.raises(ValueError, match="--ranks lists no addresses"):
        SchedulerConfig.from_settings(SchedulerSettings(ranks=" , "))
