#!/usr/bin/env bash
# Queued in session 34 (2026-11-28) for the next session's device calls, one PART each,
# output in $OUT; each PART's timeouts sum to <= 600 s. Note: T() drops every line with
# "warn" in it, pytest's summary line included: count the dots / F's in the log.
# 1 (H100, kind nvidia-h100-x1): the L2 prefetch of the compressed rows a block or two
#   ahead (DSV4_ATTN_L2PF=1|2, built in session 34, compile-only: double_k 16 B of spills,
#   seesaw none) in double_k and the seesaw kernel: bit-identity (GPU test), then GPU time
#   at the three CSA shapes of session 34 run4 (double_k 31.9 / 46.0 / 12.9 us, seesaw
#   34.9 / 45.2 / 12.4). The seesaw lost Flash CSA B=64 to its gathers' latency (one
#   staging slot, ~one short block to land): if L2 prefetch hides that, seesaw + L2PF
#   could beat double_k there. DSV4_ATTN_SS_B=eager (the producer announces chunks 4-6 as
#   they land instead of after the rope's gate) is the other seesaw producer variant.
# 2 (H100): HCA with the prefetch; the seesaw at B = 1 / 4 and with one split at B = 64
#   (its shorter chain against the merge it saves: double_k one split 41.3 us, s29).
# Run on an H200 (no H100 was lent in session 35): PART=1 = run1. The L2 prefetch measured
# slower everywhere (Flash CSA B=64: double_k 28.9 -> 30.5 / 30.6 us, seesaw 29.9 -> 30.7 /
# 32.2) and was removed after run1: on later commits DSV4_ATTN_L2PF is ignored and the
# "l2_prefetch" GPU test is gone; PARTs 1b-3 were not run.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 DSV4_COMPILE_CACHE=off
T() { timeout -s KILL "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
V="cpasync+idp"
case "${PART:-1}" in
1)
  S="$V:DSV4_ATTN_SEESAW=1"
  T 260 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_sparse_decode_attention.py \
    -k "l2_prefetch and csa" 2>&1 | tee $OUT/pytest_l2pf.log | grep -v "^$" | tail -4
  T 320 python3 benchmarks/attn_probe.py --roofline --rounds 3 --cases flash:csa:64:131072 \
    --variants $V,$V:DSV4_ATTN_L2PF=1,$V:DSV4_ATTN_L2PF=2,$S,$S:DSV4_ATTN_L2PF=1,$S:DSV4_ATTN_L2PF=2,$S:DSV4_ATTN_SS_B=eager,$S:DSV4_ATTN_SS_B=eager:DSV4_ATTN_L2PF=2 \
    | tee $OUT/attn_l2pf_flash64.log | grep "^|\|^  " ;;
1b) # the best of PART=1 at Pro CSA B = 32 and Flash CSA B = 8 (edit the variants)
  S="$V:DSV4_ATTN_SEESAW=1"
  T 300 python3 benchmarks/attn_probe.py --roofline --rounds 3 --cases pro:csa:32:131072,flash:csa:8:131072 \
    --variants $V,$V:DSV4_ATTN_L2PF=2,$S,$S:DSV4_ATTN_L2PF=2,$S:DSV4_ATTN_SS_B=eager:DSV4_ATTN_L2PF=2 \
    | tee $OUT/attn_l2pf_csa.log | grep "^|\|^  " ;;
2)
  H="cpasync+hid"
  T 200 python3 benchmarks/attn_probe.py --roofline --rounds 3 --cases flash:hca:64:131072,pro:hca:32:131072 \
    --variants $H,$H:DSV4_ATTN_L2PF=2,$H:DSV4_ATTN_SEESAW=1,$H:DSV4_ATTN_SEESAW=1:DSV4_ATTN_L2PF=2 \
    | tee $OUT/attn_l2pf_hca.log | grep "^|\|^  "
  T 200 python3 benchmarks/attn_probe.py --roofline --rounds 3 --cases flash:csa:1:131072,flash:csa:4:131072 \
    --variants $V,$V:DSV4_ATTN_SEESAW=1 | tee $OUT/attn_seesaw_small.log | grep "^|\|^  "
  T 150 python3 benchmarks/attn_probe.py --roofline --rounds 3 --cases flash:csa:64:131072 \
    --variants $V,$V+s1,$V+s1:DSV4_ATTN_SEESAW=1,$V+s1:DSV4_ATTN_SEESAW=1:DSV4_ATTN_L2PF=2 \
    | tee $OUT/attn_seesaw_s1.log | grep "^|\|^  " ;;
3)  # (H100) where the seesaw's consumers wait: Mosaic's profiler (a profiled seesaw build
    # has 2 meta slots and 48 ranges a warpgroup to fit the SMEM: timelines only), both
    # kernels, Flash CSA B = 64 (session 34 run3: double_k's 5 blocks a CTA, qk_softmax
    # 15.5 us, pv 15.4, finish 3.9, wait_k 2.8 of ~50 us profiled)
  T 150 env DSV4_ATTN_SEESAW=1 python3 benchmarks/attn_timeline.py --case flash:csa:64:131072 \
    | tee $OUT/timeline_seesaw.log
  T 150 env DSV4_ATTN_SEESAW=1 DSV4_ATTN_SS_B=eager DSV4_ATTN_L2PF=2 python3 benchmarks/attn_timeline.py \
    --case flash:csa:64:131072 | tee $OUT/timeline_seesaw_eager_pf2.log
  T 150 python3 benchmarks/attn_timeline.py --case flash:csa:64:131072 | tee $OUT/timeline_dk.log ;;
