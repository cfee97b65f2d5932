"""Inference state as pytrees (byte layout: docs/KV_CACHE.md), every read and write of it
by the model (the cache addressing), and the host-side block manager.

The cache is typed: `Cache(layers)`, a tuple of `LayerCache` dataclasses indexed by layer
id (`cache[i]`), each with the fields its layer kind has (sliding-window layers: win /
win_pos; HCA adds cmp / cst; CSA adds idx too) and None for the others, which is no leaf.
A tuple of layers rather than one stacked array because the kinds differ in fields and
shapes; a Cache rather than a bare tuple because it carries `first`, the id of its first
layer (static), so that a pipeline stage holds only its own layers (`Cache.part`) and
still addresses them by global id. The MTP block's cache is one LayerCache of its own
(`init_layer_cache(cfg, cs, num_hidden_layers)`). The storage fields of entries (win,
cmp: `kv_fields`; idx: `idx_fields`) stay dicts keyed by field: their keys depend on the
storage format, as a quantised weight's fields depend on its type.

Shapes are static: R = max_requests slots, NB = pool blocks, MAXB = blocks per request;
one logical block is 128 tokens = 128 // ratio compressed entries. With act_quant on, KV
is stored FP8 (nope) + e8m0 scales + bf16 rope and indexer keys in `index_format`; with
it off, rows are stored unquantised in the activation dtype ("raw").
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .config import Config
from pallas_kernels import formats as KF

BLOCK_TOKENS = 128
ATTENTION_BACKENDS = ("mosaic", "triton")


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    max_requests: int = 4
    num_blocks: int = 64  # pool blocks shared by all requests (per layer pool)
    max_blocks: int = 16  # blocks per request -> capacity max_blocks * 128 tokens
    kv_format: str = "fp8"  # "fp8" | "raw"
    index_format: str = "fp4"  # "fp4" | "nvfp4" | "fp8" | "raw"
    dtype: str = "bfloat16"  # raw storage dtype
    # Decode steps (T == 1) through the Pallas Mosaic-GPU kernels: "off" (pure JAX, the
    # reference), "on" (GPU), "interpret" (the Mosaic GPU interpreter, for CPU tests).
    kernels: str = "off"
    # The sparse attention kernel with kernels on: "mosaic" (warp-specialised Mosaic GPU
    # kernel, needs Hopper's wgmma; the fastest on H200: Flash CSA B=64 32K 41.0 against
    # 58.0 us) or "triton" (the portable Pallas-Triton kernel, for GPUs without wgmma).
    attention_backend: str = "mosaic"

    @property
    def capacity(self) -> int:
        return self.max_blocks * BLOCK_TOKENS

    def __post_init__(self):
        for f in ("max_requests", "num_blocks", "max_blocks"):
            if int(getattr(self, f)) <= 0:
                raise ValueError(f"CacheSpec.{f} must be positive, got {getattr(self, f)}")
        if self.kv_format not in ("fp8", "raw"):
            raise ValueError(f"CacheSpec.kv_format must be 'fp8' or 'raw', got {self.kv_format!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"CacheSpec.attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        if self.kernels not in ("off", "on", "interpret"):
            raise ValueError(f"CacheSpec.kernels must be 'off', 'on' or 'interpret', got "
                             f"{self.kernels!r}")
        if self.kernels != "off" and (self.kv_format != "fp8"
                                      or self.index_format not in KF.INDEX_FORMATS):
            raise ValueError("the kernels read the FP8 KV cache with quantised indexer keys: "
                             f"use kv_format='fp8' and index_format one of {KF.INDEX_FORMATS} "
                             f"(act_quant on), got {self.kv_format!r} / {self.index_format!r}")
        if self.index_format not in KF.INDEX_FORMATS + ("raw",):
            raise ValueError(f"CacheSpec.index_format must be one of "
                             f"{KF.INDEX_FORMATS + ('raw',)}, got {self.index_format!r}")

    @classmethod
    def for_numerics(cls, nm, **kw) -> "CacheSpec":
        """FP8/FP4 storage when simulating the trained numerics, raw rows otherwise."""
        if not nm.act_quant:
            kw.setdefault("kv_format", "raw")
            kw.setdefault("index_format", "raw")
        kw.setdefault("dtype", nm.dtype)
        return cls(**kw)


# ---------------------------------------------------------------------------------------
# Entry storage (main KV rows and indexer keys), format-dispatched
# ---------------------------------------------------------------------------------------
def kv_fields(cs: CacheSpec, lead: tuple[int, ...]):
    if cs.kv_format == "fp8":
        return {"nope": jax.ShapeDtypeStruct((*lead, 448), jnp.float8_e4m3fn),
                "scale": jax.ShapeDtypeStruct((*lead, 8), jnp.uint8),
                "rope": jax.ShapeDtypeStruct((*lead, 64), jnp.bfloat16)}
    return {"kv": jax.ShapeDtypeStruct((*lead, 512), jnp.dtype(cs.dtype))}


def encode_kv(cs: CacheSpec, x):
    if cs.kv_format == "fp8":
        n, s, r = KF.quantize_kv(x)
        return {"nope": n, "scale": s, "rope": r}
    return {"kv": x.astype(cs.dtype)}


def decode_kv(cs: CacheSpec, f, dtype):
    if cs.kv_format == "fp8":
        return KF.dequantize_kv(f["nope"], f["scale"], f["rope"], dtype)
    return f["kv"].astype(dtype)


def idx_fields(cs: CacheSpec, lead):
    if cs.index_format == "raw":
        return {"k": jax.ShapeDtypeStruct((*lead, 128), jnp.float32)}
    return {k: jax.ShapeDtypeStruct((*lead, *shp), dt)
            for k, (shp, dt) in KF.index_key_fields(cs.index_format).items()}


def encode_idx(cs: CacheSpec, k):
    if cs.index_format == "raw":
        return {"k": k.astype(jnp.float32)}
    return KF.quantize_index_key(k, cs.index_format)


def decode_idx(cs: CacheSpec, f):
    if cs.index_format == "raw":
        return f["k"]
    return KF.dequantize_index_key(f, cs.index_format)


# ---------------------------------------------------------------------------------------
# Cache pytree
# ---------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCache:
    """One layer's cache arrays (leaves: arrays, or ShapeDtypeStructs / shardings / logical
    axes in trees shaped like it). Fields a layer kind lacks are None, which adds no leaf.
      win      kv_fields [R, W, ...]   the window ring: the row of position p in slot p % W
      win_pos  [R, W] int32            the position each ring slot holds (-1: empty)
      cmp      kv_fields [NB, epb, ...] compressed entries, paged (ratio > 0: CSA, HCA)
      idx      idx_fields [NB, epb, ...] the indexer's keys of those entries (ratio 4: CSA)
      cst      [R, r, width] f32       the compressor state (ratio > 0; cmp_state_parts)
    win, win_pos and cst are per request slot; cmp and idx are per pool block."""
    win: dict
    win_pos: jax.Array
    cmp: dict | None = None
    idx: dict | None = None
    cst: jax.Array | None = None

    def replace(self, **kw) -> "LayerCache":
        return dataclasses.replace(self, **kw)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Cache:
    """The cache of consecutive layers first .. first + len(layers) - 1: `cache[i]` is
    layer i's LayerCache. The whole model's cache has first = 0; a pipeline stage holds
    only its own layers (`part`), addressed by the same global layer ids. `first` is
    static (part of the tree structure, not a leaf)."""
    layers: tuple[LayerCache, ...]
    first: int = dataclasses.field(default=0, metadata=dict(static=True))

    @property
    def ids(self) -> range:
        return range(self.first, self.first + len(self.layers))

    def __getitem__(self, i: int) -> LayerCache:
        if i not in self.ids:
            raise KeyError(f"layer {i} is not in this cache (layers {self.ids.start} .. "
                           f"{self.ids.stop - 1})")
        return self.layers[i - self.first]

    def replace_layers(self, new: dict) -> "Cache":
        """The cache with layer i's entry new[i] for each i in new."""
        if not set(new) <= set(self.ids):
            raise KeyError(f"layers {sorted(set(new) - set(self.ids))} are not in this cache")
        return dataclasses.replace(
            self, layers=tuple(new.get(i, lc) for i, lc in zip(self.ids, self.layers)))

    def part(self, ids: range) -> "Cache":
        """The layers `ids` (consecutive, all in this cache) as a cache of their own."""
        if ids.step != 1 or not len(ids) or ids.start not in self.ids or ids[-1] not in self.ids:
            raise KeyError(f"layers {ids} are not consecutive layers of this cache")
        return Cache(self.layers[ids.start - self.first:ids.stop - self.first], ids.start)


