"""The deployment's settings: defaults from deploy/.env.example (the one list of settings), then deploy/.env (or
--env-file), then the process environment (as docker compose does), checked and with the derived values filled in.

The values a setting may take are the services' own flags' (services/common/shared_flags.py, standard library only
like this package); a test holds .env.example's defaults to those flags' defaults. A setting named as a flag's
variable (KEY for TWINSPARK_KEY) is that flag: `serving` reads every declared one into a settings object.
"""

from __future__ import annotations

import os
import secrets
import shlex
from dataclasses import dataclass, field, make_dataclass
from pathlib import Path
from typing import Any

from services.common import shared_flags as flags
from services.common.flags import flag, from_env

DEPLOY = Path(__file__).resolve().parent.parent
REPO = DEPLOY.parent
EXAMPLE = DEPLOY / ".env.example"
LAUNCHERS = ("auto", "docker", "podman", "native")
WHEELS = ("index", "host")
SECRETS = ("API_KEY", "INTERNAL_TOKEN")  # never printed, never on a command line (ssh gets them on stdin)


class SettingsError(ValueError):
    """A setting that cannot work; the message names it."""


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (comments, blanks and `export ` prefixes allowed; values may be quoted), in file order."""
    out: dict[str, str] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("export ").strip()
        key, sep, value = line.partition("=")
        if not sep or not key.strip().isidentifier():
            raise SettingsError(f"{path}:{n}: not a KEY=VALUE line: {raw!r}")
        value = value.strip()
        if value[:1] in ("'", '"'):
            parts = shlex.split(value)
            value = parts[0] if parts else ""
        out[key.strip()] = value
    return out


@dataclass(frozen=True)
class Machine:
    """One machine of the deployment and the ranks it runs."""

    ssh: str | None  # None: this machine (the head)
    ranks: tuple[int, ...]

    @property
    def name(self) -> str:
        return self.ssh or "head"

    @property
    def host(self) -> str:
        """How the head reaches it: the ssh target without the user."""
        return "127.0.0.1" if self.ssh is None else self.ssh.rsplit("@", 1)[-1]


@dataclass
class Settings:
    values: dict[str, str]
    env_file: Path | None
    machines: list[Machine] = field(default_factory=list)

    def __getitem__(self, key: str) -> str:
        return self.values[key]

    def int(self, key: str) -> int:
        return int(self.values[key])

    @property
    def workers(self) -> list[Machine]:
        return [m for m in self.machines if m.ssh is not None]

    @property
    def state_dir(self) -> Path:
        p = Path(self.values["STATE_DIR"]).expanduser()
        return p if p.is_absolute() else REPO / p

    def rank_port(self, rank: int) -> int:
        return self.int("RANK_PORT") + rank


def serving(s: Settings) -> Any:
    """The serving settings of this deployment as one settings object: every flag of shared_flags.py, from the
    setting named as its variable, else its default (ValueError naming the variable when its flag refuses it)."""
    settings = make_dataclass("ServingSettings", [(spec.dest, Any, flag(spec)) for spec in flags.declared()],
                              frozen=True)
    return from_env(settings, {f"TWINSPARK_{key}": value for key, value in s.values.items()})


def load(env_file: Path | None = None, environ: dict[str, str] | None = None) -> Settings:
    """Defaults < env file < environment, then `check` (raises SettingsError)."""
    environ = dict(os.environ if environ is None else environ)
    values = read_env_file(EXAMPLE)
    if env_file is None and (DEPLOY / ".env").is_file():
        env_file = DEPLOY / ".env"
    if env_file is not None:
        if not env_file.is_file():
            raise SettingsError(f"env file {env_file} does not exist (copy deploy/.env.example)")
        extra = read_env_file(env_file)
        unknown = sorted(set(extra) - set(values))
        if unknown:
            raise SettingsError(f"{env_file}: unknown setting(s) {', '.join(unknown)} (see deploy/.env.example)")
        values.update(extra)
    values.update({k: v for k, v in environ.items() if k in values})
    s = Settings(values=values, env_file=env_file)
    check(s)
    return s


def _int(s: Settings, key: str, lo: int, hi: int | None = None) -> int:
    try:
        v = int(s.values[key])
    except ValueError:
        raise SettingsError(f"{key}={s.values[key]!r} is not a whole number") from None
    if v < lo or (hi is not None and v > hi):
        raise SettingsError(f"{key}={v} is outside {lo}..{hi if hi is not None else '∞'}")
    return v


def _choice(s: Settings, key: str, choices: tuple[str, ...]) -> None:
    if s.values[key] not in choices:
        raise SettingsError(f"{key}={s.values[key]!r} must be one of {', '.join(choices)}")


def check(s: Settings) -> None:
    """Validate every setting and derive the empty ones (machines, rank addresses, image, runtime, drafter)."""
    v = s.values
    for key in ("PORT", "SCHEDULER_PORT", "DRAFTER_PORT", "RANK_PORT", "MASTER_PORT", "PEER_PORT"):
        _int(s, key, 1, 65535)
    for key in ("MAX_NUM_SEQS", "BLOCK_SIZE", "NUM_SLOTS", "TP", "HEALTH_TIMEOUT", "PEER_TIMEOUT"):
        _int(s, key, 1)
    if v.get("MAX_NUM_BATCHED_TOKENS"):  # empty: the scheduler's default for the ranks' device
        _int(s, "MAX_NUM_BATCHED_TOKENS", 1)
    _int(s, "MAX_WAITING", 0)
    try:
        flags.scheduler_steps(v["NUM_SCHEDULER_STEPS"])
    except ValueError:
        raise SettingsError(f"NUM_SCHEDULER_STEPS={v['NUM_SCHEDULER_STEPS']!r} must be auto or "
                            f"1..{flags.MAX_SCHEDULER_STEPS}") from None
    _int(s, "NUM_BLOCKS", 0)  # 0 = sized from memory
    _int(s, "KV_CACHE_MEMORY_BYTES", 0)
    try:
        utilization = float(v["GPU_MEMORY_UTILIZATION"])
    except ValueError:
        utilization = -1.0
    if not 0 < utilization <= 1:
        raise SettingsError(f"GPU_MEMORY_UTILIZATION={v['GPU_MEMORY_UTILIZATION']!r} must be a number in (0, 1]")
    _int(s, "MAX_RESTARTS", 0)
    _int(s, "REASONING_BUDGET", -1)
    try:
        flags.parse_effort_budgets(v["REASONING_EFFORT_BUDGETS"])
    except ValueError as exc:
        raise SettingsError(f"REASONING_EFFORT_BUDGETS: {exc}") from None
    _int(s, "NUM_DRAFT_TOKENS", 0)
    for spec in (flags.DEVICE, flags.DRAFTER, flags.KV_CACHE_DTYPE):  # each setting is its flag's variable
        _choice(s, (spec.env_var or "").removeprefix("TWINSPARK_"), spec.choices or ())
    _choice(s, "LAUNCHER", LAUNCHERS)
    _choice(s, "WHEELS", WHEELS)
    if v["DTYPE"] not in ("", *flags.DTYPES):
        raise SettingsError(f"DTYPE={v['DTYPE']!r} must be empty or one of {', '.join(flags.DTYPES)}")
    if v["MODEL"] and not (Path(v["MODEL"]).expanduser() / "config.json").is_file():
        raise SettingsError(f"MODEL={v['MODEL']!r} has no config.json (a Hugging Face checkpoint directory)")
    otel = v["OTEL_EXPORTER_OTLP_ENDPOINT"]
    if otel and not otel.startswith(("http://", "https://")):
        raise SettingsError(f"OTEL_EXPORTER_OTLP_ENDPOINT={otel!r} must be an http:// or https:// URL (or empty)")

    workers = v["WORKER"].split()
    tp = s.int("TP")
    n = 1 + len(workers)
    if tp % n:
        raise SettingsError(f"TP={tp} cannot be spread evenly over {n} machine(s) (this one + WORKER={v['WORKER']!r})")
    k = tp // n
    s.machines = [Machine(ssh=w or None, ranks=tuple(range(i * k, (i + 1) * k))) for i, w in enumerate([""] + workers)]
    if workers and v["MASTER_ADDR"] in ("127.0.0.1", "localhost", ""):
        raise SettingsError("MASTER_ADDR must be this machine's address on the link to the workers (the RoCE port "
                            f"on a Spark pair), not {v['MASTER_ADDR']!r}")
    if not v["RANK_ADDRESSES"]:
        v["RANK_ADDRESSES"] = ",".join(f"{m.host}:{s.rank_port(r)}" for m in s.machines for r in m.ranks)
    elif len(v["RANK_ADDRESSES"].split(",")) != tp:
        raise SettingsError(f"RANK_ADDRESSES lists {len(v['RANK_ADDRESSES'].split(','))} address(es) for TP={tp}")
    if not v["WORKER_DIR"]:
        v["WORKER_DIR"] = str(REPO)
    if not v["CONTAINER_RUNTIME"]:
        v["CONTAINER_RUNTIME"] = "nvidia" if v["DEVICE"] == "cuda" else "runc"
    if not v["IMAGE"]:
        v["IMAGE"] = "twinspark:gpu" if v["DEVICE"] == "cuda" else "twinspark:cpu"
    if not v["RANK_HOST"]:
        v["RANK_HOST"] = "0.0.0.0" if workers else "127.0.0.1"
    if not v["INTERNAL_TOKEN"]:
        v["INTERNAL_TOKEN"] = secrets.token_hex(32)  # a new one per start: every role of this start gets it
    v["DRAFTER_ADDRESS"] = "" if v["DRAFTER"] == "none" else f"127.0.0.1:{v['DRAFTER_PORT']}"
    v["DRAFT_HIDDEN"] = "1" if v["DRAFTER"] == "mtp" else ""
