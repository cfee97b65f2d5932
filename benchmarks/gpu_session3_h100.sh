#!/usr/bin/env bash
# H100: kernel anatomy of a decode step, the weight-streaming matmuls inside the model
# (logits vs the pure-XLA step), and 4 full-width Flash layers vs the bandwidth floor.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
T() { timeout "$@" 2>&1 | grep -v -i warn; }
T 100 python3 benchmarks/step_anatomy.py --ratios 0 --sinkhorn --top 30 | tee $OUT/anatomy.log
T 240 python3 benchmarks/decode_kernels_check.py --preset flash --layers 4 --batch 8 --context 4096 --steps 4 --random-cache --kernels off --matmul pallas --act-quant on off | tee $OUT/flash_check.log
T 260 python3 -m benchmarks.decode_bench decode --preset flash --layers 4 --batch 1 8 32 --context 4096 --steps 10 --kernels off --matmul xla pallas | tee $OUT/bench4.log
