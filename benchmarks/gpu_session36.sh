#!/usr/bin/env bash
# Queued in session 35 (2026-11-28) for the next session's device calls (H200, kind
# nvidia-h200: no H100 was lent in session 35), one PART each, output in $OUT; each PART's
# timeouts sum to <= 600 s. T() drops every line with "warn" in it, pytest's summary line
# included: count the dots / F's in the log.
# 1: the seesaw's auto rule (session 35: the seesaw for Pro's heads or B <= 8) at the shapes
#    session 35's lease did not reach: Flash CSA B = 16 / 32 (auto: double_k), Pro CSA
#    B = 8 / 16 and Pro HCA B = 8 / 1 (auto: seesaw), each against the other kernel; then
#    the decode step with kernels on vs pure JAX at B = 8 (the seesaw's first run inside
#    the step; 4 full-width Flash layers, random cache, 128K, fp4 index keys).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 DSV4_COMPILE_CACHE=off
T() { timeout -s KILL "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
V="cpasync+idp"
H="cpasync+hid"
case "${PART:-1}" in
1)
  T 130 python3 benchmarks/attn_probe.py --rounds 3 --cases flash:csa:16:131072,flash:csa:32:131072 \
    --variants $V:DSV4_ATTN_SEESAW=0,$V:DSV4_ATTN_SEESAW=1 | tee $OUT/seesaw_flash_mid.log | grep "^|\|^  "
  T 130 python3 benchmarks/attn_probe.py --rounds 3 --cases pro:csa:8:131072,pro:csa:16:131072 \
    --variants $V:DSV4_ATTN_SEESAW=0,$V:DSV4_ATTN_SEESAW=1 | tee $OUT/seesaw_pro_csa.log | grep "^|\|^  "
  T 100 python3 benchmarks/attn_probe.py --rounds 3 --cases pro:hca:8:131072,pro:hca:1:131072 \
    --variants $H:DSV4_ATTN_SEESAW=0,$H:DSV4_ATTN_SEESAW=1 | tee $OUT/seesaw_pro_hca.log | grep "^|\|^  "
  T 230 python3 benchmarks/decode_kernels_check.py --preset flash --layers 4 \
    --random-cache --matmul pallas --batch 8 --context 131072 --steps 3 --index-format fp4 \
    | tee $OUT/check_b8_seesaw.log | grep -E "median|Error|argmax" ;;
esac
