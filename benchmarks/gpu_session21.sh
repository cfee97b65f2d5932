#!/usr/bin/env bash
# Queued for the next session with device time (session 20 ended with 190 s).
# PART=1: the attention kernel's qk_split (pallas_kernels/sparse_decode_attention, built
#   2026-11-26 without device time; interpreter-tested, compiles for sm_90a with no
#   spills; off by default): each consumer warpgroup scores only its 32 keys of a block and
#   the two exchange row maxima, instead of both computing the full 64-key scores. GPU
#   tests, then cpasync vs cpasync+qks vs triton at the session-20 cases. If it is exact
#   and faster: decode.ATTN_QK_SPLIT's default to "1", BENCHMARKS / README.
# PART=2: the 4-layer step with it (B = 64, 128K and B = 8, 32K) and the decode check.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 DSV4_COMPILE_CACHE=off
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
ATT="flash:csa:64:32768,flash:hca:64:131072,pro:csa:32:32768,flash:csa:8:32768,flash:csa:1:32768"
BENCH="-m benchmarks.decode_bench decode --preset flash --layers 4 --kernels on --matmul pallas --what stream"
case "${PART:-1}" in
1)
  T 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sparse_decode_attention.py -rA \
    | tee $OUT/gpu_tests.log | grep -E "passed|failed|FAILED|Error"
  T 380 python3 benchmarks/attn_probe.py --cases $ATT --variants cpasync,cpasync+qks,triton \
    | tee $OUT/probe.log
  # the split rule was tuned for the old kernel: 1-4 key-block splits at B = 64 / 32
  T 200 python3 benchmarks/attn_probe.py --cases flash:csa:64:32768,pro:csa:32:32768 \
    --variants cpasync+s1,cpasync+s2,cpasync+s3,cpasync+s4 | tee $OUT/probe_splits.log ;;
2)
  for qks in 0 1; do DSV4_ATTN_QK_SPLIT=$qks T 170 python3 $BENCH --batch 64 --context 131072 \
    --steps 10 | tee $OUT/b64_qks$qks.log | grep -E "stream step" | head -1; done
  DSV4_ATTN_QK_SPLIT=1 T 240 python3 benchmarks/decode_kernels_check.py --preset flash \
    --layers 4 --random-cache --matmul pallas --batch 1 8 --context 32768 --steps 3 \
    | tee $OUT/check_qks.log | grep -E "median" ;;
esac
true
