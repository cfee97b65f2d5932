#!/usr/bin/env bash
# Queued for the next session with device time (session 19 ran out: 78 s left).
# PART=1: "lutbf" (pallas_kernels/indexer_decode, built 2026-11-26 without device time,
#   off by default): the prmt tables give bf16 pairs directly (six prmt per two code bytes),
#   skipping "lut"'s e4m3 -> f16 -> f32 -> bf16 chain (~200 float ops a 64-entry chunk in
#   the H200 SASS). GPU tests (every code bit-identical to "bits"; fp4 and nvfp4), then
#   lut vs lutbf at B = 64 / 8, 128K and B = 1, 32K, both formats. If lutbf wins and is
#   exact: kernel.DEQUANT / NVFP4_DEQUANT = "lutbf", decode.IDX_DEQUANT's default too.
# PART=2: the decode step vs pure JAX with the defaults at B = 8 (session 19's lut checks
#   at B = 8 ran past 120 s), and the 4-layer step at B = 64, 128K.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 DSV4_COMPILE_CACHE=off
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
case "${PART:-1}" in
1)
  T 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer_decode.py -rA \
    | tee $OUT/gpu_tests.log | grep -E "passed|failed|FAILED|Error"
  V=fp4:lut:0:2:0:1,fp4:lutbf:0:2:0:1,nvfp4:lut:0:2:0:1,nvfp4:lutbf:0:2:0:1
  T 200 python3 benchmarks/indexer_probe.py sweep --cases 64:131072,8:131072,1:32768 \
    --variants $V --out $OUT | tee $OUT/sweep.log | grep -v "^{" ;;
2)
  for fmt in fp4 nvfp4; do
    T 240 python3 benchmarks/decode_kernels_check.py --preset flash --layers 4 --random-cache \
      --matmul pallas --batch 1 8 --context 32768 --steps 3 --index-format $fmt \
      | tee $OUT/check_flash4_$fmt.log | grep -E "median"
  done
  T 150 python3 -m benchmarks.decode_bench decode --preset flash --layers 4 --batch 64 \
    --context 131072 --kernels on --matmul pallas --what stream --steps 10 \
    | tee $OUT/flash4_b64_128k.log | grep -E "floor|ceiling" ;;
esac
true
