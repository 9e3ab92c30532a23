"""`twinspark up --replicas N`: N whole stacks on this machine, and vllm-router in front of them (and of any
`--replica-urls` running elsewhere) on the public port.

Each replica is a `twinspark up` of its own (its own supervisor, state dir `<state-dir>/replica<i>`, gateway on a
free loopback port), so everything one stack does — restarts, logs, `up.json` — it does unchanged. The run's own
supervisor (supervisor.py, the same code) treats each replica's supervisor and the router as its children: the
replicas start together, each must answer 200 on its /health, then the router starts; a replica whose supervisor
gives up is restarted like any child, and with more than one replica it is optional (the router serves on
without it, its health check having marked it down). `twinspark down` stops the router, then each replica.

With `--router-policy kv_aware` each replica's scheduler publishes its prefix cache's block events
(services/scheduler/kv_events.py, vLLM's format) on a loopback ZMQ port, and the router subscribes to every one
(`--kv-event-source URL=ENDPOINT`), so it routes a prompt by the blocks each replica really holds.

The router is an optional extra (`pip install -e '.[router]'`: vllm-router, a Rust binary in a pip wheel). The
flags set here make failover quick: a worker is checked every 2 s and out after 2 failed checks, and one failed
request opens its circuit breaker for 5 s, so the router's retry of that request goes to another replica.
"""

from __future__ import annotations

import shlex
import shutil
import sys
from dataclasses import replace
from pathlib import Path

from services.common.flags import to_argv

from .plan import INTERNAL_HOST, ChildSpec, LaunchConfig, LaunchPlan
from .settings import UpSettings

ROUTER = "vllm-router"
INSTALL_HINT = "pip install -e '.[router]' in the checkout (or: pip install vllm-router pyzmq msgpack)"
# Failover settings (vllm-router's flags): seconds between health checks, checks to mark a worker down / up again,
# failed requests that open a worker's circuit breaker, seconds it stays open.
HEALTH_INTERVAL_S, HEALTH_FAILURES, HEALTH_SUCCESSES = 2, 2, 1
BREAKER_FAILURES, BREAKER_OPEN_S = 1, 5
# What the replicas' own processes must not inherit from this run's environment: they are single stacks.
CLEARED_ENV = {"TWINSPARK_REPLICAS": "", "TWINSPARK_KV_EVENTS_ENDPOINT": ""}


def router_command(configured: str | None) -> tuple[str, ...] | None:
    """The command that runs vllm-router: --router-command, else the one this Python's environment installed,
    else one on PATH; None when there is none."""
    if configured:
        return tuple(shlex.split(configured))
    beside = Path(sys.executable).parent / ROUTER
    if beside.is_file():
        return (str(beside),)
    found = shutil.which(ROUTER)
    return (found,) if found else None


def replica_settings(s: UpSettings, index: int, port: int, events: str | None = None) -> UpSettings:
    """The settings of replica `index`: the run's own, as one stack on a loopback port with its own state dir
    (`events`: where its scheduler publishes its KV events)."""
    assert s.state_dir is not None
    return replace(s, replicas=1, replica_urls=None, host=INTERNAL_HOST, port=port, detach=False, background=False,
                   state_dir=str(Path(s.state_dir) / f"replica{index}"), router_command=None, router_args=None,
                   kv_events_endpoint=events)


def events_endpoint(port: int) -> str:
    return f"tcp://{INTERNAL_HOST}:{port}"


def router_argv(s: UpSettings, command: tuple[str, ...], workers: list[str], metrics_port: int,
                sources: list[str] = (), model_name: str = "", block_size: int = 16) -> list[str]:
    """`sources`: `URL=ENDPOINT` of each replica publishing KV events (kv_aware)."""
    kv = [arg for source in sources for arg in ("--kv-event-source", source)]
    if kv:
        kv += ["--kv-event-block-size", str(block_size), "--kv-event-model", model_name]
    return [*command, "--host", s.host, "--port", str(s.port), "--worker-urls", *workers,
            "--policy", s.router_policy,
            # its Prometheus port defaults to 29000 for every router: two runs on one machine would collide
            "--prometheus-host", INTERNAL_HOST, "--prometheus-port", str(metrics_port),
            "--health-check-interval-secs", str(HEALTH_INTERVAL_S),
            "--health-failure-threshold", str(HEALTH_FAILURES), "--health-success-threshold", str(HEALTH_SUCCESSES),
            "--cb-failure-threshold", str(BREAKER_FAILURES), "--cb-timeout-duration-secs", str(BREAKER_OPEN_S),
            *kv, *shlex.split(s.router_args or "")]


