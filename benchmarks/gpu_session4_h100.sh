#!/usr/bin/env bash
# H100: where the time of a full-width Flash step goes, per source op (GPU kernel time from a
# profiler trace, idle gaps between kernels, host events), B = 1, with the cache kernels.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i warn; }
A="python3 benchmarks/step_anatomy.py --ratios 0 4 128 --matmul pallas --profile --top 30"
T ${T1:-300} $A --batch 1 --kernels on --hlo-out $OUT/step_b1_kernels.hlo | tee $OUT/profile_b1_kernels.log
gzip $OUT/*.hlo
true
