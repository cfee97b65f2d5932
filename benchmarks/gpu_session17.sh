#!/usr/bin/env bash
# Session 17's GPU proof (two H100 calls): the register-resident top-k kernel
# (pallas_kernels/topk_select, rewritten 2026-11-25 after the first version lost to the
# XLA sort at B = 1) and the Triton attention variants of gpu_session15.sh PART=7.
# Run from the repo root: PART=N bash $0
#  PART=1 (H100, ~9 min): top-k GPU tests; the kernel alone vs lax.top_k at the indexer's
#         shapes (default tile / 2048, digits of 2 / 4 bits, default segments / 4);
#         4 Flash layers at B = 64, 32K context: the stream step with each top-k.
#  PART=2 (H100, ~8 min): top-k GPU tests again (3 stages at N = 256K); the long rows
#         (tile default / 2048, 2 bits); the same step at B = 1.
#  PART=4 (H100, ~6 min): the decode step with kernels on (top-k kernel / XLA top-k) vs the
#         pure-JAX step, 4 Flash layers, B = 1 / 8 at 32K context (rel. L2 of the logits).
#  PART=5 (H100, ~7 min): 4 Flash layers at B = 64, 128K: the stream step with each top-k;
#         the tiny preset's decode step with kernels vs pure JAX.
#  PART=3 (H100, ~4 min): the attention variants that spill less (col_split 2, q_in_loop)
#         against ws-lane / triton64.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 DSV4_COMPILE_CACHE=off
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
step() {  # $1 batch: the stream step with the XLA top-k, then the kernel
  for sel in xla kernel; do
    DSV4_TOPK=$sel T 110 python3 -m benchmarks.decode_bench decode --preset flash --layers 4 \
      --batch $1 --context 32768 --kernels on --matmul pallas --what stream --steps 10 \
      | tee $OUT/flash4_b$1_32k_topk_$sel.log | grep -E "floor"
  done
}
case "${PART:-1}" in
1)
  T 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_topk_select.py -rA \
    | tee $OUT/gpu_tests.log | grep -E "passed|failed|PASSED|FAILED"
  T 250 python3 benchmarks/topk_select.py --tiles 0 2048 --bits 2 4 --segments 0 4 \
    --cases 1:1056:512 64:1056:512 1:8224:512 64:8224:512 1:32800:512 8:32800:512 \
    64:32800:512 32:32800:1024 --json $OUT/topk_select.jsonl | tee $OUT/topk_select.log
  step 64 ;;
2)  # after PART=1: bits 2 won everywhere; default_segments now splits rows > tile
  T 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_topk_select.py -rA \
    | tee $OUT/gpu_tests.log | grep -E "passed|failed|PASSED|FAILED"
  T 200 python3 benchmarks/topk_select.py --tiles 0 2048 --bits 2 \
    --cases 1:8224:512 1:32800:512 8:32800:512 64:32800:512 32:32800:1024 2:262144:512 \
    --json $OUT/topk_select.jsonl | tee $OUT/topk_select.log
  step 1 ;;
3)
  T 230 python3 benchmarks/attention_decode.py --out $OUT --budget 170 --all-variants \
    --variants ws-lane,triton64,triton64c2,triton64q --trusted ws-lane,triton64 \
    --only flash:csa:64:32768,flash:hca:64:131072,pro:csa:32:32768,flash:csa:8:32768 \
    2>&1 | grep -v "^{" | grep -E "smoke|^\| (flash|pro)" ;;
4)  # the decode step with the top-k kernel (now the default) against the pure-JAX step
  for sel in kernel xla; do
    DSV4_TOPK=$sel T 240 python3 benchmarks/decode_kernels_check.py --preset flash --layers 4 \
      --random-cache --matmul pallas --batch 1 8 --context 32768 --steps 3 \
      | tee $OUT/check_flash4_topk_$sel.log | grep -E "median"
  done ;;
5)  # the long context: B = 64 at 128K (the XLA sort took 242-290 us a CSA layer there);
    # and the tiny preset's kernel step (top-k kernel by default) against pure JAX
  for sel in xla kernel; do
    DSV4_TOPK=$sel T 170 python3 -m benchmarks.decode_bench decode --preset flash --layers 4 \
      --batch 64 --context 131072 --kernels on --matmul pallas --what stream --steps 10 \
      | tee $OUT/flash4_b64_128k_topk_$sel.log | grep -E "floor"
  done
  T 100 python3 benchmarks/decode_kernels_check.py --preset tiny --batch 2 --context 300 \
    --steps 3 | tee $OUT/check_tiny.log | grep -E "median" ;;
esac
true
