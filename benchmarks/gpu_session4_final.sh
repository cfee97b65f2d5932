#!/usr/bin/env bash
# H100, session 4, last run: GPU tests of the matmul and Sinkhorn kernels; four full-width
# Flash layers + head with every kernel on (step, pipelined, generate loop; B = 1, 8); logits
# with the kernels vs the pure-JAX step; profile + optimised HLO of the 3-kind step.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
T 90 python3 -m pytest -q -p no:warnings tests/test_hc_sinkhorn.py tests/test_quant_matmul.py \
  -k gpu | tail -2 | tee $OUT/tests_gpu.log
T 200 python3 -m benchmarks.decode_bench decode --preset flash --layers 4 --context 4096 \
  --steps 20 --kernels on --matmul pallas --batch 1 8 --loop | tee $OUT/bench4_final.log
T 120 python3 benchmarks/decode_kernels_check.py --preset flash --layers 4 --batch 8 \
  --context 4096 --steps 4 --random-cache --kernels on --matmul pallas | tee $OUT/check4_final.log
T 100 python3 benchmarks/step_anatomy.py --ratios 0 4 128 --matmul pallas --kernels on \
  --profile --top 30 --hlo-out $OUT/step3_final.hlo | tee $OUT/profile3_final.log
gzip -f $OUT/*.hlo 2>/dev/null
true
