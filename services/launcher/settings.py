"""`twinspark up` and `twinspark down`: their settings, read once from the command line and the environment.

`up` takes serving flags the roles take too (declared once in shared_flags.py) and passes each on in the argv of
every role that takes it (plan.py, flags.passed_on); the KV tier and thinking flags are unset unless given, so that
unset the roles read their own variables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.common import shared_flags as shared
from services.common.flags import Flag, flag

STATE_DIR = Flag("state-dir", "where up.json and logs/ go (default $XDG_STATE_HOME/twinspark or "
                  "~/.local/state/twinspark)", metavar="DIR")


def _passed_on(spec: Flag, to: str = "every rank") -> Any:
    """A role's flag that `up` gives that role when it is set (unset, the role reads its own variable)."""
    role_help = spec.help.replace("%(default)s", spec.default or "none")  # the role's default, not up's None
    return flag(spec, help=f"{role_help}; passed on to {to} (unset: its own {spec.env_var})", default=None,
                env=None)


@dataclass(frozen=True, kw_only=True)
class UpSettings:
    model: str | None = flag(shared.MODEL, help="checkpoint directory (default: the cached tiny checkpoint)")
    tp: int = flag(shared.TP)
    host: str = flag("host", "address the gateway listens on", default="127.0.0.1", env=None)
    port: int = flag(shared.GATEWAY_PORT, help="gateway HTTP port (0 = pick a free one)", metavar="PORT")
    device: str = flag(shared.DEVICE, help="device of the rank workers")
    drafter: str = flag(shared.DRAFTER)
    # vLLM's name for it is speculative_config's "model": the draft model's folder.
    drafter_model: str | None = flag("drafter-model", "--drafter dflash: the DFlash2 drafter's folder (config.json + "
                                     "safetensors; default MODEL/dflash2, where make-tiny --drafter dflash writes "
                                     "one)", metavar="DIR")
    kv_cache_dtype: str = flag(shared.KV_CACHE_DTYPE)
    rest_fp8_kernel: str = flag(shared.REST_FP8_KERNEL)
    max_num_batched_tokens: int | None = flag(shared.MAX_NUM_BATCHED_TOKENS)
    num_scheduler_steps: int = flag(shared.NUM_SCHEDULER_STEPS)
    kv_host_bytes: int | None = _passed_on(shared.KV_HOST_BYTES)
    kv_disk_dir: str | None = _passed_on(shared.KV_DISK_DIR)
    kv_disk_bytes: int | None = _passed_on(shared.KV_DISK_BYTES)
    collective: str = flag(shared.COLLECTIVE)
    enforce_eager: bool = flag(shared.ENFORCE_EAGER)
    mps: str = flag("mps", "NVIDIA MPS for CUDA ranks that share a GPU (--tp above the GPU count; without it they "
                    "time-slice and every collective waits out a slice): auto = start a private daemon for this "
                    "stack when they share one, unless CUDA_MPS_PIPE_DIRECTORY names a daemon of yours; on = always "
                    "on CUDA; off = never", default="auto", choices=("auto", "on", "off"))
    reasoning_budget: int | None = _passed_on(shared.REASONING_BUDGET, "the gateway")
    reasoning_budget_message: str | None = _passed_on(shared.REASONING_BUDGET_MESSAGE, "the gateway")
    reasoning_effort_budgets: str | None = _passed_on(shared.REASONING_EFFORT_BUDGETS, "the gateway")
    strict_request_fields: bool = flag(shared.STRICT_REQUEST_FIELDS)
    kv_events_endpoint: str | None = flag(shared.KV_EVENTS_ENDPOINT, help=f"{shared.KV_EVENTS_ENDPOINT.help}; passed "
                                          "on to the scheduler (--router-policy kv_aware sets one per replica)")
    random_weights: str | None = flag(shared.RANDOM_WEIGHTS)
    random_block_size: int = flag(shared.RANDOM_BLOCK_SIZE)
    replicas: int = flag(shared.REPLICAS)
    replica_urls: str | None = flag("replica-urls", "replicas running elsewhere (comma-separated base URLs, "
                                    "e.g. http://spark3:8888) that vllm-router serves beside the --replicas started "
                                    "here", metavar="URLS", env=None)
    router_policy: str = flag(shared.ROUTER_POLICY)
    router_command: str | None = flag("router-command", "command that runs vllm-router, shell-quoted (default: "
                                      "the vllm-router beside this Python, else on PATH)", metavar="CMD", env=None)
    router_args: str | None = flag("router-args", "more vllm-router flags, shell-quoted (e.g. \"--retry-max-retries "
                                   "3\"); they come after the ones `up` sets, so they win", metavar="ARGS", env=None)
    detach: bool = flag("detach", "run the supervisor in the background; return once healthy (stop with "
                        "`twinspark down`)", switch=True, env=None)
    state_dir: str | None = flag(STATE_DIR)
    startup_timeout: float = flag("startup-timeout", "seconds to wait for /health to answer 200", default="600",
                                  type=float, metavar="S", env=None)
    stop_grace: float = flag("stop-grace", "seconds between SIGTERM and SIGKILL when stopping the children",
                             default="10", type=float, metavar="S", env=None)
    max_restarts: int = flag("max-restarts", "restarts allowed per role (a rank group restart counts once) over the "
                             "run's life; the next exit stops everything, except the optional drafter, which then "
                             "stays down; 0 = the first exit stops everything", default="5", type=int, metavar="N")
    role_command: str | None = flag("role-command", "command that runs a role's subcommand (serve-rank ...), "
                                    "shell-quoted (default: this Python's `-m services.cli`; e.g. the console script "
                                    ".../bin/twinspark)", metavar="CMD", env=None)
    background: bool = flag("background", "set on the detached supervisor", switch=True, env=None, hidden=True)

    @property
    def remote_urls(self) -> list[str]:
        return [u.strip().rstrip("/") for u in (self.replica_urls or "").split(",") if u.strip()]

    @property
    def routed(self) -> bool:
        """Does this run put vllm-router in front (several replicas, or remote ones)?"""
        return self.replicas > 1 or bool(self.remote_urls)


@dataclass(frozen=True, kw_only=True)
class DownSettings:
    state_dir: str | None = flag(STATE_DIR)
    timeout: float | None = flag("timeout", "seconds to wait for the supervisor before SIGKILL (default: its stop "
                                 "grace + 15)", type=float, metavar="S", env=None)