# The fields of a layer that belong to a request slot (prefix snapshots copy them).
SLOT_FIELDS = ("win", "win_pos", "cst")


def slot_state(cache: Cache) -> Cache:
    """The per-slot fields of every layer (win, win_pos, cst; the pools become None)."""
    return dataclasses.replace(cache, layers=tuple(
        LayerCache(**{f: getattr(lc, f) for f in SLOT_FIELDS}) for lc in cache.layers))


def with_slot_state(cache: Cache, state: Cache) -> Cache:
    """The cache with its per-slot fields from `state` (a tree like slot_state(cache))."""
    return dataclasses.replace(cache, layers=tuple(
        lc.replace(**{f: getattr(s, f) for f in SLOT_FIELDS})
        for lc, s in zip(cache.layers, state.layers)))


# Compressor tail state: one f32 array per compressed layer, `cst` [R, r, width] (r = the
# layer's ratio: one row per token of a compression block), holding the named parts below
# side by side along the last axis, in this order (c = head_dim, ci = index_head_dim):
#   CSA (r = 4):   st_a 2c | st_z 2c | pv_a c | pv_z c | ist_a 2ci | ist_z 2ci | ipv_a ci | ipv_z ci
#   HCA (r = 128): st_a c | st_z c
# st_* are the a / z rows of the current incomplete block, pv_* the [:c] half of the
# previous complete block (CSA pools it with the current one); the i-prefixed parts are
# the indexer compressor's. One array instead of 8 (CSA) or 2 (HCA): each donated cache
# array costs host time every step on the GPU (~3-6 us apiece). The step reads the named
# parts as slices of the array (split_cmp_state) and writes them back as one concat (XLA
# then copies the array once per step before the write: 4 Flash layers compiled for an
# H100, 268 -> 266 kernels, 2 of them such copies).
def cmp_state_parts(cfg: Config, ratio: int) -> tuple[tuple[str, int], ...]:
    """((name, width), ...) of a ratio-`ratio` layer's compressor state, in storage order."""
    c, ci = cfg.head_dim, cfg.index_head_dim
    if ratio == 4:
        return (("st_a", 2 * c), ("st_z", 2 * c), ("pv_a", c), ("pv_z", c),
                ("ist_a", 2 * ci), ("ist_z", 2 * ci), ("ipv_a", ci), ("ipv_z", ci))
    if ratio > 0:
        return (("st_a", c), ("st_z", c))
    raise ValueError(f"a layer of compression ratio {ratio} has no compressor state")


