"""The flags that several subcommands take, and the ones a deployment sets (deploy/.env), each declared once; a
subcommand's other flags are declared in its settings dataclass. Names are vLLM's where vLLM has the setting.

Every flag declared here is a serving setting that deploy/ctl hands to the roles (`declared`): it reads the ones
its .env sets and writes them as their TWINSPARK_* variables with flags.to_env. deploy/ctl cannot import the roles'
settings dataclasses themselves (they need Python 3.10 and the gateway's pull in starlette), so a role's own flag
that the deployment sets is declared here and named by that role's dataclass.

Standard library only (see flags.py): the choices here are the ones the model library implements (a test holds
them to model.row_store.KV_CACHE_DTYPES and torch's dtypes).
"""

from __future__ import annotations

from services.common.flags import Flag

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
DTYPES = ("bfloat16", "float16", "float32")


def log_level(text: str) -> str:
    """A logging level in any case, as uvicorn spells it (lower case; `logging` takes it upper-cased)."""
    level = text.strip().lower()
    if level not in LOG_LEVELS:
        raise ValueError(f"{text!r} is not one of {', '.join(LOG_LEVELS)}")
    return level


log_level.__name__ = "log level"  # argparse names the type in its "invalid log level value" message


def positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise ValueError(f"must be >= 1, got {v}")
    return v


positive_int.__name__ = "positive integer"  # argparse's "invalid positive integer value" message


# reasoning_effort levels and the thinking budget each one sets unless the server says otherwise (tokens the model
# may think before the end of thinking is forced; "unlimited": no budget). "none" turns thinking off; chat's "max"
# (the chat template's own top level) is "xhigh".
EFFORT_LEVELS = ("minimal", "low", "medium", "high", "xhigh")
DEFAULT_EFFORT_BUDGETS = "minimal=256,low=1024,medium=4096,high=16384,xhigh=unlimited"
UNLIMITED = "unlimited"


def parse_effort_budgets(text: str) -> dict[str, int | None]:
    """LEVEL=N pairs, comma-separated, over the defaults (a level not named keeps its default): level -> budget,
    None = unlimited."""
    out: dict[str, int | None] = {}
    for pairs in (DEFAULT_EFFORT_BUDGETS, text):
        for pair in filter(None, (p.strip() for p in pairs.split(","))):
            level, sep, value = (x.strip() for x in pair.partition("="))
            if not sep or level not in EFFORT_LEVELS:
                raise ValueError(f"{pair!r} is not LEVEL=N with LEVEL one of {', '.join(EFFORT_LEVELS)}")
            if value == UNLIMITED:
                out[level] = None
            elif value.isdigit() and int(value) < 1 << 31:
                out[level] = int(value)
            else:
                raise ValueError(f"{pair!r}: the budget must be a number of tokens >= 0 or {UNLIMITED!r}")
    return out


def effort_budgets(text: str) -> str:
    """The flag's text, checked (its value stays text so that `up` can pass it on as given)."""
    parse_effort_budgets(text)
    return text


effort_budgets.__name__ = "LEVEL=N list"


def reasoning_budget(text: str) -> int:
    v = int(text)
    if not -1 <= v < 1 << 31:
        raise ValueError(f"must be -1 (unlimited) or a number of tokens >= 0, got {v}")
    return v


reasoning_budget.__name__ = "token budget"


def compute_dtype(dtype: str | None, device: str) -> str:
    """--dtype, or the device's default when unset: bfloat16 on cuda, float32 on the CPU."""
    return dtype or ("bfloat16" if device == "cuda" else "float32")


