#!/usr/bin/env bash
# The sampling (and, with 2 GPUs or more, sharding) benches on a GPU machine (the device tool's H200, or a cluster node), in under 10 minutes: the torch
# sampler on CUDA over 4 adapters against the bare base (bench_sampling.py; its vLLM half where .venv-vllm holds the
# GPU build), the MoE experts' grouped GEMMs against the eager loop (bench_experts.py), then the RL loop of 1, 4 and 8 SDK clients on the torch sampler and on vLLM (bench_rl.py, SmolLM2),
# where this machine has lilo's whole environment. Each JSON line goes to stdout and to $OUT (when set); a part
# this machine cannot run says why and the rest goes on.
#
#   bash benchmarks/gpu_check.sh            # from the checkout, with .venv (and .venv-vllm) made by make
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/lilo-gpu-check}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || { echo "no NVIDIA GPU here"; exit 1; }

run() {  # run NAME SECONDS COMMAND...: one bench, its JSON line kept, its failure reported
    local name=$1 seconds=$2; shift 2
    echo "== $name (at most ${seconds} s)"
    if timeout "$seconds" "$@" > "$OUT/$name.json" 2> "$OUT/$name.err"; then
        cat "$OUT/$name.json"
    else
        echo "$name did not finish (exit $?); the end of its output:"; tail -5 "$OUT/$name.err"
    fi
}

run sampling 240 "$PYTHON" benchmarks/bench_sampling.py --device cuda --runs 3
# MoE experts with 8 adapters at Qwen3-30B-A3B's layer shape in bf16: the grouped GEMMs against the eager loop, and
# whether they agree (bench_experts.py).
run experts 90 "$PYTHON" benchmarks/bench_experts.py --device cuda
# A trainer sharded over the GPUs (bench_sharded.py): 1 rank against 2 and 4 where the machine has them, of the
# model in $LILO_SHARDED_MODEL (an 8B-class directory, where one is on disk) or SmolLM2.
GPUS=$(nvidia-smi --list-gpus | wc -l)
if [ "$GPUS" -ge 2 ] && "$PYTHON" -c "import ray, tinker, fastapi" 2> /dev/null; then
    SPLITS=1,2; [ "$GPUS" -ge 4 ] && SPLITS=1,2,4
    (cd benchmarks && run sharded 300 "../$PYTHON" bench_sharded.py --device cuda --ranks "$SPLITS" \
        --model "${LILO_SHARDED_MODEL:-smollm2}" --rows 8 --seq 512)
else
    echo "== sharded skipped: it needs 2 GPUs or more (this machine has $GPUS) and lilo's service environment"
fi
if "$PYTHON" -c "import ray, tinker, fastapi" 2> /dev/null; then
    (cd benchmarks && run rl 240 "../$PYTHON" bench_rl.py --model smollm2 --clients 1,4,8 --steps 2 --max-tokens 64)
else
    echo "== rl skipped: $PYTHON lacks lilo's service environment (ray, tinker, fastapi); make .venv/.installed first"
fi
