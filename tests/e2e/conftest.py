"""Real stacks for end-to-end tests: `twinspark up` on the tiny default checkpoint, TP = 2 and TP = 1."""

from __future__ import annotations

import pytest

from tests.e2e.stack import Stack, start


def pytest_configure(config: pytest.Config) -> None:
    # A selection beside the tiers (these tests are `stack` too): `-m agents` runs the client-library tier.
    config.addinivalue_line("markers", "agents: the client libraries agents use (the `agents` extra) on a real stack")


@pytest.fixture(scope="session")
def stack_tp2(tiny_default, tmp_path_factory) -> Stack:
    # A small queue and few running sequences so the queue-full tests can fill it; a small per-round budget so a
    # long prompt takes several rounds. The ranks exchange through the same-host collective (auto picks it on one
    # host too; named here so that the TP = 1 / 2 / 4 comparisons of test_exactness.py pin it).
    stack = start(tiny_default, tmp_path_factory.mktemp("stack_tp2"), tp=2,
                  env={"TWINSPARK_MAX_NUM_SEQS": "16", "TWINSPARK_MAX_WAITING": "8",
                       "TWINSPARK_MAX_NUM_BATCHED_TOKENS": "80", "TWINSPARK_COLLECTIVE": "ipc"})
    yield stack
    stack.down()


@pytest.fixture(scope="session")
def stack_tp1(tiny_default, tmp_path_factory) -> Stack:
    # Without drafts, rounds of plain decode rows run four decode steps each (--num-scheduler-steps; auto would
    # pick one on a CPU), so every test comparing this stack with stack_tp2 (drafts on, one step) checks that steps
    # never change a reply. Round stats every second let test_exactness.py see the steps in the rank's log.
    stack = start(tiny_default, tmp_path_factory.mktemp("stack_tp1"), tp=1,
                  env={"TWINSPARK_DRAFTER": "none", "TWINSPARK_NUM_SCHEDULER_STEPS": "4",
                       "TWINSPARK_STATS_INTERVAL": "1"})
    yield stack
    stack.down()
