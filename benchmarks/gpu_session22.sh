#!/usr/bin/env bash
# Session 22 (2026-11-26): the device calls as run, one PART each (PART=1-3 on an H200,
# 4-8 on an H100, kind nvidia-h100-x1); output in benchmarks/results/session22_*/runN,
# results in BENCHMARKS.md ("2026-11-26, session 22"). PART=3's defer variant was removed
# after the run (no gain); its variants no longer parse.
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
BENCH="-m benchmarks.decode_bench decode --preset flash --layers 4 --kernels on --matmul pallas --what stream"
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
2)
  # The indexer scoring kernel with barriers="manual" (one warpgroup barrier a chunk instead
  # of Pallas' six, block-table loads an iteration ahead): GPU tests, the sweep against
  # "auto" and deeper rings / longer CTAs, then Nsight Compute (stall reasons, per-SASS
  # source counters) of the manual fp4 kernel at B = 64, 128K.
  T 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer_decode.py -rA \
    -k "manual or lut_dequant or pipeline" | tee $OUT/gpu_tests.log | grep -E "passed|failed|FAILED|Error"
  V=fp4:lutbf:0:2:0:1:a,fp4:lutbf:0:2:0:1:m,fp4:lutbf:0:3:0:1:m,fp4:lutbf:0:4:0:1:m
  V=$V,fp4:lutbf:16:2:0:1:m,fp4:lutbf:16:3:0:1:m,nvfp4:lutbf:0:2:0:1:a,nvfp4:lutbf:0:2:0:1:m
  V=$V,fp8:bits:0:2:0:1:a,fp8:bits:0:2:0:1:m
  T 240 python3 benchmarks/indexer_probe.py sweep --cases 64:131072,8:131072,1:32768 --variants $V \
    --out $OUT | tee $OUT/sweep.log | grep -v "^{"
  S="--section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section SourceCounters"
  for v in fp4:lutbf:0:2:0:1:a fp4:lutbf:0:2:0:1:m; do
    n=ncu_${v//:/_}
    XLA_PYTHON_CLIENT_PREALLOCATE=false T 120 ncu --clock-control none --kernel-name regex:mosaic_gpu \
      --launch-skip 1 --launch-count 1 $S -o $OUT/$n python3 benchmarks/indexer_probe.py run \
      --cases 64:131072 --variants $v > $OUT/$n.log 2>&1
    ncu -i $OUT/$n.ncu-rep --page details > $OUT/$n.txt 2>&1
    grep -E "Duration|Issue Slots Busy|Issued Ipc|No Eligible|Warp Cycles Per Issued|Achieved Occupancy|Registers Per|Block Limit|Stall" $OUT/$n.txt | head -30
  done
  ncu -i $OUT/$n.ncu-rep --page source --csv --print-source sass > $OUT/${n}_sass.csv 2>&1 \
    || ncu -i $OUT/$n.ncu-rep --page source --csv > $OUT/${n}_sass.csv 2>&1
  head -c 600 $OUT/${n}_sass.csv; wc -l $OUT/${n}_sass.csv ;;
3)
  # defer: chunks in pairs with two accumulators (chunk j's wgmma under chunk j+1's wait and
  # dequant, chunk j+1's under chunk j's scores); 166 registers, 3 CTAs an SM. GPU tests
  # (bit-identical to auto / no defer), the sweep, ncu stall reasons of the defer kernel.
  T 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer_decode.py -rA \
    -k "manual or lut_dequant" | tee $OUT/gpu_tests.log | grep -E "passed|failed|FAILED|Error"
  V=fp4:lutbf:0:2:0:1:m:0,fp4:lutbf:0:2:0:1:m:1,fp4:lutbf:0:3:0:1:m:1,fp4:lutbf:0:4:0:1:m:1
  V=$V,fp4:lutbf:16:3:0:1:m:1,fp4:lutbf:0:3:0:1:a:1,nvfp4:lutbf:0:2:0:1:m:0,nvfp4:lutbf:0:3:0:1:m:1
  V=$V,fp8:bits:0:2:0:1:m:0,fp8:bits:0:3:0:1:m:1
  T 240 python3 benchmarks/indexer_probe.py sweep --cases 64:131072,8:131072,1:32768 --variants $V \
    --out $OUT | tee $OUT/sweep.log | grep -v "^{"
  S="--section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats"
  for v in fp4:lutbf:0:3:0:1:m:1; do
    XLA_PYTHON_CLIENT_PREALLOCATE=false T 120 ncu --clock-control none --kernel-name regex:mosaic_gpu \
      --launch-skip 1 --launch-count 1 $S -o /tmp/r python3 benchmarks/indexer_probe.py run \
      --cases 64:131072 --variants $v > /dev/null 2>&1
    ncu -i /tmp/r.ncu-rep --page details > $OUT/ncu_defer.txt 2>&1
    ncu -i /tmp/r.ncu-rep --page raw --csv 2>/dev/null | python3 -c "
import csv,sys
r=list(csv.reader(sys.stdin)); h,u,v=r[0],r[1],r[2]
for k,x in zip(h,v):
  if 'stall' in k and 'pct' not in k and x not in ('','0'): print(k, x)" > $OUT/ncu_defer_stalls.txt 2>&1
    grep -E "Duration|Issued Warp|No Eligible|Warp Cycles Per Issued|Achieved Active|Registers Per|Block Limit Reg" $OUT/ncu_defer.txt
    sort -t' ' -k2 -g -r $OUT/ncu_defer_stalls.txt | head -25
  done ;;
