"""start.sh's settings and the services' flags are one statement: the values deploy/ctl accepts are the flags'
choices (it imports services/common/shared_flags.py), and every default in deploy/.env.example that feeds a
flag's TWINSPARK_* variable is that flag's default."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from deploy.ctl.settings import EXAMPLE, read_env_file
from services.common.flags import Flag, flags_of
from services.drafter.cli import DrafterSettings
from services.gateway.cli import ServeGatewaySettings
from services.launcher.settings import UpSettings
from services.rank_worker.settings import RankSettings
from services.scheduler.cli import SchedulerSettings

REPO = Path(__file__).resolve().parents[2]
# Settings whose default is not the flag's on purpose; start.sh gives these roles their value on the command
# line (or under another setting), never through the variable.
OTHER_MEANING = {
    ("DRAFTER_PORT", DrafterSettings): "the deployment's own port, passed as --port",
    ("PEER_PORT", RankSettings): "the rank's default is derived (--master-port + 1): the same 29501",
    ("RANK_HOST", RankSettings): "empty = derived by start.sh from the machines (loopback for one)",
    ("RANK", RankSettings): "the rank of one worker.yml instance, set per instance",
    ("STATE_DIR", UpSettings): "the deployment's state dir inside the checkout, passed as --state-dir",
}


def _flags_by_variable() -> dict[str, list[tuple[type, Flag]]]:
    out: dict[str, list[tuple[type, Flag]]] = {}
    for role in (RankSettings, SchedulerSettings, ServeGatewaySettings, DrafterSettings, UpSettings):
        for spec in flags_of(role):
            if spec.env_var:
                out.setdefault(spec.env_var.removeprefix("TWINSPARK_"), []).append((role, spec))
    return out


def test_env_example_defaults_are_the_flags_defaults():
    flags = _flags_by_variable()
    checked, wrong = [], []
    for key, value in read_env_file(EXAMPLE).items():
        for role, spec in flags.get(key, []):
            if (key, role) in OTHER_MEANING:
                continue
            checked.append(key)
            if (value or None) != spec.default:
                wrong.append(f"{key}={value!r} but {role.__name__} {spec.option} defaults to {spec.default!r}")
    assert not wrong, wrong
    assert {"DEVICE", "KV_CACHE_DTYPE", "TP", "MAX_NUM_SEQS", "BLOCK_SIZE", "PORT", "LOG_LEVEL"} <= set(checked)


def test_ctl_imports_only_the_standard_library():
    """start.sh runs before any virtual environment exists: deploy.ctl, with the flag declarations it imports,
    loads in an interpreter that has no site-packages."""
    code = "import deploy.ctl.__main__, sys; print(sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'grpc', 'model', 'kernels'}))"
    r = subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


def test_compose_fallbacks_are_the_env_example_defaults():
    """`${X:-default}` in the compose files (run by hand without start.sh) falls back to .env.example's value; an
    empty one there is derived by start.sh, and the compose fallback is then the one-machine value."""
    example = read_env_file(EXAMPLE)
    wrong = [f"{path.name}: ${{{key}:-{value}}} but {key}={example.get(key)!r}"
             for path in (REPO / "deploy" / "compose").glob("*.yml")
             for key, value in re.findall(r"\$\{(\w+):-([^}]*)\}", path.read_text())
             if example.get(key) and example[key] != value]
    assert not wrong, wrong


def test_a_variable_read_by_several_roles_takes_one_kind_of_value():
    """`twinspark up` hands its whole environment to every role it starts, so a TWINSPARK_* variable that two roles
    read must mean the same to both: the same type and the same choices. (The scheduler once read up's
    TWINSPARK_DRAFTER=none, a draft method, as the drafter's address.)"""
    clashes = []
    for key, users in _flags_by_variable().items():
        kinds = {(spec.type, spec.choices, spec.switch or spec.toggle) for _, spec in users}
        if len(kinds) > 1:
            clashes.append(f"{key}: " + ", ".join(f"{role.__name__} {spec.option}" for role, spec in users))
    assert not clashes, clashes
