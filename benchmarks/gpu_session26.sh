#!/usr/bin/env bash
# Queued in session 26 (2026-11-27) for the next session's device calls, one PART each, on
# an H100 (kind nvidia-h100-x1), output in $OUT; each PART's timeouts sum to <= 600 s.
# 1: GPU tests of the new defaults (indexer: 16 chunks a CTA for fp4 keys at B >= 32;
#    experts: the FP4 "place" program) and the steps with them; 2: the measurements that
#    did not finish in session 26 and nvfp4 keys at 16 chunks a CTA.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 DSV4_COMPILE_CACHE=off
T() { timeout -s KILL "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
BENCH="-m benchmarks.decode_bench decode --preset flash --layers 4 --kernels on --matmul pallas --what stream"
case "${PART:-1}" in
1)
  T 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer_decode.py \
    tests/test_quant_matmul.py -rA | tee $OUT/gpu_tests.log | grep -E "passed|failed|FAILED|Error"
  # the decode check (4 Flash layers, random cache, kernels vs pure JAX) at B = 32: the
  # first batch where the indexer takes 16 chunks a CTA (128K tables)
  T 200 python3 benchmarks/decode_kernels_check.py --preset flash --layers 4 --random-cache \
    --matmul pallas --batch 32 --context 131072 --steps 3 | tee $OUT/check_b32.log | grep -E "median"
  T 120 python3 $BENCH --batch 64 --context 131072 --steps 10 | tee $OUT/b64.log \
    | grep -E "stream step" | head -1
  T 100 python3 $BENCH --batch 1 --context 131072 --steps 20 | tee $OUT/b1.log \
    | grep -E "stream step" | head -1 ;;
2)
  # attention at 128K against XLA (session 26 ran out of time on these two)
  T 200 python3 benchmarks/attn_probe.py --cases pro:hca:32:131072,pro:csa:8:131072 \
    --variants cpasync+hid,xla --rounds 2 | tee $OUT/attn.log | grep "^|"
  # nvfp4 (and fp8) keys at 16 chunks a CTA (fp4 gained 2.4-4% at B >= 32 in session 26)
  V=nvfp4:place:0:2:0:1:w:0,nvfp4:place:16:2:0:1:w:0,fp8:bits:0:2:0:1:w:0,fp8:bits:16:2:0:1:w:0
  T 200 python3 benchmarks/indexer_probe.py sweep --cases 64:131072,32:131072 \
    --variants $V --out $OUT | tee $OUT/idx.log | grep -v "^{" ;;
esac
