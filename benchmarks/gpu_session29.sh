#!/usr/bin/env bash
# Queued in session 28 (2026-11-27; its device time ran out) for the next session's device
# calls, one PART each, on an H100 (kind nvidia-h100-x1), output in $OUT; each PART's
# timeouts sum to <= 600 s.
# 1: attention double_k's GPU tests (bit-identical to the cpasync kernel; session 28's
#    170 s limit cut them off after the qk / csa case, which passed);
# 2: double_k (next dequant under P V, the default DSV4_ATTN_DK_AT=pv) on the HCA cases
#    and the Flash CSA B=64 case again, against the cpasync kernel;
# 3: the decode check and the B=64 stream step with double_k on: if both hold, make
#    double_k the default (sparse_decode_attention's double_k=None reads
#    $DSV4_ATTN_DOUBLE_K).
# (Parts 1-3 ran in session 29 (2026-11-27): all held, double_k is the default.)
# 4: the indexer's paired accumulators (DSV4_IDX_PAIR=1) against the default, fp4 / nvfp4
#    keys, and their bit-identity test (ran in session 29: bit-identical but 7-27% slower,
#    so the knob was removed again; commit 068ba37 has it and its tests);
# 5: attention against its roofline (max of bytes / HBM ceiling and flops / measured BF16
#    tensor ceiling), double_k (the default now) vs the one-tile kernel vs XLA;
# 6: the attention GPU tests that now run double_k by default (the cpasync edge cases:
#    pool edges and -1 holes, ids past the table, bounds from t, in-kernel HCA ids; the
#    kernel vs the reference), and the in-kernel merge (which falls back to one K tile).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 DSV4_COMPILE_CACHE=off
T() { timeout -s KILL "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
case "${PART:-1}" in
1)
  T 560 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sparse_decode_attention.py \
    -k "double_k" -rA | tee $OUT/gpu_tests.log | grep -E "passed|failed|FAILED|Error" ;;
2)
  V=cpasync+hid,cpasync+hid:DSV4_ATTN_DOUBLE_K=1,cpasync+hid:DSV4_ATTN_DOUBLE_K=1:DSV4_ATTN_DK_AT=qk
  T 250 python3 benchmarks/attn_probe.py --cases flash:hca:64:131072,pro:hca:32:131072,flash:hca:8:131072 \
    --variants $V --rounds 2 | tee $OUT/attn_hca.log | grep "^|"
  T 200 python3 benchmarks/attn_probe.py --cases flash:csa:64:131072,pro:csa:8:131072,flash:csa:1:32768 \
    --variants cpasync+idp,cpasync+idp:DSV4_ATTN_DOUBLE_K=1 --rounds 3 | tee $OUT/attn_csa.log | grep "^|" ;;
3)
  DSV4_ATTN_DOUBLE_K=1 T 200 python3 benchmarks/decode_kernels_check.py --preset flash --layers 4 \
    --random-cache --matmul pallas --batch 32 --context 131072 --steps 3 --index-format fp4 \
    | tee $OUT/check_b32_dk.log | grep -E "median|Error"
  BENCH="-m benchmarks.decode_bench decode --preset flash --layers 4 --kernels on --matmul pallas --what stream"
  for dk in 0 1; do
    DSV4_ATTN_DOUBLE_K=$dk T 140 python3 $BENCH --batch 64 --context 131072 --steps 10 \
      | tee $OUT/b64_dk$dk.log | grep -E "stream step" | head -1
  done ;;
4)
  T 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer_decode.py \
    -k "pair_acc" -rA | tee $OUT/gpu_tests.log | grep -E "passed|failed|FAILED|Error"
  D=place:0:2:0:1:w:0:2
  T 400 python3 benchmarks/indexer_probe.py sweep --cases 64:131072,32:131072,8:131072 \
    --variants fp4:$D,fp4:$D+DSV4_IDX_PAIR=1,nvfp4:$D,nvfp4:$D+DSV4_IDX_PAIR=1 --out $OUT \
    | tee $OUT/idx_pair.log | grep -E "^\||device" ;;
5)
  T 300 python3 benchmarks/attn_probe.py --roofline --rounds 2 \
    --cases flash:csa:64:131072,pro:csa:32:131072,flash:csa:8:131072 \
    --variants cpasync+idp,cpasync+idp:DSV4_ATTN_DOUBLE_K=0,xla | tee $OUT/attn_roof_csa.log
  T 250 python3 benchmarks/attn_probe.py --roofline --rounds 2 \
    --cases flash:hca:64:131072,pro:hca:32:131072 \
    --variants cpasync+hid,cpasync+hid:DSV4_ATTN_DOUBLE_K=0,xla | tee $OUT/attn_roof_hca.log ;;
6)
  T 560 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sparse_decode_attention.py \
    -k "not double_k and not triton" -rA | tee $OUT/gpu_tests.log \
    | grep -E "passed|failed|FAILED|Error" ;;
esac
