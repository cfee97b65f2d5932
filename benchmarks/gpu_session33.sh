#!/usr/bin/env bash
# Queued in session 32 (2026-11-28) for the next session's device calls, one PART each,
# output in $OUT; each PART's timeouts sum to <= 600 s. PARTs 1-3 need 2 x H200
# (kind nvidia-h200-x2, needs_h200: the whole Flash model is 156 GB).
# Session 32 found the whole-Flash 2 x H200 step host-bound at 19.03 ms pipelined (B = 1),
# its host enqueue 17.75 ms: 7.5x the 10-layer step's 2.37 ms for 4.3x the layers, while
# the 10-layer step is 21% faster than with the 2026-11-23 tree (BENCHMARKS.md, session 32).
# 1: where the host enqueue stops growing linearly: the plain step at 20 and 30 layers
#    (10 and 43 are in benchmarks/results/session32_h200x2), same flags as session 32.
# 2: the tree of 2026-11-23 (303e15b; 12.70 ms stream / 14.93 ms plain then) at 43 layers
#    on the same lease as this tree's 19.03 ms. Export it first, here:
#      echo /.oldtree/ >> .git/info/exclude; mkdir .oldtree
#      git archive 303e15b | tar -x -C .oldtree --exclude=benchmarks/results --exclude=notebooks
#    and carry .oldtree. Session 32 compiled the 43-layer step in ~250 s: if 295 s a tree is
#    too little, run the trees as two calls back to back (the machine stays warm 30 s).
# 3: a hypothesis for the superlinear host time: at 43 layers (85 GB in use on each GPU)
#    something moves between steps and XLA re-records the step's CUDA graphs every step,
#    as in session 10 (benchmarks/gpu_graph_update_x2.sh). The plain step, donated, with
#    the command-buffer log: "Update command buffer" lines after the first steps say yes.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 DSV4_COMPILE_CACHE=off
T() { timeout -s KILL "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
A="--preset flash --devices 2 --expert 2 --matmul pallas --kernels on --context 4096 --donate-logits --place-args --merge-x-proj --top 3"
case "${PART:-1}" in
1)
  for n in 20 30; do
    T 270 python3 -m benchmarks.step_anatomy $A --layers $n > $OUT/anatomy${n}_x2.log
    grep -v "^[IW]1" $OUT/anatomy${n}_x2.log | grep -E "kernels in the step|^step"
  done ;;
2)
  for tree in .oldtree .; do
    (cd $tree && PYTHONPATH=. T 295 python3 -m benchmarks.step_anatomy $A --layers 43) \
      > $OUT/anatomy43_x2_$(basename $(realpath $tree)).log
    grep -v "^[IW]1" $OUT/anatomy43_x2_$(basename $(realpath $tree)).log | grep -E "kernels in the step|^step"
  done ;;
3)
  T 560 env TF_CPP_VMODULE=command_buffer_thunk=3 TF_CPP_MIN_LOG_LEVEL=0 \
    python3 -m benchmarks.step_anatomy $A --layers 43 > $OUT/anatomy43_x2_vlog.log
  grep -v "command_buffer_thunk" $OUT/anatomy43_x2_vlog.log | grep -E "kernels in the step|^step"
  grep -o "Update command buffer.*" $OUT/anatomy43_x2_vlog.log | sed 's/; is_first.*//' \
    | sort | uniq -c | sort -rn | head -8
  grep -c "Update command buffer" $OUT/anatomy43_x2_vlog.log
  gzip -f $OUT/anatomy43_x2_vlog.log ;;