MODEL = Flag("model", "checkpoint directory", metavar="DIR")
DEVICE = Flag("device", "device the model runs on", default="cpu", choices=("cpu", "cuda"))
DTYPE = Flag("dtype", "compute dtype (default float32 on cpu, bfloat16 on cuda)", choices=DTYPES)
KV_CACHE_DTYPE = Flag("kv-cache-dtype", "storage of the MLA latent + indexer cache rows: auto = the compute dtype; "
                      "fp8 (= fp8_e4m3) = e4m3 with a per-row fp32 scale, about half the bf16 bytes",
                      default="auto", choices=("auto", "fp8", "fp8_e4m3"))
TP = Flag("tp", "tensor-parallel ranks", default="1", type=int, metavar="N")
# kernels/gpu/fp8_dense.SETTINGS (a test holds them equal)
REST_FP8_KERNEL = Flag("rest-fp8-kernel", "the GEMM of decode-class rows through the wide fp8 linears outside the "
                       "experts (>= 16,384 outputs: KDA's q|k|v, MLA's q_b, the dense MLP's gate|up): triton = ours; "
                       "humming = humming-kernels' dense GEMM, batch invariant (needs humming-kernels: pip install -e "
                       "'.[gpu]'; those linears are then held twice, as stored for prompt rows and repacked)",
                       default="triton", choices=("triton", "humming"))
COLLECTIVE = Flag("collective", "how the tensor-parallel ranks exchange partial sums: nccl (CUDA), gloo (CPU "
                  "tensors over sockets), ipc (ranks on one host: memory every rank maps, shared memory on the CPU, "
                  "CUDA IPC device buffers on GPUs, also several ranks on one GPU), auto (ipc when every rank is on "
                  "this host and can map it, else nccl on CUDA, gloo on the CPU); the same on every rank",
                  default="auto", choices=("auto", "nccl", "ipc", "gloo"))
ENFORCE_EAGER = Flag("enforce-eager", "on a GPU, run decode rounds eagerly instead of replaying CUDA graphs (vLLM's "
                     "flag; the same bits either way, graphs only save launch time)", switch=True)
RANDOM_WEIGHTS = Flag("random-weights", "draw random weights on the device instead of reading shards (--model still "
                      "gives the config and the tokenizer): FORMAT for every eligible linear, or EXPERTS+OTHER[+HEAD], "
                      "from fp8, w4a16, exl3[:BITS], int2, int3, int4, int8 (each with an optional :gGROUP), bf16 "
                      "(e.g. bf16, fp8, w4a16+fp8, exl3:3.0+fp8, int3+fp8, int3:g64+int4, int3+fp8+fp8); BITS is "
                      "EXL3's average bits per weight, 1-8 in half steps (default 4); GROUP is the int formats' group "
                      "size, one per recipe (default: --random-block-size); HEAD is lm_head's, bf16 (default) or fp8 "
                      "(at the release's vocabulary 128-row blocks need 2 or 1 virtual shards: serve-rank's "
                      "--virtual-shards, TWINSPARK_VIRTUAL_SHARDS); quantized linears are drawn packed",
                      metavar="FORMAT")
RANDOM_BLOCK_SIZE = Flag("random-block-size", "with --random-weights: fp8 block edge, w4a16 group size and the int "
                         "formats' group size (unless the recipe gives one, int3:g64)", default="128", type=int,
                         metavar="N")
NUM_BLOCKS = Flag("num-blocks", "KV cache blocks per rank (0 = sized from memory by --kv-cache-memory-bytes or "
                  "--gpu-memory-utilization, the group taking its smallest rank's figure); the served window is "
                  "min(the checkpoint's max_position_embeddings, blocks x block size)", default="0", type=int)
KV_HOST_BYTES = Flag("kv-host-bytes", "host-RAM KV tier behind the pool, bytes per rank: evicted prefix blocks and "
                     "KDA snapshots wait here (0 = off)", default="0", type=int, metavar="BYTES")
KV_DISK_DIR = Flag("kv-disk-dir", "disk KV tier directory (unset = off): entries pushed out of host RAM land here, "
                   "checksummed, and survive a restart with the same checkpoint and settings", metavar="DIR")
