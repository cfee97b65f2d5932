#!/usr/bin/env bash
# Session 9 (2026-11-23 afternoon). Run from the repo root on the device: PART=N bash $0
#  PART=1 (2 x H200, ~10 min): the whole Flash stream step at B=1 in the decode form, which
#         now merges wq_a + wkv, shared w1 + w3 and the routed experts' w1 + w3 (one matmul
#         kernel per pair; compile-only 4 layers: 284 -> 268 kernels), against --unmerged
#         (the checkpoint form, every weight apart), same run.
#  PART=2 (2 x H200, ~5 min): the decode form at B=8.
#  PART=3 (H100): the 128K attention cases that have not run (attention_decode.py resumes
#         after the 9 measured cases), default variant ws-lane.
#  PART=4 (H100): 4 Flash layers: the decode form gives the checkpoint form's logits and
#         cache bits on the GPU (merge_check.py), then both forms timed (step_anatomy,
#         logits donated).
#  PART=5 (H100): stream_diag at 10 layers.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 DSV4_COMPILE_CACHE=off
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
B="python3 -m benchmarks.decode_bench decode --preset flash --context 4096 --steps 30 --devices 2 --expert 2 --matmul pallas --kernels on --what stream"
case "${PART:-1}" in
1)
  T 285 $B --batch 1 | tee $OUT/flash43_x2_stream_merged.log | grep -E "matmul=|\|"
  T 285 $B --batch 1 --unmerged | tee $OUT/flash43_x2_stream_unmerged.log | grep -E "matmul=|\|" ;;
2)
  T 290 $B --batch 8 | tee $OUT/flash43_x2_stream_b8.log | grep -E "matmul=|\|" ;;
3)
  T 540 python3 benchmarks/attention_decode.py --out $OUT --skip 9 --budget 480 \
    --variants ws-lane --trusted ws-lane --default ws-lane | tail -30 | tee $OUT/attention_128k.log ;;
4)
  T 240 python3 benchmarks/merge_check.py --layers 4 --steps 3 | tee $OUT/merge_check4.log
  for m in "" "--merge-x-proj"; do
    echo "== step_anatomy 4 layers $m"
    T 150 python3 benchmarks/step_anatomy.py --preset flash --layers 4 --matmul pallas \
      --kernels on --context 4096 --donate-logits $m --top 8 | tee -a $OUT/anatomy4_merged.log \
      | grep -E "kernels in the step|^step"
  done ;;
5)
  T 400 python3 benchmarks/stream_diag.py --layers 10 --batch 1 | tee $OUT/stream_diag10.log ;;
esac
true
