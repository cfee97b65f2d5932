#!/usr/bin/env bash
# 2 x H200, session 8 (2026-11-23 afternoon): the whole Flash model's stream step after
# decode.read_tokens moved to pinned host memory (6 layers: every CUDA graph of the step
# stopped re-recording; benchmarks/results/session10_x2/). Last measured: 39.94 ms/step
# (benchmarks/results/session9_x2/flash43_x2_stream.log).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 DSV4_COMPILE_CACHE=off
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
case "${PART:-1}" in
1)  # whole model, B=1, the stream step (what Engine.stream runs)
  T 560 python3 -m benchmarks.decode_bench decode --preset flash --context 4096 --steps 30 \
    --devices 2 --expert 2 --matmul pallas --kernels on --batch ${BATCH:-1} --what stream \
    | tee $OUT/flash43_x2_stream_pinned.log | grep -E "drawn|matmul=|\|" ;;
esac
true
