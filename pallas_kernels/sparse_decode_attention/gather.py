"""The row gather of the attention kernels and their key-block bookkeeping.

Hopper has no TMA gather, and one TMA per 448-byte row issued by one thread bounds a kernel
by its issue rate. So the producer warpgroup's 128 threads copy a key block's rows with
16-byte cp.async (Ampere-style asynchronous copies): two threads a key, the two reading
adjacent 16 bytes (whole 32-byte sectors), one row id a thread. The producer also derives
each key's pool row (block table), its scale exponents and its validity itself, so XLA
only prepares the id list (or nothing: in-kernel HCA ids, ids_prefix).

Key blocks of a request: NW window blocks (ring rows b*128 + g*64 + j), then the
compressed blocks (list positions (g - NW)*64 ..). Valid compressed ids come first (top-k
output, HCA prefix), so the blocks after the last valid id are skipped.

The GPU interpreter runs no inline PTX: interpreted kernels copy the same rows, to the
same SMEM places, with plain ref loads and stores (ref_rows) and retire nothing.
"""
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm
from jax.experimental.mosaic.gpu import utils as mu

from pallas_kernels.sparse_decode_attention.layout import (BLK, BLOCK_TOKENS, D, NCH, NOPE,
                                                           NW, ROPE, SWZ64, TILED, WINDOW)

CP_ROPE = ROPE * 2 // 16     # 16-byte pieces of a rope row


