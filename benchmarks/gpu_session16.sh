#!/usr/bin/env bash
# Next session's GPU proof (one H100 call, ~9.5 min): the top-k selection kernel
# (pallas_kernels/topk_select, built 2026-11-25 without a GPU, off by default behind
# DSV4_TOPK=kernel) and the Triton attention variants of gpu_session15.sh PART=7.
# Run from the repo root: PART=N bash $0
#  PART=1 (H100, ~9 min): GPU tests (top-k, Triton attention, indexer); the top-k kernel
#         alone vs lax.top_k at the indexer's shapes (tiles 256 / 512, digits of 2 / 4
#         bits, one program per row / default_segments); 4 Flash layers at B = 64, 32K
#         context: the stream step with the XLA top-k and with the kernel.
#  PART=2 (H100, ~4 min): the attention variants that spill less (col_split 2, q_in_loop).
#  If the top-k kernel passes and wins: flip decode.TOPK_SELECT's default to "kernel" (and
#  the best tile / bits into topk_select's defaults), record the table in BENCHMARKS.md.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 DSV4_COMPILE_CACHE=off
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
case "${PART:-1}" in
1)
  T 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_topk_select.py \
    tests/test_sparse_decode_attention.py tests/test_indexer_decode.py -rA \
    | tee $OUT/gpu_tests.log | grep -E "passed|failed|PASSED|FAILED"
  T 200 python3 benchmarks/topk_select.py --tiles 256 512 --bits 2 4 --segments 0 1 \
    --cases 1:1056:512 64:1056:512 1:32800:512 8:32800:512 64:32800:512 32:32800:1024 \
    --json $OUT/topk_select.jsonl | tee $OUT/topk_select.log
  for sel in xla kernel; do   # the step-level effect at a long context, high batch
    DSV4_TOPK=$sel T 100 python3 -m benchmarks.decode_bench decode --preset flash --layers 4 \
      --batch 64 --context 32768 --kernels on --matmul pallas --what stream --steps 10 \
      | tee $OUT/flash4_b64_32k_topk_$sel.log | grep -E "floor"
  done ;;
2)
  T 230 python3 benchmarks/attention_decode.py --out $OUT --budget 170 --all-variants \
    --variants ws-lane,triton64,triton64c2,triton64q --trusted ws-lane,triton64 \
    --only flash:csa:64:32768,flash:hca:64:131072,pro:csa:32:32768,flash:csa:8:32768 \
    2>&1 | grep -v "^{" | grep -E "smoke|^\| (flash|pro)" ;;
esac
true
