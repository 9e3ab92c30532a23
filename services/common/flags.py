"""Command-line flags declared once: name, TWINSPARK_* environment variable, default and help.

A subcommand's settings are a frozen dataclass whose fields are flags (`flag(...)`): `add_flags` puts them on the
subcommand's parser, `from_args` reads the parsed namespace back into the dataclass, and the boot code takes the
dataclass, never the namespace. A flag that several subcommands take is declared once in shared_flags.py and named
by each of their dataclasses: fields declared with the same Flag are the same setting, which is how `passed_on`
carries `twinspark up`'s values into a child's settings, `to_argv` writes those as the child's command line and
`to_env` writes a deployment's settings as the TWINSPARK_* variables the roles read.

Config is by flags with environment defaults (what compose files and .env set): a flag's environment variable
replaces its default, the command line replaces both. An empty variable counts as unset, since compose passes
`${X}` through empty when X is not set.

Standard library only: deploy/ctl (start.sh, before any virtual environment exists) imports the declarations.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Collection, Mapping, TypeVar

S = TypeVar("S")

# What turns an on/off flag's variable off; any other non-empty value turns it on.
_OFF = ("0", "false", "no", "off")


def env_bool(text: str) -> bool:
    return text.strip().lower() not in _OFF


@dataclass(frozen=True)
class Flag:
    """One option: `--name`, its variable TWINSPARK_<env>, its default as the environment would spell it."""

    name: str  # without the dashes: "kv-cache-dtype"
    help: str
    default: str | None = None  # None: unset (the field is None unless given)
    type: Callable[[str], Any] = str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    env: str | None = ""  # "" = the name in capitals (KV_CACHE_DTYPE); None = no variable
    required: bool = False  # when neither the command line nor the variable gives a value
    switch: bool = False  # on/off: `--name` turns it on (the variable may too)
    toggle: bool = False  # on/off with both `--name` and `--no-name`
    one_of: str = ""  # the name of a required group of flags of which exactly one is given
    hidden: bool = False  # left out of --help (set by the program on itself, not by users)

    @property
    def option(self) -> str:
        return "--" + self.name

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def env_var(self) -> str | None:
        return None if self.env is None else "TWINSPARK_" + (self.env or self.dest.upper())

    def text(self, environ: Mapping[str, str]) -> str | None:
        """The value's text before the command line: the variable's, else the default."""
        got = environ.get(self.env_var, "") if self.env_var else ""
        return got or self.default

    def value(self, text: str | None) -> Any:
        """A text (a variable's, a default's) as the field's value."""
        if self.switch or self.toggle:
            return text is not None and env_bool(text)
        return None if text is None else self.type(text)

    def add(self, parser: Any, environ: Mapping[str, str] | None = None) -> None:
        """Add `--name` to an argparse parser (or group), its default read from `environ` (the process's)."""
        text = self.text(os.environ if environ is None else environ)
        help_text = argparse.SUPPRESS if self.hidden else \
            self.help + (f" (env {self.env_var})" if self.env_var and self.env_var not in self.help else "")
        if self.switch or self.toggle:
            action = "store_true" if self.switch else argparse.BooleanOptionalAction
            parser.add_argument(self.option, action=action, default=self.value(text), help=help_text)
            return
        # The text stays text: argparse converts a text default with `type` only when this subcommand is parsed,
        # so a bad variable is one subcommand's usage error, not a crash of every command.
        parser.add_argument(self.option, type=self.type, default=text, choices=self.choices, metavar=self.metavar,
                            required=self.required and text is None, help=help_text)


def flag(spec: Flag | str, help: str = "", **changes: Any) -> Any:
    """A settings field that is a flag: a declared one (shared_flags.py), with `changes` for this subcommand, or a
    new one named `spec`. Its dataclass default is the flag's own (no environment); its metadata keeps the
    declaration too, which says what setting it is whatever this subcommand changed (`passed_on`)."""
    if isinstance(spec, str):
        spec = declared = Flag(spec, help, **changes)
    else:
        declared = spec
        if help or changes:
            spec = replace(spec, **({"help": help} if help else {}), **changes)
    return field(default=spec.value(spec.default), metadata={"flag": spec, "declared": declared})


def flags_of(settings: type) -> list[Flag]:
    """The flags of a settings dataclass, in field order; each field is named as its flag's destination."""
    out = []
    for f in fields(settings):
        spec = f.metadata.get("flag")
        if spec is None:
            continue
        if spec.dest != f.name:
            raise TypeError(f"{settings.__name__}.{f.name} is the field of {spec.option}: name it {spec.dest}")
        out.append(spec)
    return out


