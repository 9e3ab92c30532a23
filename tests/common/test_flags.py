"""Flags declared once (services/common/flags.py): environment defaults, the command line over them, the settings
dataclass read back from the parsed namespace, and the same settings written again as a command line or as
variables, or passed on to another subcommand's settings."""

from __future__ import annotations

import argparse
from dataclasses import FrozenInstanceError, dataclass

import pytest

from services.common.flags import Flag, add_flags, flag, from_env, parse, passed_on, to_argv, to_env


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


def test_to_argv_of_some_fields_leaves_the_others_to_the_command():
    s = parse(Demo, ["--model", "m", "--ids", "1", "--port", "5", "--eager"], {})
    assert to_argv(s, names={"port", "eager", "token"}) == ["--port", "5", "--eager"]  # token: unset


def test_to_env_writes_what_is_not_the_default_and_from_env_reads_it_back():
    s = parse(Demo, ["--model", "m", "--ids", "1", "--port", "5", "--eager", "--no-caching"], {})
    env = to_env(s)
    assert env == {"TWINSPARK_MODEL": "m", "TWINSPARK_DEMO_PORT": "5", "TWINSPARK_EAGER": "1",
                   "TWINSPARK_CACHING": "0"}  # --ids has no variable
    assert from_env(Demo, env) == Demo(model="m", port=5, eager=True, caching=False)
    assert to_env(Demo()) == {}
    # defaults=True: every set value, so the caller's own variables cannot replace a default in the child
    assert to_env(Demo(model="m"), defaults=True) == {"TWINSPARK_MODEL": "m", "TWINSPARK_DEMO_PORT": "50061",
                                                      "TWINSPARK_EAGER": "0", "TWINSPARK_CACHING": "1"}


def test_from_env_refuses_a_value_naming_its_variable():
    with pytest.raises(ValueError, match="TWINSPARK_DEMO_PORT='many'"):
        from_env(Demo, {"TWINSPARK_DEMO_PORT": "many"})

    @dataclass(frozen=True)
    class Picky:
        device: str = flag("device", "where", default="cpu", choices=("cpu", "cuda"))

    with pytest.raises(ValueError, match="TWINSPARK_DEVICE='tpu': must be one of cpu, cuda"):
        from_env(Picky, {"TWINSPARK_DEVICE": "tpu"})


SHARED_PORT = Flag("port", "listen port", default="1", type=int)


def test_passed_on_are_the_fields_of_one_declaration():
    """A field takes the value of one declared with the same Flag, whatever help or default each gives it; a field
    of the same name declared apart is another setting."""
    @dataclass(frozen=True)
    class Launcher:
        port: int = flag(SHARED_PORT, help="the public port", default="8")
        model: str | None = flag("model", "checkpoint")

    @dataclass(frozen=True)
    class Child:
        port: int = flag(SHARED_PORT)
        model: str | None = flag("model", "checkpoint")

    assert passed_on(Launcher(port=9, model="m"), Child) == {"port": 9}
