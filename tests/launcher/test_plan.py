"""The launch plan is a pure function: argv per role, ports, order, names, log paths."""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass

import pytest

from services.common.flags import flag, parse
from services.launcher.plan import DEFAULT_COMMAND, ROLES, LaunchConfig, Role, internal_ports_needed, make_plan
from services.launcher.ports import free_ports, port_free
from services.launcher.settings import UpSettings

PREFIX = ("/venv/bin/twinspark",)


def _cfg(tp: int, draft_layers: tuple[int, ...] = (), **kw) -> LaunchConfig:
    kw.setdefault("drafter", "none")  # the plain three-role plan; the drafter role is tested below
    return LaunchConfig(UpSettings(model="/models/glm", state_dir="/state", tp=tp, port=8888,
                                   role_command=PREFIX[0], **kw), draft_layers)


def test_tp1_argv_per_role():
    cfg = _cfg(1)
    assert internal_ports_needed(cfg) == 4  # master, peer, rank0, scheduler
    plan = make_plan(cfg, [5000, 5009, 5001, 5002])
    assert [[c.name for c in stage] for stage in plan.stages] == [["rank0"], ["scheduler"], ["gateway"]]
    rank0, sched, gw = plan.children
    assert rank0.argv == (*PREFIX, "serve-rank", "--model", "/models/glm", "--rank", "0", "--world", "1",
                          "--master-addr", "127.0.0.1", "--master-port", "5000", "--collective", "auto",
                          "--peer-port", "5009", "--host", "127.0.0.1", "--port", "5001", "--device", "cpu",
                          "--kv-cache-dtype", "auto", "--rest-fp8-kernel", "triton", "--random-block-size", "128")
    assert sched.argv == (*PREFIX, "serve-scheduler", "--ranks", "127.0.0.1:5001", "--host", "127.0.0.1",
                          "--port", "5002", "--num-scheduler-steps", "0", "--tokenizer", "/models/glm")
    assert gw.argv == (*PREFIX, "serve-gateway", "--model", "/models/glm", "--scheduler", "127.0.0.1:5002",
                       "--host", "127.0.0.1", "--port", "8888")
    assert gw.public and not rank0.public
    assert [c.log for c in plan.children] == ["/state/logs/rank0.log", "/state/logs/scheduler.log",
                                              "/state/logs/gateway.log"]
    assert plan.endpoint == "http://127.0.0.1:8888/v1" and plan.health_url == "http://127.0.0.1:8888/health"
    assert plan.ports == {"rank0": 5001, "scheduler": 5002, "gateway": 8888, "master": 5000, "peer": 5009}


def test_tp2_ranks_share_master_and_peer_ports_and_restart_together():
    plan = make_plan(_cfg(2, device="cuda", kv_cache_dtype="fp8", collective="nccl"), [6000, 6009, 6001, 6002, 6003])
    assert [[c.name for c in stage] for stage in plan.stages] == [["rank0", "rank1"], ["scheduler"], ["gateway"]]
    r0, r1, sched, gw = plan.children
    for i, r in enumerate((r0, r1)):
        a = list(r.argv)
        assert a[a.index("--rank") + 1] == str(i) and a[a.index("--world") + 1] == "2"
        assert a[a.index("--master-port") + 1] == "6000" and a[a.index("--device") + 1] == "cuda"
        assert a[a.index("--peer-port") + 1] == "6009" and r.restart_together
        assert a[a.index("--model") + 1] == "/models/glm" and a[a.index("--kv-cache-dtype") + 1] == "fp8"
        assert a[a.index("--collective") + 1] == "nccl"
    assert (r0.port, r1.port, sched.port) == (6001, 6002, 6003)
    assert list(sched.argv)[list(sched.argv).index("--ranks") + 1] == "127.0.0.1:6001,127.0.0.1:6002"
    assert list(gw.argv)[list(gw.argv).index("--model") + 1] == "/models/glm"
    assert not sched.restart_together and not gw.restart_together  # they restart alone
    ports = list(plan.ports.values())
    assert len(set(ports)) == len(ports)


