#!/usr/bin/env bash
# 2 x H200: find the change that made the whole-Flash step stop pipelining on the expert
# mesh (2026-11-22 run: sync 22.15 / pipelined 14.83 ms; 2026-11-23: 24.82 / 26.56 ms).
# 10 Flash layers (compile ~1 min instead of ~4), B=1, every kernel on, --what step: a
# tree is "broken" if its pipelined step is not clearly faster than its sync step.
# Trees: the working tree, plus each directory under bisect/ holding an older
# dsv4_jax/ + pallas_kernels/ (git-ignored: pass carry=["bisect"] to the device tool):
#   for c in 3e91207; do mkdir -p bisect/$c && \
#     git archive $c dsv4_jax pallas_kernels | tar -x -C bisect/$c; done
# (3e91207 is the tree of the 14.83 ms run: that run started before 296a005 landed.)
# Ran 2026-11-23 with the working tree and 3e91207 (benchmarks/results/session9_x2/): both
# pipeline at 10 layers (4.07 vs 3.60 ms), so the slowdown needs more layers; the profile
# then showed the per-step CUDA-graph re-recording (BENCHMARKS.md, third session).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.97
T() { timeout "$@" 2>&1 | grep --line-buffered -v -i "warning\|warn("; }
ARGS="decode --preset flash --layers ${LAYERS:-10} --context 4096 --steps 10 --devices 2 --expert 2 --matmul pallas --kernels on --batch 1 --what step"
ROOT=$(pwd)
for d in . bisect/*/; do
  [ -d "$d/dsv4_jax" ] || continue
  name=$(basename "$(cd "$d" && pwd)")
  echo "== tree $d"
  # run from the tree: python puts the working directory first on sys.path, so its
  # dsv4_jax / pallas_kernels win; benchmarks/ comes from the repository root
  (cd "$d" && PYTHONPATH=$ROOT T ${LIMIT:-170} python3 -c \
    "import dsv4_jax; print('dsv4_jax from', dsv4_jax.__file__)" ) | tee "$OUT/bisect_$name.log"
  (cd "$d" && PYTHONPATH=$ROOT T ${LIMIT:-170} python3 -m benchmarks.decode_bench $ARGS \
    | grep "matmul=") | tee -a "$OUT/bisect_$name.log"
done
true