4)  # on an H100 (kind nvidia-h100-x1), the target GPU. defer was removed after
    # PART=3 (no gain). New since the last GPU run: the bf16 lookup program without the
    # negative table (5 prmt a register instead of 6), barriers="manual" the default.
    # GPU tests of both kernels; the attention op at the five cases (cpasync vs Triton);
    # the indexer (fp4 / nvfp4 / fp8, manual vs auto) at B = 64 / 8, 128K; the decode
    # check (kernels vs pure JAX) and the B = 64, 128K step.
  T 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer_decode.py \
    tests/test_sparse_decode_attention.py -rA -k "not triton" | tee $OUT/gpu_tests.log \
    | grep -E "passed|failed|FAILED|Error"
  T 150 python3 benchmarks/attn_probe.py --cases $ATT --variants cpasync,triton --rounds 2 \
    | tee $OUT/probe_h100.log | grep "^|"
  V=fp4:lutbf:0:2:0:1:m,fp4:lutbf:0:2:0:1:a,nvfp4:lutbf:0:2:0:1:m,nvfp4:lutbf:0:2:0:1:a
  V=$V,fp8:bits:0:2:0:1:m,fp8:bits:0:2:0:1:a
  T 150 python3 benchmarks/indexer_probe.py sweep --cases 64:131072,8:131072 --variants $V \
    --out $OUT | tee $OUT/idx_h100.log | grep -v "^{"
  T 150 python3 benchmarks/decode_kernels_check.py --preset flash --layers 4 --random-cache \
    --matmul pallas --batch 1 8 --context 32768 --steps 3 | tee $OUT/check.log | grep -E "median"
  T 120 python3 $BENCH --batch 64 --context 131072 --steps 10 | tee $OUT/b64.log \
    | grep -E "stream step" | head -1 ;;
5)  # on an H100: the indexer after run4 (kernel reads the raw block table and t, q halves
    # by TMA: no XLA prep; w loaded once a CTA; lutbf's register table words from SMEM:
    # loop 435 -> 412 SASS instructions). GPU tests, the sweep at B = 64 / 8 / 1 (manual
    # vs auto), the decode check (kernels vs pure JAX) at B = 1 and 8.
  T 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer_decode.py -rA \
    | tee $OUT/gpu_tests.log | grep -E "passed|failed|FAILED|Error"
  V=fp4:lutbf:0:2:0:1:m,fp4:lutbf:0:2:0:1:a,nvfp4:lutbf:0:2:0:1:m,fp8:bits:0:2:0:1:m
  T 150 python3 benchmarks/indexer_probe.py sweep --cases 64:131072,8:131072,1:32768 --variants $V \
    --out $OUT | tee $OUT/idx_h100.log | grep -v "^{"
  T 220 python3 benchmarks/decode_kernels_check.py --preset flash --layers 4 --random-cache \
    --matmul pallas --batch 1 8 --context 32768 --steps 3 | tee $OUT/check.log | grep -E "median" ;;
6)  # on an H100: the kernels against the XLA paths they replace, in the same run (the
    # issue's benchmark scripts): attention (ws-cpasync, Triton, XLA) at the five cases,
    # the indexer scoring + top-k (fp4 / nvfp4 / fp8 keys) at B = 64 / 8, 128K and B = 1, 4K.
  T 330 python3 benchmarks/attention_decode.py --variants ws-cpasync,triton64 --trusted triton64 \
    --all-variants --only $ATT --budget 270 --out $OUT/attn | grep -E "^\| (flash|pro)|ceiling"
  T 240 python3 benchmarks/indexer_attention.py --out $OUT --only indexer --dequant lutbf \
    --formats nvfp4,fp8 --cases idx:64:131072:512,idx:8:131072:512,idx:1:4096:512 \
    | tee $OUT/indexer.log | grep -E "^\| indexer|ceiling" ;;
7)  # on an H100: nvfp4 scales converted by the hardware (e4m3 -> f16) instead of ~12
    # integer ops each (chunk loop 602 -> 486 SASS instructions). Indexer GPU tests incl. a
    # new every-code-and-scale nvfp4 test, the nvfp4 / fp4 sweep.
  T 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer_decode.py -rA \
    | tee $OUT/gpu_tests.log | grep -E "passed|failed|FAILED|Error"
  T 120 python3 benchmarks/indexer_probe.py sweep --cases 64:131072,8:131072 \
    --variants nvfp4:lutbf:0:2:0:1:m,fp4:lutbf:0:2:0:1:m --out $OUT | tee $OUT/idx_h100.log \
    | grep -v "^{" ;;
8)  # on an H100: attention's ids_prefix (the decode step's default for compressed layers:
    # the key-block bound from t in-kernel, no XLA reduce over the ids). GPU tests incl. the
    # new bit-identity test, the op at the five cases with and without it, the decode check.
  T 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sparse_decode_attention.py \
    -rA -k "not triton" | tee $OUT/gpu_tests.log | grep -E "passed|failed|FAILED|Error"
  T 200 python3 benchmarks/attn_probe.py --cases $ATT --variants cpasync,cpasync+idp --events \
    --rounds 2 | tee $OUT/probe.log | grep -E "^\||cpasync"
  T 220 python3 benchmarks/decode_kernels_check.py --preset flash --layers 4 --random-cache \
    --matmul pallas --batch 1 8 --context 32768 --steps 3 | tee $OUT/check.log | grep -E "median" ;;
esac
true
