"""The consumer warpgroups' shared steps: dequantise a block into a K tile, the validity
bias, the online softmax, the wgmma forms, the epilogue.

Heads are the wgmma M rows (64 a CTA). The f32 output accumulator [64, 512] is too big for
one warpgroup's registers, so each of the two consumer warpgroups owns one column half
[64, 256] and accumulates its P V there in place.
"""
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.sparse_decode_attention.layout import COL, D, HT, ROW, TILED, WG

SCALE = 1.0 / math.sqrt(D)


def dequant(n_s, m_s, k_s, m_slot, chunks):
    """K[:, 64j:64j+64] = e4m3 * 2^(e_j - 127) (exact in bf16) for j in chunks, from the
    FP8 staging slot n_s[0] (chunk-major, swizzled: conflict-free loads) and the scale
    exponents m_s[m_slot, j] into the bf16 K tile k_s [64, 512]. The e4m3 -> f32
    conversion lowers to the hardware's cvt.rn.f16x2.e4m3x2 (exact)."""
    for j in chunks:
        x = plgpu.load(n_s.at[0, j], layout=WG)
        e = plgpu.load(m_s.at[m_slot, j], layout=ROW).astype(jnp.int32)
        f = lax.bitcast_convert_type(jnp.clip(e, 1, 254) << 23, jnp.float32)
        kx = x.astype(jnp.float32) * lax.broadcast_in_dim(f, (64, 64), [0])
        k_s[:, pl.ds(j * 64, 64)] = kx.astype(jnp.bfloat16)


def bias(m_s, slot):
    """0 / -inf per key of the block, from the validity byte (COL layout)."""
    ok = plgpu.load(m_s.at[slot, 7], layout=COL).astype(jnp.int32)
    return jnp.where(ok != 0, 0.0, -jnp.inf).astype(jnp.float32)


def online_update(s, m_new, m, l, acc):
    """The online-softmax step for scores s [64 heads, n keys] with the new running row max
    m_new: -> (P f32, l, acc rescaled, alpha: the rescale, which the seesaw kernel
    publishes for the consumer that did not score the block)."""
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)     # all-masked block so far
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
    l = l * alpha + p.sum(axis=1)
    return p, l, acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), alpha


def init_carry():
    """(acc [64, 256] f32 = 0, m [64] = -inf, l [64] = 0) in the WGMMA layouts."""
    m0 = plgpu.layout_cast(jnp.full((HT,), -jnp.inf, jnp.float32), ROW)
    l0 = plgpu.layout_cast(jnp.full((HT,), 0.0, jnp.float32), ROW)
    a0 = plgpu.layout_cast(jnp.full((HT, D // 2), 0.0, jnp.float32), WG)
    return a0, m0, l0


def staging(interpret):
    """The interpreter's SMEM tiles for register wgmma operands: [2 consumers, 64, 64] bf16
    (nothing on the GPU). The interpreter's wgmma takes only SMEM operands."""
    return (plgpu.SMEM((2, HT, 64), jnp.bfloat16, transforms=TILED),) if interpret else ()


def wgmma(acc_ref, a, b, stage=None):
    """plgpu.wgmma(acc_ref, a, b). stage (interpreted; a: an array in registers, as the GPU
    runs it): a is stored to this SMEM tile first (the same values)."""
    if stage is not None:
        stage[...] = a
        plgpu.commit_smem()
        a = stage
    plgpu.wgmma(acc_ref, a, b)


def mma_into(acc, a, b, under=lambda: None, interpret=False, stage=None):
    """acc + a @ b, the wgmma accumulating in place in acc's registers (a fresh
    accumulator added afterwards held two [64, 256] f32 tiles and spilled), with under()
    issued while it runs. The interpreter has no in-place accumulator (run_state over
    ACC.init): interpreted, the product goes to a fresh accumulator and is added (the
    interpreter computes acc + a @ b in f32 either way); stage: wgmma's."""
    if not interpret:
        def mma(acc_ref):
            plgpu.wgmma(acc_ref, a, b)
            under()
        return pl.run_state(mma)(plgpu.ACC.init(acc))

    def fresh(acc_ref):
        wgmma(acc_ref, a, b, stage)
        under()
        return acc_ref[...]
    return acc + pl.run_scoped(fresh, plgpu.ACC(acc.shape, jnp.float32))


def observe_final_phases(n, singles=(), pair=None):
    """Interpreted only: the interpreter requires a warpgroup that waits on a barrier to
    observe every phase of it (on the GPU a phase nobody waits for costs nothing). The
    kernels leave unobserved, of their n blocks, the last block's phase of each barrier in
    `singles` (one phase a block) and the last two blocks' phases of `pair` (one barrier a
    block parity): this waits for them."""
    @pl.when(n >= 1)
    def _():
        for bar in singles:
            plgpu.barrier_wait(bar)
    for k in (2, 1):
        @pl.when(n >= k)
        def _():
            plgpu.barrier_wait(pair.at[lax.rem(n - k, 2)])


def store_half(out, q_s, o_g, s_id, b, ht, c):
    """out [64 heads, 256] f32 -> bf16 through q_s's columns of half c -> o_g[s_id, b,
    rows of head tile ht, half c] (8-row strips: contiguous in the tiled SMEM; TMA)."""
    def store(h):
        def f():
            q_s[:, pl.ds(h * (D // 2), D // 2)] = out.astype(jnp.bfloat16)
        return f
    lax.cond(c == 0, store(0), store(1))
    plgpu.commit_smem()
    for r in range(HT // 8):
        for h in range(2):
            @pl.when(c == h)
            def _():
                plgpu.copy_smem_to_gmem(q_s.at[pl.ds(r * 8, 8), pl.ds(h * (D // 2), D // 2)],
                                        o_g.at[s_id, b, pl.ds(ht * HT + r * 8, 8),
                                               pl.ds(h * (D // 2), D // 2)])


def finish(acc, m, l, q_s, v_s, o_g, lse_g, s_id, b, ht, c, final):
    """Normalise (final: the sink v_s in the denominator; else by l, and consumer 0 emits
    the split's lse through v_s) and store the half [64 heads, 256] through q_s's columns
    of half c."""
    if final:
        sk = plgpu.load(v_s, layout=ROW)
        mm = jnp.maximum(m, sk)
        den = l * jnp.exp(m - mm) + jnp.exp(sk - mm)
        out = acc * lax.broadcast_in_dim(jnp.exp(m - mm) / den, acc.shape, [0])
    else:
        # one reciprocal per row, then multiplies (dividing the tile was 128 div.full.f32
        # a thread in the epilogue)
        inv = 1.0 / jnp.where(l > 0, l, 1.0)
        out = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
    store_half(out, q_s, o_g, s_id, b, ht, c)
    if not final:
        @pl.when(c == 0)
        def _():
            v_s[...] = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(v_s, lse_g.at[s_id, b, pl.ds(ht * HT, HT)])
    # Only the SMEM reads must finish before the CTA exits (as CUTLASS's tma_store_wait);
    # the writes to GMEM complete before the kernel does.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
