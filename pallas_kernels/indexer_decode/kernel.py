"""The lightning indexer's scoring kernel at decode (Pallas Mosaic GPU, Hopper sm_90a).

For each request b (one query token at position t_b):
    score[b, i] = sum_h w[b, h] * relu(qI[b, h] . K_i)     for i < (t_b + 1) // 4, else -inf
K_i is read straight from the indexer key pool (docs/KV_CACHE.md) and
dequantised in registers (dequant.py).

Per CTA (request b, a span of `cpc` chunks of 64 entries), per chunk:
    codes u8 [64 e, 64 B] (2 pool blocks, TMA)          scales u32 [64 e] (4 bytes an entry)
    -> K_half bf16 [64 e, 64] x 2, in registers           (fp4 / nvfp4: "place"; fp8: e4m3)
    -> S^T [64 e, 64 h] = sum_half K_half @ q_half^T      (2 wgmma, A from registers, f32)
    -> score [64 e] = sum_h relu(S^T) * w[h]              (f32; fp8: * the key scale first)
Split-half packing: byte j holds dim j (low nibble) and dim j + 64 (high nibble).

Pipeline (each part measured faster on an H100 / H200, scores bit-identical):
- A ring of 2 slots of G chunks (G = chunks_per_step: 2 halves the loop's fixed work; deeper
  rings gained nothing once the keys stayed in registers).
- Keys from registers as the wgmma's A operand: no SMEM round trip, more CTAs an SM; the
  second half's dequant runs under the first half's wgmma (fp4 B = 64 at 128K: 169 us
  against 180 through SMEM; fp8 109 against 134, H200).
- Pallas' automatic warpgroup barriers off (six a chunk): one barrier an iteration (every
  warp is done with the slot the next issue overwrites), one after the -inf fill and one
  before the scores' store; the block-table entries for the next issue are loaded an
  iteration ahead (a loop carry), and the issue (~60 SASS instructions, one lane issuing)
  runs in warp 0 only: 2.5% (H200).
- The heads' sum as one FFMA chain over the 8 column tiles, then a tile's 8 heads (48 FP
  instructions a thread a chunk against 52 for Mosaic's reduce).
- The head weights held in 16 registers a whole CTA.

The Mosaic GPU interpreter runs no inline PTX and takes no register A operand in wgmma:
interpreted (interpret=True), the keys are dequantised by dequant.py's jnp forms and go
to the wgmma through an SMEM tile, and the warpgroup barrier is a no-op (one thread a CTA);
everything else is the shipped program.
"""
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.indexer_decode.dequant import (CHUNK, PLACE_LOG2, e2m1_place_words,
                                                   e4m3_bits_to_f32, place_scale, wg_barrier,
                                                   words_q)

N_HEADS = 64
DIM = 128
EPB = 32          # indexer entries per pool block (128 tokens / ratio 4)
RATIO = 4
STAGES = 2        # ring slots


