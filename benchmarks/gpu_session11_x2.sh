#!/usr/bin/env bash
# 2 x H200, session 8 (2026-11-23 afternoon): the whole Flash model's stream step after
# decode.read_tokens moved to pinned host memory (6 layers: every CUDA graph of the step
# stopped re-recording; benchmarks/results/session10_x2/). Last measured: 39.94 ms/step
# (benchmarks/results/session9_x2/flash43_x2_stream.log).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 DSV4_COMPILE_CACHE=off
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
case "${PART:-1}" in
1)  # whole model, B=1, the stream step (what Engine.stream runs)
  T 560 python3 -m benchmarks.decode_bench decode --preset flash --context 4096 --steps 30 \
    --devices 2 --expert 2 --matmul pallas --kernels on --batch ${BATCH:-1} --what stream \
    | tee $OUT/flash43_x2_stream_pinned.log | grep -E "drawn|matmul=|\|" ;;
    # ran: 24.86 ms/step (39.94 before), benchmarks/results/session11_x2/; the timed
    # steps began with the step's graphs dropped (the token reader loaded after the step's
    # first run) and re-recorded: PART=3 times it with the reader loaded first + 2 warm steps
2)  # host cost per argument leaf (Flash: 1738 weight leaves read, 545 cache leaves
    # donated), one device and the mesh; launch cost of XLA vs Mosaic-GPU kernels in a
    # graph; then where the whole step's host time goes now (profile, logits donated)
  for d in 2 1; do T 120 python3 benchmarks/dispatch_cost.py --devices $d | tee -a $OUT/dispatch_cost.log; done
  T 100 python3 benchmarks/graph_launch.py --n 64 256 --kinds xla mosaic | tee $OUT/graph_launch_kinds_x2.log
  T 480 python3 -m benchmarks.step_anatomy --preset flash --layers 43 --devices 2 --expert 2 --matmul pallas \
    --kernels on --context 4096 --donate-logits --place-args --merge-x-proj --profile --top 12 \
    > $OUT/anatomy43_x2_donated.log
  grep -v "^[IW]1" $OUT/anatomy43_x2_donated.log | grep -E "kernels in the step|^step|profile:|host events|psum|memory" | cut -c1-1500 ;;
3)  # the stream step again, graphs warm (decode_bench fixed): 14.93 ms (step_anatomy, logits
    # donated) is the program's host-bound pace
  T 560 python3 -m benchmarks.decode_bench decode --preset flash --context 4096 --steps 30 \
    --devices 2 --expert 2 --matmul pallas --kernels on --batch ${BATCH:-1} --what stream \
    | tee $OUT/flash43_x2_stream_warm.log | grep -E "drawn|matmul=|\|" ;;
esac
true
