"""Real stacks for end-to-end tests: `twinspark up` on the tiny default checkpoint, TP = 2 and TP = 1."""

from __future__ import annotations

import pytest

from tests.e2e.stack import Stack, start


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
    stack = start(tiny_default, tmp_path_factory.mktemp("stack_tp1"), tp=1)
    yield stack
    stack.down()
