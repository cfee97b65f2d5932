#!/usr/bin/env bash
# Queued for the next session with device time (session 21 ended with ~210 s).
# PART=1: the block-table clamp added after session 21's last GPU run (one min.u32 per key
#   in the producer; compile-checked only): the attention GPU tests incl. the new
#   ids-past-the-table test, and the op at the session-21 cases (expect run5's numbers:
#   34.7 / 52.3 / 50.3 / 14.8 / 11.8 us on an H200), then the in-kernel timeline at B = 1
#   and B = 8 (where the kernel's fixed cost, not the key blocks, dominates).
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
