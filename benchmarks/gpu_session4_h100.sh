#!/usr/bin/env bash
# H100: where the time of a full-width Flash step goes, per source op (GPU kernel time from a
# profiler trace against the wall time), B = 1 and 8, XLA attention and the cache kernels.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i warn; }
A="python3 benchmarks/step_anatomy.py --ratios 0 4 128 --matmul pallas --profile --top 40"
T ${T1:-300} $A --batch 1 --kernels on | tee $OUT/profile_b1_kernels.log
[ -n "${MORE:-}" ] && T 200 $A --batch 8 --kernels on | tee $OUT/profile_b8_kernels.log
true
