#!/usr/bin/env bash
# Every GPU check and benchmark of this repository in one call on a lent GPU machine (device time is short: one
# call, results under $OUT). Run from the repository root there:
#
#   bash bench/gpu_check.sh            # tests/gpu + the Triton kernel tests, decode/prefill vs transformers,
#                                      # per-kernel bench, the served bench on CUDA
#   bash bench/gpu_check.sh tests      # only the tests
#   bash bench/gpu_check.sh whole [LAYERS] [TP] [FORMATS] [CONCURRENCY] [PREFILL]
#                                      # only bench/whole_model.py: the release config (45 layers + MTP by
#                                      # default) served on random quantized weights (default w4a16+bf16) at
#                                      # CONCURRENCY levels (default 1,8); the stack's settings come from the
#                                      # environment (e.g. TWINSPARK_KV_CACHE_DTYPE=fp8); PREFILL: prompt
#                                      # lengths timed alone after the levels (served TTFT, prompt tok/s)
#   bash bench/gpu_check.sh int        # the integer experts on humming-kernels: their GPU tests, the MoE kernel
#                                      # tests, then bench/kernels.py's intinv, intmoe (int3 / int4 / EXL3 2.5 /
#                                      # bf16 in one run) and intsweep sections (the CUDA EXL3 product builds
#                                      # in the background meanwhile)
#   bash bench/gpu_check.sh rest [FORMAT]
#                                      # issue 50's rest: the GPU tests of its GEMM paths (humming's fp8 rest,
#                                      # prefetch, grouped and SwiGLU inputs, the experts' addend), then
#                                      # bench/decode_prefill.py --profile on the 4-layer slice of random FORMAT
#                                      # weights (default int3+fp8) at batch 1 and 8, once with --rest-fp8-kernel
#                                      # triton and once humming (decode-prefill-rest-{triton,humming}.json and
#                                      # their profiles, the graph-replayed step's own times among them)
#   bash bench/gpu_check.sh profile [LAYERS] [FORMAT] [TP]
#                                      # the whole-model bench at batch 1 (default 22 layers, w4a16+fp8, TP 1) with
#                                      # the rank profiler over rounds 401-440 (PROFILE_ROUNDS=SKIP:COUNT to move
#                                      # it: a 4-layer run has ~100 rounds, so use 40:30 there), then
#                                      # bench/trace_gaps.py on rank 0's trace (its "in collectives" line: issue
#                                      # 21's share, e.g. TP 2 on one GPU)
#   bash bench/gpu_check.sh kill [LAYERS] [FORMAT] [TP]
#                                      # issue 54's rank killed mid-load: bench/rank_kill.py on LAYERS real-dim
#                                      # layers + MTP (default 45) of random FORMAT weights (default
#                                      # exl3:2.5+fp8), TP (default 1) on this GPU: 8 streams in flight, SIGKILL
#                                      # to the last rank, their errors within 5 s, 503 meanwhile, time to healthy,
#                                      # the same greedy ids after
#   bash bench/gpu_check.sh soak [LAYERS] [FORMAT] [DURATION]
#                                      # issue 54's GPU soak: bench/soak.py --mix gpu (prompts 100 tokens to 32k
#                                      # and one of 200k, n = 2, logprobs, tools / json_schema with a thinking
#                                      # budget, conversations, images when read; 10% cut) from 32 clients on
#                                      # LAYERS real-dimension layers + MTP (default 45) of random FORMAT weights
#                                      # (default exl3:2.5+fp8), TP 1, drafts off, for DURATION s (default 420),
#                                      # cut short so the load ends SOAK_END_BY s (default 480) after the script
#                                      # started: a cold start-up eats into the load, not past the call. A table
#                                      # per minute, GPU memory / host RSS drifts, p99 / median ITL, the
#                                      # Done-when checks; the stack's logs under $OUT/stack-logs
#   bash bench/gpu_check.sh hostile [LAYERS] [FORMAT] [REQUESTS]
#                                      # issue 54's hostile corpora on CUDA: bench/fuzz.py (bench/malformed.py +
#                                      # bench/hostile.py, the gateway's and the agent surface's) on LAYERS
#                                      # real-dimension layers + MTP (default 45) of random FORMAT weights (default
#                                      # exl3:2.5+fp8), TP 1, REQUESTS of them (default 3000) 8 at a time: 5xx,
#                                      # hangs, restarts, /health after; the stack's logs under $OUT/stack-logs
#   bash bench/gpu_check.sh long [LENGTHS]
#                                      # only bench/long_context.py (default 8k, 64k, 256k, 1M tokens)
#   bash bench/gpu_check.sh coldstart [LAYERS] [FORMATS]
#                                      # only bench/cold_start.py: ready time cold and with a warm kernel cache,
#                                      # the 12-request mix's first vs second pass (default 4 layers, w4a16+bf16)
#   bash bench/gpu_check.sh longserved [BUDGET]
#                                      # only bench/long_served.py: a 1,040,000-token prompt served beside a
#                                      # decoding stream at the step budget (default 8192), then offline
#   bash bench/gpu_check.sh tp2one [LAYERS] [FORMAT]
#                                      # TP 2 on one GPU (issue 21): the CUDA exchange's two-process test, then
#                                      # `twinspark up --device cuda` on LAYERS real-dim layers (default 4) of
#                                      # random FORMAT weights (default w4a16), drafts off: bench.exactness at
#                                      # TP 2, TP 1 (same ids as TP 2) and TP 2 eager (same ids as TP 2's graphs)
#   bash bench/gpu_check.sh prefill [TOKENS]
#                                      # issue 29's prefill line: bench/decode_prefill.py at batch 1 and prompts of
#                                      # TOKENS (default 2048,8192) on 4 bf16 layers with transformers in the same
#                                      # run and the kernel and host profiles of each prefill, then bench/kernels.py's
#                                      # prompt-attention, indexer-score and mHC sections (mlaxsweep, dsa, mhc)
#   bash bench/gpu_check.sh kernels [SECTIONS]
#                                      # only bench/kernels.py (default: the MoE in bf16 and W4A16, its tile
#                                      # sweeps and the invariance checks: what chooses `moe_schedule`)
#   bash bench/gpu_check.sh quality [FORMATS] [EXPERTS] [VIRTUAL]
#                                      # only bench/quality_formats.py: 4 layers at the release's dims (EXPERTS
#                                      # routed experts, default 16) written dense in bf16, quantized to each
#                                      # format (default fp8,w4a16,int4,int3,int2,exl3:2.5,exl3:3.0,exl3:4.0) on
#                                      # the GPU, each served: KL vs bf16 and top-1 agreement through the API,
#                                      # decode tok/s. VIRTUAL: the virtual shards (default 4; 2 for an fp8
#                                      # lm_head: quality int3+fp8,int3+fp8+fp8 16 2).
#                                      # Past the call's time limit, split FORMATS over two calls.
#
# What the machine lacks comes along in git-ignored folders named in the call's `carry`:
#   .device-kit    a copy of shared/device (the stack's wheels, fla-core, exllamav3 + its sm_90 extension)
#   .kernel-cache  kernels.txz, the kernel caches an earlier call left in its $OUT (see below)
#   .device-extra  wheels newer than the kit's, e.g. llguidance >= 1.9 (the kit has 1.6.1), fetched on a CPU machine:
#                  pip download --no-deps --only-binary=:all: --python-version 3.12 \
#                      --platform manylinux_2_31_x86_64 --abi abi3 llguidance==1.9.1 -d .device-extra
set -u
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
# shellcheck disable=SC1091
source .device-kit/install.sh exllamav3 >/dev/null 2>&1 || echo "no .device-kit: carry a copy of shared/device"
if compgen -G ".device-extra/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .device-extra/*.whl \
        2>&1 | grep -v -e "^WARNING" -e "Target directory" || true
