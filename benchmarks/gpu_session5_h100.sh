#!/usr/bin/env bash
# H100, prepared for the next session: (1) GPU tests of the matmul kernels incl. the untested
# reg_a variant (dequantised rows into the wgmma from registers); (2) reg_a off/on at the
# Flash shapes (kernel time, % of copy bandwidth); (3) four Flash layers + head pipelined
# with reg_a off and on (DSV4_REG_A), every kernel on; the Sinkhorn kernel against the XLA
# forms in device time.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
T 120 python3 -m pytest -q -p no:warnings tests/test_quant_matmul.py tests/test_hc_sinkhorn.py \
  -k gpu | tail -3 | tee $OUT/tests_gpu.log
T 100 python3 benchmarks/step_anatomy.py --preset tiny --ratios 0 --sinkhorn --top 1 \
  | grep sinkhorn | tee $OUT/sinkhorn_forms.log
T 200 python3 benchmarks/quant_matmul.py --out $OUT --sweep --sweep-only --reg-a-ab --budget 150 \
  | tail -20 | tee $OUT/reg_a_ab.log
B="python3 -m benchmarks.decode_bench decode --preset flash --layers 4 --context 4096 --steps 20 --kernels on --matmul pallas --batch 1"
T 120 $B | tee $OUT/bench4_reg_a_off.log
DSV4_REG_A=1 T 120 $B | tee $OUT/bench4_reg_a_on.log
true
