#!/usr/bin/env bash
# Session 14 (2026-11-25), one H100 call (~9 min). Run from the repo root on the device:
#   bash benchmarks/gpu_session14.sh
# 1. GPU tests of the attention kernel, whose split rule changed (default_splits counts
#    waves). (The routed experts' w1 + w3 merge ran on the H100 last try: merge_check.py.)
# 2. Attention split rule A/B (ws-lane = new rule, ws-lane-v1split = the old one), same run.
# 3. 4 Flash layers, the decode form with the packed compressor state: kernels and step time.
# 4. 4 Flash layers, the stream step at B = 1, 8, 32, 64 (tokens/s against batch).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 DSV4_COMPILE_CACHE=off
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
T 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sparse_decode_attention.py | tee $OUT/gpu_tests.log | tail -4
T 130 python3 benchmarks/attention_decode.py --out $OUT --budget 100 --no-profile \
  --only flash:csa:64:32768,pro:csa:8:32768,flash:csa:32:32768,flash:hca:64:131072 \
  --variants ws-lane,ws-lane-v1split --trusted ws-lane,ws-lane-v1split --all-variants \
  | tee $OUT/attention_split_ab.log | grep "^|"
T 130 python3 benchmarks/step_anatomy.py --preset flash --layers 4 --matmul pallas \
  --kernels on --context 4096 --donate-logits --merge-x-proj --top 8 | tee $OUT/anatomy4.log \
  | grep -E "kernels in the step|^step"
T 170 python3 -m benchmarks.decode_bench decode --preset flash --layers 4 --batch 1 8 32 64 \
  --context 4096 --kernels on --matmul pallas --what stream --steps 20 \
  | tee $OUT/flash4_batch.log | grep -E "\|"
true