fi
export PYTHONPATH="$PWD:$PWD/protos:/tmp/site"
# The end-to-end tests start `twinspark` from beside the interpreter, as a pip install would have put it.
bin=$(python3 -c "import os, sys; print(os.path.dirname(sys.executable))")
printf '#!/bin/sh\nexec python3 -m services.cli "$@"\n' > "$bin/twinspark" && chmod +x "$bin/twinspark"
nvidia-smi -L | tee "$OUT/gpus.txt"
# Kernel builds from one call to the next: Triton's and humming-kernels' caches live under one folder, restored from
# a carried .kernel-cache/kernels.txz when there is one and packed into $OUT/kernels.txz when the script ends (bring
# it back into .kernel-cache/ for the next call). A lent machine starts bare: a 4-layer slice's first prompts spent
# 101-131 s compiling, 4-10 s with the carried caches (docs/benchmarks.md). Both are sm_90 builds: good on an H100 or
# an H200. `coldstart` measures a cold start, so it neither restores nor packs them.
if [ "${1:-}" != "coldstart" ]; then
    cache=/tmp/twinspark-kernel-cache
    mkdir -p "$cache"
    [ -f .kernel-cache/kernels.txz ] && tar -xJf .kernel-cache/kernels.txz -C "$cache"
    export TRITON_CACHE_DIR="$cache/triton" HUMMING_CACHE_DIR="$cache/humming"
    trap 'tar -C "$cache" -cf - . | xz -T4 -3 > "$OUT/kernels.txz"' EXIT
