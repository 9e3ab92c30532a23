"""The launch plan: which processes `twinspark up` starts, in which order, with which argv and ports.

A pure function of its inputs (`LaunchConfig` + a list of free internal ports): no sockets, no processes, no
environment reads, so it is unit-tested directly. `ports.free_ports` picks the ports; `supervisor.py` runs the plan.

A child's argv is its own settings object written by flags.to_argv: the values of `up`'s flags that the child takes
too (flags.passed_on: declared with the same Flag), then what `up` derives for it (addresses, ports, its index).
Every other flag the child reads from its environment, which it inherits from `up`. So a serving setting declared
in shared_flags.py and named by `up`'s and a role's settings reaches that role with no line here.

Adding a role is one entry in `ROLES` (plus, where a peer must learn its address, one field in that peer's derived
settings: e.g. the drafter's entry, and the scheduler's `drafter` when `addrs.get("drafter")` is set).
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from services.common.flags import passed_on, to_argv
from services.drafter.cli import DrafterSettings
from services.gateway.cli import ServeGatewaySettings
from services.rank_worker.settings import RankSettings
from services.scheduler.cli import SchedulerSettings

from .addresses import bracket, client_host
from .settings import UpSettings

# How a role's subcommand is run: `<python> -m services.cli serve-rank ...`. The console script
# (`.../bin/twinspark`) works too; tests put a stand-in script here.
DEFAULT_COMMAND: tuple[str, ...] = (sys.executable, "-m", "services.cli")
INTERNAL_HOST = "127.0.0.1"  # every internal gRPC server and the torch.distributed rendezvous listen on loopback
# Ports that belong to no single child: the torch.distributed master, and rank 0's peer watchdog (peer_watch.py).
SHARED_PORTS: tuple[str, ...] = ("master", "peer")


def role_command(s: UpSettings) -> tuple[str, ...]:
    """How a role's subcommand is run: --role-command, else DEFAULT_COMMAND."""
    return tuple(shlex.split(s.role_command)) if s.role_command else DEFAULT_COMMAND


@dataclass(frozen=True)
class LaunchConfig:
    """What one stack starts from: `up`'s settings, resolved (absolute model dir, concrete public port, state dir),
    and what `up` read from the dflash drafter's config (the plan reads no files)."""

    settings: UpSettings
    draft_layers: tuple[int, ...] = ()  # the target layers the dflash drafter reads (its config's target_layer_ids)

    @property
    def command(self) -> tuple[str, ...]:
        return role_command(self.settings)


# addrs: role name -> ["host:port", ...] for every replica of every role (known before any argv is built).
# A role's derived settings: (config, addrs, shared ports, index, host, port) -> the child's fields `up` sets itself.
Derive = Callable[[LaunchConfig, Mapping[str, Sequence[str]], Mapping[str, int], int, str, int], dict[str, Any]]


@dataclass(frozen=True)
class Role:
    """One kind of process: `subcommand`, whose flags are the `settings` dataclass's, run with the values `up` passes
    on and the fields `derive` returns."""

    name: str
    subcommand: str
    settings: type
    derive: Derive
    replicas: Callable[[LaunchConfig], int] = lambda c: 1
    public: bool = False  # listens on the run's host:port (its health URL is the readiness gate of the whole run)
    indexed: bool = False  # name children `<role><i>` even when there is one replica (rank0)
    optional: bool = False  # serving goes on without it: its exit does not stop the stack (the drafter)
    restart_together: bool = False  # its replicas restart as one group (ranks: a new rank cannot join old peers)

    def argv(self, c: LaunchConfig, addrs: Mapping[str, Sequence[str]], shared: Mapping[str, int], i: int, host: str,
             port: int) -> list[str]:
        """The argv after the command prefix: the subcommand and the flags `up` gives this child."""
        given = passed_on(c.settings, self.settings)
        derived = self.derive(c, addrs, shared, i, host, port)
        settings = replace(self.settings(**given), **derived)
        return [self.subcommand, *to_argv(settings, names={*given, *derived})]


def _rank(c: LaunchConfig, addrs, shared, i: int, host: str, port: int) -> dict[str, Any]:
    return dict(rank=i, world=c.settings.tp, master_addr=INTERNAL_HOST, master_port=shared["master"],
                peer_port=shared["peer"], host=host, port=port)


def _drafter(c: LaunchConfig, addrs, shared, i: int, host: str, port: int) -> dict[str, Any]:
    # serve-drafter's method is named after the drafter's version (dflash2), up's after its family (dflash)
    dflash = c.settings.drafter == "dflash"
    return dict(method="dflash2" if dflash else c.settings.drafter,
                dflash2_weights=c.settings.drafter_model if dflash else None, host=host, port=port)


