"""One sparse-decode-attention call for ncu / nsys (Flash CSA by default). Usage:
  ncu --kernel-name regex:mosaic_gpu --launch-skip 3 --launch-count 1 \
      python3 benchmarks/attn_ncu_one.py [B] [gather] [mode]"""
import functools
import sys

import jax

from benchmarks.attention_decode import make_case
from pallas_kernels.sparse_decode_attention import kernel as K

B = int(sys.argv[1]) if len(sys.argv) > 1 else 64
gather = sys.argv[2] if len(sys.argv) > 2 else "cpasync"
mode = sys.argv[3] if len(sys.argv) > 3 else "csa"
ctx = 32768 if mode == "csa" else 131072
args = make_case(jax.random.key(0), B, 64, ctx, 512 if mode == "csa" else ctx // 128, mode)
f = jax.jit(functools.partial(K.sparse_decode_attention, gather=gather, warp_specialized=True))
for _ in range(5):
    y = f(*args)
jax.block_until_ready(y)
print("done", y.shape)
