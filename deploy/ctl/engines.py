"""The container engines start.sh drives: docker with its compose plugin, or podman with podman-compose (the
`podman` extra). Whether each answers here, and the commands and settings each needs."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from deploy.ctl.settings import DEPLOY

# runc, cgroupfs, no default rlimits: what podman needs on machines like CI's (the file says why, setting by setting).
PODMAN_CONF = DEPLOY / "podman" / "containers.conf"
# chroot isolation: the build's RUN steps need no runtime of their own; the host's network: the build's apt and pip
# reach what the host reaches, as the compose files' containers (host networking) do.
PODMAN_BUILD_FLAGS = ("--isolation", "chroot", "--network", "host")


@dataclass(frozen=True)
class Engine:
    name: str  # docker | podman: also its command
    compose: tuple[str, ...]  # its compose command on the head, before -p / -f
    env: dict[str, str] = field(default_factory=dict)  # every command of this engine gets these (head)

    def build(self, dockerfile: str, image: str, build_args: dict[str, str]) -> list[str]:
        args = [a for k, v in build_args.items() for a in ("--build-arg", f"{k}={v}")]
        flags = PODMAN_BUILD_FLAGS if self.name == "podman" else ()
        return [self.name, "build", *flags, *args, "-f", dockerfile, "-t", image, "."]

    def worker_compose(self) -> tuple[str, ...]:
        """The compose command on a worker: podman-compose from its PATH (the head's venv path means nothing there)."""
        return self.compose if self.name == "docker" else ("podman-compose",)

    def describe(self) -> str:
        if self.name == "docker":
            return "docker compose"
        return (f"{' '.join(self.compose)}; CONTAINERS_CONF={self.env['CONTAINERS_CONF']} (runtime runc, cgroup "
                f"manager cgroupfs, no default rlimits); builds with {' '.join(PODMAN_BUILD_FLAGS)}")


DOCKER = Engine("docker", ("docker", "compose"))


def podman(python: str) -> Engine:
    """podman-compose from PATH, else beside `python` (this checkout's venv, where `pip install -e '.[podman]'` puts
    it)."""
    beside = Path(python).parent / "podman-compose"
    compose = shutil.which("podman-compose") or (str(beside) if beside.exists() else "podman-compose")
    return Engine("podman", (compose,), {"CONTAINERS_CONF": str(PODMAN_CONF)})


def _ok(argv: list[str], env: dict[str, str]) -> bool:
    try:
        return subprocess.run(argv, capture_output=True, timeout=30, env={**os.environ, **env}).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def why_not(engine: Engine) -> str | None:
    """None when the engine and its compose command answer here, else what fails."""
    if shutil.which(engine.name) is None:
        return f"no {engine.name} command"
    if not _ok([engine.name, "info"], engine.env):
        return f"`{engine.name} info` fails (no engine answers)"
    if not _ok([*engine.compose, "version"], engine.env):
        hint = "install the compose plugin" if engine.name == "docker" else "pip install -e '.[podman]'"
        return f"`{' '.join(engine.compose)} version` fails ({hint})"
    return None


PULL_TIMEOUT_S = 900  # a big image over a slow link: compose would wait as long for the same pull


def image_problem(engine: Engine, image: str) -> str | None:
    """None when `image` is on this machine or the engine can pull it (it is then here for compose); else why not,
    in the engine's last words (no image registry: `short-name ... did not resolve`, a refused connection, ...)."""
    if _ok([engine.name, "image", "inspect", image], engine.env):
        return None
    try:
        r = subprocess.run([engine.name, "pull", image], capture_output=True, text=True, timeout=PULL_TIMEOUT_S,
                           env={**os.environ, **engine.env})
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    lines = (r.stderr or r.stdout).strip().splitlines()
    return None if r.returncode == 0 else lines[-1] if lines else f"exit code {r.returncode}"


def problems(engine: Engine) -> list[str]:
    why = why_not(engine)
    return [] if why is None else [f"head: {engine.name}: {why}; or use another LAUNCHER"]
