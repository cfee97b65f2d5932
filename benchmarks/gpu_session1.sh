#!/usr/bin/env bash
# One device call: GPU proof of the kernel decode path (tiny + full-width Flash layers).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import jax; print(jax.__version__, jax.devices())"
python3 benchmarks/decode_kernels_check.py --preset tiny --batch 2 --context 300 --steps 8 --chunk 128 2>&1 | grep -v -i warn | tee $OUT/tiny.log
python3 benchmarks/decode_kernels_check.py --preset flash --layers 4 --batch 1 8 --context 4096 --steps 10 --chunk 512 2>&1 | grep -v -i warn | tee $OUT/flash.log
python3 -m benchmarks.decode_bench decode --preset flash --layers 4 --batch 1 8 32 --context 4096 --steps 10 2>&1 | grep -v -i warn | tee $OUT/bench_off.log
python3 -m benchmarks.decode_bench decode --preset flash --layers 4 --batch 1 8 32 --context 4096 --steps 10 --kernels on 2>&1 | grep -v -i warn | tee $OUT/bench_on.log
