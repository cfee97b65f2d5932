"""The cached step: T new tokens for each of B batch rows (prefill chunk: B=1, T=chunk;
decode: B=max_requests, T=1), each row at its own position, compiled as one XLA program
with the cache donated.

Batch row b writes cache slot slots[b]; its tokens sit at positions pos[b] .. pos[b]+T-1,
of which the first nvalid[b] are real (the rest is padding: never written, never read).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.indexer_decode import topk_keys
from pallas_kernels.kv_scatter import append_window, flush_compressed
from pallas_kernels.sparse_decode_attention import sparse_decode_attention

from . import cache as C
from .cache import BLOCK_TOKENS, Cache, CacheSpec, LayerCache
from .config import Config
from .quant import EXACT_COMPILER_OPTIONS, Numerics
from . import layers as L
from . import model as M

F32 = jnp.float32


def compressor_chunk(p, x, tok_pos, pos, nvalid, st_a, st_z, pv_a, pv_z, ratio, c, freqs,
                     cfg: Config, nm: Numerics, kind: str, sim: bool = True):
    """Advance one compressor over a chunk. sim=False: main entries without their FP8
    simulation (finish_entries), for an FP8 cache that quantises them itself.
    x [B, T, D]; state st_a/st_z [B, r, coff*c] (rows of the current incomplete block);
    pv_a/pv_z [B, r, c] (CSA: the previous complete block's [:c] half) ->
    entries [B, nb, c], entry index [B, nb], complete [B, nb], new state."""
    B, T, _ = x.shape
    r = ratio
    a, z = L.compressor_project(p, x, r, tok_pos)  # [B, T, coff*c]
    off = pos % r
    nb = -(-(r + T) // r)  # virtual blocks covering the state rows and the chunk
    blockstart = pos - off
    end = pos + nvalid
    ncomp = (end - blockstart) // r  # complete blocks this step, <= nb
    if T == 1:
        # Decode: the token lands in row `off` of the current block, which completes when
        # off == r - 1. The new state is an elementwise select on the old one, with no
        # gather: the general form's gathers cost dynamic-slice kernels and state copies
        # every step. Same values as the general form. a and z go through the selects as
        # one [B, r, 2*coff*c] array (st_a | st_z sit side by side in the cache's packed
        # state, cache.cmp_state_parts): one select fusion instead of two.
        w = a.shape[-1]
        put = (jnp.arange(r)[None, :, None] == off[:, None, None]) & (nvalid > 0)[:, None, None]
        cur = jnp.where(put, jnp.concatenate([a, z], -1),
                        jnp.concatenate([st_a, st_z], -1))                  # [B, r, 2*coff*c]
        cur_a, cur_z = cur[..., :w], cur[..., w:]                           # [B, r, coff*c]
        a_blk = jnp.stack([cur_a, jnp.zeros_like(cur_a)], 1)                # [B, 2, r, .]
        z_blk = jnp.stack([cur_z, jnp.zeros_like(cur_z)], 1)
        done = (ncomp > 0)[:, None, None]
        new_st = jnp.where(done, 0.0, cur)
        new_st_a, new_st_z = new_st[..., :w], new_st[..., w:]
        last_a, last_z = cur_a, cur_z   # the block that completed, if one did
    else:
        VL = (nb + 1) * r  # one spare block so the trailing partial block always exists
        t = jnp.arange(T)
        dst = jnp.where(t[None, :] < nvalid[:, None], off[:, None] + t[None, :], VL)  # [B, T]
        b_ix = jnp.arange(B)[:, None]
        va = jnp.zeros((B, VL, a.shape[-1]), F32).at[:, :r].set(st_a)
        vz = jnp.zeros((B, VL, z.shape[-1]), F32).at[:, :r].set(st_z)
        va = va.at[b_ix, dst].set(a, mode="drop")
        vz = vz.at[b_ix, dst].set(z, mode="drop")
        a_blk = va[:, :nb * r].reshape(B, nb, r, -1)
        z_blk = vz[:, :nb * r].reshape(B, nb, r, -1)
        # new state: the block holding `end` becomes current; the one before it previous
        allb_a = va.reshape(B, nb + 1, r, -1)
        allb_z = vz.reshape(B, nb + 1, r, -1)
        new_st_a = allb_a[jnp.arange(B), ncomp]
        new_st_z = allb_z[jnp.arange(B), ncomp]
        last = jnp.maximum(ncomp - 1, 0)
        last_a, last_z = allb_a[jnp.arange(B), last], allb_z[jnp.arange(B), last]
    k = jnp.arange(nb)
    complete = blockstart[:, None] + (k[None, :] + 1) * r <= end[:, None]  # [B, nb]
    if r == 4:
        has_prev = (blockstart > 0)[:, None, None]
        prev_a = jnp.where(has_prev, pv_a, 0.0)
        prev_z = jnp.where(has_prev, pv_z, -jnp.inf)
        pooled = L.pool_blocks(a_blk, z_blk, r, c, prev_a, prev_z)
    else:
        pooled = L.pool_blocks(a_blk, z_blk, r, c)
    first = blockstart[:, None] + k[None, :] * r
    entries = L.finish_entries(p, pooled, first, freqs, cfg, nm, kind, sim=sim)
    eidx = blockstart[:, None] // r + k[None, :]
    new_pv_a = new_pv_z = None
    if r == 4:
        got = (ncomp > 0)[:, None, None]
        new_pv_a = jnp.where(got, last_a[..., :c], pv_a)
        new_pv_z = jnp.where(got, last_z[..., :c], pv_z)
    return entries, eidx, complete, (new_st_a, new_st_z, new_pv_a, new_pv_z)


def _compressor_update(ap, st, x, tok_pos, pos, nvalid, ratio, freqs, cfg, nm, which,
                       cs: CacheSpec):
    """Run the main ("") or indexer ("i") compressor over the chunk and put its new state in
    st (the batch rows' named state parts, cache.read_state: "st_a" [B, r, coff*c], ...).
    Returns (entries [B, nb, c], entry index [B, nb], complete [B, nb]). The entries only go
    to the cache: an FP8 cache quantises main entries itself (the simulation's values), so
    they skip the simulation (no amax kernels, no second rounding)."""
    cp = L.block_params(ap, "compressor." if which == "" else "indexer.compressor.")
    c = cfg.head_dim if which == "" else cfg.index_head_dim
    kind = "main" if which == "" else "indexer"
    n = [which + k for k in ("st_a", "st_z", "pv_a", "pv_z")]
    ent, eidx, comp, new = compressor_chunk(cp, x, tok_pos, pos, nvalid, *(st.get(k) for k in n),
                                            ratio, c, freqs, cfg, nm, kind,
                                            sim=cs.kv_format != "fp8")
    st.update({k: v for k, v in zip(n, new) if v is not None})
    return ent, eidx, comp


# The read-only kernels behind one jit each: the layers' identical calls then share one
# lowered kernel per layer kind instead of one per call (Flash: 64 calls). The in-place
# scatters (append_window, flush_compressed) stay inline: their cache buffers must alias
# the step's donated ones.
@functools.partial(jax.jit, static_argnames=("fmt", "topk", "interpret"))
def _indexer_topk_jit(q, w, keys, block_table, t, *, fmt, topk, interpret):
    return topk_keys(q, w, keys, block_table, t, topk, fmt=fmt, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("backend", "ids_prefix", "hca_entries",
                                             "interpret"))
def _sparse_attention_jit(q, win, cmp, block_table, idx, t, sink, *, backend, ids_prefix,
                          hca_entries, interpret):
    return sparse_decode_attention(q, win, cmp, block_table, idx, t, sink, backend=backend,
                                   ids_prefix=ids_prefix, hca_entries=hca_entries,
                                   interpret=interpret)


# The window-only layers' dummy compressed pool (its rows are never read: every id is -1).
# Not all-equal on purpose: XLA turns a splat constant into a broadcast, which is then a
# kernel of its own every step.
_DUMMY_POOL = (np.eye(1, 448, dtype=jnp.float8_e4m3fn)[None],   # nope [1, 1, 448]
               np.eye(1, 8, dtype=np.uint8)[None] + 126,          # scale [1, 1, 8]
               np.eye(1, 64, dtype=jnp.bfloat16)[None])           # rope [1, 1, 64]


# Most rows per request the kernel path takes in one step: a speculative verify's k + 1
# (speculative.MAX_DRAFTS + 1). At most one compressed entry then completes per request
# (T <= the smallest compression ratio), so one flush per layer writes it.
KERNEL_ROWS = 4


def _kernel_attention(ap, lc: LayerCache, x, q, kv, cq, tok_pos, valid, pos, nvalid, bt_rows,
                      cfg: Config, cs: CacheSpec, nm: Numerics, ratio: int, freqs, cqq=None):
    """T <= KERNEL_ROWS rows of every request (batch row b = slot b; decode T = 1, a
    speculative verify T = k + 1) through the Pallas kernels: quantise-scatter of the window
    rows and of the completed compressed entry / indexer key, the lightning indexer top-k
    of every row, and sparse attention reading the FP8 cache directly. Row j attends after
    rows 0..j are in the window ring and before row j+1 is: its ring then holds exactly its
    window (row j+1 overwrites the slot of position t+j+1-W, which row j still sees).
    -> (o [B, T, H, K] f32, new layer cache)."""
    interp = cs.kernels == "interpret"   # the Mosaic GPU interpreter (CPU tests)
    B, T = x.shape[:2]
    # rows past nvalid (an idle slot, a short MTP catch-up) write nothing and read at row
    # 0's position, whose blocks exist; their outputs are never used
    t_rows = tok_pos if T == 1 else jnp.where(valid, tok_pos, tok_pos[:, :1])   # [B, T]
    if 0 < ratio < T:
        raise ValueError(f"the kernel path takes at most ratio = {ratio} rows a request, got {T}")

    def append(lc, j):
        w = lc.win
        win = append_window({"win_nope": w["nope"], "win_scale": w["scale"],
                             "win_rope": w["rope"], "win_pos": lc.win_pos},
                            kv[:, j].astype(jnp.bfloat16), jnp.where(valid[:, j], tok_pos[:, j], -1),
                            interpret=interp)
        return lc.replace(win={"nope": win["win_nope"], "scale": win["win_scale"],
                               "rope": win["win_rope"]}, win_pos=win["win_pos"])

    lc = append(lc, 0)
    slots = jnp.arange(B)
    hca = None   # HCA layers: the id list's length (the kernel derives the ids)
    idx = None
    if ratio > 0:
        st = C.read_state(lc, slots, cfg, ratio)
        ent, eidx, comp = _compressor_update(ap, st, x, tok_pos, pos, nvalid, ratio, freqs,
                                             cfg, nm, "", cs)
        pool = {"cmp_nope": lc.cmp["nope"], "cmp_scale": lc.cmp["scale"],
                "cmp_rope": lc.cmp["rope"]}
        idx_pool, key = None, None
        if ratio == 4:
            kI, _, _ = _compressor_update(ap, st, x, tok_pos, pos, nvalid, ratio, freqs, cfg,
                                          nm, "i", cs)
            idx_pool, key = dict(lc.idx), kI[:, 0].astype(F32)
        lc = C.write_state(lc, slots, st, cfg, ratio)
        # the chunk's first block is the only one T <= ratio rows can complete
        pool, idx_pool = flush_compressed(pool, idx_pool, ent[:, 0].astype(jnp.bfloat16), key,
                                          comp[:, 0].astype(jnp.int32), eidx[:, 0], bt_rows,
                                          fmt=cs.index_format, interpret=interp)
        lc = lc.replace(cmp={"nope": pool["cmp_nope"], "scale": pool["cmp_scale"],
                             "rope": pool["cmp_rope"]})
        if ratio == 4:
            lc = lc.replace(idx={k: idx_pool[k] for k in lc.idx})
            ip = L.block_params(ap, "indexer.")
            qI, wI = L.indexer_query(ip, x, cq, tok_pos, freqs, cfg, nm, cqq)
            pad = 64 - cfg.index_n_heads  # the kernel works on 64 heads; zero weight is exact
            qI = jnp.pad(qI.reshape(B * T, *qI.shape[2:]), ((0, 0), (0, pad), (0, 0)))
            wI = jnp.pad(wI.reshape(B * T, -1), ((0, 0), (0, pad)))
            bt = bt_rows if T == 1 else jnp.repeat(bt_rows, T, 0)           # [B*T, MAXB]
            idx = _indexer_topk_jit(qI, wI, lc.idx, bt, t_rows.reshape(-1),
                                    fmt=cs.index_format, topk=cfg.index_topk,
                                    interpret=interp).reshape(B, T, -1)
        else:   # HCA: every visible entry; the kernel derives the ids from t (hca_indices)
            hca = bt_rows.shape[1] * (BLOCK_TOKENS // ratio)
        cmp = (lc.cmp["nope"], lc.cmp["scale"], lc.cmp["rope"])
    else:  # window only: an empty compressed list over a one-row dummy pool, never read
        cmp = _DUMMY_POOL
    outs = []
    for j in range(T):
        if j:
            lc = append(lc, j)
        win = (lc.win["nope"], lc.win["scale"], lc.win["rope"], lc.win_pos)
        ids = (np.full((B, 64), -1, np.int32) if ratio == 0 else
               None if idx is None else idx[:, j])
        outs.append(_sparse_attention_jit(q[:, j], win, cmp, bt_rows, ids, t_rows[:, j],
                                          ap["attn_sink"], backend=cs.attention_backend,
                                          # top-k output and hca_indices list their valid
                                          # ids first
                                          ids_prefix=ratio > 0, hca_entries=hca,
                                          interpret=interp))
    return jnp.stack(outs, 1).astype(F32), lc


def attention_cached(ap, lc: LayerCache, x, tok_pos, valid, slots, pos, nvalid, bt_rows,
                     cfg: Config, cs: CacheSpec, nm: Numerics, ratio: int, xq=None):
    """Attention for a chunk with the paged cache. Returns (out [B, T, D], new layer cache).
    xq: x's padded FP8 simulation (layers.norm_act), if made."""
    B, T, _ = x.shape
    W = cfg.sliding_window
    freqs = L.rope_freqs(cfg, ratio)
    # kv unsimulated where the cache stores it as FP8 rows (exactly the simulation's values;
    # the kernel path quantises it in append_window): simulated below where it is read
    fp8 = cs.kv_format == "fp8"
    q, kv_raw, cq, cqq = L.q_and_kv(ap, x, tok_pos, freqs, cfg, nm, xq=xq, sim_kv=not fp8)
    # the kernels: decode (T = 1) and a speculative verify's rows, all request slots at once;
    # prefill chunks take the path below (the sparse prefill attention kernel for long ones)
    if cs.kernels != "off" and (T == 1 or (T <= KERNEL_ROWS and B == cs.max_requests)):
        if B != cs.max_requests:
            raise ValueError("the kernel decode path runs all request slots (B == max_requests)")
        o, lc = _kernel_attention(ap, lc, x, q, kv_raw, cq, tok_pos, valid, pos, nvalid, bt_rows,
                                  cfg, cs, nm, ratio, freqs, cqq)
        return L.attn_output(ap, o, tok_pos, freqs, cfg, nm), lc
    kv = L.kv_quant_sim(kv_raw, cfg, nm) if fp8 else kv_raw
    # long chunks with the kernels on: the sparse prefill attention (each row's window band
    # and its own entries, memory bounded); else a dense [T, W + T + n] mask over all keys
    sparse = (cs.kernels != "off" and 0 < nm.sparse_prefill_rows <= T
              and cfg.head_dim == 512)   # (the kernel's head width)
    # ---- window: ring contents before this step + the chunk's own rows
    ring, ring_pos = C.read_window(lc, slots, pos, cs, nm.jdtype)  # [B, W, K], [B, W]
    if not sparse:
        new_pos = jnp.where(valid, tok_pos, -1)
        kpos = jnp.concatenate([ring_pos, new_pos], 1)  # [B, W+T]
        keys = jnp.concatenate([ring, kv], 1)
        p_t = tok_pos[:, :, None]
        mask = (kpos[:, None, :] >= 0) & (kpos[:, None, :] <= p_t) & (kpos[:, None, :] > p_t - W)
    lc = C.write_window(lc, cs, slots, tok_pos, valid, pos + nvalid, kv_raw, W)
    # sparse: the entries each row attends (window-only layers: none, over one dummy row)
    ents, ids = jnp.zeros((B, 1, cfg.head_dim), nm.jdtype), None
    ncmp = jnp.zeros((B, T), jnp.int32)
    if ratio > 0:
        epb = BLOCK_TOKENS // ratio
        NB = cs.num_blocks
        st = C.read_state(lc, slots, cfg, ratio)
        ent, eidx, comp = _compressor_update(ap, st, x, tok_pos, pos, nvalid, ratio, freqs,
                                             cfg, nm, "", cs)
        addr = C.pool_addr(eidx, comp, bt_rows, epb, NB)
        lc = C.write_entries(lc, cs, addr, ent)
        cents = C.read_entries(lc, cs, bt_rows, epb, nm.jdtype)        # [B, NE, K]
        NE = cents.shape[1]
        nvis = jnp.minimum((tok_pos + 1) // ratio, NE)                 # [B, T]
        visible = jnp.arange(NE)[None, None, :] < nvis[:, :, None]
        if ratio == 4:
            ip = L.block_params(ap, "indexer.")
            kI, _, _ = _compressor_update(ap, st, x, tok_pos, pos, nvalid, ratio, freqs, cfg,
                                          nm, "i", cs)
            lc = C.write_index_keys(lc, cs, addr, kI.astype(F32))
            keysI = C.read_index_keys(lc, cs, bt_rows, epb).astype(nm.jdtype)
            qI, wI = L.indexer_query(ip, x, cq, tok_pos, freqs, cfg, nm, cqq)
            if sparse:   # the top-k ids, scored in query blocks (no [T, n] array)
                ids = L.indexer.topk_ids_blocked(qI, wI, keysI, nvis, cfg.index_topk)
                nvis = jnp.minimum(nvis, ids.shape[-1])
            else:
                scores = L.indexer_scores(qI, wI, keysI)
                visible, _ = L.topk_mask(scores, visible, cfg.index_topk)
        lc = C.write_state(lc, slots, st, cfg, ratio)
        if sparse:   # padding rows attend no entries (their outputs are never used)
            ents, ncmp = cents, jnp.where(valid, nvis, 0)
        else:
            keys = jnp.concatenate([keys, cents], 1)
            mask = jnp.concatenate([mask, visible], -1)
    if sparse:
        o = L.attention.sparse_chunk_attention(q, ring, ring_pos, kv, pos, nvalid, ents, ids,
                                               ncmp, ap["attn_sink"], nm, cs.kernels)
    else:
        o = L.attend(q, keys[:, None], mask, ap["attn_sink"], nm)
    return L.attn_output(ap, o, tok_pos, freqs, cfg, nm), lc


def layer_loop(params, cache: Cache, X, tokens, layers, cfg: Config, nm: Numerics, attend,
               block=M.block, capture: tuple[int, ...] = ()):
    """The cached layers' loop (every cached step: decode, prefill, verify, the tensor
    layout): blocks `layers` (ids in `cache`) on the residual X [B, T, N, D], layer i's
    attention attend(i, ap, lc, x, xq) -> (out [B, T, D], new layer cache, aux) on
    lc = cache[i]. block: model.block or one of its signature (the tensor layout's).
    -> (X, the cache with those layers' new entries, {i: aux}, [X after layer i, for i in
    capture])."""
    new, auxes, captured = {}, {}, {}
    for i in layers:
        def attn(ap, x, i=i, xq=None):
            out, lc, aux = attend(i, ap, cache[i], x, xq)
            return out, (lc, aux)

        with jax.named_scope(f"layer{i}_{cfg.layer_kind(i)}"):
            X, (new[i], auxes[i]) = block(L.block_params(params, f"layers.{i}."), X, tokens, i,
                                          cfg, nm, attn)
        if i in capture:
            captured[i] = X
    return X, cache.replace_layers(new), auxes, [captured[i] for i in capture]


def step_layers(params, cache: Cache, X, tokens, slots, pos, nvalid, block_table, layers,
                cfg: Config, cs: CacheSpec, nm: Numerics, capture: tuple[int, ...] = ()):
    """Blocks `layers` (consecutive ids) of the cached step on the residual X [B, T, N, D]
    -> (X, cache with those layers' new entries). `cache` needs only those layers (a
    pipeline stage holds just its own: Cache.part). capture (static): layer ids (of
    `layers`) whose output residual is returned too, for a drafter that reads them
    (dspark.py) -> (X, cache, [X after layer i, [B, T, N, D], for i in capture])."""
    B, T = tokens.shape
    tok_pos = pos[:, None] + jnp.arange(T)[None, :]
    valid = jnp.arange(T)[None, :] < nvalid[:, None]
    bt_rows = block_table[slots]

    def attend(i, ap, lc, x, xq):
        out, lc = attention_cached(ap, lc, x, tok_pos, valid, slots, pos, nvalid, bt_rows, cfg,
                                   cs, nm, cfg.layer_ratio(i), xq)
        return out, lc, None

    X, cache, _, captured = layer_loop(params, cache, X, tokens, layers, cfg, nm, attend,
                                       capture=capture)
    if capture:
        return X, cache, captured
    return X, cache


def step_head(params, X, nvalid, cfg: Config, nm: Numerics):
    """Final residual X [B, T, N, D] -> logits [B, V] f32 at each row's last valid token."""
    last = jnp.maximum(nvalid - 1, 0)
    return M.head(params, X[jnp.arange(X.shape[0]), last], cfg, nm)


def step(params, cache, tokens, slots, pos, nvalid, block_table, cfg: Config, cs: CacheSpec,
         nm: Numerics):
    """tokens [B, T] int32, slots/pos/nvalid [B] int32, block_table [R, MAXB] int32 ->
    (logits [B, V] f32 at each row's last valid token, new cache)."""
    X = M.embed(params, tokens, cfg, nm)
    X, new_cache = step_layers(params, cache, X, tokens, slots, pos, nvalid, block_table,
                               range(cfg.num_hidden_layers), cfg, cs, nm)
    return step_head(params, X, nvalid, cfg, nm), new_cache


# XLA options of the step programs. A GPU step runs as one CUDA graph; with concurrent
# regions its independent small kernels (the q / kv / compressor / indexer branches of a
# layer) overlap in the graph: H100, SWA + CSA + HCA layers + head, B = 1: sync step 2.24 ->
# 1.87 ms, pipelined 1.27 -> 1.09 ms; 4 Flash layers: sync 2.71 -> 2.31 ms, pipelined 1.47
# either way. Only the scheduling changes, not the kernels. Plus the options that keep the
# reference's roundings on the GPU (quant.EXACT_COMPILER_OPTIONS).
STEP_COMPILER_OPTIONS = {"xla_gpu_graph_enable_concurrent_region": True,
                         **EXACT_COMPILER_OPTIONS}


# ---------------------------------------------------------------------------------------
# Streaming step on a device-resident state: nothing moves between steps
# ---------------------------------------------------------------------------------------
# XLA updates a step's CUDA graph whenever a buffer the graph uses sits at a new address,
# at a host cost that seems to grow with the graph, not with the buffers that moved (the
# logits feed one or two kernels, yet donating them saved a quarter of the 4-layer step's
# host time). A stream that feeds fresh token / position arrays and gets fresh logits back
# pays it every step. Measured on one H100, 10 Flash layers (675 kernels), B=1, pipelined:
# fresh inputs 3.60 ms/step, inputs at fixed addresses 3.39, nothing moving (logits
# donated too) 3.07. The stream step below keeps every buffer in place: the state it reads
# (tokens, positions, ...) is donated and written back by the step.
# On a host-bound H100: 3.13 ms/step against 3.63 for the plain step with fixed inputs;
# reading each step's tokens back (Engine.stream) adds ~0.5 ms there.

def init_stream_state(tokens_R, pos_R, nvalid_R, block_table, key, i0: int = 1,
                      sharding=None):
    """The device state of a stream: tok [R, 1] int32 (what each slot is fed next), pos /
    nvalid [R] int32 (position of that token; 1 = the slot runs, 0 = it idles), table
    [R, MAXB] int32 (block table), key (sampling key), i int32 (index of the token the next
    step samples: it samples with fold_in(key, i)). The state holds its own copies: it is
    donated to the step. sharding: where the (sharded) step keeps it, e.g. replicated on
    the mesh."""
    st = {"tok": np.asarray(tokens_R, np.int32).reshape(-1, 1),
          "pos": np.asarray(pos_R, np.int32), "nvalid": np.asarray(nvalid_R, np.int32),
          "table": np.asarray(block_table, np.int32), "i": np.asarray(i0, np.int32)}
    st = {k: put_state(v, sharding) for k, v in st.items()}   # fresh device buffers
    st["key"] = jax.random.wrap_key_data(put_state(np.asarray(jax.random.key_data(key)),
                                                   sharding), impl=jax.random.key_impl(key))
    return st


def put_state(x_np, sharding=None):
    """A host array -> a new device array for the stream state, placed by `sharding`
    (every process passes the same value; None: the default device). The state must enter
    placed (committed) as the step returns it, or the second step compiles (and loads) the
    step again: on one device the step's outputs are committed once its weights are."""
    x_np = np.array(x_np, copy=True)
    if sharding is None:   # (jnp.asarray: a buffer of its own, which donation can reuse)
        return jax.device_put(jnp.asarray(x_np), jax.devices()[0])
    return jax.make_array_from_callback(x_np.shape, sharding, lambda i: x_np[i])


def stream_step_fn(step_fn, sampler):
    """step_fn(params, cache, tokens, slots, pos, nvalid, table) -> (logits, cache) ->
    run(params, cache, st) -> (cache, st'): one decode step of every running slot of st,
    the next tokens sampled in the same program and written into st'.tok; st'.pos advances
    by nvalid. sampler: a generate.py sampler (one key for the batch: st.key, st.i) or one
    with draw(logits, st) -> (tokens, state updates) (serve.sampling.RowSampler). Jit it
    with the cache and st donated: every output then aliases an input."""
    def run(params, cache, st):
        R = st["tok"].shape[0]
        logits, cache = step_fn(params, cache, st["tok"], jnp.arange(R, dtype=jnp.int32),
                                st["pos"], st["nvalid"], st["table"])
        if hasattr(sampler, "draw"):   # per-row settings in the state (RowSampler)
            nxt, upd = sampler.draw(logits, st)
        else:
            nxt = sampler.get_next_tokens(logits, jax.random.fold_in(st["key"], st["i"]))
            upd = {"i": st["i"] + 1}
        run_ = st["nvalid"] > 0
        return cache, dict(st, **upd, tok=jnp.where(run_[:, None], nxt[:, None], st["tok"]),
                           pos=st["pos"] + st["nvalid"])
    return run



def multi_step_fn(stream_fn, steps: int):
    """A stream step run(params, cache, st) -> (cache, st') (stream_step_fn with the
    per-row sampler) -> the same run doing `steps` decode steps in one program (a
    fori_loop), so the host reads once per `steps` tokens. A slot runs while it is in
    st.nvalid and its draw index is below st.end [R] (its max_tokens: no write past what
    the scheduler allocated); st'.out [R, steps] holds its tokens, st'.n_out [R] how many,
    out_lp / out_top_ids / out_top_lp their log-probabilities."""
    def run(params, cache, st):
        run0 = st["nvalid"]

        def body(i, c):
            cache, st = c
            live = jnp.where(st["draw"] < st["end"], run0, 0)
            cache, st = stream_fn(params, cache, dict(st, nvalid=live))
            on = live > 0
            col = lambda name, v: st[name].at[:, i].set(
                jnp.where(on.reshape((-1,) + (1,) * (v.ndim - 1)), v, 0))
            return cache, dict(st, out=col("out", st["tok"][:, 0]),
                               n_out=st["n_out"] + on, out_lp=col("out_lp", st["lp"]),
                               out_top_ids=col("out_top_ids", st["top_ids"]),
                               out_top_lp=col("out_top_lp", st["top_lp"]))

        st = dict(st, n_out=jnp.zeros_like(st["n_out"]))
        cache, st = jax.lax.fori_loop(0, steps, body, (cache, st))
        return cache, dict(st, nvalid=run0)
    return run

# The host reads a step's tokens through this copy (one small program): reading st.tok
# itself is impossible once st is donated to the next step. The copy lands in pinned host
# memory, not in a fresh device buffer: a device allocation made between two steps moves
# the step's temporary buffer, and XLA then re-records every CUDA graph of the step
# (2 x H200, 6 Flash layers, stream step pipelined: 2.95 ms/step with a device copy, 2.32
# with the pinned one, from XLA's command-buffer log).

def read_tokens(st) -> jax.Array:
    """st -> st.tok[:, 0] [R] int32, in pinned host memory (np.asarray waits for it)."""
    return host_reader("tok")(st)


@functools.lru_cache(maxsize=None)
def host_reader(*names: str):
    """-> read(st): the stream state's arrays `names` (st.tok: its first column) copied into
    pinned host memory by one small program, placed as st is (np.asarray waits for them).
    One name gives one array, several a tuple."""
    def read(st):
        out = tuple(st[n][:, 0] if n == "tok" else st[n] for n in names)
        return out[0] if len(names) == 1 else out
    return _HostReader(read, names[0])


class _HostReader:
    """jit(read) with pinned-host outputs, one program per state sharding."""

    def __init__(self, read, name):
        self.read, self.name, self.progs = read, name, {}

    def __call__(self, st):
        sh = st[self.name].sharding
        if sh not in self.progs:
            if isinstance(sh, jax.sharding.NamedSharding):   # the state is replicated
                host = jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(),
                                                  memory_kind="pinned_host")
            else:
                host = jax.sharding.SingleDeviceSharding(next(iter(sh.device_set)),
                                                         memory_kind="pinned_host")
            self.progs[sh] = jax.jit(self.read, out_shardings=host)
        return self.progs[sh](st)
