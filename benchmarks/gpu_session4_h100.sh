#!/usr/bin/env bash
# H100: host launch cost of a decode step. One full-width SWA layer + head, B = 1, with the
# matmul kernels: step time and host enqueue time with CUDA graphs (default) and without.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i warn; }
A="python3 benchmarks/step_anatomy.py --ratios 0 --matmul pallas --top 5"
T 150 $A --profile | tee $OUT/launch_default.log
XLA_FLAGS=--xla_gpu_enable_command_buffer= T 120 $A | tee $OUT/launch_nograph.log
T 120 $A --matmul xla | tee $OUT/launch_xla.log
true
