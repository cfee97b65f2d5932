#!/usr/bin/env bash
# H100: 4 full-width Flash layers with the weight-streaming kernels (compile time after the
# kernel dedup, B = 1 / 8 / 32), and launch overhead vs XLA command-buffer settings.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
T() { timeout "$@" 2>&1 | grep -v -i warn; }
B="python3 -m benchmarks.decode_bench decode --preset flash --layers 4 --context 4096 --steps 10 --kernels off"
T 200 $B --batch 1 8 32 --matmul pallas | tee $OUT/bench4_pallas.log
XLA_FLAGS=--xla_gpu_enable_command_buffer= T 80 $B --batch 1 --matmul pallas | tee $OUT/bench4_nocmdbuf.log
XLA_FLAGS=--xla_gpu_graph_min_graph_size=1 T 80 $B --batch 1 --matmul pallas | tee $OUT/bench4_graph1.log
