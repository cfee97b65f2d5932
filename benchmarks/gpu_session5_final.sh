#!/usr/bin/env bash
# H100, last run of session 5: (1) GPU tests of the matmul kernels with the new FP4 'swar-shfl'
# decode default (helper's last edits were not GPU-run) and the Sinkhorn kernel; (2) every
# kernel on vs the pure-JAX step, 4 Flash layers, random 4K cache, B = 1 and 8; (3) the 4-layer
# decode bench B = 1 and 8 (concurrent graph regions on), and B = 1 with them off (A/B).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
T 150 python3 -m pytest -q -p no:warnings tests/test_quant_matmul.py tests/test_hc_sinkhorn.py \
  -k gpu 2>&1 | tail -3 | tee $OUT/tests_gpu.log
T 170 python3 benchmarks/decode_kernels_check.py --preset flash --layers 4 --matmul pallas \
  --random-cache --context 4096 --batch 1 8 --steps 3 | tee $OUT/check_flash4.log
B="python3 -m benchmarks.decode_bench decode --preset flash --layers 4 --context 4096 --steps 20 --kernels on --matmul pallas"
T 170 $B --batch 1 8 | tee $OUT/bench4.log
DSV4_GRAPH_CONCURRENT=0 T 100 $B --batch 1 | tee $OUT/bench4_no_concurrent.log
true
