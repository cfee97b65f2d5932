#!/usr/bin/env bash
# Queued in session 25 (2026-11-26/27, no device time: 119 s of the budget were left): the
# device calls for the next session, one PART each, on an H100 (kind nvidia-h100-x1),
# output in $OUT; each PART fits the 600 s a call may run. Order by value: 1 (correctness
# of everything built without a GPU), 3 (the routed experts' FP4 decode forms: the
# experts are ~65% of a B = 64 step), 2 (indexer w_in_loop, top-k fused; the step with
# "place"), 4. Timeouts sum to <= 600 s a PART.
# Supersedes PART=8 / PART=9 of gpu_session24.sh (never run).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 DSV4_COMPILE_CACHE=off
T() { timeout -s KILL "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
BENCH="-m benchmarks.decode_bench decode --preset flash --layers 4 --kernels on --matmul pallas --what stream"
case "${PART:-1}" in
1)
  # GPU tests of what was built without a GPU: the indexer's w_in_loop (session 24), the
  # FP4 decode programs prmt (session 24) and place (session 25), the top-k kernel's fused
  # counts (session 25), then the decode check
  # (4 Flash layers, 32K, random cache, kernels vs pure JAX) with the step's indexer
  # default "place" (never run in a step on a GPU), fp4 and nvfp4 index keys.
  T 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer_decode.py -rA \
    -k "weights_in_loop" | tee $OUT/gpu_tests_idx.log | grep -E "passed|failed|FAILED|Error"
  T 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_quant_matmul.py -rA \
    -k "fp4_programs or matches_reference or full_scale" | tee $OUT/gpu_tests_qmm.log \
    | grep -E "passed|failed|FAILED|Error"
  T 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_topk_select.py -rA \
    | tee $OUT/gpu_tests_topk.log | grep -E "passed|failed|FAILED|Error"
  T 130 python3 benchmarks/decode_kernels_check.py --preset flash --layers 4 --random-cache \
    --matmul pallas --batch 1 8 --context 32768 --steps 3 | tee $OUT/check.log | grep -E "median"
  T 130 python3 benchmarks/decode_kernels_check.py --preset flash --layers 4 --random-cache \
    --matmul pallas --batch 1 8 --context 32768 --steps 3 --index-format nvfp4 \
    | tee $OUT/check_nvfp4.log | grep -E "median" ;;
2)
  # Indexer: w_in_loop (109 -> 93 registers, 5 CTAs an SM) and 16 chunks a CTA; the top-k
  # kernel fused vs not; then the B = 64 step with the indexer's lutbf (the old default)
  # and place.
  V=fp4:place:0:2:0:1:w:0,fp4:place:0:2:0:1:w:1,nvfp4:place:0:2:0:1:w:0,nvfp4:place:0:2:0:1:w:1
  V=$V,fp4:place:16:2:0:1:w:0,fp4:place:16:2:0:1:w:1
  T 200 python3 benchmarks/indexer_probe.py sweep --cases 64:131072,32:131072,8:131072,1:32768 \
    --variants $V --out $OUT | tee $OUT/idx_h100.log | grep -v "^{"
  # top-k: a search step's 3 counts as one 2-D reduction (fused) against 3 reductions
  T 100 python3 benchmarks/topk_select.py --cases 1:8224:512 1:32800:512 8:32800:512 \
    64:32800:512 8:32800:1024 --fused 0 1 --json $OUT/topk.jsonl | tee $OUT/topk.log \
    | grep -v "^{"
  for dq in lutbf place; do
    DSV4_IDX_DEQUANT=$dq T 140 python3 $BENCH --batch 64 --context 131072 --steps 10 \
      | tee $OUT/b64_idx_$dq.log | grep -E "stream step" | head -1
  done ;;
3)
  # The routed experts as the step groups them (B = 64 and 8): the FP4 decode programs
  # mad (the default), prmt, place: the B = 64 w13 kernel's loop 1280 / 1143 / 985 SASS
  # instructions (compile-only sm_90a, session 25; place: one bf16x2 multiply a pair, no
  # SB words to build or shuffle).
  for f in mad prmt place; do
    DSV4_QMM_FP4_PTX=$f T 180 python3 benchmarks/quant_matmul.py --sweep-only --fmt fp4 \
      --moe 64 8 --budget 120 --out $OUT/moe_$f | grep -E "^\|" | tee -a $OUT/moe.log
  done ;;
4)
  # The 4-layer B = 64 stream step with each FP4 program (the winner of PART=3 becomes the
  # default only after this and PART=1's tests).
  for f in mad prmt place; do
    DSV4_QMM_FP4_PTX=$f T 180 python3 $BENCH --batch 64 --context 131072 --steps 10 \
      | tee $OUT/b64_qmm_$f.log | grep -E "stream step" | head -1
  done ;;
esac
