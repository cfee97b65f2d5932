"""The KV compressor (ratio r: CSA r=4 with overlapping blocks, HCA r=128): per-token rows,
softmax-gated pooling of complete blocks, then norm + rope (+ FP8 or Hadamard + FP4 sim).

    a_BTC, z_BTC = compressor_project(p, x_BTD, ratio, pos_BT)      # C = coff*c
    pooled_Bnc = pool_blocks(a_BnrC, z_BnrC, ratio, c[, prev_a_Brc, prev_z_Brc])
    e_Bnc = finish_entries(p, pooled_Bnc, first_pos_Bn, freqs, cfg, nm, kind)
    e_Bnc = compress_sequence(p, x_BTD, ratio, c, freqs, cfg, nm, kind)   # n = T // ratio
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import formats as kvformat

from ..config import Config
from ..quant import Numerics, f32_dot_bf16, fp4_block_sim
from .norms import rms_norm
from .rope import apply_rope

F32 = jnp.float32


def hadamard(x):
    """Orthonormal Walsh-Hadamard transform over the last dim (Sylvester order)."""
    n = x.shape[-1]
    h = np.array([[1.0]], np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return jnp.einsum("...i,ij->...j", x.astype(F32), jnp.asarray(h / math.sqrt(n)),
                      precision="highest")


def compressor_project(p, x, ratio, pos):
    """Per-token compressor rows: a = wkv x, z = wgate x + ape[pos mod r] (fp32).
    x [B, T, D], pos [B, T] -> a, z [B, T, coff*c]."""
    a = f32_dot_bf16(x, p["wkv.weight"])   # f32-exact for x of any float dtype
    z = f32_dot_bf16(x, p["wgate.weight"])
    z = z + p["ape"].astype(F32)[pos % ratio]
    return a, z


def pool_blocks(a_blk, z_blk, ratio, c, prev_a=None, prev_z=None):
    """Softmax-gated pooling of complete blocks.
    a_blk, z_blk [B, n, r, coff*c]. CSA (ratio 4): entry i pools block i-1 (channels [:c])
    and block i (channels [c:]); prev_a/prev_z [B, r, c] are the block before the first
    one (None: a = 0, z = -inf). Returns [B, n, c] f32."""
    if ratio != 4:
        w = jax.nn.softmax(z_blk, axis=2)
        return jnp.sum(w * a_blk, axis=2)
    B, n = a_blk.shape[:2]
    if prev_a is None:
        prev_a = jnp.zeros((B, ratio, c), F32)
        prev_z = jnp.full((B, ratio, c), -jnp.inf, F32)
    pa = jnp.concatenate([prev_a[:, None], a_blk[:, :-1, :, :c]], 1)
    pz = jnp.concatenate([prev_z[:, None], z_blk[:, :-1, :, :c]], 1)
    a2 = jnp.concatenate([pa, a_blk[..., c:]], 2)  # [B, n, 2r, c]
    z2 = jnp.concatenate([pz, z_blk[..., c:]], 2)
    w = jax.nn.softmax(z2, axis=2)
    return jnp.sum(w * a2, axis=2)


def finish_entries(p, pooled, first_pos, freqs, cfg: Config, nm: Numerics, kind: str,
                   sim: bool = True):
    """RMSNorm -> rope at the block's FIRST token -> main: FP8 sim of nope dims;
    indexer: Hadamard + FP4 sim. pooled [B, n, c], first_pos [B, n]. sim=False: main
    entries without the FP8 simulation (for callers that store them quantised: the
    cache's FP8 rows hold the same values either way)."""
    e = rms_norm(pooled, p["norm.weight"], cfg.rms_norm_eps, nm.jdtype)
    e = apply_rope(e, first_pos, freqs)
    if kind == "main":
        return kv_quant_sim(e, cfg, nm) if sim else e
    e = hadamard(e)
    if nm.act_quant:
        e = fp4_block_sim(e, 32)
    return e.astype(nm.jdtype)


def kv_quant_sim(kv, cfg: Config, nm: Numerics):
    """FP8-simulate the nope dims of a main KV row with 64-wide blocks (bf16 row, rope
    dims bf16): exactly what the FP8 cache stores and gives back."""
    if not nm.act_quant:
        return kv
    return kvformat.kv_sim(kv).astype(kv.dtype)


def compress_sequence(p, x, ratio, c, freqs, cfg, nm, kind, debug=None):
    """Whole-sequence compressor from position 0 (no cache): x [B, T, D] ->
    entries [B, T // r, c] (complete blocks only). debug["gates"]: softmax(z) per token."""
    B, T, _ = x.shape
    n = T // ratio
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    a, z = compressor_project(p, x, ratio, pos)
    if n == 0:
        return jnp.zeros((B, 0, c), nm.jdtype)
    a_blk = a[:, :n * ratio].reshape(B, n, ratio, -1)
    z_blk = z[:, :n * ratio].reshape(B, n, ratio, -1)
    pooled = pool_blocks(a_blk, z_blk, ratio, c)
    if debug is not None:
        debug[f"{kind}_compressor_gates"] = jax.nn.softmax(z_blk, axis=2)  # [B, n, r, coff*c]
    first = jnp.broadcast_to(jnp.arange(n) * ratio, (B, n))
    return finish_entries(p, pooled, first, freqs, cfg, nm, kind)
