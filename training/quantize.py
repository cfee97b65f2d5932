"""Master weights -> the parameter tree the training forward runs.

The FP8 / FP4 storage types (Fp8Weight, Fp4Weight) hold integer codes and are not
differentiable, so training keeps every weight as an f32 master and runs the model in its
training form (training.config.training_form: all linears plain bf16). With `qat`, each
weight that the export stores as FP8 (128 x 128 blocks) or FP4 (32-wide groups along the
input) is rounded to exactly the value the export will hold (same rules as
pallas_kernels.formats.encode_fp8_np / encode_fp4_np), with a straight-through gradient;
those values are exact in bf16, so the exported model computes what was trained.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax import param_specs as P
from dsv4_jax.config import Config
from pallas_kernels.formats import E2M1_MAX, E4M3_MAX, e2m1_decode, e2m1_encode

SCALE_FLOOR = 2.0 ** -100  # the numpy encoders' amax floor
FROZEN_SUFFIXES = ("gate.tid2eid", "gate.bias")  # fixed hash table; bias set by balancing


def _pow2_scale(amax, qmax):
    """2^e, the smallest power of two with amax / qmax <= 2^e (amax floored)."""
    a = jnp.maximum(amax, SCALE_FLOOR) / qmax
    m, e = jnp.frexp(a)
    e = jnp.where(m == 0.5, e - 1, e)
    return jnp.ldexp(jnp.ones_like(a), e)


def fake_fp8(w):
    """w f32 [..., o, i] -> the dequantised FP8 value (e4m3, one scale per 128x128 block)."""
    *lead, o, i = w.shape
    po, pi = -o % 128, -i % 128
    wp = jnp.pad(w, [(0, 0)] * len(lead) + [(0, po), (0, pi)])
    blk = wp.reshape(*lead, (o + po) // 128, 128, (i + pi) // 128, 128)
    s = _pow2_scale(jnp.abs(blk).max(axis=(-3, -1)), E4M3_MAX)[..., :, None, :, None]
    q = jnp.clip(blk / s, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    return (q * s).reshape(wp.shape)[..., :o, :i]


def fake_fp4(w):
    """w f32 [..., o, i] -> the dequantised FP4 value (e2m1, one scale per 32 inputs)."""
    blk = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    s = _pow2_scale(jnp.abs(blk).max(-1), E2M1_MAX)[..., None]
    v = jnp.clip(blk / s, -E2M1_MAX, E2M1_MAX)
    return (e2m1_decode(e2m1_encode(v)) * s).reshape(w.shape)


FAKE = {"fp8": fake_fp8, "fp4": fake_fp4}


def straight_through(w, fmt: str):
    """The fake-quantised value in the forward (bit-exact), gradient 1 in the backward."""
    sg = jax.lax.stop_gradient(w)
    return FAKE[fmt](sg) + (w - sg)


def is_frozen(key: str) -> bool:
    return key.endswith(FROZEN_SUFFIXES)


def forward_params(master: dict, frozen: dict, cfg: Config, qat: bool) -> dict:
    """{name: f32 master} + {name: frozen} -> the training form's parameter tree (bf16 /
    f32 / int32 by training_form(cfg)'s specs), FP8/FP4 fake quantisation where `cfg` (the
    export config) stores the weight quantised and `qat` is on."""
    from .config import training_form
    train_specs = P.describe(training_form(cfg))
    export_specs = P.describe(cfg)
    out = {}
    for k, spec in train_specs.items():
        if is_frozen(k):
            out[k] = jnp.asarray(frozen[k])
            continue
        w = jnp.asarray(master[k])
        fmt = export_specs[k].fmt
        if qat and fmt in FAKE:
            w = straight_through(w, fmt)
        out[k] = w.astype(jnp.bfloat16 if spec.fmt == "bf16" else jnp.float32)
    return out


def export_values(master: dict, frozen: dict) -> dict[str, np.ndarray]:
    """Host copies of every parameter's logical value (f32, int32 for tid2eid)."""
    return {k: np.asarray(jax.device_get(v)) for k, v in {**master, **frozen}.items()}
