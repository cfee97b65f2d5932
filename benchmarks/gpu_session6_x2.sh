#!/usr/bin/env bash
# 2 x H200, prepared for the next session: everything of session 5 together on the whole
# Flash model (cache kernels on the expert mesh with the read-only ones deduplicated by jit,
# new FP4 'swar-shfl' decode, concurrent graph regions). (1) 4 Flash layers sharded, every
# kernel on, vs single-device pure JAX (the Engine MTP bug that broke it is fixed);
# (2) the whole model, B = 1 and 8: compile time (was 347 s with the kernels on, 69 s off),
# sync and pipelined step.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.97
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
T 200 python3 benchmarks/decode_kernels_check.py --preset flash --layers 4 --devices 2 \
  --expert 2 --matmul pallas --random-cache --context 4096 --batch 1 --steps 2 \
  | tee $OUT/check_flash4_x2.log
T ${LIMIT:-380} python3 -m benchmarks.decode_bench decode --preset flash --context 4096 \
  --steps 8 --devices 2 --expert 2 --matmul pallas --kernels on --batch 1 8 \
  | tee $OUT/flash43_x2_kernels.log
true
# optional (AB=1): the experimental jitted in-place scatters (decode.DEDUP_SCATTER): compile
# time and step time at B = 1; adopt only if the step time does not grow (no cache copies)
if [ "${AB:-0}" = 1 ]; then
  DSV4_DEDUP_SCATTER=1 T ${LIMIT:-380} python3 -m benchmarks.decode_bench decode --preset flash \
    --context 4096 --steps 8 --devices 2 --expert 2 --matmul pallas --kernels on --batch 1 \
    | tee $OUT/flash43_x2_dedup_scatter.log
fi
# optional (MP=1): the same whole-model bench as two processes, one per GPU
# (benchmarks/launch_local.sh): the single-process step is host bound (19.3 ms host
# enqueue for both GPUs against an 11.5 ms GPU span), each process launches only its GPU
if [ "${MP:-0}" = 1 ]; then
  LOGDIR=$OUT T ${LIMIT:-380} bash benchmarks/launch_local.sh 2 python3 -m benchmarks.decode_bench \
    decode --preset flash --context 4096 --steps 8 --devices 2 --expert 2 --matmul pallas \
    --kernels on --batch 1 | tee $OUT/flash43_x2_two_processes.log
fi
