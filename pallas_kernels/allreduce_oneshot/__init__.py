"""One-shot all-reduce of a small array over a mesh axis (Mosaic GPU, one CTA a device):
each device stores its array into every peer's receive buffer through `plgpu.remote_ref`
(peer NVLink stores, no multicast), signals the peers' semaphores, and sums the n slots
in device order (the same rounding on every device).

    y = all_reduce_oneshot(x, axis_name="model", n=2)   # inside shard_map; x [R, 128]

Made for the two reductions a layer of the tensor layout at batch 1 (bf16 / f32 [1, 4096]:
8-16 KB), where a general all-reduce pays for its generality (NCCL ~20-25 us; this kernel
is three one-way NVLink latencies: ready, data, done). The kernel runs its own protocol
(`skip_device_barrier=True`, no barrier kernel before it):
  ready  every device signals each peer on entry and waits for all of them: no store
         reaches a peer's receive buffer before that peer's kernel owns it;
  data   the stores, waited for, then a signal to each peer; wait for every peer's;
  done   after reading its slots each device signals the peers and waits for theirs: no
         device's next call starts while a peer still reads this one.
Each wait decrements what it waited for, so the semaphores end every call at zero.
Compile-only so far (the Mosaic GPU interpreter does not run global semaphores); the
reference is `jax.lax.psum` (reference.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def all_reduce_oneshot(x, *, axis_name: str, n: int):
    """x [R, 128] bf16 / f32 (this device's part) -> the sum over the n devices of the
    axis, [R, 128] x.dtype (accumulated in f32, slots in device order). Call inside a
    shard_map over `axis_name` (size n)."""
    R, C = x.shape
    if C != 128 or R % 8 or x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"all_reduce_oneshot takes [R, 128] bf16 / f32 with R % 8 == 0, "
                         f"got {x.shape} {x.dtype}")

    def body(x_ref, out_ref, recv_ref, x_s, r_s, o_s, bar):
        # one global array of three (a second get_global fails to lower in jax 0.11.2)
        sems = pl.get_global(plgpu.SemaphoreType.REGULAR((3,)))
        ready, data, done = sems.at[0], sems.at[1], sems.at[2]
        me = lax.axis_index(axis_name)
        peers = [lax.rem(me + k, jnp.int32(n)) for k in range(1, n)]
        for p in peers:
            pl.semaphore_signal(ready, device_id=p)
        pl.semaphore_wait(ready, n - 1)
        plgpu.copy_gmem_to_smem(x_ref, x_s, bar)
        plgpu.barrier_wait(bar)
        plgpu.copy_smem_to_gmem(x_s, recv_ref.at[me])           # this device's own slot
        for p in peers:
            plgpu.copy_smem_to_gmem(x_s, plgpu.remote_ref(recv_ref, p).at[me])
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)        # stores complete
        for p in peers:
            pl.semaphore_signal(data, device_id=p)
        pl.semaphore_wait(data, n - 1)
        plgpu.copy_gmem_to_smem(recv_ref, r_s, bar)
        plgpu.barrier_wait(bar)
        acc = r_s[0].astype(jnp.float32)
        for j in range(1, n):
            acc = acc + r_s[j].astype(jnp.float32)
        o_s[...] = acc.astype(o_s.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, out_ref)
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)
        for p in peers:
            pl.semaphore_signal(done, device_id=p)
        pl.semaphore_wait(done, n - 1)

    out, _ = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((R, C), x.dtype),          # the sum
                  jax.ShapeDtypeStruct((n, R, C), x.dtype)),      # receive slots (peers')
        scratch_types=(plgpu.SMEM((R, C), x.dtype), plgpu.SMEM((n, R, C), x.dtype),
                       plgpu.SMEM((R, C), x.dtype), plgpu.Barrier()),
        compiler_params=plgpu.CompilerParams(skip_device_barrier=True),
    )(x)
    return out
