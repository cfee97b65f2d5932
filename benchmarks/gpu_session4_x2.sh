#!/usr/bin/env bash
# Whole DeepSeek-V4-Flash (43 layers + head, synthetic weights in the real formats) decoding
# on 2 x H200 with expert parallelism (mesh expert=2): a tiny-preset mesh smoke first (stops
# the call early if the sharded step breaks), then the full model; args: decode_bench flags.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.97
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 120 python3 -m benchmarks.decode_bench decode --preset tiny --context 512 --steps 3 \
  --devices 2 --expert 2 --matmul pallas 2>&1 | grep -v -i "warn" | tail -3 | tee "$OUT/smoke.log"
grep -q "pipelined" "$OUT/smoke.log" || { echo "smoke failed"; exit 1; }
timeout "${LIMIT:-540}" python3 -m benchmarks.decode_bench decode --preset flash --context 4096 \
  --steps 8 --devices 2 --expert 2 "$@" 2>&1 | grep -v -i "warn" | tee "$OUT/flash_x2.log"
