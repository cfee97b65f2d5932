#!/usr/bin/env bash
# Next session's GPU proof of session 14's kernel-count work (all of it compile-only so far:
# 4 Flash layers 266 -> 222 kernels): the mHC comb kernel (hc_sinkhorn.mhc_comb, one
# variadic reduction before it) and the (collapse +) norm + FP8-simulation kernels
# (norm_fp8) are Triton kernels that have not run on a GPU yet. Run from the repo root: PART=N bash $0
#  PART=1 (H100): GPU tests of the new kernels and of the exact compiler options; the
#         kernels alone against the XLA paths (benchmarks/norm_kernels.py); 4 layers:
#         kernels + step time with them on / off (was 266 kernels, 1.315 ms pipelined).
#         First try (session15_h100): norm_fp8 test failed on the XLA side (excess precision,
#         now fixed), the looped norm kernel made the step slower (1.30 -> 1.74 ms).
#  PART=3 (H100): decode step with every kernel against the pure-JAX step (4 full-width
#         Flash layers, random 4K cache); the stream step at B = 1, 8, 64.
#  PART=2 (2 x H200, ~10 min): the whole Flash stream step at B = 1 (was 12.70 ms/step,
#         78.7 tok/s on 2026-11-23, before the experts merge, the packed compressor state
#         and this session's kernels), then B = 8.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 DSV4_COMPILE_CACHE=off
# the new kernels are off by default until this proof: on for every run below but the A/B
export DSV4_NORM_FP8_ROWS=64 DSV4_MHC_COMB=1
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
case "${PART:-1}" in
1)   # ~8 min: GPU tests, the three kernels alone vs XLA, 4 layers with them on / off
  T 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_hc_sinkhorn.py \
    tests/test_norm_fp8.py tests/test_exact_numerics.py -rA | tee $OUT/gpu_tests.log \
    | grep -E "passed|failed|FAILED|PASSED|default options"
  T 100 python3 benchmarks/norm_kernels.py --rows 1 8 64 --json $OUT/norm_kernels.jsonl \
    | tee $OUT/norm_kernels.log
  for on in "64 1" "0 0"; do   # the new kernels on / off
    set -- $on
    DSV4_NORM_FP8_ROWS=$1 DSV4_MHC_COMB=$2 T 110 python3 benchmarks/step_anatomy.py --preset flash --layers 4 \
      --matmul pallas --kernels on --context 4096 --donate-logits --merge-x-proj --top 8 \
      | tee -a $OUT/anatomy4.log | grep -E "kernels in the step|^step"
  done ;;
3)   # ~9.5 min: stream steps (B = 1, 8, 64), the cost of exact numerics, kernels vs pure JAX
  T 270 python3 -m benchmarks.decode_bench decode --preset flash --layers 4 --batch 1 8 64 \
    --context 4096 --kernels on --matmul pallas --what stream --steps 20 \
    | tee $OUT/flash4_batch.log | grep -E "floor"
  DSV4_EXCESS_PRECISION=1 T 100 python3 benchmarks/step_anatomy.py --preset flash --layers 4 \
    --matmul pallas --kernels on --context 4096 --donate-logits --merge-x-proj --top 8 \
    | tee -a $OUT/anatomy4_excess_precision.log | grep -E "kernels in the step|^step"
  T 200 python3 benchmarks/decode_kernels_check.py --preset flash --layers 4 --random-cache \
    --matmul pallas --batch 1 8 --context 4096 --steps 3 | tee $OUT/check_flash4.log ;;
2)
  B="python3 -m benchmarks.decode_bench decode --preset flash --context 4096 --steps 30 --devices 2 --expert 2 --matmul pallas --kernels on --what stream"
  T 330 $B --batch 1 | tee $OUT/flash43_x2_stream_b1.log | grep -E "floor|\|"
  T 250 $B --batch 8 | tee $OUT/flash43_x2_stream_b8.log | grep -E "floor|\|" ;;