def _scheduler(c: LaunchConfig, addrs, shared, i: int, host: str, port: int) -> dict[str, Any]:
    drafter = addrs.get("drafter")
    method = c.settings.drafter if drafter else "none"
    return dict(ranks=",".join(addrs["rank"]), host=host, port=port, tokenizer=c.settings.model,
                drafter=drafter[0] if drafter else None,
                draft_hidden=method == "mtp",  # MTP drafts are fed the target's hidden states
                # DFlash drafts are fed the outputs of the layers the drafter was trained on
                draft_layers=",".join(str(layer) for layer in c.draft_layers) if method == "dflash" else None)


def _gateway(c: LaunchConfig, addrs, shared, i: int, host: str, port: int) -> dict[str, Any]:
    return dict(scheduler=addrs["scheduler"][0], host=host, port=port)


# Start order. Each role is one stage: all its replicas start together (ranks must, to meet at the master port),
# then the launcher waits for their ports to listen before the next stage.
ROLES: tuple[Role, ...] = (
    Role("rank", "serve-rank", RankSettings, _rank, replicas=lambda c: c.settings.tp, indexed=True,
         restart_together=True),
    Role("drafter", "serve-drafter", DrafterSettings, _drafter,
         replicas=lambda c: 0 if c.settings.drafter == "none" else 1, optional=True),
    Role("scheduler", "serve-scheduler", SchedulerSettings, _scheduler),
    Role("gateway", "serve-gateway", ServeGatewaySettings, _gateway, public=True),
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
        return f"{bracket(self.host)}:{self.port}"


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
        return f"{self._base}/v1"

    @property
    def health_url(self) -> str:
        return f"{self._base}/health"

    @property
    def _base(self) -> str:
        s = self.config.settings
        return f"http://{bracket(client_host(s.host))}:{s.port}"


def internal_ports_needed(config: LaunchConfig, roles: Sequence[Role] = ROLES) -> int:
    """How many free loopback ports `make_plan` needs: one per non-public child plus the shared ones."""
    return sum(r.replicas(config) for r in roles if not r.public) + len(SHARED_PORTS)


def make_plan(config: LaunchConfig, internal_ports: Sequence[int], roles: Sequence[Role] = ROLES) -> LaunchPlan:
    """Lay out every child: names, listening addresses, argv and log paths.

    internal_ports: distinct free ports on 127.0.0.1, `internal_ports_needed(config)` of them, used in order
    (shared ports first, then each non-public child in start order).
    """
    s = config.settings
    if s.model is None or s.state_dir is None:
        raise ValueError("the settings are not resolved: no model or no state dir")
    if s.tp < 1:
        raise ValueError(f"tp must be >= 1, got {s.tp}")
    if not config.command:
        raise ValueError("the role command prefix is empty")
    if not 0 < s.port < 65536:
        raise ValueError(f"public port must be in 1..65535, got {s.port}")
    need = internal_ports_needed(config, roles)
    ports = list(internal_ports)
    if len(ports) != need:
        raise ValueError(f"need {need} internal ports, got {len(ports)}")
    if len(set(ports)) != len(ports) or s.port in ports:
        raise ValueError(f"internal ports must be distinct and differ from the public port {s.port}: {ports}")

    it = iter(ports)
    shared = {name: next(it) for name in SHARED_PORTS}
    # First pass: every child's name and address, so derived settings can point at any peer.
    slots: list[tuple[Role, int, str, str, int]] = []  # role, index, name, host, port
    addrs: dict[str, list[str]] = {}
    for role in roles:
        n = role.replicas(config)
        for i in range(n):
            name = f"{role.name}{i}" if (role.indexed or n > 1) else role.name
            host, port = (s.host, s.port) if role.public else (INTERNAL_HOST, next(it))
            slots.append((role, i, name, host, port))
            addrs.setdefault(role.name, []).append(f"{bracket(client_host(host))}:{port}")
    logs = Path(s.state_dir) / "logs"
    stages: list[tuple[ChildSpec, ...]] = []
    for role in roles:
        stage = tuple(
            ChildSpec(name=name, role=role.name, index=i, host=host, port=port, public=role.public,
                      optional=role.optional, restart_together=role.restart_together,
                      argv=(*config.command, *role.argv(config, addrs, shared, i, host, port)),
                      log=str(logs / f"{name}.log"))
            for (r, i, name, host, port) in slots if r is role)
        if stage:
            stages.append(stage)
    return LaunchPlan(config=config, stages=tuple(stages), shared_ports=shared)
