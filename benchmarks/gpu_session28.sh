#!/usr/bin/env bash
# Queued in session 27 (2026-11-27) for the next session's device calls, one PART each, on
# an H100 (kind nvidia-h100-x1), output in $OUT; each PART's timeouts sum to <= 600 s.
# 1: the indexer scoring two chunks a loop iteration (chunks_per_step=2: one barrier, TMA
#    issue, wait and block-table prefetch a pair; compile-only 357 instead of 381 loop
#    instructions a chunk in warp 0, 315 instead of 331 in warps 1-3, 113 registers, 40 KB
#    of SMEM a CTA), its GPU test; the keys through SMEM (kreg off: an SS wgmma instead of
#    the register-A one, which may be the 0.76 dispatch stalls of session 27's Nsight
#    Compute run); the dequant's share (DSV4_IDX_ABLATE=nodeq, timing only);
# 2: attention shapes not yet timed at 128K (Pro CSA B=32) and qk_split there.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 DSV4_COMPILE_CACHE=off
T() { timeout -s KILL "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
case "${PART:-1}" in
1)
  T 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer_decode.py \
    -k "two_chunks" -rA | tee $OUT/gpu_tests.log | grep -E "passed|failed|FAILED|Error"
  V=fp4:place:0:2:0:1:w:0,fp4:place:0:2:0:1:w:0:2,nvfp4:place:0:2:0:1:w:0
  V=$V,nvfp4:place:0:2:0:1:w:0:2,fp8:bits:0:2:0:1:w:0,fp8:bits:0:2:0:1:w:0:2
  T 200 python3 benchmarks/indexer_probe.py sweep --cases 64:131072,32:131072,8:131072 \
    --variants $V --rounds 3 --out $OUT | tee $OUT/sweep_g2.log | grep "^|"
  V=fp4:place:0:2:0:1:w:0,fp4:place:0:2:0:0:a,fp4:place:0:2:1:0:a
  V=$V,nvfp4:place:0:2:0:1:w:0,nvfp4:place:0:2:0:0:a,nvfp4:place:0:2:1:0:a
  T 150 python3 benchmarks/indexer_probe.py sweep --cases 64:131072,8:131072 \
    --variants $V --rounds 2 --out $OUT | tee $OUT/sweep.log | grep "^|"
  for a in nodeq; do
    echo "== DSV4_IDX_ABLATE=$a"
    DSV4_IDX_ABLATE=$a T 80 python3 benchmarks/indexer_probe.py sweep --cases 64:131072 \
      --variants fp4:place:0:2:0:1:w:0,nvfp4:place:0:2:0:1:w:0 --rounds 2 --out $OUT \
      | tee -a $OUT/ablate.log | grep "^| 64"
  done ;;
2)
  T 250 python3 benchmarks/attn_probe.py --cases flash:csa:64:131072,pro:csa:32:131072 \
    --variants cpasync+idp,cpasync+idp+qks,xla --rounds 2 | tee $OUT/attn.log | grep "^|" ;;
3)
  # session 28: two chunks a loop iteration is now the default (fp4 / nvfp4; fp8 below 16
  # chunks a CTA): every indexer GPU test with it; four and eight chunks a step against two
  T 260 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer_decode.py \
    -rA | tee $OUT/gpu_tests.log | grep -E "passed|failed|FAILED|Error"
  V=fp4:place:0:2:0:1:w:0:2,fp4:place:0:2:0:1:w:0:4,fp4:place:0:2:0:1:w:0:8
  V=$V,nvfp4:place:0:2:0:1:w:0:2,nvfp4:place:0:2:0:1:w:0:4
  T 200 python3 benchmarks/indexer_probe.py sweep --cases 64:131072,32:131072,8:131072 \
    --variants $V --rounds 3 --out $OUT | tee $OUT/sweep_g4.log | grep "^|" ;;
4)
  # the decode check and the stream step with session 28's indexer default
  T 200 python3 benchmarks/decode_kernels_check.py --preset flash --layers 4 --random-cache \
    --matmul pallas --batch 32 --context 131072 --steps 3 --index-format fp4 \
    | tee $OUT/check_b32_fp4.log | grep -E "median|Error"
  BENCH="-m benchmarks.decode_bench decode --preset flash --layers 4 --kernels on --matmul pallas --what stream"
  T 120 python3 $BENCH --batch 64 --context 131072 --steps 10 | tee $OUT/b64.log \
    | grep -E "stream step" | head -1 ;;
5)
  # on top of two chunks a step: the head weights re-read a chunk (fewer registers, 5
  # CTAs an SM), 32 chunks a CTA (fewer waves' tails), a 3-slot ring
  V=fp4:place:0:2:0:1:w:0:2,fp4:place:0:2:0:1:w:1:2,fp4:place:32:2:0:1:w:0:2
  V=$V,fp4:place:0:3:0:1:w:0:2,nvfp4:place:0:2:0:1:w:0:2,nvfp4:place:0:2:0:1:w:1:2
  V=$V,nvfp4:place:32:2:0:1:w:0:2
  T 300 python3 benchmarks/indexer_probe.py sweep --cases 64:131072,32:131072,8:131072 \
    --variants $V --rounds 3 --out $OUT | tee $OUT/sweep_g2x.log | grep "^|" ;;
6)
  # attention with two K tiles (double_k: block i+1's dequant under block i's scores):
  # its GPU test (bit-identical to the cpasync kernel), then timed against it and XLA
  T 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sparse_decode_attention.py \
    -k "double_k or cpasync_pool" -rA | tee $OUT/gpu_tests.log | grep -E "passed|failed|FAILED|Error"
  T 200 python3 benchmarks/attn_probe.py --cases flash:csa:64:131072,pro:csa:32:131072,flash:csa:8:131072 \
    --variants cpasync+idp,cpasync+idp:DSV4_ATTN_DOUBLE_K=1,xla --rounds 2 | tee $OUT/attn_csa.log | grep "^|"
  T 160 python3 benchmarks/attn_probe.py --cases flash:hca:64:131072,pro:hca:32:131072 \
    --variants cpasync+hid,cpasync+hid:DSV4_ATTN_DOUBLE_K=1 --rounds 2 | tee $OUT/attn_hca.log | grep "^|" ;;
7)
  # the 4-layer stream step at B = 64, 128K with double_k off / on
  BENCH="-m benchmarks.decode_bench decode --preset flash --layers 4 --kernels on --matmul pallas --what stream"
  for dk in 0 1; do
    DSV4_ATTN_DOUBLE_K=$dk T 140 python3 $BENCH --batch 64 --context 131072 --steps 10 \
      | tee $OUT/b64_dk$dk.log | grep -E "stream step" | head -1
  done ;;
8)
  # double_k's next dequant under the scores (qk) or under P V (pv): GPU test, then timed
  T 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sparse_decode_attention.py \
    -k "double_k" -rA | tee $OUT/gpu_tests.log | grep -E "passed|failed|FAILED|Error"
  V=cpasync+idp,cpasync+idp:DSV4_ATTN_DOUBLE_K=1,cpasync+idp:DSV4_ATTN_DOUBLE_K=1:DSV4_ATTN_DK_AT=pv
  T 220 python3 benchmarks/attn_probe.py --cases flash:csa:64:131072,pro:csa:32:131072,flash:csa:8:131072 \
    --variants $V --rounds 2 | tee $OUT/attn_csa.log | grep "^|" ;;
esac
