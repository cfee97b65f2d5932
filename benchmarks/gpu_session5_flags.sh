#!/usr/bin/env bash
# H100: XLA GPU flags that might cut the small kernels around the matmul kernels (the
# normalisation "diamonds": RMSNorm and the per-128 activation-quant amax, each a reduce
# kernel plus an elementwise kernel today) or the launch cost. One SWA + CSA + HCA step +
# head, every kernel on: kernels in the step, sync step, host enqueue, pipelined.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
for F in "" \
  "--xla_gpu_experimental_enable_triton_softmax_priority_fusion=true" \
  "--xla_gpu_enable_triton_softmax_fusion=true" \
  "--xla_gpu_experimental_enable_triton_heroless_priority_fusion=true" \
  "--xla_gpu_experimental_enable_fusion_block_level_rewriter=true" \
  "--xla_gpu_graph_enable_concurrent_region=true"; do
  echo "== XLA_FLAGS='$F'"
  XLA_FLAGS="$F" timeout 110 python3 benchmarks/step_anatomy.py --ratios 0 4 128 \
    --matmul pallas --kernels on --top 0 2>&1 | grep -v -i "warn" | grep -i "kernels in\|^step\|error\|unknown" | head -5
done 2>&1 | tee $OUT/flags.log
true
