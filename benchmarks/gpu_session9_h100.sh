#!/usr/bin/env bash
# H100, prepared in session 6 for the next one (two calls of the device tool):
#  PART=1: stream_diag.py on 10 Flash layers (Engine.stream now starts each read-back with
#          copy_to_host_async: does the ~0.5 ms/step read-back cost of session 6 shrink?),
#          and graph_launch.py with its chain no longer fused (host us per kernel, fresh vs
#          donated output).
#  PART=2: the 128K attention cases that did not run (attention_decode.py resumes after the
#          9 cases done; every variant was smoke-tested before, so none is re-checked).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
case "${PART:-1}" in
1)
  T 330 python3 benchmarks/stream_diag.py --layers 10 --batch 1 | tee $OUT/stream_diag10.log
  T 150 python3 benchmarks/graph_launch.py --n 64 256 | tee $OUT/graph_launch.log ;;
2)
  T 560 python3 benchmarks/attention_decode.py --out $OUT --skip 9 --budget 480 \
    --trusted direct-lane,staged,ws-lane --default direct-lane | tail -30 \
    | tee $OUT/attention_128k.log ;;
esac
true