KV_DISK_BYTES = Flag("kv-disk-bytes", "disk KV tier size per rank in bytes (default 64 GiB)", default=str(64 << 30),
                     type=int, metavar="BYTES")
MAX_NUM_BATCHED_TOKENS = Flag("max-num-batched-tokens", "token budget of one round (vLLM's flag): decode rows first, "
                              "then prompt chunks as large as the rest allows on the 64-token grid (default: 8192 "
                              "when the ranks run on CUDA, 256 on the CPU)", type=positive_int, metavar="N")
# Decode steps one round may run (StepPlan.steps): the scheduler's flag and the rank's plan check share it.
MAX_SCHEDULER_STEPS = 32


def scheduler_steps(text: str) -> int:
    """--num-scheduler-steps: "auto" (0, which it also takes) or 1..MAX_SCHEDULER_STEPS."""
    if text.strip().lower() in ("auto", "0"):
        return 0
    v = int(text)
    if not 1 <= v <= MAX_SCHEDULER_STEPS:
        raise ValueError(f"must be auto or 1..{MAX_SCHEDULER_STEPS}, got {v}")
    return v


scheduler_steps.__name__ = "step count"  # argparse's "invalid step count value" message

NUM_SCHEDULER_STEPS = Flag("num-scheduler-steps", "decode steps per round (vLLM's flag): a round of plain decode "
                           "rows runs N forward + draw steps on the ranks, paying the host's per-round work (plan, "
                           "gRPC, launch) once per N tokens; replies are the same bits at any N. auto = as many as "
                           "fit in 8 ms of measured decode time, at most 8 (one step when a step is that long "
                           "already); rounds with prompts, drafts, grammars or penalties run one step "
                           "(default auto)", default="auto", type=scheduler_steps, metavar="auto|N")
# The roles' own settings that a deployment sets (see the module docstring).
MAX_WAITING = Flag("max-waiting", "waiting-queue bound; beyond it Generate answers RESOURCE_EXHAUSTED + retry-after "
                   "(default 64)", default="64", type=int)
MAX_NUM_SEQS = Flag("max-num-seqs", "running requests at most (also capped by the ranks' KDA slots) (default 16)",
                    default="16", type=positive_int)
NUM_DRAFT_TOKENS = Flag("num-draft-tokens", "drafts asked per decoding request and round (default 4)", default="4",
                        type=int)
PEER_TIMEOUT = Flag("peer-timeout", "seconds a peer may stay silent before this rank leaves the group with exit code "
                    "5 (default 3)", default="3", type=float)
KV_CACHE_MEMORY_BYTES = Flag(
    "kv-cache-memory-bytes", "bytes of this rank's KV pool, blocks and KDA slots together, when --num-blocks is 0 "
    "(vLLM's flag; 0 = on CUDA by --gpu-memory-utilization, on the CPU 1 GiB or half the available RAM if less)",
    default="0", type=int)
GPU_MEMORY_UTILIZATION = Flag(
    "gpu-memory-utilization", "on CUDA with --num-blocks 0 and no --kv-cache-memory-bytes: the share of the GPU's "
    "memory this rank may fill; the pool gets it less what is in use once the weights are loaded (vLLM's flag; "
    "default 0.9). On an integrated GPU (DGX Spark), whose memory is the system's: the share of the total this "
    "rank may fill, weights included, never more than the system has available", default="0.9", type=float)
BLOCK_SIZE = Flag("block-size", "positions per KV block", default="16", type=int)
NUM_SLOTS = Flag("num-slots", "KDA state slots", default="32", type=int)
SERVED_MODEL_NAME = Flag("served-model-name", "model name clients send and see (default the checkpoint directory's "
                         "name)")
API_KEY = Flag("api-key", "require one of these keys, comma-separated (an entry 'sha256:HEX' is a key's digest), as "
               "'Authorization: Bearer KEY' or 'x-api-key: KEY' on every route but /health, /metrics and "
               "/openapi.json")
