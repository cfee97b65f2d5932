#!/usr/bin/env bash
# 2 x H200: the cache kernels under the expert mesh (new this session). (1) correctness: the
# sharded step with every kernel on vs the single-device pure-JAX step (tiny preset, then 4
# full-width Flash layers on a random 4K cache); (2) the whole Flash model (43 layers +
# head) decoding with the kernels on, B = 1 and 8, sync and pipelined; the step programs now
# compile with concurrent CUDA-graph regions (decode.STEP_COMPILER_OPTIONS).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.97
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
T 150 python3 benchmarks/decode_kernels_check.py --preset tiny --devices 2 --expert 2 \
  --matmul pallas --steps 3 | tee $OUT/check_tiny_x2.log
T 200 python3 benchmarks/decode_kernels_check.py --preset flash --layers 4 --devices 2 \
  --expert 2 --matmul pallas --random-cache --context 4096 --batch 1 --steps 2 \
  | tee $OUT/check_flash4_x2.log
T ${LIMIT:-420} python3 -m benchmarks.decode_bench decode --preset flash --context 4096 \
  --steps 8 --devices 2 --expert 2 --matmul pallas --kernels on --batch 1 8 \
  | tee $OUT/flash43_x2_kernels.log
true
