#!/usr/bin/env bash
# Session 21 (2026-11-26), one H200 unless said otherwise.
# PART=1: session 21's queued qk_split proof (GPU tests, cpasync vs cpasync+qks vs triton at
#   the session-20 cases) and an ablation of the cpasync kernel at Flash CSA B = 64 32K:
#   each stage removed in turn (DSV4_ATTN_ABLATE, wrong results, timing only) to see which
#   part of the per-block chain the time goes to.
# PART=2: the split-rule sweep for the new kernel (with each kernel's GPU time), the 4-layer step with qk_split 0 / 1 and
#   the decode check with it.
# PART=3: after the in-kernel key metadata (cpasync) and the 2-fusion merge: GPU tests,
#   the op at the session-20 cases with each kernel's GPU time, the in-kernel timeline.
# PART=4: the decode check (kernels on vs pure JAX) and the B = 64 128K step.
# PART=6: on an H100: attention op and fp4 / nvfp4 indexer scoring at B = 64.
# PART=5: the epilogue's read-only store wait; A/B of waiting for q in block 0 and of
#   72 / 216 registers.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 DSV4_COMPILE_CACHE=off
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
ATT="flash:csa:64:32768,flash:hca:64:131072,pro:csa:32:32768,flash:csa:8:32768,flash:csa:1:32768"
BENCH="-m benchmarks.decode_bench decode --preset flash --layers 4 --kernels on --matmul pallas --what stream"
A=cpasync:DSV4_ATTN_ABLATE
case "${PART:-1}" in
1)
  T 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sparse_decode_attention.py -rA \
    -k "not triton" | tee $OUT/gpu_tests.log | grep -E "passed|failed|FAILED|Error"
  T 120 python3 benchmarks/attn_probe.py --cases flash:csa:64:32768 --variants \
    cpasync,cpasync+qks,$A=copy,$A=deq,$A=qk,$A=pv,$A=qk/pv,$A=deq/qk/pv,$A=copy/deq/qk/pv \
    | tee $OUT/ablate.log
  T 300 python3 benchmarks/attn_probe.py --cases $ATT --variants cpasync,cpasync+qks,triton \
    | tee $OUT/probe.log ;;
2)
  T 150 python3 benchmarks/attn_probe.py --cases flash:csa:64:32768,pro:csa:32:32768 \
    --variants cpasync+qks+s1,cpasync+qks+s2,cpasync+qks+s3,cpasync+qks+s4 --events \
    | tee $OUT/probe_splits.log
  T 100 python3 benchmarks/attn_probe.py --cases flash:hca:64:131072,flash:csa:1:32768 \
    --variants cpasync+qks --events --rounds 1 | tee $OUT/probe_events.log
  for qks in 0 1; do DSV4_ATTN_QK_SPLIT=$qks T 170 python3 $BENCH --batch 64 --context 131072 \
    --steps 10 | tee $OUT/b64_qks$qks.log | grep -E "stream step" | head -1; done
  DSV4_ATTN_QK_SPLIT=1 T 200 python3 benchmarks/decode_kernels_check.py --preset flash \
    --layers 4 --random-cache --matmul pallas --batch 1 8 --context 32768 --steps 3 \
    | tee $OUT/check_qks.log | grep -E "median" ;;
3)  # the in-kernel metadata (cpasync), the 2-fusion merge, the in-kernel profile
  T 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sparse_decode_attention.py -rA \
    -k "not triton" | tee $OUT/gpu_tests.log | grep -E "passed|failed|FAILED|Error"
  T 240 python3 benchmarks/attn_probe.py --cases $ATT --variants cpasync,cpasync+qks,triton \
    --events | tee $OUT/probe.log
  for c in flash:csa:64:32768 pro:csa:32:32768; do for v in cpasync cpasync+qks; do
    T 60 python3 benchmarks/attn_timeline.py --case $c --variant $v | tee -a $OUT/timeline.log
  done; done ;;
4)
  for qks in 0 1; do
    DSV4_ATTN_QK_SPLIT=$qks T 150 python3 benchmarks/decode_kernels_check.py --preset flash \
      --layers 4 --random-cache --matmul pallas --batch 1 8 --context 32768 --steps 3 \
      | tee $OUT/check_qks$qks.log | grep -E "median"
    DSV4_ATTN_QK_SPLIT=$qks T 120 python3 $BENCH --batch 64 --context 131072 --steps 10 \
      | tee $OUT/b64_qks$qks.log | grep -E "stream step" | head -1
  done ;;
5)  # epilogue waits only for the SMEM reads; A/B: consumers wait for q in block 0 (QLATE,
    # a knob removed after this run)
  T 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sparse_decode_attention.py -rA \
    -k "not triton" | tee $OUT/gpu_tests.log | grep -E "passed|failed|FAILED|Error"
  T 150 python3 benchmarks/attn_probe.py --cases flash:csa:64:32768 --variants \
    cpasync,cpasync:DSV4_ATTN_QLATE=1,cpasync:DSV4_ATTN_PREG=72:DSV4_ATTN_CREG=216,triton \
    | tee $OUT/probe_b64.log
  T 200 python3 benchmarks/attn_probe.py --cases ${ATT#flash:csa:64:32768,} \
    --variants cpasync,cpasync:DSV4_ATTN_QLATE=1,triton | tee $OUT/probe.log ;;
6)  # on an H100 (kind nvidia-h100-x1), the target GPU: the attention op and the
    # fp4 / nvfp4 indexer scoring at B = 64, with the ceiling measured in the same run
  T 100 python3 benchmarks/attn_probe.py --cases flash:csa:64:32768,pro:csa:32:32768 \
    --variants cpasync,triton --rounds 2 | tee $OUT/probe_h100.log
  T 100 python3 benchmarks/indexer_probe.py sweep --cases 64:131072 --rounds 2 \
    --variants fp4:lutbf:0:2:0:1,nvfp4:lutbf:0:2:0:1 --out $OUT | tee $OUT/idx_h100.log ;;
esac
true
