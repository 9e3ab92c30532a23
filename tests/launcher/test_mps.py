"""`up --mps` (services/launcher/mps.py): when CUDA ranks share a GPU, `up` runs a private MPS daemon for the stack
and hands its pipe directory to the children. No GPU here, so the control program and `nvidia-smi` are FAKE shell
scripts on PATH that record how they were called (the tests say so in their names); the ranks are the launcher
tests' stand-ins."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from services.launcher import mps
from services.launcher import state as state_mod
from tests.launcher.test_supervisor import LAUNCHER, ROOT, _env, _up_argv, _wait_up

pytestmark = pytest.mark.timeout(60)


def _fake_tools(tmp_path: Path, gpus: int = 1) -> tuple[dict[str, str], Path]:
    """A PATH whose nvidia-cuda-mps-control and nvidia-smi are fakes; the control's calls go to the returned log."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "mps-calls.log"
    bin_dir.mkdir()
    control = bin_dir / mps.CONTROL
    control.write_text(f'#!/bin/sh\nif [ $# -eq 0 ]; then read -r cmd; else cmd="$*"; fi\n'
                       f'echo "$cmd pipe=$CUDA_MPS_PIPE_DIRECTORY" >> {calls}\n')
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f'echo "GPU {i}: NVIDIA H200 (UUID: GPU-{i})"\n' for i in range(gpus)))
    for f in (control, smi):
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_MPS_", "CUDA_VISIBLE"))}
    return {**env, "PATH": f"{bin_dir}:{env.get('PATH', '')}"}, calls


@pytest.mark.parametrize(("mode", "device", "tp", "gpus", "env", "start"), [
    ("auto", "cuda", 2, 1, {}, True),  # two ranks on one GPU
    ("auto", "cuda", 2, 2, {}, False),  # a GPU each
    ("auto", "cuda", 4, 2, {}, True),
    ("auto", "cpu", 2, 1, {}, False),
    ("auto", "cuda", 2, 1, {mps.PIPE_ENV: "/tmp/theirs"}, False),  # the user's own daemon
    ("auto", "cuda", 2, None, {}, False),  # no driver tools: nothing known
    ("on", "cuda", 1, 1, {}, True),
    ("off", "cuda", 2, 1, {}, False),
])
def test_when_a_daemon_is_wanted(mode, device, tp, gpus, env, start) -> None:
    assert mps.wanted(mode, device, tp, gpus, env)[0] is start


def test_visible_gpus_from_cuda_visible_devices_or_fake_nvidia_smi(tmp_path: Path) -> None:
    env, _ = _fake_tools(tmp_path, gpus=3)
    assert mps.visible_gpus(env) == 3
    assert mps.visible_gpus({**env, "CUDA_VISIBLE_DEVICES": "1"}) == 1
    assert mps.visible_gpus({**env, "CUDA_VISIBLE_DEVICES": ""}) == 0
    assert mps.visible_gpus({"PATH": str(tmp_path / "nothing")}) is None


def test_daemon_for_needs_the_control_program(tmp_path: Path) -> None:
    said: list[str] = []
    bare = {"PATH": str(tmp_path), "CUDA_VISIBLE_DEVICES": "0"}
    assert mps.daemon_for("auto", "cuda", 2, tmp_path, bare, log=said.append) is None
    assert "time-slice" in said[-1]  # auto goes on without one, and says what it costs
    with pytest.raises(ValueError, match="not on PATH"):
        mps.daemon_for("on", "cuda", 2, tmp_path, bare, log=said.append)


def test_up_runs_a_private_daemon_for_ranks_sharing_a_gpu_fake_mps_control(tmp_path: Path) -> None:
    env, calls = _fake_tools(tmp_path, gpus=1)
    state, model = tmp_path / "state", tmp_path / "model"
    model.mkdir()
    proc = subprocess.Popen(_up_argv(state, model, "--tp", "2", "--device", "cuda", "--drafter", "none"), cwd=ROOT,
                            env=_env(**env), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "up.err", "wb"))
    try:
        _wait_up(proc, state)
        pipe = state / "mps" / "pipe"
        assert calls.read_text().splitlines() == [f"quit pipe={pipe}", f"-d pipe={pipe}"]  # a leftover quit, start
        for rank in ("rank0", "rank1"):
            assert f"CUDA_MPS_PIPE_DIRECTORY={pipe}" in (state / "logs" / f"{rank}.log").read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert calls.read_text().splitlines()[-1] == f"quit pipe={pipe}"  # quit when the stack stopped
    err = (tmp_path / "up.err").read_text()
    assert "MPS: 2 ranks share 1 GPU(s): starting a private daemon" in err and "the private daemon quit" in err


def test_down_quits_the_daemon_of_a_supervisor_that_died_hard_fake_mps_control(tmp_path: Path) -> None:
    """A SIGKILLed supervisor never quit its daemon: `down` does, from the directory up.json recorded."""
    env, calls = _fake_tools(tmp_path)
    state = tmp_path / "state"
    dead = subprocess.Popen(["true"])
    dead.wait()
    state_mod.write_up(state, {"supervisor_pid": dead.pid, "supervisor_start": 0, "children": [],
                               "mps_dir": str(state / "mps")})
    proc = subprocess.run([*LAUNCHER, "down", "--state-dir", str(state)], cwd=ROOT, env=_env(**env),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert calls.read_text().splitlines() == [f"quit pipe={state / 'mps' / 'pipe'}"]
    assert "quit the run's MPS daemon" in proc.stdout