# initial value of each part: the previous-block scores start at -inf, so a first block
# pools only itself; everything else starts at 0
_CMP_STATE_INIT = {"pv_z": -np.inf, "ipv_z": -np.inf}


def split_cmp_state(cst, cfg: Config, ratio: int) -> dict:
    """cst [..., r, width] -> {name: [..., r, part width]} (slices, in storage order)."""
    parts = cmp_state_parts(cfg, ratio)
    width = sum(w for _, w in parts)
    if cst.ndim < 2 or cst.shape[-2:] != (ratio, width):
        raise ValueError(f"compressor state of a ratio-{ratio} layer must be [..., {ratio}, "
                         f"{width}] ({' | '.join(n for n, _ in parts)}), got {cst.shape}")
    out, o = {}, 0
    for name, w in parts:
        out[name] = cst[..., o:o + w]
        o += w
    return out


def join_cmp_state(parts: dict, cfg: Config, ratio: int):
    """{name: [..., r, part width]} (every part of cmp_state_parts) -> cst [..., r, width]."""
    names = [n for n, _ in cmp_state_parts(cfg, ratio)]
    if sorted(parts) != sorted(names):
        raise ValueError(f"compressor state of a ratio-{ratio} layer has parts {names}, "
                         f"got {sorted(parts)}")
    return jnp.concatenate([parts[n] for n in names], -1)


