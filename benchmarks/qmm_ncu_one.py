"""One routed-expert call as the decode step makes it at batch B (for ncu / nsys: the 6th
kernel launch is a warm call of w13, or w2 with --w2). Usage under ncu:
  ncu --kernel-name regex:mosaic_gpu --launch-skip 5 --launch-count 1 python3 benchmarks/qmm_ncu_one.py 64"""
import sys

import jax

from benchmarks.quant_matmul import rand_fp4_bank
from dsv4_jax.layers import expert_schedule
from pallas_kernels.quant_matmul import grouped_matmul

B = int(sys.argv[1]) if len(sys.argv) > 1 else 64
N, K = (4096, 2048) if "--w2" in sys.argv else (4096, 4096)
bank = rand_fp4_bank(jax.random.key(0), 256, N, K)
e = expert_schedule(jax.random.randint(jax.random.key(1), (B, 6), 0, 256), 256, 8)[0]
x = jax.random.normal(jax.random.key(2), (e.shape[0], 8, K)).astype(jax.numpy.bfloat16)
f = jax.jit(grouped_matmul)
for _ in range(8):
    y = f(x, e, bank)
jax.block_until_ready(y)
print("done", y.shape)
