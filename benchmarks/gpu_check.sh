#!/usr/bin/env bash
# The GPU checks as one script for a lent H200 (device tool), within a few minutes: the
# kernel tests natively on CUDA (the quantized linears among them), the engine's greedy
# equality across backends (cache dtypes, quantized weights) and with CUDA graphs on and
# off, one host sync per step, then benchmarks/kernels.py (attention, the quantized
# linears, engine decode), then the quantized linears' launch sweep. Everything it prints
# lands in $OUT.
#
# Prepare here (what the device lacks, in .whl/: see benchmarks/gpu_env.sh):  make gpu-wheels
# Then run with the device tool:  command "bash benchmarks/gpu_check.sh", carry [".whl"],
#                                 timeout_s 600 (its timeouts add up to 530 s; the two GPU
#                                 scripts do not both fit one session's device time).
set -uo pipefail
source benchmarks/gpu_env.sh

{ nvidia-smi; python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)'; } \
    > "$OUT/machine.txt" 2>&1
# Left out: the native CPU kernels' tests (the device may have no C++ compiler) and the
# sm_90 compile-only test (the native run compiles everything anyway). pytest-xdist
# spreads the Triton compilations over the device's 16 cores.
timeout 170 python3 -m pytest -q -p no:cacheprovider -n 8 --timeout 150 --durations=10 \
    tests/kernel --ignore=tests/kernel/test_cpu_kernels.py \
    --ignore=tests/kernel/test_triton_compile.py tests/engine/test_gpu_sync.py \
    tests/engine/test_cuda_graphs.py::test_recorded_graphs_match_eager_on_cuda \
    2>&1 | tee "$OUT/kernel-tests.log"
timeout 300 python3 benchmarks/kernels.py --peak-gbs 4800 --contexts 1024 8192 32768 \
    2>&1 | tee "$OUT/kernels-bench.log"
# Last, and cut short if the time is up (it prints case by case): the quantized linears'
# launch sweep, whose best configurations become kernels/triton/quant_linear.py's defaults.
timeout 60 python3 benchmarks/kernels.py --parts linear-sweep 2>&1 | tee "$OUT/linear-sweep.log"