def test_wildcard_host_gateway_binds_it_and_clients_use_loopback():
    plan = make_plan(_cfg(1, host="0.0.0.0"), [1, 2, 3, 4])
    gw = plan.children[-1]
    assert list(gw.argv)[list(gw.argv).index("--host") + 1] == "0.0.0.0"
    assert plan.health_url == "http://127.0.0.1:8888/health"
    assert all(c.host == "127.0.0.1" for c in plan.children[:-1])  # internal listeners stay on loopback


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="tp"):
        make_plan(_cfg(0), [])
    with pytest.raises(ValueError, match="need 5"):
        make_plan(_cfg(2), [1, 2, 3, 4])
    with pytest.raises(ValueError, match="distinct"):
        make_plan(_cfg(2), [1, 2, 2, 3, 4])
    with pytest.raises(ValueError, match="distinct"):
        make_plan(_cfg(1), [1, 2, 3, 8888])


def test_default_command_is_this_python_running_the_cli():
    assert DEFAULT_COMMAND == (sys.executable, "-m", "services.cli")
    plan = make_plan(LaunchConfig(UpSettings(model="/m", state_dir="/s")), [1, 2, 3, 4, 5])  # with a copy drafter
    assert plan.children[0].argv[:4] == (sys.executable, "-m", "services.cli", "serve-rank")


def test_every_child_argv_is_its_settings_again():
    """What each child parses from its argv alone is the settings the plan made for it: the values `up` passes on
    and derives, the rest its own defaults."""
    cfg = _cfg(2, drafter="mtp", enforce_eager=True, kv_disk_dir="/kv", reasoning_budget_message=" Answer.")
    for child in make_plan(cfg, [6000, 6009, 6001, 6002, 6003, 6004]).children:
        role = next(r for r in ROLES if r.name == child.role)
        settings = parse(role.settings, list(child.argv[2:]), {})
        assert child.argv[1] == role.subcommand and child.port == settings.port
        if role.name == "rank":
            assert (settings.rank, settings.world, settings.enforce_eager, settings.kv_disk_dir) == \
                (child.index, 2, True, "/kv")
        if role.name == "gateway":
            assert settings.reasoning_budget_message == " Answer."


def test_a_setting_of_another_declaration_is_not_passed_on():
    """`up`'s --drafter (a method) and --startup-timeout (its wait for /health) share their names with the
    scheduler's --drafter (an address) and --startup-timeout (its wait for the ranks): other settings, not passed."""
    plan = make_plan(_cfg(1, startup_timeout=5.0), [5000, 5009, 5001, 5002])
    sched = parse(ROLES[2].settings, list(plan.children[1].argv[2:]), {})
    assert sched.drafter is None and sched.startup_timeout == 300.0


@dataclass(frozen=True, kw_only=True)
class ExtraSettings:
    host: str = flag("host", "listen address", default="127.0.0.1")
    port: int = flag("port", "listen port", default="1", type=int)


def test_adding_a_role_is_one_entry():
    extra = Role("extra", "serve-extra", ExtraSettings, lambda c, addrs, shared, i, host, port: dict(host=host,
                                                                                                      port=port))
    roles = (ROLES[0], extra, *ROLES[1:])
    cfg = _cfg(2)
    assert internal_ports_needed(cfg, roles) == 6
    plan = make_plan(cfg, [10, 11, 12, 13, 14, 15], roles)
    assert [c.name for c in plan.children] == ["rank0", "rank1", "extra", "scheduler", "gateway"]
    assert plan.children[2].argv == (*PREFIX, "serve-extra", "--host", "127.0.0.1", "--port", "14")


