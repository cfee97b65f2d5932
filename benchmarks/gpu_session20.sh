#!/usr/bin/env bash
# Session 20 (2026-11-26), one NVIDIA H200: the device calls as run, one PART each; their
# outputs are in benchmarks/results/session20_h200/runN (N = the call's number below).
# PART=1 (run1): "lutbf" GPU tests, then lut vs lutbf (fp4, nvfp4) -> lutbf the default.
# PART=2 (run2): step profile at B = 64, 128K (ONE token for all requests: step_anatomy's
#   old default, which routes every request to the same 6 experts) + decode check B = 1, 8.
# PART=3 / 4 (run3 / run4): the same profile with random tokens (the new default), with
#   and without CUDA graphs (without: kernels map to their HLO ops).
# PART=5 (run5): routed experts as the step groups them (quant_matmul --moe) + ncu.
# PART=6 (run6): attention GPU tests + ws-cpasync vs ws-lane vs triton64 (first cp.async form).
# PART=7 (run7): ncu of the first cp.async attention kernel (spills, bank conflicts).
# PART=8..10 (run8-run10): attn_probe after each fix (in-place P V; half-row cp.async
#   mapping and 56 / 224 registers; swizzled chunk-major nope buffer).
# PART=11 (run11): decode step vs pure JAX (B = 1, 8) and the B = 64, 128K step, mosaic
#   (new default) vs triton.
# PART=12 (run12): GPU tests + ncu of the final attention kernel.
# PART=13 (run13): step profile with the final kernels + B = 8, 32K step mosaic vs triton.
# PART=14 (run14): MoE tiles by gathers and the combine as gather + sum over k (slower:
#   reverted), and the mHC sums as einsum + sum at B = 64 (DSV4_HC_FUSED_ROWS=16).
# PART=15 (run15): MoE tiles by gathers, combine kept as scatter-add (the committed form):
#   step profile + the B = 64, 128K stream step.
# PART=16 (run16): decode step vs pure JAX with nvfp4 index keys (lutbf now their default).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 DSV4_COMPILE_CACHE=off
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn(\|stats = dict"; }
NCU="ncu --clock-control none --kernel-name regex:mosaic_gpu --launch-skip"
ANAT="benchmarks/step_anatomy.py --preset flash --layers 4 --batch 64 --context 131072 --matmul pallas --kernels on --merge-x-proj --profile"
BENCH="-m benchmarks.decode_bench decode --preset flash --layers 4 --kernels on --matmul pallas --what stream"
CHECK="benchmarks/decode_kernels_check.py --preset flash --layers 4 --random-cache --matmul pallas --batch 1 8 --context 32768 --steps 3 --index-format fp4"
ATT="flash:csa:64:32768,flash:hca:64:131072,pro:csa:32:32768,flash:csa:8:32768"
case "${PART:-1}" in
1)
  T 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer_decode.py -rA > $OUT/gpu_tests.log
  V=fp4:lut:0:2:0:1,fp4:lutbf:0:2:0:1,nvfp4:lut:0:2:0:1,nvfp4:lutbf:0:2:0:1
  T 200 python3 benchmarks/indexer_probe.py sweep --cases 64:131072,8:131072,1:32768 \
    --variants $V --out $OUT | tee $OUT/sweep.log ;;
2)
  T 200 python3 $ANAT --tokens same --top 40 > $OUT/anatomy_b64_128k.log
  T 240 python3 $CHECK > $OUT/check_flash4_fp4.log ;;
3) T 240 python3 $ANAT --top 45 > $OUT/anatomy_b64_128k_rand.log ;;
4) XLA_FLAGS=--xla_gpu_enable_command_buffer= T 240 python3 $ANAT --top 60 > $OUT/anatomy_b64_128k_rand_nograph.log ;;
5)
  T 280 python3 benchmarks/quant_matmul.py --sweep-only --moe 64 8 --budget 230 --out $OUT/moe
  XLA_PYTHON_CLIENT_PREALLOCATE=false T 150 $NCU 5 --launch-count 1 --section SpeedOfLight \
    --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section WarpStateStats python3 benchmarks/qmm_ncu_one.py 64 > $OUT/ncu_w13_b64.txt ;;
6)
  T 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sparse_decode_attention.py -k gpu_kernel_matches
  T 420 python3 benchmarks/attention_decode.py --variants ws-cpasync,ws-lane,triton64 \
    --trusted ws-lane,triton64 --all-variants --only $ATT,flash:csa:1:32768 --budget 330 --out $OUT/attn ;;
7|12)
  [ "$PART" = 12 ] && T 330 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_sparse_decode_attention.py tests/test_kernel_decode.py -rA > $OUT/gpu_tests.log
  XLA_PYTHON_CLIENT_PREALLOCATE=false T 200 $NCU 3 --launch-count 1 --section SpeedOfLight \
    --section ComputeWorkloadAnalysis --section WarpStateStats --section MemoryWorkloadAnalysis \
    --section MemoryWorkloadAnalysis_Tables python3 benchmarks/attn_ncu_one.py 64 cpasync \
    > $OUT/ncu_attn_cpasync.txt ;;
8|9|10)
  T 400 python3 benchmarks/attn_probe.py --cases $ATT,flash:csa:1:32768 \
    --variants cpasync,direct,triton | tee $OUT/probe.log ;;
11)
  T 200 python3 $CHECK > $OUT/check_flash4_fp4_mosaic.log
  for be in mosaic triton; do DSV4_ATTN_BACKEND=$be T 170 python3 $BENCH --batch 64 \
    --context 131072 --steps 10 > $OUT/flash4_b64_128k_$be.log; done ;;
13)
  T 150 python3 $ANAT --top 30 > $OUT/anatomy_b64_128k_mosaic.log
  for be in mosaic triton; do DSV4_ATTN_BACKEND=$be T 150 python3 $BENCH --batch 8 \
    --context 32768 --steps 20; done ;;
14)
  T 150 python3 $ANAT --top 40 > $OUT/anatomy_moe_gather.log
  DSV4_HC_FUSED_ROWS=16 T 150 python3 $ANAT --top 40 > $OUT/anatomy_moe_gather_hc16.log ;;
15)
  T 150 python3 $ANAT --top 40 > $OUT/anatomy_moe_xgather.log
  T 150 python3 $BENCH --batch 64 --context 131072 --steps 10 ;;
16) T 220 python3 ${CHECK/fp4/nvfp4} > $OUT/check_flash4_nvfp4.log ;;
esac
true
