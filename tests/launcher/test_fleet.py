"""`twinspark up --replicas N` (services/launcher/fleet.py): the plan as a pure function, the refusals, and a whole
run through the real launcher with STAND-IN roles and a STAND-IN router (tests/launcher/standin_router.py):
replicas healthy first, then the router with every replica's URL, `down` leaving nothing. The real vllm-router in
front of real replicas: tests/e2e/test_router.py."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from services.common.flags import parse, to_argv
from services.launcher import cli
from services.launcher.fleet import fleet_plan, gpu_slices, replica_settings
from services.launcher.settings import UpSettings

from .test_supervisor import LAUNCHER, ROLE_CMD, ROOT, _alive, _assert_all_gone, _env, _get

ROUTER_CMD = shlex.join([sys.executable, str(Path(__file__).with_name("standin_router.py"))])
PY = ("/venv/bin/python", "-m", "services.launcher")


def _settings(*argv: str) -> UpSettings:
    s = parse(UpSettings, ["--model", "/models/glm", "--state-dir", "/st", "--port", "9000", *argv], {})
    return replace(s, role_command="/venv/bin/python -m services.cli")


def test_replicas_then_router_argv():
    s = _settings("--replicas", "2", "--tp", "2", "--drafter", "none", "--router-policy", "round_robin",
                  "--replica-urls", "http://spark3:8888/, http://spark4:8888", "--router-args", "--retry-max-retries 3")
    plan = fleet_plan(s, PY, ("/bin/vllm-router",), [7001, 7002], 7009)
    assert [[c.name for c in stage] for stage in plan.stages] == [["replica0", "replica1"], ["router"]]
    r0, r1, router = plan.children
    # A replica is `twinspark up` of one stack: the run's settings, its own loopback port and state dir.
    assert r0.argv[:4] == (*PY, "up")
    assert parse(UpSettings, list(r0.argv[4:]), {}) == replica_settings(s, 0, 7001)
    one = replica_settings(s, 1, 7002)
    assert (one.replicas, one.port, one.host, one.state_dir, one.tp, one.drafter, one.replica_urls) == \
        (1, 7002, "127.0.0.1", "/st/replica1", 2, "none", None)
    assert r1.health == "http://127.0.0.1:7002/health" and r1.optional and not r1.public
    assert r1.env["TWINSPARK_REPLICAS"] == "" and r1.log == "/st/logs/replica1.log"
    assert router.public and router.port == 9000 and plan.endpoint == "http://127.0.0.1:9000/v1"
    argv = list(router.argv)
    urls = argv[argv.index("--worker-urls") + 1:argv.index("--policy")]
    assert urls == ["http://127.0.0.1:7001", "http://127.0.0.1:7002", "http://spark3:8888", "http://spark4:8888"]
    assert argv[argv.index("--policy") + 1] == "round_robin" and argv[-2:] == ["--retry-max-retries", "3"]
    assert argv[argv.index("--prometheus-port") + 1] == "7009" and plan.ports["router_metrics"] == 7009


def test_gpu_slices_share_the_gpus_out_as_data_parallel_ranks():
    ids = ["0", "1", "2", "3"]
    assert gpu_slices(2, 2, ids) == [["0", "1"], ["2", "3"]]  # a TP pair each
    assert gpu_slices(2, 1, ids) == [["0"], ["1"]]  # one each; the rest stay free
    assert gpu_slices(4, 2, ids) == [["0"], ["1"], ["2"], ["3"]]  # both ranks of a replica on its one GPU (MPS)
    assert gpu_slices(3, 4, ["GPU-a", "GPU-b"]) == [["GPU-a"], ["GPU-b"], ["GPU-a"]]  # fewer GPUs than replicas
    assert gpu_slices(2, 1, []) == [[], []]


def test_cuda_replicas_each_see_their_own_gpus():
    s = _settings("--replicas", "2", "--tp", "2", "--device", "cuda")
    r0, r1, _ = fleet_plan(s, PY, ("r",), [7001, 7002], 7009, gpus=["0", "1", "2", "3"]).children
    assert (r0.env["CUDA_VISIBLE_DEVICES"], r1.env["CUDA_VISIBLE_DEVICES"]) == ("0,1", "2,3")
    assert r1.env["TWINSPARK_REPLICAS"] == ""
    cpu = fleet_plan(_settings("--replicas", "2"), PY, ("r",), [7001, 7002], 7009, gpus=["0", "1"]).children
    assert all("CUDA_VISIBLE_DEVICES" not in c.env for c in cpu)
    unknown = fleet_plan(s, PY, ("r",), [7001, 7002], 7009).children  # no GPU list: what the run sees
    assert all("CUDA_VISIBLE_DEVICES" not in c.env for c in unknown)


def test_kv_aware_gives_each_replica_an_event_port_and_the_router_every_source():
    s = _settings("--replicas", "2", "--router-policy", "kv_aware")
    plan = fleet_plan(s, PY, ("/bin/vllm-router",), [7001, 7002], 7009, [7011, 7012], model_name="glm",
                      block_size=16)
    r0, r1, router = plan.children
    assert parse(UpSettings, list(r1.argv[4:]), {}).kv_events_endpoint == "tcp://127.0.0.1:7012"
    assert r1.env["TWINSPARK_KV_EVENTS_ENDPOINT"] == ""  # a user's variable would give both replicas one port
    argv = " ".join(router.argv)
    assert "--kv-event-source http://127.0.0.1:7001=tcp://127.0.0.1:7011 --kv-event-source " \
           "http://127.0.0.1:7002=tcp://127.0.0.1:7012 --kv-event-block-size 16 --kv-event-model glm" in argv
    assert plan.ports["replica1_kv_events"] == 7012
    # The replica passes it on to its scheduler (plan.py), which publishes there.
    from services.launcher.plan import LaunchConfig, make_plan
    one = make_plan(LaunchConfig(UpSettings(model="/m", state_dir="/s", drafter="none",
                                            kv_events_endpoint="tcp://127.0.0.1:7011")), [5000, 5001, 5002, 5003])
    assert "--kv-events-endpoint tcp://127.0.0.1:7011" in " ".join(one.children[1].argv)
    with pytest.raises(ValueError):
        fleet_plan(s, PY, ("r",), [7001, 7002], 7009)  # kv_aware without event ports
    assert "--kv-event-source" not in " ".join(fleet_plan(_settings("--replicas", "2"), PY, ("r",), [7001, 7002],
                                                           7009).children[-1].argv)


def test_one_replica_with_remote_ones_is_routed_and_not_optional():
    s = _settings("--replica-urls", "http://spark3:8888")
    assert s.routed and s.replicas == 1
    assert fleet_plan(s, PY, ("r",), [7001], 7009).children[0].optional  # the remote replica serves meanwhile
    two = fleet_plan(replace(s, replicas=2, replica_urls=None), PY, ("r",), [7001, 7002], 7009)
    assert two.children[0].health == "http://127.0.0.1:7001/health"
    assert not _settings().routed and _settings("--replicas", "2").routed
    remote_only = fleet_plan(replace(s, replicas=0), PY, ("r",), [], 7009)
    assert [c.name for c in remote_only.children] == ["router"] and "http://spark3:8888" in remote_only.children[0].argv
    with pytest.raises(ValueError):
        fleet_plan(replace(s, replicas=2), PY, ("r",), [7001], 7009)


@pytest.mark.parametrize(("argv", "says"), [
    (["--replicas", "0"], "--replicas must be >= 1"),
    (["--replicas", "2", "--replica-urls", "spark3:8888"], "http(s) base URLs"),
    (["--replicas", "2"], "vllm-router"),
])
def test_refusals(monkeypatch, capsys, tmp_path, argv, says):
    monkeypatch.setattr(cli, "router_command", lambda configured: None)  # as if vllm-router were not installed
    s = parse(UpSettings, ["--model", str(tmp_path), "--state-dir", str(tmp_path / "st"), *argv], {})
    assert cli.up(s) == 1
    err = capsys.readouterr().err
    assert says in err and ("pip install" in err or says != "vllm-router")


def test_replicas_detach_then_down_leaves_nothing(tmp_path):
    state, model, argv_file = tmp_path / "state", tmp_path / "model", tmp_path / "router-argv.json"
    model.mkdir()
    env = _env(STANDIN_ROUTER_ARGV=str(argv_file), TWINSPARK_REPLICAS="2")  # the replicas must not inherit it
    run = lambda *a: subprocess.run([*LAUNCHER, *a], cwd=ROOT, env=env, capture_output=True, text=True,  # noqa: E731
                                    timeout=60)
    up = run("up", "--detach", "--port", "0", "--state-dir", str(state), "--model", str(model),
             "--role-command", ROLE_CMD, "--router-command", ROUTER_CMD, "--drafter", "none",
             "--stop-grace", "1", "--startup-timeout", "20")
    assert up.returncode == 0, up.stderr
    info = json.loads((state / "up.json").read_text())
    assert [c["name"] for c in info["children"]] == ["replica0", "replica1", "router"]
    assert "behind vllm-router (cache_aware)" in up.stdout and _get(info["health_url"]) == 200
    err = up.stderr
    assert err.index("replica0 is healthy") < err.index("starting router") and "replica1 is healthy" in err
    urls = [r["url"] for r in info["replicas"]]
    router_argv = json.loads(argv_file.read_text())
    assert router_argv[router_argv.index("--worker-urls") + 1:router_argv.index("--policy")] == urls
    pids = [info["supervisor_pid"]] + [c["pid"] for c in info["children"]]
    for replica in info["replicas"]:  # each replica is a whole stack (rank0, scheduler, gateway) of its own
        inner = json.loads((Path(replica["state_dir"]) / "up.json").read_text())
        assert [c["name"] for c in inner["children"]] == ["rank0", "scheduler", "gateway"]
        assert inner["endpoint"] == replica["url"] + "/v1" and _get(replica["url"] + "/health") == 200
        pids += [c["pid"] for c in inner["children"]]
    assert len(pids) == 10 and all(_alive(p) for p in pids)

    down = run("down", "--state-dir", str(state))
    assert down.returncode == 0, down.stderr
    assert "replica0" in down.stdout and "router" in down.stdout
    _assert_all_gone(pids)
    assert not (state / "up.json").exists() and not (state / "replica0" / "up.json").exists()


def test_down_stops_replicas_whose_run_died_hard(tmp_path):
    """The run's supervisor SIGKILLed: its replicas (runs of their own) are still stopped by `down`."""
    state, model = tmp_path / "state", tmp_path / "model"
    model.mkdir()
    base = ["--state-dir", str(state / "replica0"), "--model", str(model), "--role-command", ROLE_CMD,
            "--drafter", "none", "--stop-grace", "1", "--startup-timeout", "20", "--port", "0"]
    up = subprocess.run([*LAUNCHER, "up", "--detach", *base], cwd=ROOT, env=_env(), capture_output=True,
                        text=True, timeout=60)
    assert up.returncode == 0, up.stderr
    inner = json.loads((state / "replica0" / "up.json").read_text())
    dead = subprocess.Popen(["true"])
    dead.wait()
    (state / "up.json").write_text(json.dumps({
        "supervisor_pid": dead.pid, "endpoint": "http://127.0.0.1:1/v1", "children": [],
        "replicas": [{"url": inner["endpoint"][:-3], "state_dir": str(state / "replica0")}]}))
    down = subprocess.run([*LAUNCHER, "down", "--state-dir", str(state)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert down.returncode == 0, down.stderr
    assert "is still recorded: stopping it" in down.stdout
    _assert_all_gone([inner["supervisor_pid"]] + [c["pid"] for c in inner["children"]])
    assert not (state / "replica0" / "up.json").exists()


def test_settings_round_trip_through_the_detached_supervisor():
    s = _settings("--replicas", "3", "--router-policy", "power_of_two", "--replica-urls", "http://a:1",
                  "--router-command", "/opt/router", "--router-args", "--log-level debug", "--detach")
    child = replace(s, detach=False, background=True)
    assert parse(UpSettings, to_argv(child), {}) == child
