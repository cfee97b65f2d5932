#!/usr/bin/env bash
# 2 x H200, session 6: the whole Flash model (43 layers + head, synthetic weights), expert
# parallel, every kernel on, B=1, 4K, one process per GPU (benchmarks/launch_local.sh: each
# process launches only its GPU's step; the single-process step was host bound, 19.3 ms of
# host enqueue for 11.5 ms of GPU work). --what step: sync, pipelined, pipelined with fixed
# inputs (one compilation: the whole model compiles for ~6 min). If the two-process run
# fails early, the same bench runs in one process.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.97
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
ARGS="decode --preset flash --context 4096 --steps 8 --devices 2 --expert 2 --matmul pallas --kernels on --batch 1 --what step"
t0=$(date +%s)
LOGDIR=$OUT T ${LIMIT:-560} bash benchmarks/launch_local.sh 2 python3 -m benchmarks.decode_bench \
  $ARGS | tee $OUT/flash43_x2_two_processes.log
if ! grep -q "pipelined" $OUT/flash43_x2_two_processes.log && [ $(( $(date +%s) - t0 )) -lt 120 ]; then
  echo "two-process run failed after $(( $(date +%s) - t0 )) s; one process:"
  T 450 python3 -m benchmarks.decode_bench $ARGS | tee $OUT/flash43_x2_one_process.log
fi
true