def add_flags(settings: type, parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """Every flag of `settings` on `parser`."""
    groups: dict[str, Any] = {}
    for spec in flags_of(settings):
        target = parser
        if spec.one_of:
            if spec.one_of not in groups:
                groups[spec.one_of] = parser.add_mutually_exclusive_group(required=True)
            target = groups[spec.one_of]
        spec.add(target, environ)


def from_args(settings: type[S], args: argparse.Namespace) -> S:
    """The settings a parsed namespace holds."""
    return settings(**{spec.dest: getattr(args, spec.dest) for spec in flags_of(settings)})


def parse(settings: type[S], argv: list[str], environ: Mapping[str, str] | None = None, prog: str = "") -> S:
    """Settings from a command line and an environment alone, without a subcommand's parser (what the tests of
    each role's settings check)."""
    parser = argparse.ArgumentParser(prog=prog or None)
    add_flags(settings, parser, environ)
    return from_args(settings, parser.parse_args(argv))


def from_env(settings: type[S], environ: Mapping[str, str]) -> S:
    """Settings from an environment alone (each flag's variable, else its default), without argparse: what
    deploy/ctl reads from its .env. Nothing is required here; a value its flag refuses raises ValueError naming
    the variable."""
    values: dict[str, Any] = {}
    for spec in flags_of(settings):
        text = spec.text(environ)
        try:
            if spec.choices and text is not None and text not in spec.choices:
                raise ValueError(f"must be one of {', '.join(spec.choices)}")
            values[spec.dest] = spec.value(text)
        except ValueError as exc:
            raise ValueError(f"{spec.env_var}={text!r}: {exc}") from None
    return settings(**values)


def passed_on(source: Any, settings: type) -> dict[str, Any]:
    """The values of `source`'s flags that `settings` takes too: the fields declared with the same Flag, which are
    one setting whatever help or default each subcommand gives it (a field of the same name declared apart, such
    as `up`'s --drafter method and the scheduler's --drafter address, is another setting)."""
    mine = {f.name: f.metadata["declared"] for f in fields(source) if "declared" in f.metadata}
    return {f.name: getattr(source, f.name) for f in fields(settings)
            if "declared" in f.metadata and mine.get(f.name) is f.metadata["declared"]}


def config_values(settings: Any, config: type) -> dict[str, Any]:
    """The values of `settings`' fields that the dataclass `config` has a field of the same name for: how a role's
    internal config takes its flags without listing them."""
    names = {f.name for f in fields(config)}
    return {f.name: getattr(settings, f.name) for f in fields(settings) if f.name in names}


def to_argv(settings: Any, names: Collection[str] | None = None) -> list[str]:
    """The command line that gives `settings` again: every flag that is set (a switch only when on); with `names`,
    only those fields' flags, the others left to the command's own environment and defaults."""
    argv: list[str] = []
    for spec in flags_of(type(settings)):
        value = getattr(settings, spec.dest)
        if (names is not None and spec.dest not in names) or value is None:
            continue
        if spec.toggle:
            argv.append(spec.option if value else f"--no-{spec.name}")
        elif spec.switch:
            argv += [spec.option] if value else []
        else:
            argv += [spec.option, str(value)]
    return argv


def to_env(settings: Any, *, defaults: bool = False) -> dict[str, str]:
    """The TWINSPARK_* variables that give `settings` to a command reading its flags' defaults from them: one per
    flag with a variable whose value is not the default (a default needs none, and an empty variable is unset).
    `defaults`: every set value, defaults too, so that a variable the caller's own environment holds cannot replace
    them in the child's (a deployment's file is the whole configuration)."""
    env: dict[str, str] = {}
    for f in fields(settings):
        spec = f.metadata.get("flag")
        value = getattr(settings, f.name)
        if spec is None or spec.env_var is None or (value == f.default and not (defaults and value is not None)):
            continue
        if value is None:
            raise ValueError(f"{spec.env_var} cannot unset {spec.option}, whose default is {f.default!r}")
        env[spec.env_var] = ("1" if value else "0") if spec.switch or spec.toggle else str(value)
    return env


def add_subcommand(sub: argparse._SubParsersAction, name: str, settings: type[S], run: Callable[[S], int],
                   **parser_kw: Any) -> argparse.ArgumentParser:
    """`twinspark NAME`: the settings' flags on a new subcommand parser, whose `func` builds the settings once from
    the parsed flags and the environment and hands them to `run`."""
    p = sub.add_parser(name, **parser_kw)
    add_flags(settings, p)
    p.set_defaults(func=lambda args: run(from_args(settings, args)))
    return p