def cp_async_rows(window, refs, s_refs, row_base, idx_off, b, slot, epb, implicit=0,
                  parts="nr", nope_chunks=(0, NCH), meta=True, commit=False):
    """Copy one key block with cp.async from the calling warpgroup's 128 threads: the nope
    rows into the FP8 staging slot, the rope rows straight into columns 448.. of K tile
    `slot`, the meta (scale exponents + validity byte) into m_s[slot]; then wait for this
    thread's copies and fence them for the wgmma's async proxy (or, commit, close them as
    one cp.async group: retire). GPU only (inline PTX).
    window: rows row_base + key, valid where the row's position is within the last 128 of
    t[b]; else the rows of ids idx[idx_off + key] (pool row blk * EPB + id % EPB with blk =
    block_table[b, id // EPB]; a -1 id reads row 0 and is masked; an id past the table
    reads its last entry, as XLA's clamping gather would, not another request's row).
    implicit = K > 0 (HCA): idx is not read; the id at list position idx_off + key is the
    position itself, valid below min(K, (t[b] + 1) * EPB // 128) (hca_indices' list).
    refs = (nope [rows * 7, 64] e4m3, rope [rows, 64] bf16, idx [B, KP] i32, block_table
    [R, MAXB] i32, win_scale [R * 128, 8] u8, cmp_scale [rows, 8] u8, win_pos [R, 128] i32,
    t [B] i32) in GMEM; s_refs = (n_s [1, 7, 64, 64] e4m3 (layout.SWZ64), k_s [2, 64, 512]
    bf16 (layout.TILED), m_s [slots, 8, 64] u8) in SMEM.
    parts: "n" the nope chunks nope_chunks = (lo, hi) (and the meta if meta), "r" the rope
    rows, "nr" both."""
    splat = plgpu.Layout.WG_SPLAT(())
    ref, n_ref, r_ref = plgpu.RefType(), plgpu.RefType(SWZ64), plgpu.RefType(TILED)
    EPB_, MAXB = epb, refs[3].shape[1]

    @plgpu.inline_mgpu(arg_types=(ref,) * 8 + (n_ref, r_ref, ref) + (splat,) * 4)
    def gather(ctx, nope_g, rope_g, idx_g, bt_g, wsc_g, csc_g, pos_g, t_g, n_s, r_s, m_s,
               rb, io, bb, sl):
        del ctx
        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        c32 = lambda v: mu.c(v, i32)
        c64 = lambda v: mu.c(v, i64)
        gaddr = lambda ref: llvm.ptrtoint(i64, mu.memref_ptr(ref))
        saddr = lambda ref: llvm.ptrtoint(i32, mu.memref_ptr(ref))
        rb, io, bb, sl = (x.registers.item() for x in (rb, io, bb, sl))
        t = arith.remui(mu.thread_idx(), c32(128))
        g_n, g_r = gaddr(nope_g), gaddr(rope_g)
        s_n, s_r, s_m = (saddr(r) for r in (n_s, r_s, m_s))

        def ld32(base, i):   # base: i64 address, i: i32 element index
            a = arith.addi(base, arith.muli(arith.extui(i64, i), c64(4)))
            return mu.inline_ptx("ld.global.nc.b32 $0, [$1];", a, result_types=i32)

        def sge(x, y):
            return arith.cmpi(arith.CmpIPredicate.sge, x, y)

        key, h = arith.shrui(t, c32(1)), arith.andi(t, c32(1))
        if window:
            row = arith.addi(rb, key)
            pos, tb = ld32(gaddr(pos_g), row), ld32(gaddr(t_g), bb)
            ok = arith.andi(arith.andi(sge(pos, c32(0)), sge(tb, pos)),
                            sge(pos, arith.subi(tb, c32(WINDOW - 1))))
            g_sc = gaddr(wsc_g)
        elif implicit:   # HCA: the list position is the id; valid below min(K, n(t))
            i, tb = arith.addi(io, key), ld32(gaddr(t_g), bb)
            n = arith.divsi(arith.muli(arith.maxsi(arith.addi(tb, c32(1)), c32(0)), c32(EPB_)),
                            c32(BLOCK_TOKENS))
            ok = arith.cmpi(arith.CmpIPredicate.slt, i, arith.minsi(n, c32(implicit)))
            safe = i
        if not window:
            if not implicit:
                i = ld32(gaddr(idx_g), arith.addi(io, key))
                ok = sge(i, c32(0))
                safe = arith.maxsi(i, c32(0))
            col = arith.minui(arith.divui(safe, c32(EPB_)), c32(MAXB - 1))
            blk = ld32(gaddr(bt_g), arith.addi(arith.muli(bb, c32(MAXB)), col))
            row = arith.addi(arith.muli(arith.maxsi(blk, c32(0)), c32(EPB_)),
                             arith.remui(safe, c32(EPB_)))
            g_sc = gaddr(csc_g)
        row = arith.extui(i64, row)

        def copy(dst, src, pred=None):   # dst: i32 shared address, src: i64 global
            mu.inline_ptx("cp.async.cg.shared.global [$0], [$1], 16;", dst, src,
                          predicate=pred, has_side_effects=True)

        # thread t copies half of key t // 2's row: pieces h, h + 2, h + 4, ... (h = t % 2),
        # every piece a constant offset from two base addresses
        h16 = arith.muli(h, c32(16))
        # n_s [1, 7 chunks, 64 keys, 64 B], tiled (8, 64) and 64-byte swizzled: key r's
        # 16-byte unit v of chunk j sits at j * 4096 + (r // 8) * 512 + (r % 8) * 64 +
        # (v ^ ((r >> 1) & 3)) * 16; this thread's units are v = h (even i), h + 2 (odd i)
        if "n" in parts:
            src = arith.addi(g_n, arith.addi(arith.muli(row, c64(NOPE)), arith.extui(i64, h16)))
            x = arith.andi(arith.shrui(key, c32(1)), c32(3))
            base = arith.addi(s_n, arith.addi(c32(0), arith.muli(key, c32(64))))
            unit = [arith.addi(base, arith.muli(arith.xori(arith.addi(h, c32(2 * k)), x),
                                                c32(16))) for k in range(2)]
            for i in range(2 * nope_chunks[0], 2 * nope_chunks[1]):
                copy(arith.addi(unit[i % 2], c32((i // 2) * BLK * 64)),
                     arith.addi(src, c64(32 * i)))
        if "r" in parts:
            src = arith.addi(g_r, arith.addi(arith.muli(row, c64(ROPE * 2)),
                                             arith.extui(i64, h16)))
            # K tile [64 keys, 512] bf16, tiled (8, 64), 128-byte swizzled: the rope columns
            # are tile column 7; key r's 16-byte unit u sits at slot * 64 KB + ((r // 8) * 8
            # + 7) * 1024 + (r % 8) * 128 + (u ^ (r % 8)) * 16; this thread's units are
            # u = h + 2 i
            r8 = arith.andi(key, c32(7))
            base = arith.addi(s_r, arith.addi(
                arith.muli(sl, c32(BLK * D * 2)),
                arith.addi(arith.muli(arith.addi(arith.muli(arith.shrui(key, c32(3)), c32(8)),
                                                 c32(NCH)), c32(1024)),
                           arith.muli(r8, c32(128)))))
            for i in range(CP_ROPE // 2):
                u = arith.xori(arith.addi(h, c32(2 * i)), r8)
                copy(arith.addi(base, arith.muli(u, c32(16))), arith.addi(src, c64(32 * i)))

        def finish(fence):
            """Close this thread's copies: one group (commit) or wait for them, and
            fence them for the wgmma's async proxy."""
            if commit:
                mu.inline_ptx("cp.async.commit_group;", has_side_effects=True)
                return
            mu.inline_ptx("cp.async.wait_all;", has_side_effects=True)
            if fence:
                mu.inline_ptx("fence.proxy.async.shared::cta;", has_side_effects=True)

        if "n" not in parts or not meta:
            finish(True)
            return
        # meta: thread h writes exponents 4h .. 4h + 3 of its key into m_s [8, 64]; the
        # format's unused 8th exponent becomes the validity byte
        w = mu.inline_ptx("ld.global.nc.b32 $0, [$1];",
                          arith.addi(g_sc, arith.addi(arith.muli(row, c64(8)),
                                                      arith.extui(i64, arith.muli(h, c32(4))))),
                          result_types=i32)
        w_ok = arith.ori(arith.andi(w, c32(0x00FFFFFF)),
                         arith.shli(arith.extui(i32, ok), c32(24)))
        w = arith.select(arith.cmpi(arith.CmpIPredicate.eq, h, c32(1)), w_ok, w)
        m = arith.addi(s_m, arith.addi(arith.muli(sl, c32(8 * BLK)),
                                       arith.addi(arith.muli(h, c32(4 * BLK)), key)))
        for k in range(4):
            mu.inline_ptx("st.shared.u8 [$0], $1;", arith.addi(m, c32(k * BLK)),
                          arith.shrui(w, c32(8 * k)), has_side_effects=True)
        finish("r" in parts)

    gather(*refs, *s_refs, row_base, idx_off, b, slot)


def ref_rows(window, refs, s_refs, row_base, idx_off, b, slot, epb, implicit=0, parts="nr",
             nope_chunks=(0, NCH), meta=True, commit=False):
    """The interpreter's stand-in for cp_async_rows: the same rows, validity and meta into
    the same SMEM places, by plain ref loads and stores, one key at a time (complete on
    return: nothing to wait for or retire)."""
    del commit
    nope_g, rope_g, idx_g, bt_g, wsc_g, csc_g, pos_g, t_g = refs
    n_s, k_s, m_s = s_refs
    MAXB = bt_g.shape[1]
    lo, hi = nope_chunks
    byte = lax.broadcasted_iota(jnp.int32, (1, 8), 1)

    @pl.loop(0, BLK)
    def _(key):
        if window:
            row = row_base + key
            pos, tb = pos_g[row // WINDOW, row % WINDOW], t_g[b]
            ok = (pos >= 0) & (tb >= pos) & (pos >= tb - (WINDOW - 1))
            sc_g = wsc_g
        else:
            if implicit:
                i, tb = idx_off + key, t_g[b]
                ok = i < jnp.minimum(lax.div(jnp.maximum(tb + 1, 0) * epb, BLOCK_TOKENS),
                                     implicit)
                safe = i
            else:
                kp = idx_g.shape[1]
                i = idx_g[(idx_off + key) // kp, (idx_off + key) % kp]
                ok = i >= 0
                safe = jnp.maximum(i, 0)
            blk = bt_g[b, jnp.minimum(safe // epb, MAXB - 1)]
            row = jnp.maximum(blk, 0) * epb + safe % epb
            sc_g = csc_g
        if "n" in parts:
            for j in range(lo, hi):
                n_s[0, j, pl.ds(key, 1), :] = nope_g[pl.ds(row * NCH + j, 1), :]
            if meta:
                e = jnp.where(byte == 7, ok.astype(jnp.uint8), sc_g[pl.ds(row, 1), :])
                for j in range(8):
                    m_s[slot, j, pl.ds(key, 1)] = e[:, j]
        if "r" in parts:
            k_s[slot, pl.ds(key, 1), pl.ds(NOPE, ROPE)] = rope_g[pl.ds(row, 1), :]


def block_copier(b, g_refs, s_refs, epb, implicit=0, interpret=False, **rows_kw):
    """-> copy(g, slot, after=None): the rows of key block g into slot (the window ring's
    rows b*128 + g*64 + j for g < NW, else those of the compressed ids at list positions
    (g - NW)*64 ..), then after(window) in the same branch (the caller's barrier arrival).
    g_refs = (win nope, win rope, cmp nope, cmp rope, idx, block_table, win_scale,
    cmp_scale, win_pos, t); implicit, rows_kw: cp_async_rows'."""
    wn_g, wr_g, cn_g, cr_g, idx_g, *rest = g_refs
    i32 = lambda v: jnp.asarray(v, jnp.int32)
    rows = functools.partial(ref_rows if interpret else cp_async_rows, **rows_kw)

    def copy(g, slot, after=lambda window: None):
        @pl.when(g < NW)
        def _():
            rows(True, (wn_g, wr_g, idx_g, *rest), s_refs, i32(b * WINDOW + g * BLK),
                 i32(0), i32(b), i32(slot), epb, implicit)
            after(True)

        @pl.when(g >= NW)
        def _():
            off = (g - NW) * BLK if implicit else b * idx_g.shape[1] + (g - NW) * BLK
            rows(False, (cn_g, cr_g, idx_g, *rest), s_refs, i32(0), i32(off), i32(b),
                 i32(slot), epb, implicit)
            after(False)
    return copy


def issuer(b, g_refs, s_refs, epb, implicit=0, parts="nr", interpret=False):
    """-> issue(g, slot, wbar, cbar): copy `parts` of block g into slot (the calling
    warpgroup waits for its copies), then arrive once on wbar[slot] (window block) or
    cbar[slot] (compressed block)."""
    copy = block_copier(b, g_refs, s_refs, epb, implicit, interpret, parts=parts)

    def issue(g, slot, wbar, cbar):
        copy(g, slot, lambda window: plgpu.barrier_arrive((wbar if window else cbar).at[slot]))
    return issue


def part_issuer(b, g_refs, s_refs, epb, implicit, parts, chunks, meta, interpret=False):
    """-> issue(g, slot): start (no wait: one cp.async group, see retire) the copies of one
    part of key block g: parts "n" the nope chunks `chunks` (and the meta into m_s[slot]
    if meta), "r" the rope rows into K tile `slot`."""
    return block_copier(b, g_refs, s_refs, epb, implicit, interpret, parts=parts,
                        nope_chunks=chunks, meta=meta, commit=True)


def retire(pending, fence=False, interpret=False):
    """Wait until at most `pending` of this thread's cp.async groups are in flight (the
    older ones are done); fence: make them visible to the async proxy (the wgmma).
    Interpreted copies are complete already."""
    if interpret:
        return

    @plgpu.inline_mgpu()
    def retire_(ctx):
        del ctx
        mu.inline_ptx(f"cp.async.wait_group {pending};", has_side_effects=True)
        if fence:
            mu.inline_ptx("fence.proxy.async.shared::cta;", has_side_effects=True)
    retire_()


def wait_block(g, slot, wbar, cbar):
    """Wait for key block g's copies in slot: wbar for a window block, cbar otherwise."""
    @pl.when(g < NW)
    def _():
        plgpu.barrier_wait(wbar.at[slot])

    @pl.when(g >= NW)
    def _():
        plgpu.barrier_wait(cbar.at[slot])


def key_blocks(keys, implicit, NS):
    """-> (kp, bps): the compressed key slots (implicit HCA ids: K rounded up to whole
    blocks; else the padded id list's length) and the key blocks a split takes of a
    request's NW + kp / 64."""
    kp = -(-implicit // BLK) * BLK if implicit else keys[0].shape[1]
    return kp, -(-(NW + kp // BLK) // NS)


def split_load(used, g0, bps, kp, epb, used_from_t):
    """Key blocks a CTA loads: its split's share (blocks g0 .. g0 + bps) of the request's
    used blocks. used: 1 + the position of the last valid id, or t (used_from_t, the
    caller's ids_prefix promise): the eligible compressed entries min(kp, (t + 1) * EPB //
    128) bound the blocks."""
    if used_from_t:
        used = jnp.minimum(lax.div(jnp.maximum(used + 1, 0) * epb, BLOCK_TOKENS), kp)
    nb = NW + (used + BLK - 1) // BLK
    return jnp.clip(jnp.minimum(nb, g0 + bps) - g0, 0, bps)
