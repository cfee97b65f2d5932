"""Registers and spills of a Triton kernel (sparse attention, top-k select) for an H100,
without a GPU.

    PYTHONPATH=.:/opt/jax-cuda python benchmarks/triton_regs.py [--head-tile 64 --num-warps 8]
        [--q-in-loop] [--col-split 2] [--joined] [--B 64 --H 64 --ctx 32768 --topk 512]
    PYTHONPATH=.:/opt/jax-cuda python benchmarks/triton_regs.py --kernel topk [--B 64
        --ctx 131072 --topk 512 --tile 4096 --bits 2 --num-warps 8]

Compiles sparse_decode_attention(backend="triton") for the compile-only CUDA topology of
benchmarks/aot_anatomy.py (needs the CUDA PJRT plugin + nvcc wheels, see there) with
ptxas -v, and prints ptxas' register / spill report for the kernel. A kernel that spills
(255 registers + local memory) loses bandwidth; check variants here before device time.
Seen here: XLA logs ptxas' report only when ptxas warns (a spill), so "OK" without a
report means no spill (the attention kernel's spill is reported, col_split=2 prints none).
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_gpu_ptx_compiler_extra_flags=-v").strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0")

import argparse  # noqa: E402
import functools  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-tile", type=int, default=64)
    ap.add_argument("--num-warps", type=int, default=None,
                    help="attention: 8 by default; topk: the kernel's rule by default")
    ap.add_argument("--q-in-loop", action="store_true")
    ap.add_argument("--col-split", type=int, default=1)
    ap.add_argument("--joined", action="store_true", help="attention: K / output as whole tiles")
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--H", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--topk", type=int, default=512)
    ap.add_argument("--kernel", default="attention", choices=["attention", "topk"])
    ap.add_argument("--tile", type=int, default=None,
                    help="topk: keys a program holds when a row is split (default_tile)")
    ap.add_argument("--bits", type=int, default=2, help="topk: radix digit bits")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not a.child:   # ptxas' report goes to the process' stderr log: filter it
        p = subprocess.run([sys.executable, __file__, "--child"] + sys.argv[1:],
                           capture_output=True, text=True)
        lines = [ln for ln in (p.stdout + p.stderr).splitlines()
                 if "ptxas" in ln or "registers" in ln or "spill" in ln or ln.startswith("OK")]
        print("\n".join(lines) or (p.stdout + p.stderr)[-3000:])
        return
    import jax
    from benchmarks.aot_anatomy import _tracing_for_gpu, gpu_devices
    from benchmarks.attention_decode import make_case
    from pallas_kernels.sparse_decode_attention import kernel as AK
    dev = gpu_devices()[0]
    sh = jax.sharding.SingleDeviceSharding(dev)
    if a.kernel == "topk":
        import jax.numpy as jnp
        from pallas_kernels.topk_select import topk_select
        x = jax.ShapeDtypeStruct((a.B, a.ctx // 4), jnp.float32, sharding=sh)
        f = functools.partial(topk_select, k=a.topk, tile=a.tile, bits=a.bits,
                              num_warps=a.num_warps)
        with _tracing_for_gpu(dev.device_kind):   # (+ 1: an XLA kernel, so ptxas runs)
            jax.jit(lambda s: f(s) + 1).lower(x).compile()
        print(f"OK topk B={a.B} N={a.ctx // 4} k={a.topk} tile={a.tile} bits={a.bits} "
              f"num_warps={a.num_warps}")
        return
    shapes = jax.eval_shape(lambda: make_case(jax.random.key(0), a.B, a.H, a.ctx, a.topk, "csa"))
    absd = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes)
    f = functools.partial(AK.sparse_decode_attention, backend="triton", head_tile=a.head_tile,
                          num_warps=a.num_warps or 8, q_in_loop=a.q_in_loop, col_split=a.col_split,
                          joined=a.joined)
    with _tracing_for_gpu(dev.device_kind):
        jax.jit(f).lower(*absd).compile()
    print(f"OK head_tile={a.head_tile} num_warps={a.num_warps} q_in_loop={a.q_in_loop} "
          f"col_split={a.col_split} joined={a.joined}")


if __name__ == "__main__":
    main()
