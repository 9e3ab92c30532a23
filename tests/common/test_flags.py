"""Flags declared once (services/common/flags.py): environment defaults, the command line over them, and the
settings dataclass read back from the parsed namespace."""

from __future__ import annotations

import argparse
from dataclasses import FrozenInstanceError, dataclass

import pytest

from services.common.flags import Flag, add_flags, flag, parse, to_argv


@dataclass(frozen=True, kw_only=True)
class Demo:
    model: str = flag("model", "checkpoint", required=True)
    port: int = flag("port", "listen port", default="50061", type=int, env="DEMO_PORT")
    eager: bool = flag("eager", "no graphs", switch=True)
    caching: bool = flag("caching", "reuse prefixes", default="1", toggle=True)
    token: str | None = flag("token", "secret")
    prompt: str | None = flag("prompt", "text", env=None, one_of="source")
    ids: str | None = flag("ids", "token ids", env=None, one_of="source")


def test_defaults_then_environment_then_command_line():
    s = parse(Demo, ["--model", "m", "--ids", "1"], {})
    assert (s.model, s.port, s.eager, s.caching, s.token, s.ids) == ("m", 50061, False, True, None, "1")
    env = {"TWINSPARK_MODEL": "from-env", "TWINSPARK_DEMO_PORT": "7", "TWINSPARK_EAGER": "1",
           "TWINSPARK_CACHING": "off", "TWINSPARK_TOKEN": "t"}
    s = parse(Demo, ["--prompt", "hi"], env)
    assert (s.model, s.port, s.eager, s.caching, s.token, s.prompt) == ("from-env", 7, True, False, "t", "hi")
    s = parse(Demo, ["--prompt", "hi", "--model", "cli", "--port", "9", "--caching"], env)
    assert (s.model, s.port, s.caching) == ("cli", 9, True)


def test_an_empty_variable_is_unset():
    """Compose passes `${X}` through empty when X is unset: that is no value, not an empty one."""
    s = parse(Demo, ["--model", "m", "--ids", "1"], {"TWINSPARK_TOKEN": "", "TWINSPARK_DEMO_PORT": ""})
    assert s.token is None and s.port == 50061
    with pytest.raises(SystemExit):  # --model is required when the variable is empty
        parse(Demo, ["--ids", "1"], {"TWINSPARK_MODEL": ""})


def test_a_bad_variable_is_a_usage_error_of_its_own_command_only(capsys):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_flags(Demo, sub.add_parser("demo"), {"TWINSPARK_DEMO_PORT": "many"})
    sub.add_parser("other")
    assert parser.parse_args(["other"]).command == "other"  # building the parser did not convert it
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["demo", "--model", "m", "--ids", "1"])
    assert exc.value.code == 2 and "invalid int value: 'many'" in capsys.readouterr().err


def test_one_of_a_group_is_required():
    with pytest.raises(SystemExit):
        parse(Demo, ["--model", "m"], {})
    with pytest.raises(SystemExit):
        parse(Demo, ["--model", "m", "--ids", "1", "--prompt", "p"], {})


def test_help_names_the_variable(capsys):
    with pytest.raises(SystemExit):
        parse(Demo, ["--help"], {})
    out = " ".join(capsys.readouterr().out.split())
    assert "listen port (env TWINSPARK_DEMO_PORT)" in out and "text (env" not in out


def test_to_argv_gives_the_same_settings_again():
    s = parse(Demo, ["--model", "m", "--ids", "1", "--eager", "--no-caching", "--port", "5"], {})
    assert to_argv(s) == ["--model", "m", "--port", "5", "--eager", "--no-caching", "--ids", "1"]
    assert parse(Demo, to_argv(s), {}) == s
    with pytest.raises(FrozenInstanceError):
        s.port = 6  # type: ignore[misc]


def test_a_field_is_named_as_its_flag():
    @dataclass(frozen=True)
    class Wrong:
        world_size: int = flag(Flag("world", "ranks", default="1", type=int))

    with pytest.raises(TypeError, match="name it world"):
        parse(Wrong, [], {})
