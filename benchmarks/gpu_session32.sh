#!/usr/bin/env bash
# Queued in session 31 (2026-11-27) for the next session's device calls, one PART each, on
# an H100 (kind nvidia-h100-x1), output in $OUT; each PART's timeouts sum to <= 600 s.
# 1: double_k with the producer dequantising ($DSV4_ATTN_PRODUCER_DEQ=1, _attn_call_pd;
#    built and compiled for sm_90a in session 31 with no device time left: 168 registers,
#    no spills (HCA) / 4 bytes (CSA, as the default), never run): its bit-identity GPU
#    tests against the one-tile cpasync kernel (CSA, HCA), then timed against the default at
#    128K. The consumers then only score, update the softmax and run P V; the copies' and
#    the dequant's latency sit on the producer. If a test hangs, the barriers are the
#    suspect (MOSAIC_GPU_NOTES.md: setmaxnreg / phases).
# Run in session 32: PART=1 measured the producer dequant slower everywhere (it was then
# removed, code at f944b16: PART=1 no longer selects anything); PART=2..4 on 2 x H200.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 DSV4_COMPILE_CACHE=off
T() { timeout -s KILL "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
case "${PART:-1}" in
1)
  T 240 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_sparse_decode_attention.py \
    -k "double_k_matches and producer_deq" 2>&1 | tee $OUT/pytest_pdeq.log | grep -v "^$" | tail -6
  T 200 python3 benchmarks/attn_probe.py --roofline --rounds 3 \
    --cases flash:csa:64:131072,pro:csa:32:131072,flash:csa:8:131072 \
    --variants cpasync+idp,cpasync+idp:DSV4_ATTN_PRODUCER_DEQ=1 | tee $OUT/attn_pdeq_csa.log | grep "^|\|^  "
  T 150 python3 benchmarks/attn_probe.py --roofline --rounds 3 \
    --cases flash:hca:64:131072,pro:hca:32:131072 \
    --variants cpasync+hid,cpasync+hid:DSV4_ATTN_PRODUCER_DEQ=1 | tee $OUT/attn_pdeq_hca.log | grep "^|\|^  " ;;
2)  # 2 x H200 (nvidia-h200-x2, needs_h200): the whole Flash model's stream step, B = 1 then 8
    # (last measured 2026-11-23: 12.70 ms/step at B = 1, before every kernel since session 11)
  T 570 python3 -m benchmarks.decode_bench decode --preset flash --context 4096 --steps 30 \
    --devices 2 --expert 2 --matmul pallas --kernels on --what stream --batch 1 8 \
    | tee $OUT/flash43_x2_stream.log | grep -E "floor|\||device|synthetic" ;;
3)  # 2 x H200: PART=2 measured 20.83 ms at B = 1 (12.70 on 2026-11-23) and 17.14 at B = 8:
    # the plain step's kernels, host enqueue and profiled GPU time, as session 11's
    # anatomy43_x2_donated.log (3391 kernels, host 14.86 ms, pipelined 14.93, GPU 12.0 ms)
  T 560 python3 -m benchmarks.step_anatomy --preset flash --layers 43 --devices 2 --expert 2 --matmul pallas \
    --kernels on --context 4096 --donate-logits --place-args --merge-x-proj --profile --top 25 \
    > $OUT/anatomy43_x2_donated.log
  grep -v "^[IW]1" $OUT/anatomy43_x2_donated.log | grep -E "kernels in the step|^step|profile:|host events|psum|memory" | cut -c1-1500 ;;
4)  # 2 x H200: PART=3 found 2610 kernels (3391 on 2026-11-23) but host enqueue 17.75 ms (14.86)
    # and pipelined 19.03 ms (14.93): the tree of 2026-11-23 (303e15b, exported to .oldtree,
    # carried) against this one on the same machine, 10 Flash layers, plain step
  A="--preset flash --layers 10 --devices 2 --expert 2 --matmul pallas --kernels on --context 4096 --donate-logits --place-args --merge-x-proj --top 3"
  for tree in .oldtree .; do
    (cd $tree && PYTHONPATH=. T 150 python3 -m benchmarks.step_anatomy $A) > $OUT/anatomy10_x2_$(basename $(realpath $tree)).log
    grep -v "^[IW]1" $OUT/anatomy10_x2_*$(basename $(realpath $tree)).log | grep -E "kernels in the step|^step"
  done ;;
esac