def gpu_slices(replicas: int, tp: int, gpus: list[str]) -> list[list[str]]:
    """The GPUs each replica's ranks see (its CUDA_VISIBLE_DEVICES), as vLLM's data parallelism places its ranks:
    disjoint runs of up to `tp` GPUs while there are enough for every replica (a replica with fewer GPUs than ranks
    shares them through its own MPS daemon); with fewer GPUs than replicas, replica i takes GPU i mod the count
    (replicas on one GPU each hold a copy of the weights)."""
    if not gpus:
        return [[] for _ in range(replicas)]
    if len(gpus) < replicas:
        return [[gpus[i % len(gpus)]] for i in range(replicas)]
    per = min(tp, len(gpus) // replicas)
    return [gpus[i * per:(i + 1) * per] for i in range(replicas)]


def fleet_plan(s: UpSettings, launcher: tuple[str, ...], router: tuple[str, ...], replica_ports: list[int],
               metrics_port: int, event_ports: list[int] = (), *, model_name: str = "",
               block_size: int = 16, gpus: list[str] | None = None) -> LaunchPlan:
    """Replicas (one stage: they load together), then the router. `launcher` runs `twinspark up` (`... up`
    follows); the settings are resolved (model, port, state dir); `event_ports`: each replica's KV event port
    (kv_aware only; `model_name` and `block_size` are what the router needs to read them); `gpus`: the GPUs the run
    sees, shared out by `gpu_slices` (CUDA replicas; None: every replica sees what the run sees). A pure
    function, like plan.make_plan."""
    assert s.model is not None and s.state_dir is not None
    if len(replica_ports) != s.replicas:
        raise ValueError(f"need {s.replicas} replica ports, got {len(replica_ports)}")
    kv_aware = s.router_policy == "kv_aware"
    if len(event_ports) != (s.replicas if kv_aware else 0):
        raise ValueError(f"need a KV event port per replica with kv_aware only, got {len(event_ports)}")
    logs = Path(s.state_dir) / "logs"
    slices = gpu_slices(s.replicas, s.tp, gpus) if gpus is not None and s.device == "cuda" else None
    replicas = []
    for i, port in enumerate(replica_ports):
        one = replica_settings(s, i, port, events_endpoint(event_ports[i]) if kv_aware else None)
        url = f"http://{INTERNAL_HOST}:{port}"
        env = {**CLEARED_ENV, **({"CUDA_VISIBLE_DEVICES": ",".join(slices[i])} if slices else {})}
        replicas.append(ChildSpec(name=f"replica{i}", role="replica", index=i, argv=(*launcher, "up", *to_argv(one)),
                                  host=INTERNAL_HOST, port=port, log=str(logs / f"replica{i}.log"),
                                  env=env, optional=s.replicas + len(s.remote_urls) > 1,
                                  health=url + "/health"))
    workers = [f"http://{c.address}" for c in replicas] + s.remote_urls
    sources = [f"http://{c.address}={events_endpoint(e)}" for c, e in zip(replicas, event_ports)]
    argv = router_argv(s, router, workers, metrics_port, sources, model_name, block_size)
    router = ChildSpec(name="router", role="router", index=0, argv=tuple(argv),
                       host=s.host, port=s.port, log=str(logs / "router.log"), public=True)
    stages = (tuple(replicas), (router,)) if replicas else ((router,),)
    shared = {"router_metrics": metrics_port, **{f"replica{i}_kv_events": e for i, e in enumerate(event_ports)}}
    return LaunchPlan(config=LaunchConfig(s), stages=stages, shared_ports=shared)


def fleet_info(plan: LaunchPlan, s: UpSettings) -> dict[str, object]:
    """What up.json records beyond a stack's: the replicas (to stop them in `down` even if this run's supervisor
    died hard) and the policy."""
    local = [{"url": f"http://{c.address}", "state_dir": str(Path(s.state_dir or "") / c.name)}
             for c in plan.children if c.role == "replica"]
    return {"replicas": local + [{"url": u, "state_dir": None} for u in s.remote_urls],
            "router_policy": s.router_policy}


__all__ = ["INSTALL_HINT", "fleet_info", "fleet_plan", "replica_settings", "router_argv", "router_command"]
