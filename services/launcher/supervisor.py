"""Run a `LaunchPlan`: start every child in its own process group, wait until the gateway is healthy, supervise,
and stop them all (SIGTERM to each process group, SIGKILL after a grace period).

Lifecycle of `Supervisor.run`:
1. take the state dir's lock (one supervisor per state dir), clean up after a previous supervisor that died hard;
2. start the plan stage by stage (all ranks together, then the scheduler, then the gateway), waiting after each
   stage for its ports to listen, then for `GET /health` = 200 — failing fast, with the tail of the child's log, if
   a child exits or the startup timeout passes;
3. supervise: a child that exits is restarted with the same argv and ports — the ranks as one group (they meet in
   a collective, so a lone new rank cannot join old peers: the others are given `GROUP_EXIT_WAIT_S` to leave by
   themselves, which their peer watchdog makes them do, then SIGTERM / SIGKILL), every other role alone. Each role
   may be restarted `max_restarts` times over the run's life (a rank group restart counts once for "rank"); one
   more exit stops everything and `run` returns 1 (`max_restarts=0`: the first exit does). An optional child (the
   drafter) past its limit only stays down: serving goes on without it.
   SIGINT / SIGTERM / SIGHUP stop everything and `run` returns 0.
`up.json` in the state dir records the supervisor, the children (pid, process group, start time, port, log; updated
on every restart) and the endpoint while the run lives; `down` reads it. Logs are appended to, each start marked by
a `# twinspark up: <name> started|restarted ...` line.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable

from . import procs, state
from .plan import ChildSpec, LaunchPlan
from .ports import listening

POLL_S = 0.1
GROUP_EXIT_WAIT_S = 5.0  # a rank's peers leave within ~3 s (peer watchdog timeout) of it dying; then they are stopped
HEALTH_POLL_S = 0.2
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def log(msg: str) -> None:
    """One line of what happened, timestamped, on stderr (the detached supervisor's stderr is its log file)."""
    print(f"[twinspark {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def tail(path: str | Path, lines: int = 30, max_bytes: int = 16384) -> str:
    """The last `lines` lines of a log file, indented for quoting under a message."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            text = f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"    (cannot read {path}: {e})"
    got = text.splitlines()[-lines:]
    return "\n".join(f"    | {line}" for line in got) if got else "    (log is empty)"


def describe_exit(rc: int) -> str:
    return f"signal {procs.signal_name(-rc)}" if rc < 0 else f"code {rc}"


class StartupError(Exception):
    """Startup failed; `child` is the process whose log explains it (if any)."""

    def __init__(self, message: str, child: "Child | None" = None):
        super().__init__(message)
        self.child = child


class _StopRequested(Exception):
    pass


def _child_preexec() -> None:  # runs in the child between fork and exec
    # Linux: if the supervisor dies without stopping us (SIGKILL, OOM), get SIGTERM instead of living on orphaned.
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


try:
    _LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:  # pragma: no cover
    _LIBC = None


@dataclass
class Child:
    spec: ChildSpec
    proc: subprocess.Popen
    started: int | None  # /proc start time, to recognise the pid later (down, stale cleanup)
    logfile: IO[bytes]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def pgid(self) -> int:
        return self.proc.pid  # start_new_session: every child leads its own session and process group

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "role": self.spec.role, "pid": self.pid, "pgid": self.pgid, "start": self.started,
                "host": self.spec.host, "port": self.spec.port, "log": self.spec.log, "argv": list(self.spec.argv)}


class Supervisor:
    def __init__(self, plan: LaunchPlan, *, stop_grace: float = 10.0, startup_timeout: float = 600.0,
                 max_restarts: int = 5, env: dict[str, str] | None = None, out: Callable[[str], None] | None = None,
                 info: dict[str, Any] | None = None):
        self.plan = plan
        self.extra_info = info or {}  # more for up.json (a routed run: its replicas and the router's policy)
        self.max_restarts = max_restarts
        self.restarts: dict[str, int] = {}  # role -> restarts so far
        self._gone: set[str] = set()  # optional children past their restart limit: left down
        state_dir = plan.config.settings.state_dir
        assert state_dir is not None  # a plan's settings are resolved
        self.state_dir = Path(state_dir)
        self.stop_grace = stop_grace
        self.startup_timeout = startup_timeout
        self.env = dict(os.environ if env is None else env)
        self.out = out or (lambda s: print(s, flush=True))  # the banner (stdout)
        self.children: list[Child] = []
        self.pending_signal: int | None = None
        self.t0 = time.monotonic()
        self.info: dict[str, Any] = {}
        self._stopped = False

    # ---- whole lifecycle -------------------------------------------------------------------------------------
    def run(self) -> int:
        lock = state.try_lock(self.state_dir)
        if lock is None:
            other = (state.read_up(self.state_dir) or {}).get("supervisor_pid", "?")
            log(f"another twinspark is already running with state dir {self.state_dir} (supervisor pid {other}); "
                f"stop it with `twinspark down --state-dir {self.state_dir}`")
            return 1
        previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        try:
            stale = state.read_up(self.state_dir)
            if stale is not None:
                log(f"found up.json of a supervisor that is gone (pid {stale.get('supervisor_pid')}): cleaning up")
                kill_leftovers(stale.get("children", []))
                state.remove_up(self.state_dir)
            (self.state_dir / "logs").mkdir(parents=True, exist_ok=True)
            try:
                self._start_and_wait()
            except StartupError as e:
                log(f"startup failed: {e}")
                if e.child is not None:
                    log(f"last lines of {e.child.spec.log}:\n{tail(e.child.spec.log)}")
                self.stop_all("startup failed")
                log(f"all logs: {self.state_dir / 'logs'}")
                return 1
            except _StopRequested:
                self.stop_all(f"got {procs.signal_name(self.pending_signal or 0)} during startup")
                return 0
            return self.supervise()
        finally:
            self.stop_all("supervisor exiting")
            state.remove_up(self.state_dir, only_pid=os.getpid())
            for s, h in previous.items():
                signal.signal(s, h)
            os.close(lock)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.pending_signal is None:
            self.pending_signal = signum

    # ---- startup ---------------------------------------------------------------------------------------------
    def _start_and_wait(self) -> None:
        s = self.plan.config.settings
        deadline = self.t0 + self.startup_timeout
        log(f"starting twinspark: model {s.model}, tp {s.tp}, device {s.device}; "
            f"serving on {s.host}:{s.port}, internal ports {self.plan.ports} (state dir {self.state_dir})")
        self.info = {
            "status": "starting", "supervisor_pid": os.getpid(), "supervisor_start": procs.start_time(os.getpid()),
            "endpoint": self.plan.endpoint, "health_url": self.plan.health_url, "host": s.host, "port": s.port,
            "model": s.model, "tp": s.tp, "device": s.device, "state_dir": str(self.state_dir),
            "logs": str(self.state_dir / "logs"), "ports": self.plan.ports, "stop_grace": self.stop_grace,
            "max_restarts": self.max_restarts, "restarts": self.restarts, "started_at": time.time(), "children": [],
            **self.extra_info,
        }
        self._write_state()
        for stage in self.plan.stages:
            for spec in stage:
                self.children.append(self._spawn(spec, "started"))
            self._write_state()
            for child in self.children[-len(stage):]:
                if child.spec.public or child.spec.health:
                    self._wait_healthy(child, deadline, child.spec.health or self.plan.health_url)
                else:
                    self._wait_listening(child, deadline)
        took = time.monotonic() - self.t0
        log(f"healthy after {took:.1f} s ({self.plan.health_url} answered 200): {self.plan.endpoint}")
        self.info.update(status="up", healthy_after_s=round(took, 2), served_model=self._served_model())
        self._write_state()
        self.out(format_banner(self.info) + f"\n  stop: Ctrl-C here, or `twinspark down --state-dir {self.state_dir}`")

    def _spawn(self, spec: ChildSpec, how: str) -> Child:
        """Start one child; `how` ("started", "restarted (...)") marks the start in its log, which is appended to."""
        what = f"{spec.role} {spec.index}" if spec.name != spec.role else spec.role
        log(f"starting {what} on {spec.address}: {' '.join(spec.argv)}")
        log(f"  {spec.name} log: {spec.log}")
        Path(spec.log).parent.mkdir(parents=True, exist_ok=True)
        logfile = open(spec.log, "ab")  # noqa: SIM115 — kept open for the child's lifetime
        logfile.write(f"# twinspark up: {spec.name} {how} {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
                      f"# argv: {json.dumps(list(spec.argv))}\n".encode())
        logfile.flush()
        try:
            proc = subprocess.Popen(list(spec.argv), stdin=subprocess.DEVNULL, stdout=logfile,
                                    stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                                    env={**self.env, "PYTHONUNBUFFERED": "1", **spec.env},
                                    preexec_fn=_child_preexec)
        except OSError as e:
            logfile.close()
            raise StartupError(f"cannot start {spec.name} ({spec.argv[0]}): {e}") from e
        child = Child(spec=spec, proc=proc, started=procs.start_time(proc.pid), logfile=logfile)
        log(f"  {spec.name} pid {child.pid}")
        return child

    def _check_startup(self, waiting_for: Child, deadline: float, what: str) -> None:
        if self.pending_signal is not None:
            raise _StopRequested()
        for c in self.children:
            rc = c.proc.poll()
            if rc is not None:
                raise StartupError(f"{c.name} (pid {c.pid}) exited with {describe_exit(rc)} during startup", c)
        if time.monotonic() > deadline:
            raise StartupError(f"not healthy after {self.startup_timeout:g} s (startup timeout): still waiting for "
                               f"{what}", waiting_for)

    def _wait_listening(self, child: Child, deadline: float) -> None:
        what = f"{child.name} to listen on {child.spec.address}"
        while True:
            self._check_startup(child, deadline, what)
            if listening(child.spec.host, child.spec.port, timeout=0.5):
                log(f"{child.name} is listening on {child.spec.address} ({time.monotonic() - self.t0:.1f} s)")
                return
            time.sleep(POLL_S)

    def _wait_healthy(self, child: Child, deadline: float, url: str) -> None:
        last = "no answer yet"
        while True:
            self._check_startup(child, deadline, f"{url} to answer 200 (last: {last})")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        if not child.spec.public:  # the public one's line follows ("healthy after ...")
                            log(f"{child.name} is healthy: {url} answered 200 ({time.monotonic() - self.t0:.1f} s)")
                        return
                    last = f"HTTP {r.status}"
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}"
            except (OSError, ValueError) as e:
                last = str(getattr(e, "reason", e))
            time.sleep(HEALTH_POLL_S)

    def _served_model(self) -> str | None:
        """The model id the gateway serves (best effort, for the curl example)."""
        try:
            with urllib.request.urlopen(self.plan.endpoint + "/models", timeout=2) as r:
                data = json.loads(r.read())
            return str(data["data"][0]["id"])
        except Exception:  # noqa: BLE001 — only decoration; an auth-protected gateway answers 401 here
            return None

    def _write_state(self) -> None:
        self.info["children"] = [c.record() for c in self.children]
        state.write_up(self.state_dir, self.info)

    # ---- steady state ----------------------------------------------------------------------------------------
    def supervise(self) -> int:
        while True:
            if self.pending_signal is not None:
                self.stop_all(f"got {procs.signal_name(self.pending_signal)}")
                return 0
            for c in list(self.children):
                rc = c.proc.poll()
                if rc is None or c.name in self._gone or c not in self.children:  # (a restart may replace peers)
                    continue
                log(f"child {c.name} (pid {c.pid}) exited with {describe_exit(rc)}; last lines of {c.spec.log}:\n"
                    f"{tail(c.spec.log)}")
                done = self.restarts.get(c.spec.role, 0)
                if done < self.max_restarts:
                    self._restart(c)
                elif c.spec.optional:
                    self._gone.add(c.name)
                    log(f"{c.name} is optional and past its restart limit ({done} of --max-restarts "
                        f"{self.max_restarts}): serving goes on without it")
                else:
                    log(f"{c.spec.role} is past its restart limit ({done} of --max-restarts {self.max_restarts}): "
                        f"stopping everything")
                    self.stop_all(f"{c.name} exited")
                    return 1
            time.sleep(POLL_S)

    def _restart(self, failed: Child) -> None:
        """Start `failed` again — with all its role's replicas when the role restarts together (the ranks: first
        give the others `GROUP_EXIT_WAIT_S` to leave on their own, then stop what is left) — same argv and ports."""
        role = failed.spec.role
        n = self.restarts[role] = self.restarts.get(role, 0) + 1
        group = [c for c in self.children if c.spec.role == role] if failed.spec.restart_together else [failed]
        others = [c for c in group if c is not failed]
        if others:
            log(f"restarting the {role} group ({', '.join(c.name for c in group)}), restart {n} of at most "
                f"{self.max_restarts}: waiting up to {GROUP_EXIT_WAIT_S:g} s for "
                f"{', '.join(c.name for c in others)} to leave on its own")
            until = time.monotonic() + GROUP_EXIT_WAIT_S
            while any(c.proc.poll() is None for c in others) and time.monotonic() < until:
                time.sleep(POLL_S)
            for c in others:
                if c.proc.returncode is not None:
                    log(f"{c.name} (pid {c.pid}) exited with {describe_exit(c.proc.returncode)}; last lines of "
                        f"{c.spec.log}:\n{tail(c.spec.log, lines=5)}")
        else:
            log(f"restarting {failed.name}, restart {n} of at most {self.max_restarts} for {role}")
        self._terminate(group, f"restarting the {role} group" if others else f"restarting {failed.name}")
        if self.pending_signal is not None:
            return  # told to stop meanwhile: the loop stops everything; nothing new to start just to kill it
        for c in group:
            c.logfile.close()
            self.children[self.children.index(c)] = self._spawn(
                c.spec, f"restarted (restart {n} of at most {self.max_restarts} for {role})")
        self._write_state()

    def stop_all(self, reason: str) -> None:
        """Stop every child (gateway first); idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._terminate(list(reversed(self.children)), reason)
        for c in self.children:
            c.logfile.close()

    def _terminate(self, kids: list[Child], reason: str) -> None:
        """SIGTERM the process group of each child still running (in order), wait up to the grace period, SIGKILL
        what is left (grandchildren included), reap."""
        for c in kids:
            c.proc.poll()
        live = [c for c in kids if c.proc.returncode is None or c.pgid in procs.live_groups([c.pgid])]
        if not live:
            return
        t = time.monotonic()
        log(f"stopping {', '.join(c.name for c in live)} ({reason}): SIGTERM to each process group, "
            f"SIGKILL after {self.stop_grace:g} s")
        for c in live:
            procs.signal_group(c.pgid, signal.SIGTERM)
        deadline = t + self.stop_grace
        left = live
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = self._still_running(left)
        for c in left:
            log(f"{c.name} (process group {c.pgid}) still running after {self.stop_grace:g} s: SIGKILL")
            procs.signal_group(c.pgid, signal.SIGKILL)
        for c in live:
            try:
                c.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log(f"{c.name} (pid {c.pid}) did not exit even after SIGKILL")
        until = time.monotonic() + 2.0  # SIGKILLed grandchildren (no longer ours to reap) take a moment to go
        while (left := self._still_running(left)) and time.monotonic() < until:
            time.sleep(0.05)
        for c in left:
            log(f"process group {c.pgid} of {c.name} still has live members after SIGKILL")
        log(f"stopped {', '.join(f'{c.name} ({describe_exit(c.proc.returncode)})' for c in live if c.proc.returncode is not None)} "
            f"in {time.monotonic() - t:.1f} s")

    @staticmethod
    def _still_running(children: list[Child]) -> list[Child]:
        for c in children:
            c.proc.poll()
        groups = procs.live_groups([c.pgid for c in children])
        return [c for c in children if c.proc.returncode is None or c.pgid in groups]


def recorded_alive(r: dict[str, Any]) -> bool:
    """Does a child recorded in up.json still have live processes? Its leader pid counts only if it is the same
    process (start time matches); a group whose leader is gone counts while any member lives."""
    pid, pgid, started = int(r.get("pid", 0)), int(r.get("pgid", r.get("pid", 0))), r.get("start")
    if procs.alive(pid):
        now = procs.start_time(pid)
        if started is not None and now is not None and now != started:
            return False  # the pid now belongs to another program
        return True
    return pgid in procs.live_groups([pgid])


def kill_leftovers(records: list[dict[str, Any]], sig: int = signal.SIGKILL) -> list[str]:
    """Signal the process group of every recorded child that is still alive; the names signalled."""
    hit = []
    for r in records:
        if recorded_alive(r) and procs.signal_group(int(r.get("pgid", r.get("pid", 0))), sig):
            hit.append(f"{r.get('name')} (process group {r.get('pgid', r.get('pid'))})")
    return hit


def format_banner(info: dict[str, Any]) -> str:
    endpoint = info["endpoint"]
    model_id = info.get("served_model") or Path(str(info.get("model", "model"))).name
    body = json.dumps({"model": model_id, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
    return "\n".join([
        f"twinspark is up: {endpoint}  (model {info.get('model')}, tp {info.get('tp')}, device {info.get('device')})",
        *([f"  replicas: {', '.join(r['url'] for r in info['replicas'])} behind vllm-router "
           f"({info.get('router_policy')})"] if info.get("replicas") else []),
        f"  try:  curl -s {endpoint}/chat/completions -H 'Content-Type: application/json' -d '{body}'",
        f"  logs: {info.get('logs')}/",
    ])
