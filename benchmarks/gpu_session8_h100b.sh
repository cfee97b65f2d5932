#!/usr/bin/env bash
# H100, session 6: the stream step (device-resident state, donated: no buffer moves, greedy
# sampling inside; what Engine.stream now runs) against the plain step's pipelined loops,
# 10 Flash layers, B=1 and 8, 4K, kernels on.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
T 560 python3 -m benchmarks.decode_bench decode --preset flash --layers 10 --kernels on \
  --matmul pallas --batch 1 8 --context 4096 --steps 20 | tee $OUT/bench10_stream.log
true
