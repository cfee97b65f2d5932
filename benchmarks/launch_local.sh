#!/usr/bin/env bash
# Run one process per GPU on this machine (multi-controller JAX): N copies of the command,
# copy i sees only GPU i (CUDA_VISIBLE_DEVICES=i) and joins through DSV4_COORDINATOR /
# DSV4_NUM_PROCESSES / DSV4_PROCESS_ID (dsv4_jax.distributed.init_processes_from_env, which
# `dsv4` and the decode bench call first). Each process then launches only its own GPU's
# step, so the host launch work is split across processes. Output: process 0's on stdout,
# the others' in $LOGDIR/proc<i>.log.
#   bash benchmarks/launch_local.sh 2 python3 -m benchmarks.decode_bench decode --devices 2 ...
set -u
N=$1; shift
PORT=${PORT:-$((20000 + RANDOM % 20000))}
LOGDIR=${LOGDIR:-${OUT:-/tmp}}
pids=()
for ((i = 1; i < N; i++)); do
  CUDA_VISIBLE_DEVICES=${GPUS_PER_PROC:-$i} DSV4_COORDINATOR=127.0.0.1:$PORT DSV4_NUM_PROCESSES=$N \
    DSV4_PROCESS_ID=$i "$@" > "$LOGDIR/proc$i.log" 2>&1 &
  pids+=($!)
done
CUDA_VISIBLE_DEVICES=${GPUS_PER_PROC:-0} DSV4_COORDINATOR=127.0.0.1:$PORT DSV4_NUM_PROCESSES=$N \
  DSV4_PROCESS_ID=0 "$@"
rc=$?
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
