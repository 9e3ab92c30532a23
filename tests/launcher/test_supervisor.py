"""`up` / `down` mechanics through the real launcher code, with STAND-IN children (tests/launcher/standin_role.py)
in place of the real services: health wait, a child dying, SIGTERM, startup failures, --detach + down.

Each run is a real `python -m services.launcher up ...` process; "no process left behind" is checked on every pid
the stand-ins wrote (children and their `sleep` grandchildren) with os.kill(pid, 0) and /proc (zombies = gone).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from services.launcher.tiny_cache import NAME as TINY_NAME

ROOT = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).with_name("standin_role.py")
ROLE_CMD = shlex.join([sys.executable, str(STANDIN)])
LAUNCHER = [sys.executable, "-m", "services.launcher"]

pytestmark = pytest.mark.timeout(60)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def _pids(piddir: Path) -> dict[str, int]:
    # the stand-ins write ".<name>.tmp" and rename it into place: only whole pid files are read
    return {p.name: int(p.read_text()) for p in piddir.iterdir() if not p.name.startswith(".")}


def _env(**standin: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STANDIN_", "TWINSPARK_"))}
    return {**env, **standin}


def _up_argv(state: Path, model: Path | None, *extra: str) -> list[str]:
    argv = [*LAUNCHER, "up", "--port", "0", "--state-dir", str(state), "--role-command", ROLE_CMD,
            "--stop-grace", "1", "--startup-timeout", "20", *extra]
    return argv + (["--model", str(model)] if model else [])


def _start(tmp_path: Path, *extra: str, **standin: str) -> tuple[subprocess.Popen, Path]:
    """A foreground `up` (the supervisor itself), output to files."""
    state = tmp_path / "state"
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    out, err = open(tmp_path / "up.out", "wb"), open(tmp_path / "up.err", "wb")
    proc = subprocess.Popen(_up_argv(state, model, *extra), cwd=ROOT, env=_env(**standin),
                            stdin=subprocess.DEVNULL, stdout=out, stderr=err)
    out.close()
    err.close()
    return proc, state


def _wait_up(proc: subprocess.Popen, state: Path, timeout: float = 20) -> dict:
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        try:
            info = json.loads((state / "up.json").read_text())
            if info["status"] == "up":
                return info
        except (OSError, ValueError, KeyError):
            pass
        assert proc.poll() is None, f"up exited early with {proc.returncode}"
        time.sleep(0.05)
    raise AssertionError("not up in time")


def _outputs(tmp_path: Path) -> tuple[str, str]:
    return (tmp_path / "up.out").read_text(), (tmp_path / "up.err").read_text()


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status


def _assert_all_gone(pids: dict[str, int] | list[int], within: float = 3.0) -> None:
    values = list(pids.values()) if isinstance(pids, dict) else list(pids)
    until = time.monotonic() + within
    while any(_alive(p) for p in values) and time.monotonic() < until:
        time.sleep(0.05)
    left = {k: v for k, v in (pids.items() if isinstance(pids, dict) else enumerate(pids)) if _alive(v)}
    assert not left, f"processes left behind: {left}"


def test_foreground_healthy_then_sigterm_stops_everything(tmp_path):
    piddir = tmp_path / "pids"
    piddir.mkdir()
    proc, state = _start(tmp_path, "--tp", "2", STANDIN_PIDDIR=str(piddir), STANDIN_STUBBORN="rank1")
    try:
        info = _wait_up(proc, state)
        assert _get(info["health_url"]) == 200
        assert [c["name"] for c in info["children"]] == ["rank0", "rank1", "drafter", "scheduler", "gateway"]
        assert info["supervisor_pid"] == proc.pid and info["tp"] == 2
        ports = list(info["ports"].values())
        assert len(set(ports)) == len(ports) == 7 and info["port"] == info["ports"]["gateway"]
        assert info["endpoint"] == f"http://127.0.0.1:{info['port']}/v1"
        for c in info["children"]:
            assert Path(c["log"]) == state / "logs" / f"{c['name']}.log" and Path(c["log"]).is_file()
        pids = _pids(piddir)
        assert len(pids) == 10 and all(_alive(p) for p in pids.values())  # 5 stand-ins + 5 sleep grandchildren
        assert {pids[f"{c['name']}.pid"] for c in info["children"]} == {c["pid"] for c in info["children"]}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    out, err = _outputs(tmp_path)
    assert f"twinspark is up: {info['endpoint']}" in out and "curl" in out and "standin-model" in out
    assert "starting rank 0" in err and "healthy after" in err and "got SIGTERM" in err
    assert "rank1 (process group" in err and "SIGKILL" in err  # rank1 ignored SIGTERM
    _assert_all_gone(pids)
    assert not (state / "up.json").exists()


def test_child_dying_with_max_restarts_0_stops_everything_and_exits_nonzero(tmp_path):
    piddir, trigger = tmp_path / "pids", tmp_path / "crash-now"
    piddir.mkdir()
    proc, state = _start(tmp_path, "--max-restarts", "0", STANDIN_PIDDIR=str(piddir),
                         STANDIN_CRASH_ON=f"scheduler:3:{trigger}")
    try:
        _wait_up(proc, state)
        pids = _pids(piddir)
        trigger.touch()
        assert proc.wait(timeout=15) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    _, err = _outputs(tmp_path)
    assert "child scheduler" in err and "exited with code 3" in err and "crashing on purpose" in err
    assert "past its restart limit (0 of --max-restarts 0)" in err
    _assert_all_gone(pids)
    assert not (state / "up.json").exists()


def _wait_restarted(state: Path, restarts: dict[str, int], timeout: float = 20) -> dict:
    """up.json once it counts `restarts` and records live children (the restarted ones included)."""
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        try:
            info = json.loads((state / "up.json").read_text())
            if info["restarts"] == restarts and all(_alive(c["pid"]) for c in info["children"]):
                return info
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"no restart {restarts} recorded in time")


def test_rank_exit_restarts_the_rank_group_with_the_same_argv(tmp_path):
    piddir, trigger = tmp_path / "pids", tmp_path / "crash-now"
    piddir.mkdir()
    proc, state = _start(tmp_path, "--tp", "2", STANDIN_PIDDIR=str(piddir), STANDIN_CRASH_ON=f"rank1:5:{trigger}")
    try:
        before = {c["name"]: c for c in _wait_up(proc, state)["children"]}
        old = _pids(piddir)
        trigger.touch()
        after = {c["name"]: c for c in _wait_restarted(state, {"rank": 1})["children"]}
        for name in ("rank0", "rank1"):  # both ranks are new processes, on the same argv and ports
            assert after[name]["pid"] != before[name]["pid"] and after[name]["argv"] == before[name]["argv"]
        for name in ("drafter", "scheduler", "gateway"):
            assert after[name]["pid"] == before[name]["pid"]
        _assert_all_gone([old[f"rank{i}.{k}"] for i in (0, 1) for k in ("pid", "grandchild")])
        assert _get(f"http://127.0.0.1:{after['gateway']['port']}/health") == 200
        restarted = {after["rank0"]["pid"], after["rank1"]["pid"]}
        until = time.monotonic() + 10  # the restarted stand-ins write their pid files once their Python is up
        while {(new := _pids(piddir))["rank0.pid"], new["rank1.pid"]} != restarted and time.monotonic() < until:
            time.sleep(0.05)
        assert {new["rank0.pid"], new["rank1.pid"]} == restarted
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    _, err = _outputs(tmp_path)
    assert "child rank1" in err and "exited with code 5" in err
    # The stand-in rank0 has no peer watchdog: it is given the wait, then stopped (with rank1's orphaned grandchild).
    assert "waiting up to 5 s for rank0 to leave on its own" in err
    assert "stopping rank0, rank1 (restarting the rank group)" in err
    log = (state / "logs" / "rank1.log").read_text()
    assert "# twinspark up: rank1 started" in log and "crashing on purpose" in log  # the first run's lines are kept
    assert "# twinspark up: rank1 restarted (restart 1 of at most 5 for rank)" in log
    _assert_all_gone(new)


def test_scheduler_restarts_alone_until_its_limit(tmp_path):
    piddir, trigger = tmp_path / "pids", tmp_path / "crash-now"
    piddir.mkdir()
    proc, state = _start(tmp_path, "--max-restarts", "1", STANDIN_PIDDIR=str(piddir),
                         STANDIN_CRASH_ON=f"scheduler:7:{trigger}")
    try:
        before = {c["name"]: c["pid"] for c in _wait_up(proc, state)["children"]}
        trigger.touch()
        info = _wait_restarted(state, {"scheduler": 1})
        after = {c["name"]: c["pid"] for c in info["children"]}
        assert after["scheduler"] != before["scheduler"]
        assert {k: v for k, v in after.items() if k != "scheduler"} == \
            {k: v for k, v in before.items() if k != "scheduler"}  # nobody else was touched
        pids = _pids(piddir)
        trigger.touch()  # one exit more than --max-restarts allows
        assert proc.wait(timeout=15) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    _, err = _outputs(tmp_path)
    assert "restarting scheduler, restart 1 of at most 1" in err
    assert "scheduler is past its restart limit (1 of --max-restarts 1): stopping everything" in err
    _assert_all_gone(pids)
    assert not (state / "up.json").exists()


def test_child_failing_at_startup_fails_fast_with_its_log(tmp_path):
    piddir = tmp_path / "pids"
    piddir.mkdir()
    t = time.monotonic()
    proc, state = _start(tmp_path, "--tp", "2", STANDIN_PIDDIR=str(piddir), STANDIN_FAIL_AT_START="rank1:5")
    assert proc.wait(timeout=20) == 1
    assert time.monotonic() - t < 10
    _, err = _outputs(tmp_path)
    assert "rank1" in err and "exited with code 5 during startup" in err
    assert "boom, failing at start on purpose" in err and str(state / "logs" / "rank1.log") in err
    _assert_all_gone(_pids(piddir))  # rank0 stopped, and rank1's orphaned grandchild too


def test_startup_timeout_shows_gateway_log(tmp_path):
    proc, state = _start(tmp_path, "--startup-timeout", "1.5", STANDIN_UNHEALTHY="1")
    assert proc.wait(timeout=20) == 1
    _, err = _outputs(tmp_path)
    assert "not healthy after 1.5 s" in err and "HTTP 503" in err
    assert "last lines of" in err and "gateway.log" in err and "GET /health" in err


def test_detach_then_down_leaves_nothing(tmp_path):
    state, piddir, cache = tmp_path / "state", tmp_path / "pids", tmp_path / "cache"
    piddir.mkdir()
    env = _env(STANDIN_PIDDIR=str(piddir), TWINSPARK_STATE_DIR=str(state), TWINSPARK_CACHE_DIR=str(cache),
               TWINSPARK_TP="2", TWINSPARK_PORT="0")
    run = lambda *a: subprocess.run([*LAUNCHER, *a], cwd=ROOT, env=env, capture_output=True, text=True,  # noqa: E731
                                    timeout=40)
    # No --model: the tiny checkpoint is made in the cache (the real make_tiny) and passed to ranks and gateway.
    up = run("up", "--detach", "--role-command", ROLE_CMD, "--stop-grace", "1", "--startup-timeout", "20")
    assert up.returncode == 0, up.stderr
    info = json.loads((state / "up.json").read_text())
    assert info["status"] == "up" and info["model"] == str(cache / TINY_NAME)
    assert f"twinspark is up: {info['endpoint']}" in up.stdout and "twinspark down" in up.stdout
    assert "no --model: serving the tiny checkpoint" in up.stderr and "starting rank 1" in up.stderr
    assert all(f"--model {cache / TINY_NAME}" in " ".join(c["argv"]) for c in info["children"]
               if c["role"] in ("rank", "gateway"))
    assert _get(info["health_url"]) == 200
    sup = info["supervisor_pid"]
    pids = {**_pids(piddir), "supervisor": sup}
    assert len(pids) == 11 and all(_alive(p) for p in pids.values())

    again = run("up", "--detach", "--role-command", ROLE_CMD)
    assert again.returncode == 1 and "already running" in again.stderr

    down = run("down")
    assert down.returncode == 0, down.stderr
    assert f"stopped supervisor {sup}" in down.stdout and "rank0" in down.stdout
    _assert_all_gone(pids)
    assert not (state / "up.json").exists()
    log = (state / "logs" / "supervisor.log").read_text()
    assert "got SIGTERM" in log and "stopped gateway" in log

    nothing = run("down")
    assert nothing.returncode == 0 and "nothing is running" in nothing.stdout


def test_down_cleans_up_after_a_supervisor_that_died_hard(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = subprocess.Popen(["sleep", "600"], start_new_session=True)  # a child its supervisor left behind
    start = int(Path(f"/proc/{orphan.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    (state / "up.json").write_text(json.dumps({
        "supervisor_pid": dead.pid, "endpoint": "http://127.0.0.1:1/v1",
        "children": [{"name": "rank0", "pid": orphan.pid, "pgid": orphan.pid, "start": start}]}))
    try:
        down = subprocess.run([*LAUNCHER, "down", "--state-dir", str(state)], cwd=ROOT, env=_env(),
                              capture_output=True, text=True, timeout=20)
        assert down.returncode == 0, down.stderr
        assert "stale up.json" in down.stdout and "SIGKILLed rank0" in down.stdout
        assert orphan.wait(timeout=5) == -signal.SIGKILL
        assert not (state / "up.json").exists()
    finally:
        if orphan.poll() is None:
            orphan.kill()


@pytest.mark.parametrize("cmd", ["up", "down"])
def test_help(cmd):
    proc = subprocess.run([*LAUNCHER, cmd, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0 and "usage:" in proc.stdout and "--state-dir" in proc.stdout


def test_registered_in_twinspark_cli():
    from services.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    if "up" not in sub.choices:
        pytest.skip("services.launcher.cli is not in services/cli.py's _COMMANDS yet")
    assert "down" in sub.choices