esac
# H200 (kind nvidia-h200; session 35 found no H100 lent, only H200s): the defaults of every
# issue-5 kernel against the XLA path they replace, at the table's shapes, on this GPU.
# h1: attention (CSA B = 64 / 32 Pro / 8 / 1, HCA B = 64 / 32 Pro) and the fp4 / nvfp4
#     indexer scoring kernels alone (B = 64 / 32 / 8, 128K).
# h2: the indexer call with the XLA path (scores + top-k) at B = 64 / 8, 128K, and the
#     window append / compressed flush against XLA.
case "${PART:-1}" in
h1)
  T 240 python3 benchmarks/attn_probe.py --roofline --rounds 3 \
    --cases flash:csa:64:131072,pro:csa:32:131072,flash:csa:8:131072,flash:csa:1:131072 \
    --variants $V,xla | tee $OUT/h200_attn_csa.log | grep "^|\|^  "
  T 150 python3 benchmarks/attn_probe.py --roofline --rounds 3 \
    --cases flash:hca:64:131072,pro:hca:32:131072 \
    --variants cpasync+hid,xla | tee $OUT/h200_attn_hca.log | grep "^|\|^  "
  W=place:0:2:0:1:w
  T 180 python3 benchmarks/indexer_probe.py sweep --rounds 3 \
    --cases 64:131072,32:131072,8:131072 --variants fp4:$W,nvfp4:$W \
    | tee $OUT/h200_indexer.log | grep "^|\|device" ;;
h2)
  T 330 python3 benchmarks/indexer_attention.py --only indexer --out $OUT \
    --cases idx:64:131072:512,idx:8:131072:512 --formats fp4,nvfp4,fp8 \
    | tee $OUT/h200_indexer_xla.log | grep "^|"
  T 240 python3 benchmarks/kv_scatter_gather.py --final --budget-s 200 --out $OUT \
    | tee $OUT/h200_scatter.log | grep "^|" ;;
esac
# h3 (H200): the tunables chosen on the H100, checked on the H200: attention's key-block
#     splits (1 / default / 3) and the seesaw (it won Pro CSA B=32 and Flash CSA B=8 by 2-4%
#     on the H100) at CSA B=64 / Pro 32 / 8 and HCA B=64 / Pro 32; the fp4 / nvfp4
#     indexer's chunks a CTA (default 32 at these sizes / 16) at B=64 / 32, 128K.
if [ "${PART:-1}" = h3 ]; then
  S="$V:DSV4_ATTN_SEESAW=1"
  T 200 python3 benchmarks/attn_probe.py --roofline --rounds 3 \
    --cases flash:csa:64:131072,pro:csa:32:131072 \
    --variants $V,$V+s1,$V+s3,$S | tee $OUT/h200_attn_csa_tune.log | grep "^|\|^  "
  T 70 python3 benchmarks/attn_probe.py --roofline --rounds 3 --cases flash:csa:8:131072 \
    --variants $V,$S | tee $OUT/h200_attn_csa8_tune.log | grep "^|\|^  "
  H=cpasync+hid
  T 170 python3 benchmarks/attn_probe.py --roofline --rounds 3 \
    --cases flash:hca:64:131072,pro:hca:32:131072 \
    --variants $H,$H+s1,$H+s3,$H:DSV4_ATTN_SEESAW=1 | tee $OUT/h200_attn_hca_tune.log | grep "^|\|^  "
  W=place:0:2:0:1:w; W16=place:16:2:0:1:w
  T 120 python3 benchmarks/indexer_probe.py sweep --rounds 3 --cases 64:131072,32:131072 \
    --variants fp4:$W,fp4:$W16,nvfp4:$W,nvfp4:$W16 | tee $OUT/h200_indexer_cpc.log | grep "^|\|device"
fi
# h4 (H200): the seesaw against double_k at the shapes h3 did not cover (it won Pro CSA B=32
#     and Flash CSA B=8, lost Flash B=64 CSA / HCA, tied Pro HCA B=32): where to switch.
if [ "${PART:-1}" = h4 ]; then
  S="$V:DSV4_ATTN_SEESAW=1"
  T 120 python3 benchmarks/attn_probe.py --rounds 3 \
    --cases flash:csa:1:131072,flash:csa:4:131072,flash:csa:16:131072,flash:csa:32:131072 \
    --variants $V,$S | tee $OUT/h200_seesaw_flash.log | grep "^|\|^  "
  T 100 python3 benchmarks/attn_probe.py --rounds 3 \
    --cases pro:csa:1:131072,pro:csa:8:131072,pro:csa:16:131072 \
    --variants $V,$S | tee $OUT/h200_seesaw_pro.log | grep "^|\|^  "
fi
