#!/usr/bin/env bash
# H100, prepared for the next session: (1) every kernel on vs pure JAX at B = 8 (4 Flash
# layers; it ran out of time in session 5); (2) the 4-layer bench at B = 32 (tokens/s scaling
# with batch on the kernel path, never measured); (3) issue 5's 128K attention cases
# (`attention_decode.py --skip 7 --trusted ws-lane` resumes where the helper's run stopped).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
T 170 python3 benchmarks/decode_kernels_check.py --preset flash --layers 4 --matmul pallas \
  --random-cache --context 4096 --batch 8 --steps 3 | tee $OUT/check_flash4_b8.log
T 170 python3 -m benchmarks.decode_bench decode --preset flash --layers 4 --context 4096 \
  --steps 20 --kernels on --matmul pallas --batch 32 | tee $OUT/bench4_b32.log
T 200 python3 benchmarks/attention_decode.py --out $OUT --skip 7 --trusted ws-lane \
  | tail -30 | tee $OUT/attention_128k.log
true
