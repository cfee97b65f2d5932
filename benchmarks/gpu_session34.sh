#!/usr/bin/env bash
# Queued in session 33 (2026-11-28) for the next session's device calls, one PART each,
# output in $OUT; each PART's timeouts sum to <= 600 s.
# 1 (H100, kind nvidia-h100-x1, ~5 min): the seesaw protocol toy (benchmarks/seesaw_probe.py,
#   built and interpreter-tested in session 33, never run on a GPU): q.k once a block
#   (consumer i % 2 owns block i, publishes P and the row statistics through SMEM) against
#   both consumers scoring every block (double_k's form), on bf16 keys copied by TMA. GPU
#   tests (all forms bit-identical, within 1e-2 of float64), then GPU time at 128 CTAs x 5
#   blocks (the Flash CSA B=64 grid), 64 x 10 and 132 x 10, each with every block copied
#   and with only blocks 0-1 copied (the consumers' chain alone). sm_90a spills: dup 48 B,
#   seesaw 136 B, seesaw_nest 84 B (ptxas 13.0). If seesaw wins clearly with the copies
#   off, the real kernel's version is worth its SMEM problem (MOSAIC_GPU_NOTES.md).
#   Hangs are possible on a first run of a new barrier protocol: timeout -s KILL.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 DSV4_COMPILE_CACHE=off
T() { timeout -s KILL "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
case "${PART:-1}" in
1)
  T 200 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_seesaw_probe.py 2>&1 \
    | tee $OUT/pytest_seesaw.log | grep -v "^$" | tail -6
  T 330 python3 benchmarks/seesaw_probe.py --rounds 3 --cases 128:320,64:640,132:640 \
    | tee $OUT/seesaw_probe.log | grep "^|\|device\|identical" ;;
esac
