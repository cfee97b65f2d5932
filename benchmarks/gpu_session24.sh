#!/usr/bin/env bash
# Session 24 (2026-11-26): the device calls as run, one PART each (on an H100, kind
# nvidia-h100-x1); output in benchmarks/results/session24_h100/runN, results in
# BENCHMARKS.md ("2026-11-26, session 24").
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 DSV4_COMPILE_CACHE=off
T() { timeout -s KILL "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
case "${PART:-1}" in
1)
  # Session 23's PART=7, never run: the cluster merge after the receive-barrier count fix
  # (Pallas inits a Lane-semantics Barrier with num_arrivals x 128; st.async arrives from
  # each of the sender's 128 threads). The probe's three modes (killed after 60 s each),
  # the cluster-vs-XLA-merge GPU test, then the op with the merge on vs off.
  for m in bar store both; do timeout -s KILL 60 python3 benchmarks/cluster_probe.py $m 2>&1 \
    | grep -E "^(bar|store|both)|Error" | tee -a $OUT/cluster_probe.log; done
  T 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sparse_decode_attention.py -rA \
    -k "cluster" | tee $OUT/gpu_tests.log | grep -E "passed|failed|FAILED|Error"
  T 200 python3 benchmarks/attn_probe.py --cases flash:csa:64:32768,flash:hca:64:131072,pro:csa:32:32768 \
    --rounds 3 --events --variants cpasync+idp,cpasync+idp:DSV4_ATTN_MERGE=auto \
    | tee $OUT/probe.log | grep -v "^{" ;;
2)
  # Run1: the cluster merge runs and is correct (rel err unchanged) but slower (kernel +6.1
  # to +7.6 us, more than the XLA merge's 5.4); its GPU test had a bad pool size (fixed).
  # New: DSV4_ATTN_DEQ=bf16 (e4m3 -> bf16 by bit placement + two bf16 multiplies: 5
  # instructions a pair instead of 6, 16 registers a chunk instead of 32) and pipe
  # (DSV4_ATTN_PIPE=1: each consumer's dequant interleaved with its score wgmmas; c re-read
  # from SMEM each block, else ptxas spills the hoisted descriptors). Compile-only sm_90a:
  # no spills in any of the four forms; the default's SASS equals HEAD's.
  # The attention GPU tests (new: the dequant's exactness on every code and exponent, pipe
  # and bf16 against the default, the fixed cluster test), then the op at five cases.
  T 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sparse_decode_attention.py -rA \
    -k "not triton" | tee $OUT/gpu_tests.log | grep -E "passed|failed|FAILED|Error|assert"
  ATT="flash:csa:64:32768,flash:hca:64:131072,pro:csa:32:32768,flash:csa:8:32768,flash:csa:1:32768"
  V=cpasync+idp,cpasync+idp:DSV4_ATTN_DEQ=bf16,cpasync+idp:DSV4_ATTN_PIPE=1
  V=$V,cpasync+idp:DSV4_ATTN_DEQ=bf16:DSV4_ATTN_PIPE=1
  T 300 python3 benchmarks/attn_probe.py --cases $ATT --rounds 2 --variants $V \
    | tee $OUT/probe.log | grep "^|" ;;
esac
