#!/usr/bin/env bash
# Queued in session 29 (2026-11-27) for the next session's device calls, one PART each, on
# an H100 (kind nvidia-h100-x1), output in $OUT; each PART's timeouts sum to <= 600 s.
# 1: Nsight Compute of the attention kernel as it now runs by default (double_k, ids from
#    t), Flash CSA B=64 and Pro CSA B=32 at 128K: pipes, issue, stall reasons, against the
#    one-tile kernel (session 27: tensor pipe 28%) — where the restructure (q.k once a
#    block, the producer dequantising; MOSAIC_GPU_NOTES.md) should start.
# 2: key-block splits at small and middle batches. default_splits counts only the serial
#    key blocks, so Flash CSA B <= 8 takes 10 splits (one block a CTA), and each CTA
#    writes a 128 KB f32 partial that the XLA merge reads back: at B = 8, ~10.5 MB written
#    and read against 4 MB of keys. The rule was checked at B = 64 / Pro B = 32 only
#    (session 21). Times 10 / 5 / 3 / 2 splits (Flash CSA B = 8, 16; Pro CSA B = 8; Flash
#    HCA B = 8) against the default, with the roofline.
# 3 (added and run in session 30 at commit 03607ed; the variant was removed after it measured
#    slower, so on later commits the tests select nothing and the env knob is ignored): qk_dims ($DSV4_ATTN_QK_DIMS=1: each consumer scores its own 256
#    dims, the f32 partials exchanged through the idle K tile): GPU tests (vs the
#    reference and the full-score double_k; double_k's pv bit-identity tests, to show the
#    default path unchanged), then timed against double_k with the roofline.
# 4: the indexer's w_in_loop (head weights re-read from SMEM: 16 registers fewer, 5 CTAs
#    an SM instead of 4) with two chunks a step, never timed together.
# 5: where the double_k consumers wait: Nsight Compute's warp-state samples per SASS
#    instruction (SourceCounters), Flash CSA B=64 at 128K; the 40 instructions with the
#    most samples, with their stall reasons (the source page as CSV, gzipped).
# 6: the splits' merge as one Mosaic-GPU kernel (merge="kernel", merge.py) against XLA's two
#    fusions: GPU test, then timed (with each kernel's GPU time) at small and large batches.
# 7: the merge kernel as the default from B = 8: the decode check (kernels vs pure JAX, B=32,
#    128K, 4 Flash layers) and the B=64 stream step with the XLA merge and with the kernel.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 DSV4_COMPILE_CACHE=off
T() { timeout -s KILL "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
case "${PART:-1}" in
1)
  S="--section SpeedOfLight --section ComputeWorkloadAnalysis --section Occupancy --section WarpStateStats --section SchedulerStats"
  for c in "flash 64 1" "pro 32 1" "flash 64 0"; do
    set -- $c
    n=ncu_attn_$1_csa$2_dk$3
    DSV4_ATTN_DOUBLE_K=$3 XLA_PYTHON_CLIENT_PREALLOCATE=false T 170 ncu --clock-control none \
      --kernel-name regex:mosaic_gpu --launch-skip 3 --launch-count 1 $S -o $OUT/$n \
      python3 benchmarks/attn_ncu_one.py $2 cpasync csa $1 131072 > $OUT/$n.log 2>&1
    ncu -i $OUT/$n.ncu-rep --page details > $OUT/$n.txt 2>&1
    echo "== $n"
    grep -E "Duration|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Registers Per|highest-utilized|DRAM Throughput" $OUT/$n.txt | head -12
    ncu -i $OUT/$n.ncu-rep --page raw --csv 2>/dev/null | python3 -c "
import csv,sys
r=list(csv.reader(sys.stdin)); h,v=r[0],r[2]
for k,x in zip(h,v):
  if ('stall' in k and 'pct' not in k or ('pipe' in k and 'avg.pct_of_peak_sustained_active' in k)) and x not in ('','0'): print(k, x)" > $OUT/${n}_raw.txt 2>&1
    sort -t' ' -k2 -g -r $OUT/${n}_raw.txt | head -20
  done ;;
