"""The lightning indexer's scoring kernel at decode on Blackwell (sm_100a): tcgen05 MMA into
tensor memory (TMEM).

    score[b, i] = sum_h w[b, h] * relu(qI[b, h] . K_i)     for i < (t_b + 1) // 4, else -inf

The same inputs, outputs, grid (request, span of chunks) and key decode (dequant.py) as
kernel.py. What differs:
- wgmma does not exist on sm_100, and tcgen05.mma takes A from SMEM / TMEM only: the
  dequantised keys go to an SMEM tile, and the MMA writes S^T [128 e, 64 h] f32 into TMEM.
- 128 entries (2 chunks of 64) an MMA: 1-CTA tcgen05 at M = 64 needs the B tile's swizzle
  <= 64 bytes, so M = 128 (the full TMEM lanes) and a step is always two chunks.
- The heads' sum is thread-local: loaded from TMEM, each thread holds one entry's row of
  64 head scores (tcgen05's 32x32b layout), so relu(S^T) w reduces in registers, with no
  cross-lane shuffles.
- Pallas' automatic warpgroup barriers stay on (the Hopper kernel's hand-placed ones are
  tuned to its wgmma; none of this has been timed).

Per CTA (request b, a span of `cpc` chunks, cpc even), per step of 2 chunks (ring slot):
    codes u8 [128 e, 64 B] (4 pool blocks, TMA)            scales [128 e]
    -> K_half bf16 [128 e, 64] x 2, registers -> SMEM
    -> S^T [128 e, 64 h] = sum_half K_half @ q_half^T       (2 tcgen05.mma, TMEM, f32)
    -> score [128 e] = sum_h relu(S^T) * w[h]               (fp8: * the key scale first)

Interpreted (interpret given), the keys are dequantised by dequant.py's jnp forms (the
interpreter runs no inline PTX); the rest is the program the GPU runs.
"""
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.indexer_decode.dequant import (CHUNK, PLACE_LOG2, e2m1_place_words,
                                                   e4m3_bits_to_f32, place_scale, words_q)
from pallas_kernels.indexer_decode.kernel import EPB, N_HEADS, RATIO, STAGES

G = 2             # chunks a step: the MMA's M = 128 entries
STEP = G * CHUNK


