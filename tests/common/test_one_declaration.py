"""A serving setting is declared once (issue 53): a new flag, declared beside the others in shared_flags.py and named
by `up`'s and each role's settings, reaches the argv of every child `up` starts and the environment deploy/ctl gives
the roles, with no other list edited (no argv builder, no launch config field, no deploy/ctl key)."""

from __future__ import annotations

from dataclasses import make_dataclass, replace

import pytest

from deploy.ctl.plan import native_env
from deploy.ctl.settings import EXAMPLE, load
from services.common import shared_flags
from services.common.flags import Flag, flag, parse
from services.launcher.plan import ROLES, LaunchConfig, internal_ports_needed, make_plan
from services.launcher.settings import UpSettings

KNOB = Flag("test-knob", "a serving setting made up by this test", default="a")


def _naming_knob(settings: type) -> type:
    """`settings` as it would be declared with one more field: KNOB."""
    return make_dataclass(settings.__name__, [("test_knob", str, flag(KNOB))], bases=(settings,), frozen=True,
                          kw_only=True)


@pytest.fixture
def knob(monkeypatch: pytest.MonkeyPatch) -> Flag:
    monkeypatch.setattr(shared_flags, "TEST_KNOB", KNOB, raising=False)
    return KNOB


def test_it_reaches_every_child_that_up_starts(knob):
    roles = tuple(replace(role, settings=_naming_knob(role.settings)) for role in ROLES)
    up = parse(_naming_knob(UpSettings), ["--model", "/m", "--state-dir", "/s", "--tp", "2", "--drafter", "mtp",
                                          "--test-knob", "b"], {})
    config = LaunchConfig(up)
    plan = make_plan(config, list(range(7000, 7000 + internal_ports_needed(config, roles))), roles)
    assert [c.name for c in plan.children] == ["rank0", "rank1", "drafter", "scheduler", "gateway"]
    for child in plan.children:
        role = next(r for r in roles if r.name == child.role)
        assert parse(role.settings, list(child.argv[len(config.command) + 1:]), {}).test_knob == "b", child.argv


def test_it_reaches_the_environment_deploy_ctl_gives_the_roles(knob):
    s = load(EXAMPLE, environ={"LAUNCHER": "native"})
    s.values["TEST_KNOB"] = "b"  # what deploy/.env.example would list
    assert native_env(s)["TWINSPARK_TEST_KNOB"] == "b"
    s.values["TEST_KNOB"] = "a"  # the default too: the shell's own TWINSPARK_TEST_KNOB must not win over .env
    assert native_env(s)["TWINSPARK_TEST_KNOB"] == "a"
