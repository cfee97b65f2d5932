#!/usr/bin/env bash
# H100, prepared in session 6 (no device time was left then). First the launch question:
# the decode step's host time sits in cuGraphLaunch at ~3-4.5 us per kernel (1 SWA layer:
# 393 us for 140 kernels; whole Flash on 2 x H200: 19.3 ms for ~4300). Is that the CUDA
# graph being updated because the logits output gets a new address each step (XLA updates a
# command buffer whose buffers moved), or the launch itself?
#  (1) benchmarks/graph_launch.py: N-kernel chains, fresh vs donated output, under the
#      default, --xla_gpu_command_buffer_update_mode=SKIP_PROFILED (XLA VA-remaps the
#      buffers that move, so the graph is never updated) and graphs off;
#  (2) 4 Flash layers B=1 (step_anatomy): default vs --donate-logits vs SKIP_PROFILED;
#  (3) what gpu_session6_h100.sh had queued (kernels-on check B=8, bench B=32, 128K attention).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
SKIP=--xla_gpu_command_buffer_update_mode=SKIP_PROFILED
# (0) session 6's kernel change, first on the GPU: no group-id operand (expert_G=None) and
#     only the real rows returned (rows=); then every GPU test of the matmul kernel
T 150 python3 -m pytest -q -p no:warnings -m gpu tests/test_quant_matmul.py \
  | tail -5 | tee $OUT/tests_gpu_quant_matmul.log
T 60 python3 benchmarks/graph_launch.py | tee $OUT/graph_launch_default.log
XLA_FLAGS=$SKIP T 60 python3 benchmarks/graph_launch.py | tee $OUT/graph_launch_skip_profiled.log
XLA_FLAGS=--xla_gpu_enable_command_buffer= T 60 python3 benchmarks/graph_launch.py --n 64 256 \
  | tee $OUT/graph_launch_no_graphs.log
A="--preset flash --layers 4 --kernels on --matmul pallas --batch 1 --context 4096 --top 5"
T 150 python3 benchmarks/step_anatomy.py $A | tee $OUT/anatomy4_default.log
T 100 python3 benchmarks/step_anatomy.py $A --donate-logits | tee $OUT/anatomy4_donated.log
XLA_FLAGS=$SKIP T 100 python3 benchmarks/step_anatomy.py $A | tee $OUT/anatomy4_skip_profiled.log
[ "${MORE:-1}" = 1 ] && bash benchmarks/gpu_session6_h100.sh
true