2)
  T 290 python3 benchmarks/attn_probe.py --roofline --rounds 2 \
    --cases flash:csa:8:131072,flash:csa:16:131072,pro:csa:8:131072 \
    --variants cpasync+idp,cpasync+idp+s2,cpasync+idp+s3,cpasync+idp+s5,cpasync+idp+s10 \
    | tee $OUT/attn_splits_csa.log | grep "^|"
  T 200 python3 benchmarks/attn_probe.py --roofline --rounds 2 --cases flash:hca:8:131072 \
    --variants cpasync+hid,cpasync+hid+s3,cpasync+hid+s5,cpasync+hid+s9 \
    | tee $OUT/attn_splits_hca.log | grep "^|" ;;
3)
  T 260 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_sparse_decode_attention.py \
    -k "qk_dims or (double_k_matches and pv)" 2>&1 | tee $OUT/pytest_qk_dims.log | grep -v "^$" | tail -20
  T 190 python3 benchmarks/attn_probe.py --roofline --rounds 3 \
    --cases flash:csa:64:131072,pro:csa:32:131072,flash:csa:8:131072,pro:csa:8:131072 \
    --variants cpasync+idp,cpasync+idp:DSV4_ATTN_QK_DIMS=1 | tee $OUT/attn_qk_dims_csa.log | grep "^|"
  T 130 python3 benchmarks/attn_probe.py --roofline --rounds 3 \
    --cases flash:hca:64:131072,pro:hca:32:131072 \
    --variants cpasync+hid,cpasync+hid:DSV4_ATTN_QK_DIMS=1 | tee $OUT/attn_qk_dims_hca.log | grep "^|" ;;
4)
  T 400 python3 benchmarks/indexer_probe.py sweep --rounds 3 --cases 64:131072,32:131072,8:131072 \
    --variants fp4:place:0:2:0:1:w:0:2,fp4:place:0:2:0:1:w:1:2,nvfp4:place:0:2:0:1:w:0:2,nvfp4:place:0:2:0:1:w:1:2 \
    | tee $OUT/indexer_wloop.log | grep "^|" ;;
5)
  n=ncu_attn_flash_csa64_src
  XLA_PYTHON_CLIENT_PREALLOCATE=false T 200 ncu --clock-control none --kernel-name regex:mosaic_gpu \
    --launch-skip 3 --launch-count 1 --section SourceCounters --section WarpStateStats \
    --import-source no -o $OUT/$n python3 benchmarks/attn_ncu_one.py 64 cpasync csa flash 131072 \
    > $OUT/$n.log 2>&1
  ncu -i $OUT/$n.ncu-rep --page source --csv --print-source sass > $OUT/${n}_sass.csv 2>&1
  python3 benchmarks/ncu_top_stalls.py $OUT/${n}_sass.csv 40 | tee $OUT/${n}_top.txt
  gzip $OUT/${n}_sass.csv; rm -f $OUT/$n.ncu-rep ;;
6)
  T 200 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_sparse_decode_attention.py \
    -k "merge_kernel" 2>&1 | tee $OUT/pytest_merge.log | grep -v "^$" | tail -8
  T 200 python3 benchmarks/attn_probe.py --roofline --events --rounds 3 \
    --cases flash:csa:64:131072,pro:csa:32:131072,flash:csa:8:131072,pro:csa:8:131072,flash:csa:1:32768 \
    --variants cpasync+idp,cpasync+idp:DSV4_ATTN_MERGE=kernel | tee $OUT/attn_merge_csa.log | grep "^|\|^  "
  T 150 python3 benchmarks/attn_probe.py --roofline --events --rounds 3 \
    --cases flash:hca:64:131072,pro:hca:32:131072,flash:hca:8:131072 \
    --variants cpasync+hid,cpasync+hid:DSV4_ATTN_MERGE=kernel | tee $OUT/attn_merge_hca.log | grep "^|\|^  " ;;
7)
  T 220 python3 benchmarks/decode_kernels_check.py --preset flash --layers 4 \
    --random-cache --matmul pallas --batch 32 --context 131072 --steps 3 --index-format fp4 \
    | tee $OUT/check_b32_merge.log | grep -E "median|Error"
  BENCH="-m benchmarks.decode_bench decode --preset flash --layers 4 --kernels on --matmul pallas --what stream"
  for mg in xla kernel xla kernel; do
    DSV4_ATTN_MERGE=$mg T 120 python3 $BENCH --batch 64 --context 131072 --steps 10 \
      | tee -a $OUT/b64_merge_$mg.log | grep -E "stream step" | head -1
  done ;;
esac
