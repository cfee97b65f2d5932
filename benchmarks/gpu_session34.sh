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
#   Ran in session 34: benchmarks/results/session34_h100/seesaw_probe.log.
# 2 (H100): the seesaw attention kernel (_attn_call_ss, DSV4_ATTN_SEESAW=1; built in session
#   34, compile-only: 812 B of spills at ptxas' 168 registers, q's rope columns held in
#   registers): bit-identity with double_k (GPU tests), then GPU time against double_k.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 DSV4_COMPILE_CACHE=off
T() { timeout -s KILL "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
case "${PART:-1}" in
1)
  T 200 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_seesaw_probe.py 2>&1 \
    | tee $OUT/pytest_seesaw.log | grep -v "^$" | tail -6
  T 330 python3 benchmarks/seesaw_probe.py --rounds 3 --cases 128:320,64:640,132:640 \
    | tee $OUT/seesaw_probe.log | grep "^|\|device\|identical" ;;
2)
  T 200 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_sparse_decode_attention.py \
    -k "seesaw_matches" 2>&1 | tee $OUT/pytest_seesaw_attn.log | grep -v "^$" | tail -8
  T 250 python3 benchmarks/attn_probe.py --roofline --rounds 3 \
    --cases flash:csa:64:131072,pro:csa:32:131072,flash:csa:8:131072 \
    --variants cpasync+idp,cpasync+idp:DSV4_ATTN_SEESAW=1 | tee $OUT/attn_seesaw_csa.log | grep "^|\|^  "
  T 130 python3 benchmarks/attn_probe.py --roofline --rounds 3 --cases flash:hca:64:131072 \
    --variants cpasync+hid,cpasync+hid:DSV4_ATTN_SEESAW=1 | tee $OUT/attn_seesaw_hca.log | grep "^|\|^  " ;;
3)  # (H100) why seesaw is slower (run2: Flash CSA B=64 50.5 vs 32.9 us): Mosaic's in-kernel
    # profiler per warpgroup scope, both kernels; and both with the row copies ablated
  T 150 env DSV4_ATTN_SEESAW=1 python3 benchmarks/attn_timeline.py --case flash:csa:64:131072 \
    | tee $OUT/timeline_seesaw.log
  T 150 python3 benchmarks/attn_timeline.py --case flash:csa:64:131072 | tee $OUT/timeline_dk.log
  T 250 python3 benchmarks/attn_probe.py --rounds 3 --cases flash:csa:64:131072 \
    --variants cpasync+idp,cpasync+idp:DSV4_ATTN_SEESAW=1,cpasync+idp:DSV4_ATTN_ABLATE=copy,cpasync+idp:DSV4_ATTN_SEESAW=1:DSV4_ATTN_ABLATE=copy \
    | tee $OUT/attn_seesaw_ablate.log | grep "^|\|^  " ;;
4)  # (H100) seesaw with q_s indexed from SMEM (spills 812 -> 176 B; 0 with the next
    # block's chunks 4-6 dequantised under P V, DSV4_ATTN_SS_DEQ_AT=pv)
  T 240 python3 benchmarks/attn_probe.py --roofline --rounds 3 \
    --cases flash:csa:64:131072,pro:csa:32:131072,flash:csa:8:131072 \
    --variants cpasync+idp,cpasync+idp:DSV4_ATTN_SEESAW=1,cpasync+idp:DSV4_ATTN_SEESAW=1:DSV4_ATTN_SS_DEQ_AT=pv \
    | tee $OUT/attn_seesaw2_csa.log | grep "^|\|^  "
  T 120 python3 benchmarks/attn_probe.py --rounds 3 --cases flash:csa:64:131072 \
    --variants cpasync+idp:DSV4_ATTN_ABLATE=copy,cpasync+idp:DSV4_ATTN_SEESAW=1:DSV4_ATTN_ABLATE=copy,cpasync+idp:DSV4_ATTN_SEESAW=1:DSV4_ATTN_SS_DEQ_AT=pv:DSV4_ATTN_ABLATE=copy \
    | tee $OUT/attn_seesaw2_ablate.log | grep "^|\|^  "
  T 200 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_sparse_decode_attention.py \
    -k "seesaw_matches and csa" 2>&1 | tee $OUT/pytest_seesaw2.log | grep -v "^$" | tail -4 ;;
5)  # (H100) run4's pytest was cut by its 200 s limit after one of the two csa tests: the
    # seesaw's default (DSV4_ATTN_SS_DEQ_AT=pv) against double_k, csa and hca cases
  T 420 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_sparse_decode_attention.py \
    -k "seesaw_matches and pv" 2>&1 | tee $OUT/pytest_seesaw_pv.log | grep -E "passed|failed|Error" | tail -4 ;;
esac
