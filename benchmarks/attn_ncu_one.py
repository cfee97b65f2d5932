"""One sparse-decode-attention call for ncu / nsys (Flash CSA by default; the kernel's
defaults otherwise, e.g. double_k unless DSV4_ATTN_DOUBLE_K=0; key blocks bounded from t,
ids_prefix, as the decode step calls it). Usage:
  ncu --kernel-name regex:mosaic_gpu --launch-skip 3 --launch-count 1 \
      python3 benchmarks/attn_ncu_one.py [B] [gather] [mode] [flash|pro] [ctx]"""
import functools
import sys

import jax

from benchmarks.attention_decode import MODELS, make_case
from pallas_kernels.sparse_decode_attention import kernel as K

B = int(sys.argv[1]) if len(sys.argv) > 1 else 64
gather = sys.argv[2] if len(sys.argv) > 2 else "cpasync"
mode = sys.argv[3] if len(sys.argv) > 3 else "csa"
H, topk = MODELS[sys.argv[4] if len(sys.argv) > 4 else "flash"]
ctx = int(sys.argv[5]) if len(sys.argv) > 5 else 32768 if mode == "csa" else 131072
args = make_case(jax.random.key(0), B, H, ctx, topk if mode == "csa" else ctx // 128, mode)
f = jax.jit(functools.partial(K.sparse_decode_attention, gather=gather, warp_specialized=True,
                              ids_prefix=True))
for _ in range(5):
    y = f(*args)
jax.block_until_ready(y)
print("done", y.shape)
