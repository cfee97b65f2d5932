#!/usr/bin/env bash
# H100, session 4: four full-width Flash layers (SWA, SWA, CSA, HCA) + head with the matmul
# and cache kernels, B = 1 and 8, 4K context: step (synchronous), pipelined; then a profile
# of the 3-kind step.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
T 60 python3 -m pytest -q -p no:warnings tests/test_hc_sinkhorn.py | tail -2 | tee $OUT/test_hc_sinkhorn.log
T ${T1:-330} python3 -m benchmarks.decode_bench decode --preset flash --layers 4 --context 4096 \
  --steps 20 --kernels on --matmul pallas --batch 1 8 | tee $OUT/bench4_kernels.log
[ -n "${PROF:-}" ] && T 200 python3 benchmarks/step_anatomy.py --ratios 0 4 128 --matmul pallas \
  --kernels on --profile --top 30 | tee $OUT/profile3.log
true
