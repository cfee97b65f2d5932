#!/usr/bin/env bash
# Next session's GPU proof (two H100 calls, ~6 min each): the indexer scoring kernel's two new
# FP4-key paths (pallas_kernels/indexer_decode, built 2026-11-25 without device time):
#   dequant="e4m3": the nibble re-packed as an e4m3 byte, converted by cvt.rn.f16x2.e4m3x2,
#     scaled in f16 / bf16; in the sm_90a PTX a thread per 64-entry chunk: ~300 integer +
#     ~140 float ops + 128 conversions, against ~810 + ~80 + 64 for "bits"; 92 registers.
#   dequant="fp8mma": the e4m3 bytes straight into SMEM, one e4m3 wgmma per 32-dim group
#     against q as e4m3 groups, scales on the group sums; ~230 integer + ~330 f32 ops, no
#     conversions; 177 registers (2 CTAs an SM instead of 5: watch the latency hiding).
# Run from the repo root: PART=N bash $0
#  PART=1: GPU tests of the indexer (all three dequants); the scoring kernel alone with each
#    at B = 64 / 8 at 128K and B = 1 at 4K (time, GB/s, % of copy bandwidth, vs the XLA
#    path, rel err, top-k overlap).
#  PART=2: 4 Flash layers at B = 64, 128K: the stream step with each dequant.
#  If one passes and wins: make it indexer_scores' and decode.IDX_DEQUANT's default.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 DSV4_COMPILE_CACHE=off
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
case "${PART:-1}" in
1)
  T 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer_decode.py -rA \
    | tee $OUT/gpu_tests.log | grep -E "passed|failed|PASSED|FAILED"
  T 400 python3 benchmarks/indexer_attention.py --out $OUT --dequant bits,e4m3,fp8mma \
    --cases idx:64:131072:512,idx:8:131072:512,idx:1:4096:512 | tee $OUT/indexer.log \
    | grep -E "^\| indexer|bandwidth" ;;
2)
  for dq in bits e4m3 fp8mma; do
    DSV4_IDX_DEQUANT=$dq T 170 python3 -m benchmarks.decode_bench decode --preset flash \
      --layers 4 --batch 64 --context 131072 --kernels on --matmul pallas --what stream \
      --steps 10 | tee $OUT/flash4_b64_128k_dequant_$dq.log | grep -E "floor"
  done ;;
esac
true