def scores_call(qh, w, codes, scales, bt, t, *, fmt, cpc, n_ctas, G, interpret=None):
    """Scores [B, n_ctas * cpc * 64] f32 (past each request's eligible entries -inf).

    qh bf16 [B, 64 h, 128]; w f32 [B, 64 h]; bt int32 [R >= B, MAXB] (the raw block table,
    -1 unused); t int32 [B]. fmt "fp4": codes uint8 [NB, 32, 64], scales (u32 [NB, 32],)
    (4 e8m0 bytes an entry). "nvfp4": codes as fp4, scales (lo, hi) u32 [NB, 32] (4 e4m3
    bytes an entry and half, dims 16q.. of the half in byte q). "fp8": codes e4m3
    [NB, 32, 128], scales (f32 [NB, 32],) (applied to the scores: relu(q . k * s) =
    s * relu(q . k) for s >= 0). cpc chunks a CTA, G chunks a loop iteration (cpc % G == 0).
    interpret: None or plgpu.InterpretGPUParams."""
    if len(scales) != (2 if fmt == "nvfp4" else 1):
        raise ValueError(f"format {fmt!r}: got {len(scales)} scale arrays")
    if cpc % G:
        raise ValueError(f"chunks_per_step={G} must divide the CTA span ({cpc} chunks a CTA)")
    interp = interpret is not None
    place = fmt in ("fp4", "nvfp4")
    if place:
        qh = words_q(qh)   # the wgmma's k index w reads key byte WORDS_PERM[w]
    B = qh.shape[0]
    MAXB = bt.shape[1]
    WG = plgpu.Layout.WGMMA
    ROW, COL = WG.reduce(1), WG.reduce(0)
    tr = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    n_sc = len(scales)
    stages = STAGES
    span = cpc * CHUNK
    span_s = -(-span // 256) * 256   # the -inf fill's layout takes 256-float multiples

    def kernel(*refs, q_s, w_s, c_s, sc_s, o_s, qbar, bar, k_s=None):
        q_g, w_g, codes_g, *scale_gs, bt_g, t_g, o_g = refs
        b = lax.axis_index("b")
        cta = lax.axis_index("c")
        ne = jnp.minimum(lax.div(jnp.maximum(t_g[b] + 1, 0), RATIO), MAXB * EPB)  # eligible
        first = cta * cpc
        n_load = jnp.clip(lax.div(ne - first * CHUNK + CHUNK - 1, CHUNK), 0, cpc)
        n_steps = lax.div(n_load + G - 1, G)   # loop iterations of G chunks

        def blocks(j):
            """The pool blocks of this CTA's chunk j. Columns past the table (the last CTA's
            padding; j one past the CTA's end) read its last column; -1 reads block 0.
            Either way the entries are past ne and masked."""
            col = 2 * (first + j)
            ids = (bt_g[b, jnp.minimum(col, MAXB - 1)], bt_g[b, jnp.minimum(col + 1, MAXB - 1)])
            return tuple(jnp.maximum(i, 0) for i in ids)

        def step_blocks(i):
            """The pool blocks of step i's G chunks (2 G ids)."""
            return sum((blocks(G * i + g) for g in range(G)), ())

        def issue(i, slot, blks=None):
            """Copies of step i's G chunks (2 G pool blocks) into ring slot `slot`."""
            blks = step_blocks(i) if blks is None else blks
            for k in range(2 * G):
                blk = blks[k]
                rows = pl.ds(k * EPB, EPB)
                plgpu.copy_gmem_to_smem(codes_g.at[blk], c_s.at[slot, rows], bar.at[slot])
                for i, scale_g in enumerate(scale_gs):
                    plgpu.copy_gmem_to_smem(scale_g.at[blk], sc_s.at[slot, i, rows],
                                            bar.at[slot])

        for j0 in range(stages - 1):
            @pl.when(j0 < n_steps)
            def _():
                issue(j0, j0)

        @pl.when(n_load > 0)
        def _():
            for half in range(2):   # q_s[half] = q[b, :, half * 64 : half * 64 + 64]
                plgpu.copy_gmem_to_smem(q_g.at[b, :, pl.ds(half * 64, 64)], q_s.at[half], qbar)
            plgpu.copy_gmem_to_smem(w_g.at[b], w_s, qbar)

        o_s[...] = jnp.full((span_s,), -jnp.inf, jnp.float32)
        wg_barrier(interpret=interp)   # the fill lands before any thread's scores

        @pl.when(n_load > 0)
        def _():
            plgpu.barrier_wait(qbar)
        # The head weights, loaded once (garbage if n_load == 0: then no chunk runs).
        # "place": the keys come * 2^-64, so do the scores; the 2^64 goes on the weights.
        wv0 = plgpu.load(w_s, layout=COL)
        if place:
            wv0 = wv0 * jnp.float32(2.0 ** PLACE_LOG2)

        def epilogue(j, s):
            wb = lax.broadcast_in_dim(wv0, s.shape, [1])
            # relu(s) w summed over the 8 column tiles of 8 heads as one FFMA chain a
            # register, then over a tile's 8 heads
            acc = None
            for c in range(N_HEADS // 8):
                cols = slice(8 * c, 8 * c + 8)
                t = jnp.maximum(s[:, cols], 0.0) * wb[:, cols]
                acc = t if acc is None else acc + t
            score = acc.sum(axis=1)
            ids = plgpu.broadcasted_iota(jnp.int32, (CHUNK,), 0, layout=ROW) + (first + j) * CHUNK
            o_s[pl.ds(j * CHUNK, CHUNK)] = jnp.where(ids < ne, score, -jnp.inf)

        def top(j, carry):
            """The iteration's sync, the next step's issue, the wait for step j's data."""
            slot = lax.rem(j, stages)
            ahead = j + stages - 1
            wg_barrier(interpret=interp)   # all warps are done with the slot the issue overwrites

            @pl.when(ahead < n_steps)
            def _():
                # Only warp 0 runs the issue's ~60 instructions (one lane issues either
                # way): the other three warps branch past them.
                @plgpu.warp_map
                def _(warp):
                    @pl.when(warp == 0)
                    def _():
                        issue(ahead, lax.rem(ahead, stages), carry)
            carry = step_blocks(ahead + 1)   # used by the next iteration's issue
            plgpu.barrier_wait(bar.at[slot])
            return slot, carry

        def unpack(slot, g=0):
            """Chunk g of ring slot `slot` -> keys(half): bf16 [64 e, 64] keys of dims
            half*64.. (fp4 / nvfp4: in the "words" k order), and sc: the [64] scale words."""
            rows = pl.ds(g * CHUNK, CHUNK)
            sc = plgpu.load(sc_s.at[slot, 0, rows], layout=ROW)             # [64]
            if place:
                # (bit ops on u16 instead of u32 measured the same; Mosaic has no shifts on
                # 8-bit types)
                col = plgpu.broadcasted_iota(jnp.int32, (CHUNK, 64), 1, layout=WG)
                # whole words: bytes 16 c + 4 t + j of a row in thread t
                e8_halves = e2m1_place_words(plgpu.load(
                    c_s.at[slot, rows], layout=plgpu.Layout.WGMMA_8BIT, optimized=False),
                    interpret=interp)

            def keys(half):
                """Keys of dims half*64.. of this chunk: bf16 [64 e, 64] (WGMMA layout)."""
                if fmt == "fp8":   # e4m3 -> bf16 is exact
                    x = plgpu.load(c_s.at[slot, rows, pl.ds(half * 64, 64)], layout=WG)
                    return x.astype(jnp.float32).astype(jnp.bfloat16)
                if fmt == "fp4":
                    # values * 2^-126 and keys * 2^-64: the block factor is 2^(E - 65), a
                    # bf16 normal (exact) for E <= 192 (E >= 193: exponent 255, inf)
                    off = 126 - PLACE_LOG2
                    ex = lambda i: (sc >> (16 * half + 8 * i)) & 0xFF
                    s0, s1 = ((lax.bitcast_convert_type(
                        jnp.minimum(ex(i) + off, 255) << 23, jnp.float32)) for i in range(2))
                    blk = jnp.where(col < 32, lax.broadcast_in_dim(s0, (CHUNK, 64), [0]),
                                    lax.broadcast_in_dim(s1, (CHUNK, 64), [0]))
                    return place_scale(e8_halves[half], blk.astype(jnp.bfloat16),
                                       interpret=interp)
                # nvfp4: the half's four e4m3 scales (one u32 an entry: idx_scale_lo / _hi)
                # decoded on [64] vectors, * 2^(126 - 64) (the placed values' 2^-126 and
                # the keys' 2^-64); e2m1 * e4m3 (at most 6 significant bits) is exact in bf16.
                unit = 2.0 ** (126 - PLACE_LOG2)
                word = sc if half == 0 else plgpu.load(sc_s.at[slot, 1, rows], layout=ROW)
                blk = None
                for part in range(3, -1, -1):
                    s16 = lax.broadcast_in_dim(e4m3_bits_to_f32(word >> (8 * part), unit),
                                               (CHUNK, 64), [0]).astype(jnp.bfloat16)
                    blk = s16 if blk is None else jnp.where(col < 16 * (part + 1), s16, blk)
                return place_scale(e8_halves[half], blk, interpret=interp)

            return keys, sc

        def body(j, carry):
            slot, carry = top(j, carry)
            for g in range(G):   # the step's chunks, one after another
                chunk(slot, g, G * j + g)
            return carry

        def chunk(slot, g, j):
            """Scores of chunk j, the g-th of ring slot `slot`, into o_s."""
            keys, sc = unpack(slot, g)
            if interp:   # the interpreter's wgmma takes its A operand from SMEM only
                def mma(acc_ref):
                    for half in range(2):
                        k_s[...] = keys(half)
                        plgpu.commit_smem()
                        plgpu.wgmma(acc_ref, k_s, q_s.at[half].T)
                    return acc_ref[...]
            else:
                def mma(acc_ref):
                    plgpu.wgmma(acc_ref, keys(0), q_s.at[0].T)
                    plgpu.wgmma(acc_ref, keys(1), q_s.at[1].T)
                    return acc_ref[...]
            s = pl.run_scoped(mma, plgpu.ACC((CHUNK, N_HEADS), jnp.float32))   # [64 e, 64 h]
            if fmt == "fp8":
                s = s * lax.broadcast_in_dim(sc, s.shape, [0])
            epilogue(j, s)

        lax.fori_loop(0, n_steps, body, step_blocks(stages - 1))
        wg_barrier(interpret=interp)   # every thread's scores are in o_s
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s.at[pl.ds(0, span)], o_g.at[b, pl.ds(first * CHUNK, span)])
        plgpu.wait_smem_to_gmem(0)

    scratch = dict(
        q_s=plgpu.SMEM((2, N_HEADS, 64), jnp.bfloat16, transforms=tr),
        w_s=plgpu.SMEM((N_HEADS,), jnp.float32),
        c_s=plgpu.SMEM((stages, G * CHUNK) + codes.shape[2:], codes.dtype),
        sc_s=plgpu.SMEM((stages, n_sc, G * CHUNK), scales[0].dtype),
        o_s=plgpu.SMEM((span_s,), jnp.float32),
        qbar=plgpu.Barrier(num_arrivals=3),   # q (2 tiles) and w
        bar=plgpu.Barrier(num_arrivals=2 * G * (1 + n_sc), num_barriers=stages),
    )
    if interp:
        scratch["k_s"] = plgpu.SMEM((CHUNK, 64), jnp.bfloat16, transforms=tr)
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((B, n_ctas * span), jnp.float32),
        grid=(B, n_ctas), grid_names=("b", "c"),
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True),
        interpret=interpret,
    )(qh, w, codes, *scales, bt, t)
