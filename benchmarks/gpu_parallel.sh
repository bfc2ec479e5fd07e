#!/usr/bin/env bash
# Issue 41's GPU check, for a lent machine with two or more GPUs (device tool): tensor- and
# pipeline-parallel workers on NCCL (two ranks on cuda:0 and cuda:1, the all-reduce inside
# each rank's CUDA graphs) against one process, decode tokens/s at batch 1 and 32 on the
# `small` preset in bf16; then `lamina up --tensor-parallel-size 2` answering the OpenAI
# client. Everything it prints lands in $OUT. On a machine with one GPU it says so and stops.
#
# Prepare here:  make gpu-wheels.  Run with the device tool: command
# "bash benchmarks/gpu_parallel.sh", carry [".whl"], timeout_s 420.
set -uo pipefail
source benchmarks/gpu_env.sh
nvidia-smi > "$OUT/machine.txt" 2>&1
gpus=$(nvidia-smi --list-gpus | wc -l)
if [ "$gpus" -lt 2 ]; then
    echo "$gpus GPU(s): tensor parallelism across GPUs needs two; nothing run" | tee "$OUT/parallel.log"
    exit 0
fi

timeout 200 python3 benchmarks/parallel.py --device cuda --dtype bfloat16 --no-memory --runs 3 \
    2>&1 | tee "$OUT/parallel.log"

small=$(python3 -m lamina.services.cli model init --preset small)
python3 -m lamina.services.cli up --device cuda --dtype bfloat16 --model "$small" \
    --tensor-parallel-size 2 --http-port 18000 --metrics-port 19400 > "$OUT/up.log" 2>&1 &
up=$!
timeout 150 python3 benchmarks/openai_client_check.py --base-url http://127.0.0.1:18000/v1 \
    --wait 120 2>&1 | tee "$OUT/openai.log"
kill -INT "$up"
timeout 60 tail --pid="$up" -f /dev/null || kill -KILL "$up"