@pytest.mark.parametrize("method", ["copy", "mtp"])
def test_drafter_role_and_scheduler_flag(method):
    cfg = _cfg(1, drafter=method)
    assert internal_ports_needed(cfg) == 5
    plan = make_plan(cfg, [19, 20, 21, 22, 23])
    assert [c.name for c in plan.children] == ["rank0", "drafter", "scheduler", "gateway"]
    drafter, sched = plan.children[1], plan.children[2]
    assert drafter.argv == (*PREFIX, "serve-drafter", "--host", "127.0.0.1", "--port", "22", "--method", method,
                            "--model", "/models/glm", "--device", "cpu")
    hidden = ("--draft-hidden",) if method == "mtp" else ()
    assert sched.argv == (*PREFIX, "serve-scheduler", "--ranks", "127.0.0.1:21", "--host", "127.0.0.1", "--port",
                          "23", "--num-scheduler-steps", "0", "--drafter", "127.0.0.1:22", *hidden,
                          "--tokenizer", "/models/glm")


def test_dflash_drafter_gets_its_folder_and_the_scheduler_its_layers():
    cfg = _cfg(1, (1, 3, 5), drafter="dflash", drafter_model="/models/glm/dflash2")
    drafter, sched = make_plan(cfg, [19, 20, 21, 22, 23]).children[1:3]
    assert drafter.argv == (*PREFIX, "serve-drafter", "--host", "127.0.0.1", "--port", "22", "--method", "dflash2",
                            "--model", "/models/glm", "--device", "cpu", "--dflash2-weights", "/models/glm/dflash2")
    assert sched.argv[-6:] == ("--drafter", "127.0.0.1:22", "--draft-layers", "1,3,5", "--tokenizer", "/models/glm")


def test_free_ports_distinct_and_bindable():
    ports = free_ports(6, exclude=(8888,))
    assert len(set(ports)) == 6 and 8888 not in ports
    assert all(port_free("127.0.0.1", p) for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert not port_free("127.0.0.1", s.getsockname()[1])


def test_random_weights_reach_every_rank_and_nothing_else():
    plan = make_plan(_cfg(2, random_weights="w4a16+fp8", random_block_size=8), [6000, 6009, 6001, 6002, 6003])
    for child in plan.children:
        a = list(child.argv)
        if child.role == "rank":
            assert a[a.index("--random-weights") + 1] == "w4a16+fp8" and a[a.index("--random-block-size") + 1] == "8"
        else:
            assert "--random-weights" not in a and "--random-block-size" not in a
    assert "--random-weights" not in make_plan(_cfg(1), [5000, 5009, 5001, 5002]).children[0].argv


def test_decode_steps_reach_the_scheduler_only():
    plan = make_plan(_cfg(1, num_scheduler_steps=4), [5000, 5009, 5001, 5002])
    for child in plan.children:
        a = list(child.argv)
        if child.role == "scheduler":
            assert a[a.index("--num-scheduler-steps") + 1] == "4"
        else:
            assert "--num-scheduler-steps" not in a


def test_settings_left_unset_stay_the_childs_own():
    """The KV tier and thinking flags `up` has unset: the ranks and the gateway read their own variables."""
    argv = " ".join(a for c in make_plan(_cfg(1), [5000, 5009, 5001, 5002]).children for a in c.argv)
    assert "--kv-" not in argv.replace("--kv-cache-dtype", "") and "--reasoning" not in argv


def test_up_reads_the_dflash_drafters_layers(tiny_dflash, tmp_path):
    from services.launcher.cli import _dflash_drafter
    from services.launcher.settings import UpSettings

    folder, layers = _dflash_drafter(UpSettings(drafter="dflash"), tiny_dflash)  # default: MODEL/dflash2
    assert folder == str(tiny_dflash / "dflash2") and layers == (1, 2, 3, 4, 5)
    with pytest.raises(ValueError, match="no usable drafter in"):
        _dflash_drafter(UpSettings(drafter="dflash", drafter_model=str(tmp_path)), tiny_dflash)
