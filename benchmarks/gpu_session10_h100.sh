#!/usr/bin/env bash
# H100, prepared in session 7 (2026-11-23, no device time left) for the next one; replaces
# gpu_session9_h100.sh, which never ran:
#  PART=1: the decode form of the weights (params.merge_x_proj, now the Engine's and the
#          CLI's default): 4 Flash layers + head, B=1, kernels and time with the five CSA
#          x-projections apart (--unmerged / no --merge-x-proj) and merged; then
#          stream_diag on 10 layers (the copy_to_host_async read-back, not measured yet;
#          the read-back into pinned host memory); graph_launch with Mosaic-GPU kernels.
#  PART=2: the 128K attention cases that did not run (attention_decode.py resumes after the
#          9 cases done; every variant was smoke-tested before, so none is re-checked).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
case "${PART:-1}" in
1)
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
  # host cost per launch / per graph update: XLA fusions vs Mosaic-GPU custom calls
  T 120 python3 benchmarks/graph_launch.py --n 64 256 --kinds xla mosaic \
    | tee $OUT/graph_launch_kinds.log ;;
2)
  T 560 python3 benchmarks/attention_decode.py --out $OUT --skip 9 --budget 480 \
    --trusted direct-lane,staged,ws-lane --default direct-lane | tail -30 \
    | tee $OUT/attention_128k.log ;;
esac
true
