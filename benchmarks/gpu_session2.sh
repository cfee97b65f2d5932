#!/usr/bin/env bash
# Device call 2: full-width Flash layers, kernels vs pure JAX on one random cache, and the
# decode benchmark vs the bandwidth floor. Each command has its own time limit.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
T() { timeout "$@" 2>&1 | grep -v -i warn; }
T 200 python3 benchmarks/decode_kernels_check.py --preset flash --layers 4 --batch 8 --context 4096 --steps 6 --random-cache | tee $OUT/flash_check.log
T 150 python3 -m benchmarks.decode_bench decode --preset flash --layers 4 --batch 1 32 --context 4096 --steps 10 --kernels on | tee $OUT/bench_on.log
T 150 python3 -m benchmarks.decode_bench decode --preset flash --layers 4 --batch 1 32 --context 4096 --steps 10 --kernels off | tee $OUT/bench_off.log