def compressor_state(cache: Cache, cfg: Config, layer: int) -> dict:
    """The named parts of layer `layer`'s compressor state in a cache tree (init_cache):
    {"st_a": [R, r, .], "st_z": ..., ...} (see cmp_state_parts); for inspection."""
    ratio = cfg.layer_ratio(layer)
    if ratio == 0:
        raise ValueError(f"layer {layer} is a sliding-window layer: no compressor state")
    return split_cmp_state(cache[layer].cst, cfg, ratio)


def layer_structs(cfg: Config, cs: CacheSpec, layer: int) -> LayerCache:
    R, NB, W = cs.max_requests, cs.num_blocks, cfg.sliding_window
    S = jax.ShapeDtypeStruct
    lc = LayerCache(win=kv_fields(cs, (R, W)), win_pos=S((R, W), jnp.int32))
    r = cfg.layer_ratio(layer)
    if r > 0:
        lc = lc.replace(cmp=kv_fields(cs, (NB, BLOCK_TOKENS // r)),
                        idx=idx_fields(cs, (NB, BLOCK_TOKENS // r)) if r == 4 else None,
                        cst=S((R, r, sum(w for _, w in cmp_state_parts(cfg, r))), jnp.float32))
    return lc


def cache_structs(cfg: Config, cs: CacheSpec) -> Cache:
    return Cache(tuple(layer_structs(cfg, cs, i) for i in range(cfg.num_hidden_layers)))


def init_cache(cfg: Config, cs: CacheSpec) -> Cache:
    return Cache(tuple(_init_layer(cfg, s) for s in cache_structs(cfg, cs).layers))


def init_layer_cache(cfg: Config, cs: CacheSpec, layer: int) -> LayerCache:
    """One layer's cache arrays, e.g. the MTP block's (layer == num_hidden_layers), which
    the speculative decoder keeps beside the main cache."""
    return _init_layer(cfg, layer_structs(cfg, cs, layer))


def _init_layer(cfg: Config, s: LayerCache) -> LayerCache:
    zeros = lambda t: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), t)
    lc = LayerCache(win=zeros(s.win), win_pos=jnp.full(s.win_pos.shape, -1, s.win_pos.dtype),
                    cmp=zeros(s.cmp), idx=zeros(s.idx))
    if s.cst is not None:   # [R, r, width]: each part's initial value along the last axis
        row = np.concatenate([np.full(w, _CMP_STATE_INIT.get(n, 0.0), np.float32)
                              for n, w in cmp_state_parts(cfg, s.cst.shape[1])])
        lc = lc.replace(cst=jnp.broadcast_to(jnp.asarray(row), s.cst.shape))
    return lc


def cache_bytes(cfg: Config, cs: CacheSpec) -> dict:
    """Memory: per request slot (window + compressor state), per pool block (all layers),
    and totals, in bytes."""
    nbytes = lambda t: sum(int(np.prod(s.shape)) * jnp.dtype(s.dtype).itemsize
                           for s in jax.tree.leaves(t))
    per_req = pool = 0
    for i in range(cfg.num_hidden_layers):
        lc = layer_structs(cfg, cs, i)
        per_req += nbytes([lc.win, lc.win_pos, lc.cst])
        pool += nbytes([lc.cmp, lc.idx])
    per_req //= cs.max_requests
    per_block = pool // cs.num_blocks
    return {"per_request_bytes": per_req, "per_block_bytes": per_block,
            "pool_bytes": pool, "total_bytes": per_req * cs.max_requests + pool}


# ---------------------------------------------------------------------------------------
# Cache addressing: every read and write of a layer's cache by the model goes through
# these (ring slots, pool addresses, entry gathers, compressor state, the verify's
# snapshot and restore). Out-of-range indices of a write are dropped.
# ---------------------------------------------------------------------------------------
def take_rows(tree, slots):
    """Rows `slots` of every leaf (leading axis)."""
    return jax.tree.map(lambda a: a[slots], tree)


def scatter(tree, idx, new):
    """tree leaves [N0, N1, ...]; idx a tuple of index arrays (out of range -> dropped)."""
    return jax.tree.map(lambda a, n: a.at[idx].set(n.astype(a.dtype), mode="drop"), tree, new)


def read_window(lc: LayerCache, slots, pos, cs: CacheSpec, dtype):
    """The batch rows' window rings before the step: (rows [B, W, K] decoded to dtype,
    their positions [B, W], -1 where empty or stale: a slot's ring holds its previous
    request's rows at positions >= pos until they are overwritten)."""
    ring = decode_kv(cs, take_rows(lc.win, slots), dtype)
    ring_pos = take_rows(lc.win_pos, slots)
    return ring, jnp.where(ring_pos < pos[:, None], ring_pos, -1)


def write_window(lc: LayerCache, cs: CacheSpec, slots, tok_pos, valid, end, kv, W: int
                 ) -> LayerCache:
    """The chunk's last W valid rows kv [B, T, K] (at tok_pos [B, T], rows ending before
    end [B]) into the rings of slots [B], slot p % W for position p (unique slots)."""
    B, T = tok_pos.shape
    keep = valid & (tok_pos >= (end - W)[:, None])
    rslot = jnp.where(keep, tok_pos % W, W)
    srow = jnp.broadcast_to(slots[:, None], (B, T))
    return lc.replace(win=scatter(lc.win, (srow, rslot), encode_kv(cs, kv)),
                      win_pos=lc.win_pos.at[srow, rslot].set(tok_pos, mode="drop"))


def pool_addr(eidx, ok, bt_rows, epb, nb_total):
    """Pool (block, slot) of compressed entries eidx [B, n] of the requests whose block
    table rows are bt_rows [B, MAXB]; entries not ok, in no block yet or past the table
    -> block nb_total (out of range: a write drops them)."""
    blk = jnp.take_along_axis(bt_rows, jnp.clip(eidx // epb, 0, bt_rows.shape[1] - 1), 1)
    ok = ok & (blk >= 0) & (eidx // epb < bt_rows.shape[1])
    return jnp.where(ok, blk, nb_total), eidx % epb


def gather_entries(pool, bt_rows, epb):
    """All entry slots of each request: pool leaves [NB, epb, ...] -> [B, MAXB*epb, ...]."""
    blk = jnp.maximum(bt_rows, 0)  # unused blocks read block 0, masked by visibility
    return jax.tree.map(lambda a: a[blk].reshape(blk.shape[0], -1, *a.shape[2:]), pool)


def write_entries(lc: LayerCache, cs: CacheSpec, addr, ent) -> LayerCache:
    """Compressed entries ent [B, n, K] to the pool at addr (pool_addr)."""
    return lc.replace(cmp=scatter(lc.cmp, addr, encode_kv(cs, ent)))


def read_entries(lc: LayerCache, cs: CacheSpec, bt_rows, epb, dtype):
    """Every entry slot of each request, decoded: [B, MAXB*epb, K]."""
    return decode_kv(cs, gather_entries(lc.cmp, bt_rows, epb), dtype)


def write_index_keys(lc: LayerCache, cs: CacheSpec, addr, keys) -> LayerCache:
    """Indexer keys [B, n, 128] f32 to the key pool at addr (pool_addr)."""
    return lc.replace(idx=scatter(lc.idx, addr, encode_idx(cs, keys)))


def read_index_keys(lc: LayerCache, cs: CacheSpec, bt_rows, epb):
    """Every indexer key slot of each request, decoded: [B, MAXB*epb, 128] f32."""
    return decode_idx(cs, gather_entries(lc.idx, bt_rows, epb))


def read_state(lc: LayerCache, slots, cfg: Config, ratio: int) -> dict:
    """The batch rows' compressor state: lc.cst [R, r, width] -> {name: [B, r, part]}."""
    return split_cmp_state(lc.cst[slots], cfg, ratio)


def write_state(lc: LayerCache, slots, st: dict, cfg: Config, ratio: int) -> LayerCache:
    """Store the batch rows' new compressor state (all parts as one write)."""
    return lc.replace(cst=lc.cst.at[slots].set(join_cmp_state(st, cfg, ratio)))


# The speculative verify writes T rows of every slot (batch row b = slot b) and then
# undoes the rows past each request's accepted ones: before the step it copies what the
# rows may overwrite (verify_snapshot), after it writes the copies back for the rejected
# rows (restore_rejected). The compressor state is recomputed instead (speculative.rollback).
def _ring_slots(pos, T, W):
    return (pos[:, None] + jnp.arange(T)[None, :]) % W                       # [B, T]


def _completed_entries(pos, nvalid, T, ratio):
    """Entry completed by row j (token pos + j), if any: (entry index [B, T], done [B, T])."""
    t = pos[:, None] + jnp.arange(T)[None, :]
    done = ((t + 1) % ratio == 0) & (jnp.arange(T)[None, :] < nvalid[:, None])
    return (t + 1) // ratio - 1, done


def _completed_addr(pos, nvalid, T, ratio, bt_rows, cs: CacheSpec, rows_ok=None):
    eidx, done = _completed_entries(pos, nvalid, T, ratio)
    if rows_ok is not None:
        done = done & rows_ok
    return pool_addr(eidx, done & (eidx >= 0), bt_rows, BLOCK_TOKENS // ratio, cs.num_blocks)


def verify_snapshot(lc: LayerCache, pos, nvalid, bt_rows, T: int, ratio: int, cfg: Config,
                    cs: CacheSpec) -> LayerCache:
    """What the T verify rows of one layer may overwrite, read before the step, as a
    LayerCache of [B, T, ...] rows: the ring rows and positions at slots (pos + j) % W, and
    the pool entries (cmp, idx) the rows complete. cst is left None: the caller keeps the
    state before the step (the rollback recomputes from it)."""
    B = pos.shape[0]
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    rs = _ring_slots(pos, T, cfg.sliding_window)
    snap = LayerCache(win=jax.tree.map(lambda a: a[rows, rs], lc.win),
                      win_pos=lc.win_pos[rows, rs])
    if ratio > 0:
        blk, sl = _completed_addr(pos, nvalid, T, ratio, bt_rows, cs)
        get = lambda a: a[jnp.minimum(blk, cs.num_blocks - 1), sl]
        snap = snap.replace(cmp=jax.tree.map(get, lc.cmp),
                            idx=jax.tree.map(get, lc.idx) if ratio == 4 else None)
    return snap


def restore_rejected(lc: LayerCache, snap: LayerCache, pos, nvalid, keep, bt_rows, ratio: int,
                     cfg: Config, cs: CacheSpec) -> LayerCache:
    """The ring slots and completed pool entries written by the verify rows j >= keep[b]
    (of nvalid[b] written) get their verify_snapshot copies back."""
    W = cfg.sliding_window
    B, T = snap.win_pos.shape
    j = jnp.arange(T)[None, :]
    rejected = (j >= keep[:, None]) & (j < nvalid[:, None])                 # [B, T]
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    rs = jnp.where(rejected, _ring_slots(pos, T, W), W)                     # W: dropped
    lc = lc.replace(win=scatter(lc.win, (rows, rs), snap.win),
                    win_pos=lc.win_pos.at[rows, rs].set(snap.win_pos, mode="drop"))
    if ratio > 0:
        addr = _completed_addr(pos, nvalid, T, ratio, bt_rows, cs, rejected)
        lc = lc.replace(cmp=scatter(lc.cmp, addr, snap.cmp))
        if ratio == 4:
            lc = lc.replace(idx=scatter(lc.idx, addr, snap.idx))
    return lc


# ---------------------------------------------------------------------------------------
# Host-side block manager
# ---------------------------------------------------------------------------------------
class CacheError(RuntimeError):
    pass


class PoolExhausted(CacheError):
    pass


class CapacityExceeded(CacheError):
    pass


def blocks_needed(cfg: Config, n_tokens: int) -> int:
    """Blocks holding every compressed entry emitted by n_tokens tokens."""
    need = 0
    for r in set(cfg.compress_ratios[:cfg.num_hidden_layers]):
        if r > 0:
            entries = n_tokens // r
            need = max(need, -(-entries // (BLOCK_TOKENS // r)))
    return need


class BlockManager:
    """Admits and releases requests, owns the free list and the block table. Every method
    either succeeds or raises before changing any state."""

    def __init__(self, cfg: Config, cs: CacheSpec):
        self.cfg, self.cs = cfg, cs
        self.free = list(range(cs.num_blocks))[::-1]
        self.table = np.full((cs.max_requests, cs.max_blocks), -1, np.int32)
        self.length = np.zeros(cs.max_requests, np.int64)  # tokens in the cache
        self.active = np.zeros(cs.max_requests, bool)

    def admit(self, prompt_len: int) -> int:
        if prompt_len <= 0:
            raise ValueError("prompt is empty")
        if prompt_len > self.cs.capacity:
            raise CapacityExceeded(
                f"prompt of {prompt_len} tokens is longer than the cache capacity of "
                f"{self.cs.capacity} tokens per request (max_blocks={self.cs.max_blocks} x 128)")
        free_slots = np.flatnonzero(~self.active)
        if len(free_slots) == 0:
            raise CacheError(f"all {self.cs.max_requests} request slots are in use")
        slot = int(free_slots[0])
        self.active[slot] = True
        self.length[slot] = 0
        return slot

    def ensure(self, slot: int, new_len: int) -> None:
        """Allocate exactly the blocks needed for the request to hold new_len tokens."""
        if not self.active[slot]:
            raise CacheError(f"request slot {slot} is not active")
        if new_len > self.cs.capacity:
            raise CapacityExceeded(
                f"request in slot {slot} would reach {new_len} tokens, over the capacity of "
                f"{self.cs.capacity} tokens per request")
        have = int((self.table[slot] >= 0).sum())
        need = blocks_needed(self.cfg, new_len)
        if need - have > len(self.free):
            raise PoolExhausted(
                f"block pool exhausted: request in slot {slot} needs {need - have} more "
                f"block(s) to reach {new_len} tokens, {len(self.free)} free of "
                f"{self.cs.num_blocks}")
        for j in range(have, need):
            self.table[slot, j] = self.free.pop()

    def ensure_many(self, new_lens: dict[int, int]) -> None:
        """ensure() for several requests, all or nothing."""
        extra = sum(max(0, blocks_needed(self.cfg, n) - int((self.table[s] >= 0).sum()))
                    for s, n in new_lens.items())
        if extra > len(self.free):
            raise PoolExhausted(
                f"block pool exhausted: the step needs {extra} more block(s) for requests "
                f"{sorted(new_lens)}, {len(self.free)} free of {self.cs.num_blocks}")
        for s, n in new_lens.items():
            if n > self.cs.capacity:
                raise CapacityExceeded(
                    f"request in slot {s} would reach {n} tokens, over the capacity of "
                    f"{self.cs.capacity} tokens per request")
        for s, n in new_lens.items():
            self.ensure(s, n)

    def advance(self, slot: int, n: int) -> None:
        self.length[slot] += n

    def release(self, slot: int) -> None:
        if not self.active[slot]:
            raise CacheError(f"request slot {slot} is not active")
        blocks = [int(b) for b in self.table[slot] if b >= 0]
        self.free.extend(blocks[::-1])
        self.table[slot] = -1
        self.active[slot] = False
        self.length[slot] = 0

    def snapshot(self):
        return (list(self.free), self.table.copy(), self.length.copy(), self.active.copy())