fi
# The logs of the stacks the benches started (their temporary state dirs), beside the results.
copy_stack_logs() {
    for d in /tmp/twinspark-bench-*/logs; do
        [ -d "$d" ] && mkdir -p "$OUT/stack-logs" && cp -r "$d" "$OUT/stack-logs/$(basename "$(dirname "$d")")"
    done
}

if [ "${1:-}" = "kill" ]; then
    python3 -m bench.whole_model --write-dir /tmp/kill-config --layers "${2:-45}" > /dev/null
    python3 -m bench.rank_kill --device cuda --tp "${4:-1}" --model /tmp/kill-config \
        --random-weights "${3:-exl3:2.5+fp8}" --streams 8 --out "$OUT" > "$OUT/rank_kill.log" 2>&1
    echo "rank_kill exit status $? (0: every check held)"
    sed -n '/^| check/,/^Verdict/p' "$OUT"/rank_kill-*.md
    copy_stack_logs
    exit 0
fi

if [ "${1:-}" = "soak" ]; then
    python3 -m bench.whole_model --write-dir /tmp/soak-config --layers "${2:-45}" > /dev/null
    python3 -m bench.soak --device cuda --tp 1 --model /tmp/soak-config --random-weights "${3:-exl3:2.5+fp8}" \
        --mix gpu --clients 32 --duration "${4:-420}" --end-by $(( ${SOAK_END_BY:-480} - SECONDS )) --late-s 45 \
        --out "$OUT" > "$OUT/soak.log" 2>&1
    echo "soak exit status $? (0: the Done-when held)"
    tail -3 "$OUT/soak.log"
    sed -n '/^| minute | sent/,/^$/p; /^Steady minutes/,/^| process/p' "$OUT"/soak-*.md
    copy_stack_logs
    exit 0
fi
if [ "${1:-}" = "hostile" ]; then
    python3 -m bench.whole_model --write-dir /tmp/hostile-config --layers "${2:-45}" > /dev/null
    python3 -m bench.fuzz --device cuda --tp 1 --model /tmp/hostile-config --random-weights "${3:-exl3:2.5+fp8}" \
        --requests "${4:-3000}" --concurrency 8 --out "$OUT" > "$OUT/fuzz.log" 2>&1
    echo "fuzz exit status $? (0: no 5xx, hang, wrong error shape or restart; /health 200 after)"
    tail -1 "$OUT/fuzz.log"
    sed -n '/^| 5xx/,/^$/p' "$OUT"/fuzz-*.md
    copy_stack_logs
    exit 0
fi
if [ "${1:-}" = "long" ]; then
    python3 -m bench.long_context --out "$OUT" ${2:+--lengths "$2"} > "$OUT/long_context.log" 2>&1
    tail -12 "$OUT/long_context.log"
    exit 0
fi
if [ "${1:-}" = "coldstart" ]; then
    python3 -m bench.whole_model --write-dir /tmp/cold-start-config --layers "${2:-4}" > /dev/null
    python3 -m bench.cold_start --model /tmp/cold-start-config --random-weights "${3:-w4a16+bf16}" --out "$OUT" \
        > "$OUT/cold_start.log" 2>&1
    tail -8 "$OUT/cold_start.log"
    exit 0