def blackwell_chunks_per_cta(cpc):
    """The CTA span in chunks: whole steps of G chunks."""
    return -(-cpc // G) * G


def scores_call(qh, w, codes, scales, bt, t, *, fmt, cpc, n_ctas, interpret=None):
    """Scores [B, n_ctas * cpc * 64] f32 (past each request's eligible entries -inf):
    kernel.scores_call's operands and output; cpc a multiple of G (2)."""
    if len(scales) != (2 if fmt == "nvfp4" else 1):
        raise ValueError(f"format {fmt!r}: got {len(scales)} scale arrays")
    if cpc % G:
        raise ValueError(f"the Blackwell kernel takes whole steps of {G} chunks, got cpc={cpc}")
    interp = interpret is not None
    place = fmt in ("fp4", "nvfp4")
    if place:
        qh = words_q(qh)   # the MMA's k index w reads key byte WORDS_PERM[w]
    B = qh.shape[0]
    MAXB = bt.shape[1]
    WG = plgpu.Layout.WGMMA
    WROW = WG.reduce(1)
    TC = plgpu.Layout.TCGEN05
    TROW, TCOL = TC.reduce(1), TC.reduce(0)
    tr = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    n_sc = len(scales)
    span = cpc * CHUNK
    span_s = -(-span // 256) * 256   # the -inf fill's layout takes 256-float multiples

    def kernel(*refs, q_s, w_s, c_s, sc_s, k_s, o_s, qbar, bar, mbar, tbar, acc_t):
        q_g, w_g, codes_g, *scale_gs, bt_g, t_g, o_g = refs
        b = lax.axis_index("b")
        cta = lax.axis_index("c")
        ne = jnp.minimum(lax.div(jnp.maximum(t_g[b] + 1, 0), RATIO), MAXB * EPB)  # eligible
        first = cta * cpc
        n_load = jnp.clip(lax.div(ne - first * CHUNK + CHUNK - 1, CHUNK), 0, cpc)
        n_steps = lax.div(n_load + G - 1, G)

        def issue(i, slot):
            """Copies of step i's G chunks (2 G pool blocks) into ring slot `slot`. Columns
            past the table read its last column, -1 reads block 0: masked entries."""
            for k in range(2 * G):
                col = jnp.minimum(2 * (first + G * i) + k, MAXB - 1)
                blk = jnp.maximum(bt_g[b, col], 0)
                rows = pl.ds(k * EPB, EPB)
                plgpu.copy_gmem_to_smem(codes_g.at[blk], c_s.at[slot, rows], bar.at[slot])
                for j, scale_g in enumerate(scale_gs):
                    plgpu.copy_gmem_to_smem(scale_g.at[blk], sc_s.at[slot, j, rows],
                                            bar.at[slot])

        for j0 in range(STAGES - 1):
            @pl.when(j0 < n_steps)
            def _():
                issue(j0, j0)

        @pl.when(n_load > 0)
        def _():
            for half in range(2):   # q_s[half] = q[b, :, half * 64 : half * 64 + 64]
                plgpu.copy_gmem_to_smem(q_g.at[b, :, pl.ds(half * 64, 64)], q_s.at[half], qbar)
            plgpu.copy_gmem_to_smem(w_g.at[b], w_s, qbar)

        o_s[...] = jnp.full((span_s,), -jnp.inf, jnp.float32)

        @pl.when(n_load > 0)
        def _():
            plgpu.barrier_wait(qbar)

        def keys_to_smem(slot, g):
            """Chunk g of ring slot `slot` -> bf16 keys into k_s[half, rows of chunk g]
            (fp4 / nvfp4 in the "words" k order, * 2^-64: "place")."""
            rows = pl.ds(g * CHUNK, CHUNK)
            sc = plgpu.load(sc_s.at[slot, 0, rows], layout=WROW)             # [64]
            if place:
                col = plgpu.broadcasted_iota(jnp.int32, (CHUNK, 64), 1, layout=WG)
                e8_halves = e2m1_place_words(plgpu.load(
                    c_s.at[slot, rows], layout=plgpu.Layout.WGMMA_8BIT, optimized=False),
                    interpret=interp)
            for half in range(2):
                if fmt == "fp8":   # e4m3 -> bf16 is exact
                    x = plgpu.load(c_s.at[slot, rows, pl.ds(half * 64, 64)], layout=WG)
                    kv = x.astype(jnp.float32).astype(jnp.bfloat16)
                elif fmt == "fp4":
                    # values * 2^-126 and keys * 2^-64: the block factor is 2^(E - 65)
                    off = 126 - PLACE_LOG2
                    ex = lambda i: (sc >> (16 * half + 8 * i)) & 0xFF
                    s0, s1 = ((lax.bitcast_convert_type(
                        jnp.minimum(ex(i) + off, 255) << 23, jnp.float32)) for i in range(2))
                    blk = jnp.where(col < 32, lax.broadcast_in_dim(s0, (CHUNK, 64), [0]),
                                    lax.broadcast_in_dim(s1, (CHUNK, 64), [0]))
                    kv = place_scale(e8_halves[half], blk.astype(jnp.bfloat16),
                                     interpret=interp)
                else:   # nvfp4: four e4m3 scales a half (kernel.py)
                    unit = 2.0 ** (126 - PLACE_LOG2)
                    word = sc if half == 0 else plgpu.load(sc_s.at[slot, 1, rows], layout=WROW)
                    blk = None
                    for part in range(3, -1, -1):
                        s16 = lax.broadcast_in_dim(e4m3_bits_to_f32(word >> (8 * part), unit),
                                                   (CHUNK, 64), [0]).astype(jnp.bfloat16)
                        blk = s16 if blk is None else jnp.where(col < 16 * (part + 1), s16, blk)
                    kv = place_scale(e8_halves[half], blk, interpret=interp)
                k_s[half, rows] = kv

        # the head weights, once ("place": the keys come * 2^-64, the 2^64 goes on them)
        wv0 = plgpu.load(w_s, layout=TCOL)
        if place:
            wv0 = wv0 * jnp.float32(2.0 ** PLACE_LOG2)

        @pl.loop(0, n_steps)
        def _(i):
            slot = lax.rem(i, STAGES)

            @pl.when(i + STAGES - 1 < n_steps)
            def _():
                issue(i + STAGES - 1, lax.rem(i + STAGES - 1, STAGES))
            plgpu.barrier_wait(bar.at[slot])
            for g in range(G):
                keys_to_smem(slot, g)
            plgpu.commit_smem()   # (with its warpgroup barrier) before the one-thread issue
            plgpu.tcgen05_mma(acc_t, k_s.at[0], q_s.at[0].T, accumulate=False)
            plgpu.tcgen05_mma(acc_t, k_s.at[1], q_s.at[1].T, mbar, accumulate=True)
            plgpu.barrier_wait(mbar)
            s = plgpu.async_load_tmem(acc_t, layout=TC)                 # [128 e, 64 h]
            plgpu.wait_load_tmem()
            # every thread's TMEM reads are done before the next step's MMA overwrites it
            plgpu.barrier_arrive(tbar)
            plgpu.barrier_wait(tbar)
            if fmt == "fp8":
                sc = plgpu.load(sc_s.at[slot, 0], layout=TROW)
                s = s * lax.broadcast_in_dim(sc, s.shape, [0])
            score = (jnp.maximum(s, 0.0) * lax.broadcast_in_dim(wv0, s.shape, [1])).sum(axis=1)
            ids = plgpu.broadcasted_iota(jnp.int32, (STEP,), 0, layout=TROW) + (
                first * CHUNK + i * STEP)
            o_s[pl.ds(i * STEP, STEP)] = jnp.where(ids < ne, score, -jnp.inf)

        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s.at[pl.ds(0, span)], o_g.at[b, pl.ds(first * CHUNK, span)])
        plgpu.wait_smem_to_gmem(0)

    scratch = dict(
        q_s=plgpu.SMEM((2, N_HEADS, 64), jnp.bfloat16, transforms=tr),
        w_s=plgpu.SMEM((N_HEADS,), jnp.float32),
        c_s=plgpu.SMEM((STAGES, STEP) + codes.shape[2:], codes.dtype),
        sc_s=plgpu.SMEM((STAGES, n_sc, STEP), scales[0].dtype),
        k_s=plgpu.SMEM((2, STEP, 64), jnp.bfloat16, transforms=tr),
        o_s=plgpu.SMEM((span_s,), jnp.float32),
        qbar=plgpu.Barrier(num_arrivals=3),   # q (2 tiles) and w
        bar=plgpu.Barrier(num_arrivals=2 * G * (1 + n_sc), num_barriers=STAGES),
        mbar=plgpu.Barrier(num_arrivals=1, orders_tensor_core=True),
        tbar=plgpu.Barrier(num_arrivals=1, orders_tensor_core=True),
        acc_t=plgpu.TMEM((STEP, N_HEADS), jnp.float32),
    )
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((B, n_ctas * span), jnp.float32),
        grid=(B, n_ctas), grid_names=("b", "c"),
        scratch_types=scratch,
        interpret=interpret,
    )(qh, w, codes, *scales, bt, t)
