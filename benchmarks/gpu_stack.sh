#!/usr/bin/env bash
# Issue 21's whole-stack checks as one script for a lent H200 (device tool), within a few
# minutes: batch-1 model-bandwidth utilisation with CUDA graphs on the 0.7B `medium` preset
# (made there), `lamina up --device cuda --dtype bfloat16` answering the OpenAI client
# through every hop, and benchmarks/stack_overhead.py with the engine on the GPU on both
# sides. Everything it prints lands in $OUT.
#
# Prepare here (what the device lacks, in .whl/: see benchmarks/gpu_env.sh):  make gpu-wheels
# Then run with the device tool:  command "bash benchmarks/gpu_stack.sh", carry [".whl"],
#                                 timeout_s 600 (its timeouts add up to 540 s; the two GPU
#                                 scripts do not both fit one session's device time).
set -uo pipefail
source benchmarks/gpu_env.sh
nvidia-smi > "$OUT/machine.txt" 2>&1

timeout 150 python3 benchmarks/kernels.py --parts mbu --peak-gbs 4800 2>&1 | tee "$OUT/mbu.log"

small=$(python3 -m lamina.services.cli model init --preset small)
python3 -m lamina.services.cli up --device cuda --dtype bfloat16 --model "$small" \
    --http-port 18000 --metrics-port 19400 > "$OUT/up.log" 2>&1 &
up=$!
timeout 180 python3 benchmarks/openai_client_check.py --base-url http://127.0.0.1:18000/v1 \
    --wait 150 2>&1 | tee "$OUT/openai.log"
kill -INT "$up"  # lamina up stops its services in order; give it a minute, then end it
timeout 60 tail --pid="$up" -f /dev/null || kill -KILL "$up"

timeout 150 python3 benchmarks/stack_overhead.py --device cuda --dtype bfloat16 --runs 3 \
    2>&1 | tee "$OUT/stack-overhead.log"