fi
if [ "${1:-}" = "longserved" ]; then
    python3 -m bench.long_served --out "$OUT" --budget "${2:-8192}" > "$OUT/long_served.log" 2>&1
    tail -30 "$OUT/long_served.log"
    exit 0
fi
if [ "${1:-}" = "tp2one" ]; then
    python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_device_exchange_cuda.py > "$OUT/device_exchange.log" 2>&1
    grep -E "device exchange|passed|failed" "$OUT/device_exchange.log" | tail -4
    python3 -m bench.whole_model --write-dir /tmp/tp2one-config --layers "${2:-4}" > /dev/null
    export TWINSPARK_DEVICE=cuda TWINSPARK_RANDOM_WEIGHTS="${3:-w4a16}" TWINSPARK_DRAFTER=none
    python3 -m bench.exactness --tp 2 --model /tmp/tp2one-config --label "TP 2" --json "$OUT/exactness-tp2.json" \
        > "$OUT/exactness-tp2.log" 2>&1
    tail -n 1 "$OUT/exactness-tp2.log"
    python3 -m bench.exactness --tp 1 --model /tmp/tp2one-config --label "TP 1" --json "$OUT/exactness-tp1.json" \
        --same-as "$OUT/exactness-tp2.json" > "$OUT/exactness-tp1.log" 2>&1
    TWINSPARK_ENFORCE_EAGER=1 python3 -m bench.exactness --tp 2 --model /tmp/tp2one-config --label "TP 2 eager" \
        --same-as "$OUT/exactness-tp2.json" > "$OUT/exactness-tp2-eager.log" 2>&1
    tail -qn 2 "$OUT/exactness-tp1.log" "$OUT/exactness-tp2-eager.log"
    exit 0
fi
if [ "${1:-}" = "prefill" ]; then
    python3 -m bench.decode_prefill --batches 1 --prefill "${2:-2048,8192}" --profile --out "$OUT" \
        > "$OUT/decode_prefill.log" 2>&1
    grep -E "prefill .*median|peer prefill" "$OUT/decode_prefill.log" | tail -6
    python3 -m bench.kernels --only mlaxsweep,dsa,mhc --out "$OUT" > "$OUT/kernels-prefill.log" 2>&1
    grep -E "mla expanded|dsa scores|mhc t=" "$OUT/kernels-prefill.log" | tail -17
    exit 0
fi
if [ "${1:-}" = "kernels" ]; then
    python3 -m bench.kernels --only "${2:-moe,moesweep,invariance}" --out "$OUT" > "$OUT/kernels.log" 2>&1
    grep -E "best|^.{11}moe (bf16|w4a16)|invariance" "$OUT/kernels.log" | tail -40
    exit 0
fi
if [ "${1:-}" = "int" ]; then
    (python3 -c "from kernels.gpu import exl3_cuda; exl3_cuda.extension()" > "$OUT/exl3_build.log" 2>&1) &
    build=$!
    python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_int_moe.py tests/kernels/test_gpu_int_moe.py \
        > "$OUT/gpu_tests_int.log" 2>&1
    grep -E "int3 MoE|passed|failed" "$OUT/gpu_tests_int.log" | tail -8
    python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gpu_moe.py tests/kernels/test_gpu_gemm.py \
        > "$OUT/gpu_tests_kernels.log" 2>&1
    tail -1 "$OUT/gpu_tests_kernels.log"
    python3 -m bench.kernels --only intinv --out "$OUT" > "$OUT/kernels-intinv.log" 2>&1
    grep invariance "$OUT/kernels-intinv.log"
    wait $build
    python3 -m bench.kernels --only intmoe --out "$OUT" > "$OUT/kernels-intmoe.log" 2>&1
    grep -E "^.{11}(moe |int[34] )" "$OUT/kernels-intmoe.log" | tail -40
    python3 -m bench.kernels --only intsweep --out "$OUT" > "$OUT/kernels-intsweep.log" 2>&1
    grep -E "sweep prompt" "$OUT/kernels-intsweep.log" | tail -14
    exit 0
