#!/usr/bin/env bash
# H100, session 4: (1) the mHC Sinkhorn kernel's GPU test; (2) one full-width SWA layer +
# head with the matmul + cache kernels, B = 1: profile (kernel time vs host launch), then
# step / pipelined / generate-loop timings, with default XLA flags and with while loops
# inside CUDA graphs.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i warn; }
T 60 python3 -m pytest -q -x tests/test_hc_sinkhorn.py | tail -3 | tee $OUT/test_hc_sinkhorn.log
T 120 python3 benchmarks/step_anatomy.py --ratios 0 --matmul pallas --kernels on --profile \
  --top 12 | tee $OUT/profile_swa.log
B="python3 -m benchmarks.decode_bench decode --preset flash --layers 1 --context 4096 --steps 20 --kernels on --matmul pallas --loop"
T 170 $B --batch 1 8 | tee $OUT/bench1_default.log
XLA_FLAGS=--xla_gpu_enable_command_buffer=+while,+conditional T 150 $B --batch 1 \
  | tee $OUT/bench1_while_graph.log
true