esac
# PART=4 (H100, kind nvidia-h100-x1, ~8 min): the indexer's "words" key order (session 32,
# compile-only: 25 SASS instructions a chunk fewer, fp4 and nvfp4; DSV4_IDX_KEY_ORDER=words):
# its GPU tests (within rounding of the natural order and the reference, the same top-k up
# to ties), then timed against the default at B = 64 / 32 / 8, 128K and B = 64, 32K. The
# "scoring kernel us" column is the kernel alone (the call's total adds "words"' q
# permutation, which the decode step fuses into q's own fusion).
if [ "${PART:-1}" = 4 ]; then
  T 200 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_indexer_decode.py \
    -k "words_key_order" 2>&1 | tee $OUT/pytest_words.log | grep -v "^$" | tail -6
  V=place:0:2:0:1:w
  T 330 python3 benchmarks/indexer_probe.py sweep --rounds 3 \
    --cases 64:131072,32:131072,8:131072,64:32768 \
    --variants fp4:$V,fp4:$V+DSV4_IDX_KEY_ORDER=words,nvfp4:$V,nvfp4:$V+DSV4_IDX_KEY_ORDER=words \
    | tee $OUT/indexer_words.log | grep "^|\|device"
fi
# PART=5 (H100, kind nvidia-h100-x1, ~8 min; session 33): the indexer's heads reduction as
# one FFMA chain (DSV4_IDX_EPILOGUE=chain, the default since; 4 float instructions a chunk
# fewer than Mosaic's reduce, "tree") with the words key order: GPU tests, timing against
# tree at B = 64 / 32 / 8, 128K and B = 64, 32K; then the decode check (4 Flash layers,
# random cache, kernels vs pure JAX, B = 32, 128K, fp4 index keys) with both defaults.
if [ "${PART:-1}" = 5 ]; then
  T 170 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_indexer_decode.py \
    -k "epilogue or words_key_order or lut_dequant_every_code or nvfp4_every_code" 2>&1 \
    | tee $OUT/pytest_epilogue.log | grep -v "^$" | tail -6
  V=place:0:2:0:1:w
  T 170 python3 benchmarks/indexer_probe.py sweep --rounds 3 \
    --cases 64:131072,32:131072,8:131072,64:32768 \
    --variants fp4:$V,fp4:$V+DSV4_IDX_EPILOGUE=tree,nvfp4:$V,nvfp4:$V+DSV4_IDX_EPILOGUE=tree \
    | tee $OUT/indexer_epilogue.log | grep "^|\|device"
  T 230 python3 benchmarks/decode_kernels_check.py --preset flash --layers 4 \
    --random-cache --matmul pallas --batch 32 --context 131072 --steps 3 --index-format fp4 \
    | tee $OUT/check_b32_words.log | grep -E "median|Error|argmax"
fi
# PART=6 (H100, ~3 min; session 33): the fp4 / nvfp4 scoring kernels with this session's
# defaults (words order, chain epilogue) against session 32's (natural, tree) on one more
# lease, 5 rounds, B = 64 and 32 at 128K: how firm the 60% at B = 64 is.
if [ "${PART:-1}" = 6 ]; then
  V=place:0:2:0:1:w
  OLD=+DSV4_IDX_KEY_ORDER=natural+DSV4_IDX_EPILOGUE=tree
  T 400 python3 benchmarks/indexer_probe.py sweep --rounds 5 --cases 64:131072,32:131072 \
    --variants fp4:$V,fp4:$V$OLD,nvfp4:$V,nvfp4:$V$OLD | tee $OUT/indexer_defaults.log | grep "^|\|device"
fi
# PART=7 (H100, ~4 min; session 33): XLA puts kernel runs shorter than
# xla_gpu_graph_min_graph_size (default 5) between two Mosaic GPU calls outside its CUDA
# graphs: 75 of 166 XLA kernels of the 4-layer x2 step (compile-only thunk dump). With the
# size at 1 all 166 go into 43 graphs. Does the host enqueue less? 10 Flash layers, one
# H100, B = 1, the plain step with nothing moving between steps, default vs 1.
if [ "${PART:-1}" = 7 ]; then
  A="--preset flash --layers 10 --matmul pallas --kernels on --context 4096 --donate-logits --place-args --merge-x-proj --top 3"
  for g in 5 1 5; do
    XLA_FLAGS=--xla_gpu_graph_min_graph_size=$g T 130 python3 -m benchmarks.step_anatomy $A \
      >> $OUT/anatomy10_graph$g.log
    echo "min graph size $g: $(grep -v '^[IW]1' $OUT/anatomy10_graph$g.log | grep -E '^step')"
  done
fi