GATEWAY_PORT = Flag("port", "the gateway's HTTP port (default %(default)s)", default="8888", type=int, env="PORT")
# `twinspark up`'s and start.sh's draft method (the drafter process's own flag is --method).
DRAFTER = Flag("drafter", "draft method of the drafter process (copy: n-gram prompt lookup; mtp: the checkpoint's "
               "MTP layer; dflash: a DFlash2 block drafter, --drafter-model; none: no drafter, no drafts)",
               default="copy", choices=("copy", "mtp", "dflash", "none"))
INTERNAL_TOKEN = Flag("internal-token", "shared secret that every internal gRPC call carries and every internal "
                      "server requires (the variable is preferred: an argv is visible to other local users; "
                      "`twinspark up` and start.sh make one per run); unset = no check, loopback only",
                      metavar="TOKEN")
REPLICAS = Flag("replicas", "model replicas (whole stacks) to start on this machine; above 1, vllm-router serves "
                "them on --port (pip install -e '.[router]')", default="1", type=int, metavar="N")
# vllm-router's policies (`vllm-router --help`); cache_aware routes a prompt to the replica whose earlier prompts
# share its longest prefix, so the replica's prefix cache serves it.
ROUTER_POLICY = Flag("router-policy", "vllm-router's load-balancing policy in front of the replicas",
                     default="cache_aware", choices=("cache_aware", "kv_aware", "round_robin", "power_of_two",
                                                      "consistent_hash", "random", "sticky_least_loaded"))
KV_EVENTS_ENDPOINT = Flag("kv-events-endpoint", "publish the prefix cache's block events in vLLM's KV event format "
                          "on this ZMQ address (e.g. tcp://127.0.0.1:5557), for vllm-router's kv_aware policy "
                          "(--kv-event-source URL=ADDRESS); unset = off", metavar="ADDRESS")
STRICT_REQUEST_FIELDS = Flag("strict-request-fields", "refuse request fields the gateway does not know with "
                             "OpenAI's 400 ('Unrecognized request argument supplied') instead of ignoring them as "
                             "vLLM does (each name logged once, listed per response in the x-twinspark-ignored-fields "
                             "header); routers such as vllm-router add fields of their own, so leave it off behind "
                             "one", switch=True)
LOG_LEVEL = Flag("log-level", f"logging level: {', '.join(LOG_LEVELS)} (any case)", default="INFO", type=log_level)
# Thinking control, llama.cpp's names (`--reasoning-budget`, `--reasoning-budget-message`): the gateway turns a
# request's budget into GenerateRequest.thinking, the scheduler forces the end of thinking once it is spent.
REASONING_BUDGET = Flag("reasoning-budget", "thinking budget of a request that sets none (no thinking_token_budget, "
                        "reasoning_effort or budget_tokens): tokens the model may think before the end of thinking is "
                        "forced; -1 = unlimited, 0 = end at once (default %(default)s)", default="-1",
                        type=reasoning_budget, metavar="N")
REASONING_BUDGET_MESSAGE = Flag("reasoning-budget-message", "text forced before the end-of-thinking token when a "
                                "thinking budget runs out, e.g. ' Time to answer.' (default none)", metavar="TEXT")
REASONING_EFFORT_BUDGETS = Flag("reasoning-effort-budgets", "the thinking budget of each reasoning_effort (chat, "
                                "Responses' reasoning.effort): LEVEL=N pairs over the defaults, N a number of tokens "
                                "or 'unlimited' (default %(default)s)", default=DEFAULT_EFFORT_BUDGETS,
                                type=effort_budgets, metavar="LEVEL=N,...")


def declared() -> list[Flag]:
    """Every flag declared in this module, in order: the serving settings deploy/ctl hands to the roles."""
    return [value for value in globals().values() if isinstance(value, Flag)]
