#!/usr/bin/env bash
# Prepared in session 8 (2026-11-23) for the next one (no device time left to run it).
#  PART=1 (2 x H200, ~10 min of device time): the whole Flash stream step with the decode
#         form that now also merges wq_a + wkv and shared w1 + w3 (one matmul kernel per
#         pair; compile-only 4 layers: 284 -> 272 kernels), against --unmerged (the
#         checkpoint form); 12.70 ms/step was the x-projections-only decode form.
#  PART=2 (2 x H200, ~5 min): the same at batch 8 (tokens/s scaling).
#  PART=3 (H100, ~5 min of device time at 50%): 4 Flash layers, decode form vs checkpoint
#         form (step_anatomy, logits donated); stream_diag at 10 layers (did not finish
#         in session 8: give it 400 s).
#  PART=4 (H100): the 128K attention cases that have not run (attention_decode.py resumes).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 DSV4_COMPILE_CACHE=off
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
B="python3 -m benchmarks.decode_bench decode --preset flash --context 4096 --steps 30 --devices 2 --expert 2 --matmul pallas --kernels on --what stream"
case "${PART:-1}" in
1)
  T 290 $B --batch 1 | tee $OUT/flash43_x2_stream_rowmerge.log | grep -E "matmul=|\|"
  T 290 $B --batch 1 --unmerged | tee $OUT/flash43_x2_stream_unmerged.log | grep -E "matmul=|\|" ;;
2)
  T 290 $B --batch 8 | tee $OUT/flash43_x2_stream_b8.log | grep -E "matmul=|\|" ;;
3)
  for m in "" "--merge-x-proj"; do
    echo "== step_anatomy 4 layers $m"
    T 150 python3 benchmarks/step_anatomy.py --preset flash --layers 4 --matmul pallas \
      --kernels on --context 4096 --donate-logits $m --top 8 | tee -a $OUT/anatomy4_rowmerge.log \
      | grep -E "kernels in the step|^step"
  done
  T 400 python3 benchmarks/stream_diag.py --layers 10 --batch 1 | tee $OUT/stream_diag10.log ;;
4)
  T 560 python3 benchmarks/attention_decode.py --out $OUT --skip 9 --budget 500 \
    --trusted direct-lane,staged,ws-lane --default direct-lane | tail -30 | tee $OUT/attention_128k.log ;;
esac
true
