#!/usr/bin/env bash
# H100, session 8 (2026-11-23 afternoon), one call: gpu_session10_h100.sh's PART=1 minus
# graph_launch (ran on x2 this session), after this session's stream fixes (tokens read
# into pinned host memory; the token reader loaded before the step's first run; the state
# committed, so the step compiles once), then PART=2 (128K attention) on what time is left.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
for m in "" "--merge-x-proj"; do
  echo "== step_anatomy 4 layers $m"
  T 150 python3 benchmarks/step_anatomy.py --preset flash --layers 4 --matmul pallas \
    --kernels on --context 4096 --donate-logits $m --top 8 | tee -a $OUT/anatomy4_merge.log \
    | grep -E "kernels in the step|^step"
done
T 200 python3 -m benchmarks.decode_bench decode --preset flash --layers 4 --context 4096 \
  --matmul pallas --kernels on --batch 1 8 --what step stream | grep "matmul=" \
  | tee $OUT/bench4_merged.log
T 200 python3 benchmarks/stream_diag.py --layers 10 --batch 1 | tee $OUT/stream_diag10.log
T ${ATT:-250} python3 benchmarks/attention_decode.py --out $OUT --skip 9 --budget $(( ${ATT:-250} - 30 )) \
  --trusted direct-lane,staged,ws-lane --default direct-lane | tail -30 | tee $OUT/attention_128k.log
true
