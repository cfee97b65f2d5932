#!/usr/bin/env bash
# H100, prepared in session 5 (no device time was left then). Three calls of the device
# tool (each must fit its 600 s limit): PART=1, PART=2, PART=3.
# The launch question: the decode step's host time sits in cuGraphLaunch at ~3-4.5 us per
# kernel (1 SWA layer: 393 us for 140 kernels; whole Flash on 2 x H200: 19.3 ms for ~4300).
# Is that the CUDA graph being updated because the logits output gets a new address each
# step (XLA updates a command buffer whose buffers moved), or the launch itself?
#  PART=1: the session's matmul-kernel change on the GPU (no group-id operand, real rows
#          only; every GPU test of the kernel), benchmarks/graph_launch.py (N-kernel
#          chains, fresh vs donated output) under the default,
#          --xla_gpu_command_buffer_update_mode=SKIP_PROFILED (XLA VA-remaps the buffers
#          that move, so the graph is never updated) and graphs off; 4 Flash layers B=1
#          (step_anatomy, default: also the effect of the session's kernel cuts, 277 -> 262
#          kernels, against session 4's 1.47 ms pipelined)
#  PART=2: the same 4 layers with --donate-logits and under SKIP_PROFILED
#  PART=3: what gpu_session6_h100.sh had queued (kernels-on check B=8, bench B=32, 128K
#          attention)
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
SKIP=--xla_gpu_command_buffer_update_mode=SKIP_PROFILED
A="--preset flash --layers 4 --kernels on --matmul pallas --batch 1 --context 4096 --top 5"
case "${PART:-1}" in
1)
  T 120 python3 -m pytest -q -p no:warnings -m gpu tests/test_quant_matmul.py \
    | tail -5 | tee $OUT/tests_gpu_quant_matmul.log
  T 50 python3 benchmarks/graph_launch.py | tee $OUT/graph_launch_default.log
  XLA_FLAGS=$SKIP T 50 python3 benchmarks/graph_launch.py | tee $OUT/graph_launch_skip_profiled.log
  XLA_FLAGS=--xla_gpu_enable_command_buffer= T 40 python3 benchmarks/graph_launch.py \
    --n 64 256 | tee $OUT/graph_launch_no_graphs.log
  T 300 python3 benchmarks/step_anatomy.py $A | tee $OUT/anatomy4_default.log ;;
2)
  T 280 python3 benchmarks/step_anatomy.py $A --donate-logits | tee $OUT/anatomy4_donated.log
  XLA_FLAGS=$SKIP T 280 python3 benchmarks/step_anatomy.py $A | tee $OUT/anatomy4_skip_profiled.log ;;
3)
  bash benchmarks/gpu_session6_h100.sh ;;
esac
true
