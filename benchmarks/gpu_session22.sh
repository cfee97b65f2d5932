#!/usr/bin/env bash
# Queued for the next session with device time (session 21 ended with ~210 s).
# PART=1: two changes made after session 21's last GPU run, compile-checked (no spills)
#   and interpreter-tested only: the producer clamps the block-table column (one min.u32
#   a key) and the epilogue multiplies by one reciprocal per row instead of dividing the
#   tile (SASS 3832 -> 3456 instructions). The attention GPU tests incl. the new
#   ids-past-the-table test, the op at the session-21 cases (run5 had 34.7 / 52.3 / 50.3 /
#   14.8 / 11.8 us on an H200), then the in-kernel timeline at B = 1 and B = 8 (where the
#   kernel's fixed cost, not the key blocks, dominates).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 DSV4_COMPILE_CACHE=off
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
ATT="flash:csa:64:32768,flash:hca:64:131072,pro:csa:32:32768,flash:csa:8:32768,flash:csa:1:32768"
case "${PART:-1}" in
1)
  T 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sparse_decode_attention.py -rA \
    -k "not triton" | tee $OUT/gpu_tests.log | grep -E "passed|failed|FAILED|Error"
  T 200 python3 benchmarks/attn_probe.py --cases $ATT --variants cpasync,triton --events \
    | tee $OUT/probe.log
  for c in flash:csa:1:32768 flash:csa:8:32768; do
    T 60 python3 benchmarks/attn_timeline.py --case $c | tee -a $OUT/timeline.log
  done ;;
esac
true
