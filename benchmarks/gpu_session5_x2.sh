#!/usr/bin/env bash
# 2 x H200, prepared for the next session: where the whole Flash model's step goes per GPU
# (device 0's kernels from a profiler trace, host launch, optimised HLO), B = 1, experts split
# over the two GPUs. A layer costs ~0.40 ms here against ~0.33 ms on one H100 (session 4).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.97
timeout ${LIMIT:-420} python3 benchmarks/step_anatomy.py --preset flash --layers 43 \
  --devices 2 --expert 2 --matmul pallas --context 4096 --profile --top 40 \
  --hlo-out $OUT/flash43_x2.hlo 2>&1 | grep -v -i "warn" | tee $OUT/profile_flash43_x2.log
gzip -f $OUT/*.hlo 2>/dev/null
true
