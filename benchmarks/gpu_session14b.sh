#!/usr/bin/env bash
# Session 14, second H100 call (~8 min): what the first call's limits cut off.
# 1. 4 Flash layers, the stream step at B = 1, 8, 32, 64 (one process, weights drawn once).
# 2. Attention split rule A/B on one more case (Pro CSA B=8 32K: 6 splits vs 9).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 DSV4_COMPILE_CACHE=off
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
T 430 python3 -m benchmarks.decode_bench decode --preset flash --layers 4 --batch 1 8 32 64 \
  --context 4096 --kernels on --matmul pallas --what stream --steps 20 \
  | tee $OUT/flash4_batch.log | grep -E "floor"
T 100 python3 benchmarks/attention_decode.py --out $OUT --budget 30 --no-profile \
  --only pro:csa:8:32768 --variants ws-lane,ws-lane-v1split \
  --trusted ws-lane,ws-lane-v1split --all-variants | tee $OUT/attention_split_ab.log | grep "^{"
true
