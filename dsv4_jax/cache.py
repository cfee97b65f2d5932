"""Inference state as pytrees (byte layout: docs/KV_CACHE.md) and the host-side block
manager.

The cache is a dict {"L<i>": per-layer dict of arrays}. Shapes are static:
R = max_requests slots, NB = pool blocks, MAXB = blocks per request; one logical block is
128 tokens = 128 // ratio compressed entries. With act_quant on, KV is stored FP8 (nope) +
e8m0 scales + bf16 rope and indexer keys in `index_format`; with it off, rows are stored
unquantised in the activation dtype ("raw").
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


def compressor_state(cache: dict, cfg: Config, layer: int) -> dict:
    """The named parts of layer `layer`'s compressor state in a cache tree (init_cache):
    {"st_a": [R, r, .], "st_z": ..., ...} (see cmp_state_parts); for inspection."""
    ratio = cfg.layer_ratio(layer)
    if ratio == 0:
        raise ValueError(f"layer {layer} is a sliding-window layer: no compressor state")
    return split_cmp_state(cache[f"L{layer}"]["cst"], cfg, ratio)


def layer_structs(cfg: Config, cs: CacheSpec, layer: int) -> dict:
    R, NB, W = cs.max_requests, cs.num_blocks, cfg.sliding_window
    S = jax.ShapeDtypeStruct
    d: dict = {"win": kv_fields(cs, (R, W)), "win_pos": S((R, W), jnp.int32)}
    r = cfg.layer_ratio(layer)
    if r > 0:
        d["cmp"] = kv_fields(cs, (NB, BLOCK_TOKENS // r))
        if r == 4:
            d["idx"] = idx_fields(cs, (NB, BLOCK_TOKENS // r))
        d["cst"] = S((R, r, sum(w for _, w in cmp_state_parts(cfg, r))), jnp.float32)
    return d


def cache_structs(cfg: Config, cs: CacheSpec) -> dict:
    return {f"L{i}": layer_structs(cfg, cs, i) for i in range(cfg.num_hidden_layers)}


def init_cache(cfg: Config, cs: CacheSpec) -> dict:
    return _init_arrays(cfg, cache_structs(cfg, cs))


def init_layer_cache(cfg: Config, cs: CacheSpec, layer: int) -> dict:
    """One layer's cache arrays, e.g. the MTP block's (layer == num_hidden_layers), which
    the speculative decoder keeps beside the main cache."""
    return _init_arrays(cfg, layer_structs(cfg, cs, layer))


def _init_arrays(cfg: Config, structs: dict) -> dict:
    def make(path, s):
        name = path[-1].key
        if name == "win_pos":
            return jnp.full(s.shape, -1, s.dtype)
        if name == "cst":   # [R, r, width]: each part's initial value along the last axis
            row = np.concatenate([np.full(w, _CMP_STATE_INIT.get(n, 0.0), np.float32)
                                  for n, w in cmp_state_parts(cfg, s.shape[1])])
            return jnp.broadcast_to(jnp.asarray(row), s.shape)
        return jnp.zeros(s.shape, s.dtype)
    return jax.tree_util.tree_map_with_path(make, structs)


def cache_bytes(cfg: Config, cs: CacheSpec) -> dict:
    """Memory: per request slot (window + compressor state), per pool block (all layers),
    and totals, in bytes."""
    per_req = pool = 0
    for i in range(cfg.num_hidden_layers):
        for path, s in jax.tree_util.tree_flatten_with_path(layer_structs(cfg, cs, i))[0]:
            n = int(np.prod(s.shape)) * jnp.dtype(s.dtype).itemsize
            name = jax.tree_util.keystr(path)
            if "cmp" in name or "'idx'" in name:
                pool += n
            else:
                per_req += n
    per_req //= cs.max_requests
    per_block = pool // cs.num_blocks
    return {"per_request_bytes": per_req, "per_block_bytes": per_block,
            "pool_bytes": pool, "total_bytes": per_req * cs.max_requests + pool}


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
