"""Rotary embedding: interleaved pairs on the last R dims; per-layer base, YaRN on the
compressed layers.

    freqs_R2 = rope_freqs(cfg, ratio)              # [R/2] numpy f32
    x = apply_rope(x_THK, pos_T, freqs_R2[, inverse=True])
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from ..config import Config

F32 = jnp.float32


def rope_freqs(cfg: Config, ratio: int) -> np.ndarray:
    """[R/2] inverse frequencies of a layer (ratio 0: base rope_theta, no YaRN;
    ratio > 0: compress_rope_theta with YaRN)."""
    dim = cfg.qk_rope_head_dim
    base = cfg.rope_theta if ratio == 0 else cfg.compress_rope_theta
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if ratio == 0:
        return freqs.astype(np.float32)
    orig = cfg.rope_original_max_position

    def corr_dim(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(cfg.rope_beta_fast)), 0)
    high = min(math.ceil(corr_dim(cfg.rope_beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    smooth = 1 - ramp
    freqs = freqs / cfg.rope_factor * (1 - smooth) + freqs * smooth
    return freqs.astype(np.float32)


def apply_rope(x, pos, freqs, inverse=False):
    """Rotate the last 2*len(freqs) dims of x [..., T, (heads,) dim] at positions pos
    [..., T] (broadcast over any head axis between T and dim)."""
    R = 2 * freqs.shape[0]
    ang = pos.astype(F32)[..., None] * jnp.asarray(freqs)  # [..., T, R/2]
    while ang.ndim < x.ndim:  # insert head axes
        ang = ang[..., None, :]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    if inverse:
        sin = -sin
    r = x[..., -R:].astype(F32).reshape(*x.shape[:-1], R // 2, 2)
    re, im = r[..., 0], r[..., 1]
    out = jnp.stack([re * cos - im * sin, re * sin + im * cos], -1).reshape(*x.shape[:-1], R)
    return jnp.concatenate([x[..., :-R], out.astype(x.dtype)], -1)
