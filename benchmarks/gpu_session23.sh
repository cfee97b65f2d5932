#!/usr/bin/env bash
# Session 23 (2026-11-26): the device calls as run, one PART each (on an H100, kind
# nvidia-h100-x1); output in benchmarks/results/session23_h100/runN, results in
# BENCHMARKS.md ("2026-11-26, session 23").
# PART=1: the indexer's barriers="warp" (manual barriers, and the chunk loop's TMA issue
#   in warp 0 only: fp4 loop 412 -> 393 SASS instructions in warp 0, 347 in warps 1-3).
#   Indexer GPU tests (warp bit-identical to manual and auto), the sweep manual vs warp
#   at B = 64 / 8, 128K and B = 1, 32K, the decode check (kernels vs pure JAX).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 DSV4_COMPILE_CACHE=off
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
case "${PART:-1}" in
1)
  T 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer_decode.py -rA \
    | tee $OUT/gpu_tests.log | grep -E "passed|failed|FAILED|Error"
  V=fp4:lutbf:0:2:0:1:m,fp4:lutbf:0:2:0:1:w,nvfp4:lutbf:0:2:0:1:m,nvfp4:lutbf:0:2:0:1:w
  V=$V,fp8:bits:0:2:0:1:m,fp8:bits:0:2:0:1:w
  T 200 python3 benchmarks/indexer_probe.py sweep --cases 64:131072,8:131072,1:32768 --variants $V \
    --out $OUT | tee $OUT/idx_h100.log | grep -v "^{"
  T 180 python3 benchmarks/decode_kernels_check.py --preset flash --layers 4 --random-cache \
    --matmul pallas --batch 1 8 --context 32768 --steps 3 | tee $OUT/check.log | grep -E "median" ;;
esac
