#!/usr/bin/env bash
# Next session's GPU proof (four H100 calls, ~6-9 min each): the indexer scoring kernel's two new
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
#  PART=3: the nvfp4 / fp8 indexer key formats (scoring kernels built 2026-11-25 session 18
#    without device time; nvfp4 stores its scales as two per-half fields): the GPU tests of
#    the scoring and scatter kernels, the scoring kernel alone at the same three shapes, and
#    the decode step with kernels vs pure JAX for each format (tiny preset; 4 Flash layers
#    on a random cache, B = 1 / 8 at 32K).
#  PART=4: the Triton attention's joined form (kernel_triton joined=True, built 2026-11-25
#    session 18 without device time; sm_90a SASS a key block: 3 CTA barriers + 2 wgmma waits
#    instead of 23 + 16, ~28 spilled registers): GPU tests, triton64 vs triton64j at the
#    four benchmark cases, and the 4-layer Flash step at B = 64, 32K with and without it.
#    If it wins: ATTN_JOINED on by default (dsv4_jax/decode.py).
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
3)
  T 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer_decode.py \
    tests/test_kv_scatter.py -k "nvfp4 or fp8 or other_key" -rA | tee $OUT/gpu_tests_formats.log \
    | grep -E "passed|failed|PASSED|FAILED"
  T 200 python3 benchmarks/indexer_attention.py --out $OUT --dequant "" --formats nvfp4,fp8 \
    --cases idx:64:131072:512,idx:8:131072:512,idx:1:4096:512 | tee $OUT/indexer_formats.log \
    | grep -E "^\| indexer|bandwidth"
  for fmt in nvfp4 fp8; do
    T 60 python3 benchmarks/decode_kernels_check.py --preset tiny --batch 2 --context 300 \
      --steps 3 --index-format $fmt | tee $OUT/check_tiny_$fmt.log | grep -E "median"
    T 120 python3 benchmarks/decode_kernels_check.py --preset flash --layers 4 --random-cache \
      --matmul pallas --batch 1 8 --context 32768 --steps 3 --index-format $fmt \
      | tee $OUT/check_flash4_$fmt.log | grep -E "median"
  done ;;
4)
  T 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sparse_decode_attention.py \
    -k triton -rA | tee $OUT/gpu_tests_attn.log | grep -E "passed|failed|PASSED|FAILED"
  T 240 python3 benchmarks/attention_decode.py --out $OUT --budget 200 --all-variants \
    --variants triton64,triton64j --trusted triton64,triton64j \
    --only flash:csa:64:32768,flash:hca:64:131072,pro:csa:32:32768,flash:csa:8:32768 \
    2>&1 | grep -v "^{" | grep -E "smoke|^\| (flash|pro)"
  for j in 0 1; do
    DSV4_ATTN_JOINED=$j T 100 python3 -m benchmarks.decode_bench decode --preset flash \
      --layers 4 --batch 64 --context 32768 --kernels on --matmul pallas --what stream \
      --steps 10 | tee $OUT/flash4_b64_32k_joined_$j.log | grep -E "floor"
  done
  DSV4_ATTN_JOINED=1 T 100 python3 benchmarks/decode_kernels_check.py --preset flash --layers 4 \
    --random-cache --matmul pallas --batch 8 --context 32768 --steps 3 \
    | tee $OUT/check_flash4_joined.log | grep -E "median" ;;
esac
true
