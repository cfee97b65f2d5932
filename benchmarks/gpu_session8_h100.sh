#!/usr/bin/env bash
# H100, session 6 (2026-11-23). Where a host-bound step's time goes, on 10 Flash layers
# (enough kernels that the host launch matters, as in the whole model), B=1, 4K, kernels on:
#  PART=1: decode_bench --loop: sync step, pipelined (a fresh pos array per step: inputs
#          move), pipelined with every input at one address, the jitted while loop (host
#          drives each iteration); step_anatomy --donate-logits: nothing moves at all
#  PART=2: the while loop as a CUDA graph with conditional nodes (no host per iteration)
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
A="--preset flash --layers 10 --kernels on --matmul pallas --batch 1 --context 4096"
case "${PART:-1}" in
1)
  T 330 python3 -m benchmarks.decode_bench decode $A --steps 20 --loop | tee $OUT/bench10_loop.log
  T 240 python3 benchmarks/step_anatomy.py $A --top 3 --donate-logits | tee $OUT/anatomy10_donated.log ;;
2)
  XLA_FLAGS=--xla_gpu_enable_command_buffer=+while,+conditional T 400 python3 -m \
    benchmarks.decode_bench decode $A --steps 20 --loop | tee $OUT/bench10_while_graph.log ;;
esac
true