esac
true
# PART=4 (H100, ~8 min): the Triton-backend attention (kernel_triton: vector-load row
# gathers) against the Mosaic ws-lane kernel and XLA, every variant on each case
if [ "${PART:-1}" = 4 ]; then
  T 560 python3 benchmarks/attention_decode.py --out $OUT --budget 420 --all-variants \
    --variants ws-lane,triton16,triton32,triton64 \
    --only flash:csa:64:32768,flash:csa:8:32768,pro:csa:8:32768,flash:csa:1:32768,flash:hca:64:131072,pro:csa:32:32768 \
    2>&1 | grep -v "^{" | tail -40
fi
# PART=5 (H100, ~9 min): Triton attention with software pipelining (num_stages 2, 3) and
# 4 warps, then the 4-layer step with the Triton attention vs the Mosaic one
if [ "${PART:-1}" = 5 ]; then
  T 330 python3 benchmarks/attention_decode.py --out $OUT --budget 250 --all-variants \
    --variants ws-lane,triton64,triton64s2,triton64s3,triton64w4 --trusted ws-lane,triton64 \
    --only flash:csa:64:32768,flash:hca:64:131072,pro:csa:32:32768,flash:csa:8:32768 \
    2>&1 | grep -v "^{" | grep -E "smoke|^\| (flash|pro)" 
  for be in triton mosaic; do
    DSV4_ATTN_BACKEND=$be T 110 python3 benchmarks/step_anatomy.py --preset flash --layers 4 \
      --matmul pallas --kernels on --context 4096 --donate-logits --merge-x-proj --top 8 \
      --batch 8 | tee -a $OUT/anatomy4_attn_$be.log | grep -E "kernels in the step|^step"
  done
fi
# PART=6 (H100, ~8 min): Triton attention with the one-program-per-SM split rule; the 4-layer
# step with it (B = 8); the 4-layer stream step at B = 64 (never measured before)
if [ "${PART:-1}" = 6 ]; then
  T 230 python3 benchmarks/attention_decode.py --out $OUT --budget 150 --all-variants \
    --variants ws-lane,triton64,triton64-cps4 --trusted ws-lane,triton64,triton64-cps4 \
    --only flash:csa:64:32768,flash:hca:64:131072,pro:csa:32:32768,flash:csa:8:32768 \
    2>&1 | grep -v "^{" | grep -E "^\| (flash|pro)"
  DSV4_ATTN_BACKEND=triton T 100 python3 benchmarks/step_anatomy.py --preset flash --layers 4 \
    --matmul pallas --kernels on --context 4096 --donate-logits --merge-x-proj --top 8 \
    --batch 8 | tee -a $OUT/anatomy4_attn_triton.log | grep -E "kernels in the step|^step"
  DSV4_ATTN_BACKEND=triton T 150 python3 -m benchmarks.decode_bench decode --preset flash --layers 4 \
    --batch 64 --context 4096 --kernels on --matmul pallas --what stream --steps 20 \
    | tee $OUT/flash4_b64_triton.log | grep -E "floor"
fi
# PART=7 (next session, H100, ~6 min): the Triton attention variants that spill less
# (col_split 2: no spill at 64 heads; q_in_loop), against triton64 and ws-lane
if [ "${PART:-1}" = 7 ]; then
  T 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sparse_decode_attention.py \
    -k triton -rA | grep -E "passed|failed|PASSED|FAILED"
  T 330 python3 benchmarks/attention_decode.py --out $OUT --budget 240 --all-variants \
    --variants ws-lane,triton64,triton64c2,triton64q --trusted ws-lane,triton64 \
    --only flash:csa:64:32768,flash:hca:64:131072,pro:csa:32:32768,flash:csa:8:32768,flash:csa:1:32768 \
    2>&1 | grep -v "^{" | grep -E "smoke|^\| (flash|pro)"
fi
