"""The launch plan: which processes `twinspark up` starts, in which order, with which argv and ports.

A pure function of its inputs (`LaunchConfig` + a list of free internal ports): no sockets, no processes, no
environment reads, so it is unit-tested directly. `ports.free_ports` picks the ports; `supervisor.py` runs the plan.

Adding a role is one entry in `ROLES` (plus, where a peer must learn its address, one line in that peer's argv
builder: e.g. a drafter entry with `replicas=lambda c: 1 if c.drafter else 0`, and `--drafter` added to the
scheduler's argv when `addrs.get("drafter")` is set).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

# How a role's subcommand is run: `<python> -m services.cli serve-rank ...`. The console script
# (`.../bin/twinspark`) works too; tests put a stand-in script here.
DEFAULT_COMMAND: tuple[str, ...] = (sys.executable, "-m", "services.cli")
INTERNAL_HOST = "127.0.0.1"  # every internal gRPC server and the torch.distributed rendezvous listen on loopback
# Ports that belong to no single child: the torch.distributed master, and rank 0's peer watchdog (peer_watch.py).
SHARED_PORTS: tuple[str, ...] = ("master", "peer")
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})


@dataclass(frozen=True)
class LaunchConfig:
    """What the user asked for (already resolved: absolute model dir, concrete public port)."""

    model: str
    state_dir: str
    tp: int = 1
    host: str = "127.0.0.1"  # where the gateway listens (the only public listener)
    port: int = 8888
    device: str = "cpu"
    command: tuple[str, ...] = DEFAULT_COMMAND
    drafter: str = "copy"  # draft method of the drafter role: copy | mtp | dflash | none (no drafter, no drafts)
    drafter_model: str = ""  # dflash: the drafter's folder
    draft_layers: tuple[int, ...] = ()  # dflash: the target layers the drafter reads (its config's target_layer_ids)
    kv_cache_dtype: str = "auto"  # storage of the ranks' latent + indexer cache rows: auto | fp8 | fp8_e4m3
    collective: str = "auto"  # the ranks' --collective: auto | nccl | ipc | gloo
    enforce_eager: bool = False  # GPU ranks: no CUDA graphs for decode rounds
    kv_tiers: tuple[str, ...] = ()  # the ranks' KV tier flags (--kv-host-bytes / --kv-disk-dir / --kv-disk-bytes)
    random_weights: str = ""  # ranks draw random weights in this recipe (serve-rank --random-weights); "" = read them
    random_block_size: int = 128
    max_num_batched_tokens: int | None = None  # the scheduler's round budget; None: its device default
    num_scheduler_steps: int = 0  # decode steps per round; 0: auto
    gateway_flags: tuple[str, ...] = ()  # the gateway's thinking flags (--reasoning-budget, ...) given to `up`
    strict_request_fields: bool = False  # the gateway refuses unknown request fields (OpenAI's 400)
    kv_events_endpoint: str | None = None  # the scheduler publishes its prefix cache's block events here


# addrs: role name -> ["host:port", ...] for every replica of every role (known before any argv is built).
ArgvBuilder = Callable[[LaunchConfig, Mapping[str, Sequence[str]], Mapping[str, int], int, str, int], list[str]]


@dataclass(frozen=True)
class Role:
    """One kind of process. `args(config, addrs, shared_ports, index, host, port)` returns the argv after the
    command prefix (subcommand first)."""

    name: str
    args: ArgvBuilder
    replicas: Callable[[LaunchConfig], int] = lambda c: 1
    public: bool = False  # listens on config.host:config.port (its health URL is the readiness gate of the whole run)
    indexed: bool = False  # name children `<role><i>` even when there is one replica (rank0)
    optional: bool = False  # serving goes on without it: its exit does not stop the stack (the drafter)
    restart_together: bool = False  # its replicas restart as one group (ranks: a new rank cannot join old peers)


def _rank_args(c: LaunchConfig, addrs, shared, i: int, host: str, port: int) -> list[str]:
    return ["serve-rank", "--model", c.model, "--rank", str(i), "--world", str(c.tp),
            "--master-addr", INTERNAL_HOST, "--master-port", str(shared["master"]), "--peer-port", str(shared["peer"]),
            "--host", host, "--port", str(port), "--device", c.device, "--kv-cache-dtype", c.kv_cache_dtype,
            "--collective", c.collective,
            *(["--enforce-eager"] if c.enforce_eager else []),
            *(["--max-num-batched-tokens", str(c.max_num_batched_tokens)]
              if c.max_num_batched_tokens is not None else []),
            *(["--random-weights", c.random_weights, "--random-block-size", str(c.random_block_size)]
              if c.random_weights else []),
            *c.kv_tiers]


def _scheduler_args(c: LaunchConfig, addrs, shared, i: int, host: str, port: int) -> list[str]:
    argv = ["serve-scheduler", "--ranks", ",".join(addrs["rank"]), "--host", host, "--port", str(port),
            "--tokenizer", c.model]
    if c.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(c.max_num_batched_tokens)]
    if c.num_scheduler_steps:
        argv += ["--num-scheduler-steps", str(c.num_scheduler_steps)]
    if c.kv_events_endpoint:
        argv += ["--kv-events-endpoint", c.kv_events_endpoint]
    if addrs.get("drafter"):
        argv += ["--drafter", addrs["drafter"][0]]
        if c.drafter == "mtp":
            argv.append("--draft-hidden")  # MTP drafts are fed the target's hidden states
        if c.drafter == "dflash":  # DFlash drafts are fed the outputs of the layers the drafter was trained on
            argv += ["--draft-layers", ",".join(str(i) for i in c.draft_layers)]
    return argv


def _drafter_args(c: LaunchConfig, addrs, shared, i: int, host: str, port: int) -> list[str]:
    # serve-drafter's method is named after the drafter's version (dflash2), up's after its family (dflash)
    method = ["dflash2", "--dflash2-weights", c.drafter_model] if c.drafter == "dflash" else [c.drafter]
    return ["serve-drafter", "--method", *method, "--model", c.model, "--host", host, "--port", str(port),
            "--device", c.device]


def _gateway_args(c: LaunchConfig, addrs, shared, i: int, host: str, port: int) -> list[str]:
    return ["serve-gateway", "--model", c.model, "--scheduler", addrs["scheduler"][0], "--host", host,
            "--port", str(port), *c.gateway_flags,
            *(["--strict-request-fields"] if c.strict_request_fields else [])]


# Start order. Each role is one stage: all its replicas start together (ranks must, to meet at the master port),
# then the launcher waits for their ports to listen before the next stage.
ROLES: tuple[Role, ...] = (
    Role("rank", _rank_args, replicas=lambda c: c.tp, indexed=True, restart_together=True),
    Role("drafter", _drafter_args, replicas=lambda c: 0 if c.drafter == "none" else 1, optional=True),
    Role("scheduler", _scheduler_args),
    Role("gateway", _gateway_args, public=True),
)


@dataclass(frozen=True)
class ChildSpec:
    """One process to start."""

    name: str  # rank0, rank1, scheduler, gateway — also its log file name
    role: str
    index: int
    argv: tuple[str, ...]
    host: str
    port: int  # the port it listens on
    log: str  # <state-dir>/logs/<name>.log
    public: bool = False
    env: Mapping[str, str] = field(default_factory=dict)  # extra environment on top of the launcher's
    optional: bool = False  # see Role.optional
    restart_together: bool = False  # see Role.restart_together
    health: str = ""  # a URL that must answer 200 before the next stage starts (else: the port must listen)

    @property
    def address(self) -> str:
        return f"{_bracket(self.host)}:{self.port}"


@dataclass(frozen=True)
class LaunchPlan:
    config: LaunchConfig
    stages: tuple[tuple[ChildSpec, ...], ...]  # start order; one stage per role
    shared_ports: Mapping[str, int]  # master, peer -> port

    @property
    def children(self) -> tuple[ChildSpec, ...]:
        return tuple(c for stage in self.stages for c in stage)

    @property
    def ports(self) -> dict[str, int]:
        """Every port in the plan by owner: rank0, ..., scheduler, gateway, master, peer."""
        return {**{c.name: c.port for c in self.children}, **self.shared_ports}

    @property
    def endpoint(self) -> str:
        """The OpenAI base URL a client uses (loopback when the gateway listens on every interface)."""
        return f"http://{_bracket(client_host(self.config.host))}:{self.config.port}/v1"

    @property
    def health_url(self) -> str:
        return f"http://{_bracket(client_host(self.config.host))}:{self.config.port}/health"


def client_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to `host`."""
    if host in WILDCARD_HOSTS:
        return "::1" if ":" in host else "127.0.0.1"
    return host.strip("[]")


