"""Minimal checks of the two pieces the attention kernel's in-kernel split merge
(merge="cluster") uses, one mode a process (a hang is killed by the caller's timeout):
  bar:   a 2-CTA cluster's ClusterBarrier (each consumer warpgroup of both CTAs arrives)
  store: consumer c != s sends a [64, 256] bf16 tile into CTA c's SMEM (async_store_smem,
         st.async + the receiver's mbarrier); consumer c == s waits and writes it out
  both:  bar, then store (what _cluster_merge does)
Usage: python3 benchmarks/cluster_probe.py MODE
H100, 2026-11-26 (session 23 run5, benchmarks/results/session23_h100/run5): "bar" passes
(each CTA writes its own values); "store" printed nothing within 60 s (killed: a hang) and
the GPU stayed blocked for the rest of that call, so "both" is unknown. Found afterwards in
the PTX: Pallas counts a Barrier's arrivals per warpgroup in Lane semantics (mbarrier.init
with num_arrivals * 128), while async_store_smem arrives once from each of the sender's
128 threads. The receiver's Barrier(num_arrivals=128) waited for 16384 arrivals; it is
Barrier(num_arrivals=1) now, not yet run on a GPU. The kernel's merge="cluster" had the
same bug (3 * 128 for 3 stores)."""
import sys

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

TILED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
WG = plgpu.Layout.WGMMA


def _store(q_s, o_g, s, h):
    for r in range(8):   # 8-row strips of a half: contiguous in the tiled SMEM
        plgpu.copy_smem_to_gmem(q_s.at[pl.ds(r * 8, 8), pl.ds(h * 256, 256)],
                                o_g.at[s, pl.ds(r * 8, 8), pl.ds(h * 256, 256)])
    plgpu.wait_smem_to_gmem(0)


def run(mode):
    def kernel(x_g, o_g):
        s = lax.axis_index("s")
        wg = lax.axis_index("wg")

        def scoped(q_s, cbar, rbar):
            @pl.when(wg < 2)
            def _():
                c = wg
                val = (plgpu.layout_cast(jnp.full((64, 256), 1.0, jnp.float32), WG)
                       * (1 + s * 2 + c).astype(jnp.float32)).astype(jnp.bfloat16)
                if mode in ("bar", "both"):
                    plgpu.barrier_arrive(cbar)
                    plgpu.barrier_wait(cbar)
                if mode == "bar":
                    for h in range(2):
                        @pl.when(c == h)
                        def _():
                            q_s[:, pl.ds(h * 256, 256)] = val
                            plgpu.commit_smem()
                            _store(q_s, o_g, s, h)
                    return

                @pl.when(c != s)
                def _():
                    for h in range(2):
                        @pl.when(c == h)
                        def _():
                            plgpu.async_store_smem(val, q_s.at[:, pl.ds(h * 256, 256)], rbar,
                                                   cluster_idx=jnp.int32(h), cluster_dim="s")

                @pl.when(c == s)
                def _():
                    plgpu.barrier_wait(rbar)
                    for h in range(2):
                        @pl.when(c == h)
                        def _():
                            _store(q_s, o_g, s, h)

        pl.run_scoped(scoped, plgpu.SMEM((64, 512), jnp.bfloat16, transforms=TILED),
                      plgpu.ClusterBarrier(collective_axes=("s",), num_arrivals=2),
                      # per warpgroup: init count 128, one st.async sender's threads
                      plgpu.Barrier(num_arrivals=1), collective_axes="wg")

    f = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((2, 64, 512), jnp.bfloat16),
                     grid=(1,), grid_names=("b",), cluster=(2,), cluster_names=("s",),
                     num_threads=3, thread_name="wg",
                     compiler_params=plgpu.CompilerParams(
                         lowering_semantics=plgpu.LoweringSemantics.Lane,
                         unsafe_no_auto_barriers=True))
    out = np.asarray(jax.jit(f)(jnp.zeros((2, 64, 512), jnp.bfloat16))).astype(np.float32)
    # CTA s, half h: "bar" -> own consumer h's value 1 + 2s + h; store -> CTA h's half h
    # comes from the other CTA's consumer h: 1 + 2(1-h) + h
    bad = 0
    for s in range(2):
        for h in range(2):
            got = np.unique(out[s, :, h * 256:(h + 1) * 256])
            want = 1 + 2 * s + h if mode == "bar" else 1 + 2 * (1 - h) + h
            ok = got.tolist() == [want] if (mode == "bar" or s == h) else True
            bad += not ok
            print(mode, "cta", s, "half", h, "values", got[:4], "ok" if ok else f"want {want}",
                  flush=True)
    if bad:
        raise SystemExit(f"{mode}: {bad} halves wrong")


if __name__ == "__main__":
    run(sys.argv[1])
