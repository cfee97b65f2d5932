#!/usr/bin/env bash
# 2 x H200: does the sharded step re-record its CUDA graph every step? (the whole-Flash x2
# profile of 2026-11-23: host enqueue 29.9 ms of which command_buffer::update 8.3 ms/step).
# A/B on a few Flash layers, one XLA setting per process, each profiled (host events) and
# PART=2/4 with XLA's command-buffer log (which graphs re-record, how many allocations moved).
# PART=1..3 ran on 2026-11-23 (BENCHMARKS.md, benchmarks/results/session9_x2/); PART=4 is
# next. Runs the tree in $TREE (default: the working tree) from its own directory.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 DSV4_COMPILE_CACHE=off
R=$(pwd)
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
A="--preset flash --layers ${LAYERS:-6} --devices 2 --expert 2 --matmul pallas --kernels on --context 4096 --profile --top 12"
run() {  # name, env...
  name=$1; shift
  echo "== $name"
  (cd ${TREE:-.} && export "$@" PYTHONPATH=$R && T ${LIMIT:-140} python3 -m benchmarks.step_anatomy $A) \
    > $OUT/graph_update_$name.log
  grep -E "kernels in the step|^step|profile:|host events|psum|memory" $OUT/graph_update_$name.log | cut -c1-700
}
case "${PART:-1}" in
1)  # 2026-11-23 run 1 (logs: benchmarks/results/session9_x2/)
  run default X=1
  run no_collectives_in_graph XLA_FLAGS=--xla_gpu_enable_command_buffer=-COLLECTIVES
  run concurrent_off DSV4_GRAPH_CONCURRENT=0 ;;
2)  # how many allocations moved when XLA re-records (VLOG of command_buffer_thunk), and
    # the step with CUDA graphs off
  run vlog TF_CPP_VMODULE=command_buffer_thunk=3 TF_CPP_MIN_LOG_LEVEL=0
  grep -o "Update command buffer.*" $OUT/graph_update_vlog.log | sort | uniq -c | sort -rn | head -12
  grep -c "Update command buffer" $OUT/graph_update_vlog.log
  run graphs_off XLA_FLAGS=--xla_gpu_enable_command_buffer= ;;
3)  # a temp buffer that keeps its address (own memory colour), and inputs placed once
  run separate_color XLA_FLAGS=--xla_gpu_temp_buffer_use_separate_color=true
  A="$A --place-args" run place_args X=1
  echo "== decode_bench step + stream, separate colour"
  (cd ${TREE:-.} && export XLA_FLAGS=--xla_gpu_temp_buffer_use_separate_color=true PYTHONPATH=$R && \
   T 200 python3 -m benchmarks.decode_bench decode --preset flash --layers ${LAYERS:-6} \
     --context 4096 --steps 12 --devices 2 --expert 2 --matmul pallas --kernels on --batch 1 \
     --what step stream) | grep "matmul=" | tee $OUT/bench_separate_color.log ;;
4)  # next: (a) the step writing its logits over the donated previous ones, inputs placed
    # once: does the re-recording stop on the mesh, as it did on one H100? (b) the stream
    # step on the mesh (whole model: 39.9 ms, worse than the plain step), with the counts
  A="$A --place-args --donate-logits" run donated TF_CPP_VMODULE=command_buffer_thunk=3 TF_CPP_MIN_LOG_LEVEL=0
  grep -o "Update command buffer.*" $OUT/graph_update_donated.log | sed 's/; is_first.*//' \
    | sort | uniq -c | sort -rn | head -12
  for mode in stream_noread stream_read stream_read_pinned; do   # one process each: the log is that mode's
    echo "== stream_diag, mesh, $mode"
    (cd ${TREE:-.} && export TF_CPP_VMODULE=command_buffer_thunk=3 TF_CPP_MIN_LOG_LEVEL=0 \
       DSV4_COMPILE_CACHE=off PYTHONPATH=$R && T ${LIMIT:-200} python3 -m benchmarks.stream_diag \
       --layers ${LAYERS:-6} --devices 2 --expert 2 --steps 20 --only $mode) \
       > $OUT/stream_diag_x2_$mode.log
    grep -v "command_buffer_thunk" $OUT/stream_diag_x2_$mode.log | grep "ms/step\|compiled"
    grep -o "Update command buffer.*" $OUT/stream_diag_x2_$mode.log | sed 's/; is_first.*//' \
      | sort | uniq -c | sort -rn | head -8
  done
  T 100 python3 benchmarks/graph_launch.py --n 64 256 --kinds xla mosaic \
    | tee $OUT/graph_launch_kinds_x2.log
  gzip -f $OUT/*.log ;;
esac
true