def _bracket(host: str) -> str:
    host = host.strip("[]")
    return f"[{host}]" if ":" in host else host


def internal_ports_needed(config: LaunchConfig, roles: Sequence[Role] = ROLES) -> int:
    """How many free loopback ports `make_plan` needs: one per non-public child plus the shared ones."""
    return sum(r.replicas(config) for r in roles if not r.public) + len(SHARED_PORTS)


def make_plan(config: LaunchConfig, internal_ports: Sequence[int], roles: Sequence[Role] = ROLES) -> LaunchPlan:
    """Lay out every child: names, listening addresses, argv and log paths.

    internal_ports: distinct free ports on 127.0.0.1, `internal_ports_needed(config)` of them, used in order
    (shared ports first, then each non-public child in start order).
    """
    if config.tp < 1:
        raise ValueError(f"tp must be >= 1, got {config.tp}")
    if not config.command:
        raise ValueError("the role command prefix is empty")
    if not 0 < config.port < 65536:
        raise ValueError(f"public port must be in 1..65535, got {config.port}")
    need = internal_ports_needed(config, roles)
    ports = list(internal_ports)
    if len(ports) != need:
        raise ValueError(f"need {need} internal ports, got {len(ports)}")
    if len(set(ports)) != len(ports) or config.port in ports:
        raise ValueError(f"internal ports must be distinct and differ from the public port {config.port}: {ports}")

    it = iter(ports)
    shared = {name: next(it) for name in SHARED_PORTS}
    # First pass: every child's name and address, so argv builders can point at any peer.
    slots: list[tuple[Role, int, str, str, int]] = []  # role, index, name, host, port
    addrs: dict[str, list[str]] = {}
    for role in roles:
        n = role.replicas(config)
        for i in range(n):
            name = f"{role.name}{i}" if (role.indexed or n > 1) else role.name
            host, port = (config.host, config.port) if role.public else (INTERNAL_HOST, next(it))
            slots.append((role, i, name, host, port))
            addrs.setdefault(role.name, []).append(f"{_bracket(client_host(host))}:{port}")
    logs = Path(config.state_dir) / "logs"
    stages: list[tuple[ChildSpec, ...]] = []
    for role in roles:
        stage = tuple(
            ChildSpec(name=name, role=role.name, index=i, host=host, port=port, public=role.public,
                      optional=role.optional, restart_together=role.restart_together,
                      argv=(*config.command, *role.args(config, addrs, shared, i, host, port)),
                      log=str(logs / f"{name}.log"))
            for (r, i, name, host, port) in slots if r is role)
        if stage:
            stages.append(stage)
    return LaunchPlan(config=config, stages=tuple(stages), shared_ports=shared)