fi
if [ "${1:-}" = "rest" ]; then
    python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fp8_dense_humming.py tests/gpu/test_gemm_prefetch.py \
        tests/gpu/test_gemm_inputs.py tests/gpu/test_int_moe.py > "$OUT/gpu_tests_rest.log" 2>&1
    grep -E "fp8 dense|passed|failed" "$OUT/gpu_tests_rest.log" | tail -6
    for kernel in triton humming; do
        python3 -m bench.decode_prefill --batches 1,8 --prefill 2048 --peer none --random-weights "${2:-int3+fp8}" \
            --rest-fp8-kernel "$kernel" --name "decode_prefill-rest-$kernel" --profile --out "$OUT" \
            > "$OUT/decode_prefill-rest-$kernel.log" 2>&1
        echo "rest fp8 kernel $kernel:"
        grep -E "rest fp8 kernel|median" "$OUT/decode_prefill-rest-$kernel.log" | tail -6
    done
    exit 0
fi
if [ "${1:-}" = "quality" ]; then
    python3 -m bench.quality_formats --device cuda --dims release --layers 4 --experts "${3:-16}" \
        ${2:+--formats "$2"} ${4:+--virtual-shards "$4"} --work /tmp/quality-formats --out "$OUT" \
        > "$OUT/quality_formats.log" 2>&1
    tail -14 "$OUT/quality_formats.log"
    copy_stack_logs
    exit 0
fi
if [ "${1:-}" = "profile" ]; then
    python3 -m bench.whole_model --write-dir /tmp/whole-model-config --layers "${2:-22}" > /dev/null
    TWINSPARK_TORCH_PROFILER_DIR="$OUT/prof" TWINSPARK_PROFILE_ROUNDS="${PROFILE_ROUNDS:-400:40}" python3 -m bench.whole_model \
        --model /tmp/whole-model-config --tp "${4:-1}" --formats "${3:-w4a16+fp8}" --concurrency 1 --out "$OUT" \
        > "$OUT/whole_model.log" 2>&1
    tail -4 "$OUT/whole_model.log"
    python3 -m bench.trace_gaps "$OUT/prof/rank0-rounds.json" --out "$OUT/trace.md" | head -30
    # ~90 MB of JSON; the .xz is ~2 MB, moved beside the tables (prof/ holds more files than a lent machine returns)
    xz -T4 "$OUT/prof/rank0-rounds.json" && mv "$OUT/prof/rank0-rounds.json.xz" "$OUT/"
    exit 0
fi
if [ "${1:-}" = "whole" ]; then
    layers=${2:-45}
    python3 -m bench.whole_model --write-dir /tmp/whole-model-config --layers "$layers" > /dev/null
    python3 -m bench.whole_model --model /tmp/whole-model-config --tp "${3:-2}" --formats "${4:-w4a16+bf16}" \
        --concurrency "${5:-1,8}" ${6:+--prefill "$6"} --out "$OUT" > "$OUT/whole_model.log" 2>&1
    tail -12 "$OUT/whole_model.log"
    # The stacks' own logs (rank: graph captures and their cost; scheduler: round times with TWINSPARK_LOG_LEVEL=debug;
    # the rank profiler's tables with TWINSPARK_TORCH_PROFILER_DIR set) say where a slow level's time went.
    copy_stack_logs
    exit 0
fi

python3 -m pytest -q -s -rA -p no:cacheprovider tests/gpu tests/kernels > "$OUT/gpu_tests.log" 2>&1
grep -E "identical|inter-token|passed|failed" "$OUT/gpu_tests.log" | tail -8
[ "${1:-}" = "tests" ] && exit 0

python3 -m bench.decode_prefill --out "$OUT" --iters 10 --peer-iters 5 > "$OUT/decode_prefill.log" 2>&1
grep -E "median|peer" "$OUT/decode_prefill.log" | tail -12
python3 -m bench.kernels --only gemm,moe,kda,mla,mhc,invariance --out "$OUT" > "$OUT/kernels.log" 2>&1
tail -3 "$OUT/kernels.log"
if [ -n "${MODEL:-}" ]; then  # a checkpoint directory on the machine (the tiny default is too small to time)
    TWINSPARK_DEVICE=cuda TWINSPARK_DRAFTER=none \
        python3 -m bench.serve --tp "${TP:-1}" --model "$MODEL" --concurrency 1,4,16,64 --out "$OUT" \
        > "$OUT/serve.log" 2>&1
    tail -8 "$OUT/serve.log"
else
    echo "served bench skipped: set MODEL to a checkpoint directory"
fi
