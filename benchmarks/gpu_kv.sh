#!/usr/bin/env bash
# Issue 42's KV-that-moves measurements as one script for a lent H200 (device tool),
# within a few minutes, the engines in bf16 on the GPU: the lower tiers against none
# (pinned host copies and the disk tier on the stream), a prefix fetched from another
# engine against computing it, disaggregated prefill and decode against mixed (two
# workers sharing the GPU), and a drain that moves (transfer against recompute).
# benchmarks/kv_moves.py --device cuda. Everything it prints lands in $OUT.
#
# Prepare here (what the device lacks, in .whl/: see benchmarks/gpu_env.sh):  make gpu-wheels
# Then run with the device tool:  command "bash benchmarks/gpu_kv.sh", carry [".whl"],
#                                 timeout_s 600 (its timeouts add up to 540 s: it does not
#                                 fit one session's device time with another GPU script).
set -uo pipefail
source benchmarks/gpu_env.sh
nvidia-smi > "$OUT/machine.txt" 2>&1
gpu=(--device cuda --dtype bfloat16)

timeout 120 python3 -u benchmarks/kv_moves.py "${gpu[@]}" --runs 3 2>&1 | tee "$OUT/tier.log"
timeout 90 python3 -u benchmarks/kv_moves.py --part transfer "${gpu[@]}" --runs 3 \
    2>&1 | tee "$OUT/transfer.log"
timeout 150 python3 -u benchmarks/kv_moves.py --part pd "${gpu[@]}" --runs 1 --duration 15 \
    2>&1 | tee "$OUT/pd.log"
timeout 180 python3 -u benchmarks/kv_moves.py --part drain "${gpu[@]}" --contexts 2048 8192 \
    --runs 1 2>&1 | tee "$OUT/drain.log"
