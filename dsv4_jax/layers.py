"""DeepSeek-V4 building blocks as pure functions over parameter dicts.

Every function takes the block's params (official names with the block prefix stripped,
see params.block_params), activations, and a static `Numerics`. Shapes: B batch, T tokens,
D hidden, H heads, K head_dim (512), R rope dims (64), N hc streams (4), E experts.
"""
from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from .config import Config
from .params import ROW_MERGES, X_PROJ, X_PROJ_PARTS
from .quant import (KERNEL_MAX_ROWS, Fp8Weight, Numerics, WeightRows, dequant, f32_dot_bf16,
                    fp8_block_sim, fp4_block_sim, grouped_linear, linear)
from pallas_kernels import formats as kvformat

F32 = jnp.float32


# ---------------------------------------------------------------------------------------
# Norms
# ---------------------------------------------------------------------------------------
def rms_norm(x, w, eps, out_dtype):
    xf = x.astype(F32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)
    if w is not None:
        y = y * w.astype(F32)
    return y.astype(out_dtype)


# Decode-sized norms (at most this many token rows) feeding a weight-streaming matmul run
# as one kernel with the matmul input's FP8 simulation (pallas_kernels/norm_fp8). GPU-proven
# 2026-11-25 (H100: tests pass; 1.5 / 3.2 us of GPU time against XLA's 3.4 / 4.8 us in 3-4
# kernels; 4 Flash layers 255 -> 220 kernels with MHC_COMB, pipelined step 1.306 -> 1.279
# ms, benchmarks/results/session15b_h100). DSV4_NORM_FP8_ROWS=0 turns them off (A/B).
NORM_FP8_ROWS = int(os.environ.get("DSV4_NORM_FP8_ROWS", "64"))
# The mHC comb matrix from the raw sums in one kernel (hc_sinkhorn.mhc_comb), GPU-proven the
# same day; DSV4_MHC_COMB=0 runs the sinkhorn_softmax kernel after XLA's prelude instead.
MHC_COMB = os.environ.get("DSV4_MHC_COMB", "1") == "1"


def _norm_fp8_ok(shape, nm: Numerics) -> bool:
    """Whether activations of `shape` [..., D] take the norm_fp8 kernels: FP8-simulated bf16
    inputs of the matmul kernels, decode-sized."""
    return (nm.act_quant and nm.bf16_operands and nm.jdtype == jnp.bfloat16
            and nm.matmul in ("pallas", "interpret") and math.prod(shape[:-1]) <= NORM_FP8_ROWS
            and shape[-1] % 128 == 0 and (on_gpu() or nm.matmul == "interpret"))


def norm_act(x, w, cfg: Config, nm: Numerics):
    """rms_norm(x, w) [..., D] and, when the matmul kernels run with the FP8 activation
    simulation (decode sizes), also its simulation padded to kernel rows, xq bf16
    [ceil(rows/8)*8, D], for `linear(..., xq=xq)`: one Pallas kernel where XLA used three
    (sum of squares, amax, quantise + pad). Otherwise xq is None."""
    rows = math.prod(x.shape[:-1])
    if not _norm_fp8_ok(x.shape, nm):
        return rms_norm(x, w, cfg.rms_norm_eps, nm.jdtype), None
    from pallas_kernels.norm_fp8 import rms_norm_fp8
    y, yq = rms_norm_fp8(x.reshape(rows, x.shape[-1]), w, eps=cfg.rms_norm_eps,
                         rows=-(-rows // 8) * 8, interpret=nm.matmul == "interpret")
    return y.reshape(x.shape), yq


# ---------------------------------------------------------------------------------------
# Rotary embedding: interleaved pairs on the last R dims; per-layer base / YaRN
# ---------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------
# mHC: manifold-constrained hyper-connections
# ---------------------------------------------------------------------------------------
# Whether to trace the GPU-only paths: None = whether jax runs on a GPU; True / False force
# it (benchmarks/aot_anatomy.py compiles for a GPU from a CPU process).
ON_GPU: bool | None = None


def on_gpu() -> bool:
    return jax.default_backend() == "gpu" if ON_GPU is None else ON_GPU


# mHC sums of at most this many token rows (decode) take one variadic reduction; larger
# inputs (prefill) the einsum + a sum, whose operands XLA never broadcasts.
HC_FUSED_ROWS = int(os.environ.get("DSV4_HC_FUSED_ROWS", 64))


def hc_sums(X, fn):
    """X [..., N, D], fn [n, N*D] -> (s [..., n] = flat . fn^T, q [..., k] whose column 0
    is sum(flat^2)), f32, flat = X's N streams side by side: the raw sums an mHC site
    normalises (m = s * rsqrt(q[..., :1] / (N*D) + eps)). For decode-sized inputs both come
    out of ONE variadic reduction (q then repeats the sum n times): XLA-GPU makes it one
    kernel where the dot and the sum were two (one fewer per mHC site). Same products,
    summed in another order than the einsum."""
    flat = X.reshape(*X.shape[:-2], -1).astype(F32)
    fn = fn.astype(F32)
    if math.prod(flat.shape[:-1]) > HC_FUSED_ROWS:
        return (jnp.einsum("...i,oi->...o", flat, fn, precision="highest"),
                jnp.sum(flat * flat, -1, keepdims=True))
    prod = flat[..., None, :] * fn                                          # [..., n, ND]
    sq = jnp.broadcast_to((flat * flat)[..., None, :], prod.shape)
    # (a concatenated [fn; flat] operand was materialised by XLA instead: two kernels)
    return jax.lax.reduce((prod, sq), (np.float32(0), np.float32(0)),
                          lambda a, b: (a[0] + b[0], a[1] + b[1]), (prod.ndim - 1,))


def hc_project(X, fn, eps: float):
    """m [..., n] = (flat . fn^T) * rsqrt(mean(flat^2) + eps) (see hc_sums)."""
    s, q = hc_sums(X, fn)
    return s * jax.lax.rsqrt(q[..., :1] / (X.shape[-2] * X.shape[-1]) + eps)


def hc_weights(X, fn, scale, base, cfg: Config):
    """X [..., N, D] -> pre [..., N], post [..., N], comb [..., N, N] (all f32)."""
    return _hc_mix(X, *hc_sums(X, fn), scale, base, cfg)


def hc_site(X, fn, scale, base, norm_w, cfg: Config, nm: Numerics):
    """An mHC site before its sublayer: X [..., N, D] -> (pre, post, comb (hc_weights),
    x = rms_norm(hc_collapse(X, pre), norm_w) [..., D], xq (norm_act: x's padded FP8
    simulation or None)). Where norm_act would run its kernel, the collapse runs in that
    kernel too (pallas_kernels/norm_fp8.hc_norm_fp8, from the site's raw sums): no XLA
    kernel for the collapse."""
    s, q = hc_sums(X, fn)
    pre, post, C = _hc_mix(X, s, q, scale, base, cfg)
    if not _norm_fp8_ok((*X.shape[:-2], X.shape[-1]), nm):
        x, xq = norm_act(hc_collapse(X, pre, nm.jdtype), norm_w, cfg, nm)
        return pre, post, C, x, xq
    from pallas_kernels.norm_fp8 import hc_norm_fp8
    N, D = X.shape[-2:]
    rows = math.prod(X.shape[:-2])
    y, yq = hc_norm_fp8(X.reshape(rows, N, D), s.reshape(rows, -1), q.reshape(rows, -1), scale,
                        base, norm_w, N=N, eps=cfg.rms_norm_eps, rms_eps=cfg.rms_norm_eps,
                        hc_eps=cfg.hc_eps, rows=-(-rows // 8) * 8,
                        interpret=nm.matmul == "interpret")
    return pre, post, C, y.reshape(*X.shape[:-2], D), yq


def _hc_mix(X, s, q, scale, base, cfg: Config):
    """hc_weights from the site's raw sums (hc_sums)."""
    N = cfg.hc_mult
    m = s * jax.lax.rsqrt(q[..., :1] / (N * X.shape[-1]) + cfg.rms_norm_eps)
    pre = jax.nn.sigmoid(m[..., :N] * scale[0] + base[:N]) + cfg.hc_eps
    post = 2 * jax.nn.sigmoid(m[..., N:2 * N] * scale[1] + base[N:2 * N])
    if on_gpu() and MHC_COMB:
        # one small kernel from the raw sums (normalisation, logits, softmax, Sinkhorn)
        # instead of ~12 XLA kernels, and no XLA kernel for the logits before it
        from pallas_kernels.hc_sinkhorn import mhc_comb
        C = mhc_comb(s.reshape(-1, s.shape[-1]), q.reshape(-1, q.shape[-1]), scale, base,
                     N=N, nd=N * X.shape[-1], iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps,
                     rms_eps=cfg.rms_norm_eps)
        return pre, post, C.reshape(*m.shape[:-1], N, N)
    C = (m[..., 2 * N:] * scale[2] + base[2 * N:]).reshape(*m.shape[:-1], N, N)
    if on_gpu():  # one small kernel (softmax + Sinkhorn) instead of ~12 XLA kernels
        from pallas_kernels.hc_sinkhorn import sinkhorn_softmax
        C = sinkhorn_softmax(C.reshape(-1, N, N), cfg.hc_sinkhorn_iters, cfg.hc_eps)
        return pre, post, C.reshape(*m.shape[:-1], N, N)
    C = jax.nn.softmax(C, -1) + cfg.hc_eps
    return pre, post, sinkhorn_reduce(C, cfg.hc_sinkhorn_iters, cfg.hc_eps)


def sinkhorn_reduce(C, iters: int, eps: float):
    """Column normalisation, then (iters - 1) x (row, column) normalisations of C [..., N, N].
    (On GPU, hc_weights runs softmax + this loop as one kernel: pallas_kernels/hc_sinkhorn.
    XLA-GPU splits this form into ~11 kernels; written as N^2 scalar arrays it fuses into
    one kernel whose single thread runs the whole division chain, 50-100 us per site.)"""
    C = C / (C.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        C = C / (C.sum(-1, keepdims=True) + eps)
        C = C / (C.sum(-2, keepdims=True) + eps)
    return C


# hc_collapse / hc_expand mix N = 4 streams: written as N explicit f32 multiply-adds (not
# einsums), so XLA fuses them into the neighbouring elementwise / norm kernels instead of
# launching a reduction and a GEMM kernel per mHC site (decode: 4 kernels per layer).
def hc_collapse(X, pre, dtype):
    """sum_i pre[i] X[i]: [..., N, D] -> [..., D]."""
    Xf = X.astype(F32)
    y = pre[..., 0, None] * Xf[..., 0, :]
    for i in range(1, X.shape[-2]):
        y = y + pre[..., i, None] * Xf[..., i, :]
    return y.astype(dtype)


def hc_expand(f, X, post, C, dtype):
    """X_new[j] = post[j] f + sum_i C[i, j] X[i]."""
    Xf = X.astype(F32)
    mix = C[..., 0, :, None] * Xf[..., 0, None, :]  # [..., N(j), D]
    for i in range(1, X.shape[-2]):
        mix = mix + C[..., i, :, None] * Xf[..., i, None, :]
    y = post[..., :, None] * f.astype(F32)[..., None, :] + mix
    return y.astype(dtype)


def hc_head(X, fn, scale, base, cfg: Config, dtype):
    m = hc_project(X, fn, cfg.rms_norm_eps)
    pre = jax.nn.sigmoid(m * scale[0] + base) + cfg.hc_eps
    return hc_collapse(X, pre, dtype)


# ---------------------------------------------------------------------------------------
# Compressor (ratio r: CSA r=4 with overlap, HCA r=128) and Hadamard
# ---------------------------------------------------------------------------------------
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
    xf = x.astype(F32)
    a = f32_dot_bf16(xf, p["wkv.weight"])
    z = f32_dot_bf16(xf, p["wgate.weight"])
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


def finish_entries(p, pooled, first_pos, freqs, cfg: Config, nm: Numerics, kind: str):
    """RMSNorm -> rope at the block's FIRST token -> main: FP8 sim of nope dims;
    indexer: Hadamard + FP4 sim. pooled [B, n, c], first_pos [B, n]."""
    e = rms_norm(pooled, p["norm.weight"], cfg.rms_norm_eps, nm.jdtype)
    e = apply_rope(e, first_pos, freqs)
    if kind == "main":
        return kv_quant_sim(e, cfg, nm)
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


# ---------------------------------------------------------------------------------------
# Lightning indexer
# ---------------------------------------------------------------------------------------
def indexer_query(p, x, cq, pos, freqs, cfg: Config, nm: Numerics, cqq=None):
    """qI [B, T, nI, 128] (rope, Hadamard, FP4 sim) and head weights w [B, T, nI] f32.
    cqq: cq's padded FP8 simulation, if q_and_kv made one."""
    B, T, _ = x.shape
    nI, c = cfg.index_n_heads, cfg.index_head_dim
    q = linear(cq, p["wq_b"], nm, xq=cqq).reshape(B, T, nI, c)
    q = apply_rope(q, pos, freqs)
    q = hadamard(q)
    if nm.act_quant:
        q = fp4_block_sim(q, 32)
    q = q.astype(nm.jdtype)
    w = linear(x, p["weights_proj.weight"], nm, out_dtype=F32) * (c ** -0.5 * nI ** -0.5)
    return q, w


def indexer_scores(qI, w, keys):
    """I[b, t, i] = sum_h w[b,t,h] relu(qI[b,t,h] . K[b,i]). qI [B,T,nI,c], keys [B,n,c]."""
    s = jnp.einsum("bthc,bnc->bthn", qI.astype(F32), keys.astype(F32), precision="highest")
    return jnp.einsum("bth,bthn->btn", w, jax.nn.relu(s), precision="highest")


def topk_mask(scores, eligible, k):
    """Boolean [..., n] mask of the top-min(k, #eligible) eligible entries."""
    n = scores.shape[-1]
    k = min(k, n)
    s = jnp.where(eligible, scores, -jnp.inf)
    _, idx = jax.lax.top_k(s, k)
    sel = jnp.zeros(scores.shape, bool)
    sel = jnp.any(jax.nn.one_hot(idx, n, dtype=bool), axis=-2) if k > 0 else sel
    return sel & eligible, idx


# ---------------------------------------------------------------------------------------
# Attention core: scores over [keys] with a sink in the denominator
# ---------------------------------------------------------------------------------------
def attend(q, keys, mask, sink, nm: Numerics):
    """q [B, T, H, K], keys [B, T or 1, S, K] (K = V), mask [B, T, S] bool, sink [H] ->
    out [B, T, H, K] f32. p_j = exp(s_j) / (sum exp(s_j) + exp(sink))."""
    K = q.shape[-1]
    s = jnp.einsum("bthk,btsk->bths", q.astype(F32), keys.astype(F32),
                   precision="highest") / math.sqrt(K)
    s = jnp.where(mask[:, :, None, :], s, -jnp.inf)
    sink = sink.astype(F32)[None, None, :]
    m = jnp.maximum(jnp.max(s, -1), sink)
    p = jnp.exp(s - m[..., None])
    denom = p.sum(-1) + jnp.exp(sink - m)
    if nm.jdtype == jnp.bfloat16:  # the reference kernel rounds P to bf16 before P.V
        p = p.astype(jnp.bfloat16).astype(F32)
    o = jnp.einsum("bths,btsk->bthk", p, keys.astype(F32), precision="highest")
    return o / denom[..., None]


def q_and_kv(p, x, pos, freqs, cfg: Config, nm: Numerics, xq=None):
    """Query heads [B,T,H,K], the shared K=V row [B,T,K] (roped, FP8-simulated), cq, and
    cq's padded FP8 simulation cqq (norm_act; None off the kernel path). xq: x's, if the
    caller made one."""
    B, T, _ = x.shape
    H, K = cfg.num_attention_heads, cfg.head_dim
    cq, cqq = norm_act(linear(x, p["wq_a"], nm, xq=xq), p["q_norm.weight"], cfg, nm)
    q = linear(cq, p["wq_b"], nm, xq=cqq).reshape(B, T, H, K)
    q = rms_norm(q, None, cfg.rms_norm_eps, nm.jdtype)  # weightless per-head norm
    q = apply_rope(q, pos, freqs)
    kv = rms_norm(linear(x, p["wkv"], nm, xq=xq), p["kv_norm.weight"], cfg.rms_norm_eps,
                  nm.jdtype)
    kv = apply_rope(kv, pos, freqs)
    kv = kv_quant_sim(kv, cfg, nm)
    return q, kv, cq, cqq


def attn_output(p, o, pos, freqs, cfg: Config, nm: Numerics):
    """Inverse rope, grouped wo_a (bf16, no activation quant, as the reference), wo_b.
    o [B, T, H, K] f32 -> [B, T, D]."""
    B, T, H, K = o.shape
    G = cfg.o_groups
    o = apply_rope(o.astype(nm.jdtype), pos, freqs, inverse=True)
    og = o.reshape(B, T, G, H // G * K)
    w = p["wo_a"]
    if (nm.matmul != "xla" and isinstance(w, Fp8Weight) and cfg.o_lora_rank % 128 == 0
            and B * T <= KERNEL_MAX_ROWS):  # groups = "experts" of the weight-streaming kernel
        wg = Fp8Weight(w.w.reshape(G, cfg.o_lora_rank, -1),
                       w.scale.reshape(G, cfg.o_lora_rank // 128, -1))
        z = grouped_linear(og.reshape(B * T, G, -1).transpose(1, 0, 2),
                           None, wg, nm)  # [G, B*T, ol]; group g = weight group g
        z = z.transpose(1, 0, 2).reshape(B, T, G, -1).astype(nm.jdtype)
    else:
        wo_a = dequant(w, nm.jdtype).reshape(G, cfg.o_lora_rank, H // G * K)
        z = jnp.einsum("btgk,gok->btgo", og, wo_a, preferred_element_type=F32).astype(nm.jdtype)
    return linear(z.reshape(B, T, G * cfg.o_lora_rank), p["wo_b"], nm)


def attention_prefill(p, x, cfg: Config, nm: Numerics, ratio: int, debug=None, xq=None):
    """Whole-sequence attention from position 0 (no cache). x [B, T, D] -> [B, T, D].
    `debug`, if a dict, receives intermediates (indexer picks, compressor entries). xq:
    x's padded FP8 simulation (norm_act), if made."""
    B, T, _ = x.shape
    freqs = rope_freqs(cfg, ratio)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    q, kv, cq, cqq = q_and_kv(p, x, pos, freqs, cfg, nm, xq=xq)
    t = jnp.arange(T)
    win = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - cfg.sliding_window)
    keys, mask = kv, jnp.broadcast_to(win, (B, T, T))
    if ratio > 0:
        ent = compress_sequence(block_params(p, "compressor."), x, ratio, cfg.head_dim, freqs,
                                cfg, nm, "main", debug)  # [B, n, K]
        n = ent.shape[1]
        visible = jnp.arange(n)[None, :] < ((t + 1) // ratio)[:, None]  # [T, n]
        visible = jnp.broadcast_to(visible, (B, T, n))
        if ratio == 4 and n > 0:
            ip = block_params(p, "indexer.")
            keysI = compress_sequence(block_params(ip, "compressor."), x, ratio,
                                      cfg.index_head_dim, freqs, cfg, nm, "indexer")
            qI, wI = indexer_query(ip, x, cq, pos, freqs, cfg, nm, cqq)
            scores = indexer_scores(qI, wI, keysI)
            if debug is not None:
                debug["indexer_eligible"] = visible  # [B, T, n]: what the top-k chose from
            visible, idx = topk_mask(scores, visible, cfg.index_topk)
            if debug is not None:
                debug["indexer_scores"] = scores  # [B, T, n] (before the causal mask)
                debug["indexer_topk"] = jnp.where(jnp.take_along_axis(
                    jnp.broadcast_to(jnp.arange(n) < ((t + 1) // ratio)[:, None], (B, T, n)),
                    idx, -1), idx, -1)
        if debug is not None:
            debug["compressed_entries"] = ent
        keys = jnp.concatenate([kv, ent], 1)
        mask = jnp.concatenate([mask, visible], -1)
    o = attend(q, keys[:, None], mask, p["attn_sink"], nm)
    if debug is not None:
        debug["attn_mask"] = mask  # [B, T, T + n]: window keys (by position), then entries
        debug["attn_probs"] = attention_probs(q, keys[:, None], mask, p["attn_sink"])
    return attn_output(p, o, pos, freqs, cfg, nm)


def attention_probs(q, keys, mask, sink):
    """[B, T, H, S] attention probabilities (sink excluded, so rows sum to < 1)."""
    s = jnp.einsum("bthk,btsk->bths", q.astype(F32), keys.astype(F32),
                   precision="highest") / math.sqrt(q.shape[-1])
    s = jnp.where(mask[:, :, None, :], s, -jnp.inf)
    m = jnp.maximum(jnp.max(s, -1), sink.astype(F32))
    p = jnp.exp(s - m[..., None])
    return p / (p.sum(-1) + jnp.exp(sink.astype(F32) - m))[..., None]


def block_params(p: dict, prefix: str) -> dict:
    """The entries of p under `prefix`, the prefix stripped. An attention block stored in
    decode form (params.merge_x_proj: "x_proj_merged" among its keys) also shows the five
    weights it holds under their own names, as row views (`x_proj_views`), so that
    block_params(ap, "compressor.") etc. look the same in either form."""
    if X_PROJ in p:
        p = {**p, **x_proj_views(p)}
    if any(k.endswith(tuple(ROW_MERGES)) for k in p):
        p = {**p, **row_merge_views(p)}
    n = len(prefix)
    return {k[n:]: v for k, v in p.items() if k.startswith(prefix)}


def x_proj_views(ap: dict) -> dict:
    """The five weights of an attention block's x_proj_merged [rows, D] (names and row
    order: params.X_PROJ_PARTS) as WeightRows views. The row split is read off the block
    itself, no config needed: each compressor's wkv and wgate have as many rows as its
    `ape` has columns; weights_proj has the rows left. Every matmul with a view multiplies
    x by the whole merged weight and slices (quant.f32_dot_bf16): the compressor, indexer
    compressor and indexer calls are then one and the same dot, which XLA computes once."""
    w = ap[X_PROJ]
    c, ci = ap["compressor.ape"].shape[-1], ap["indexer.compressor.ape"].shape[-1]
    sizes = (c, c, ci, ci, w.shape[0] - 2 * c - 2 * ci)
    if sizes[-1] <= 0:
        raise ValueError(f"{X_PROJ} has {w.shape[0]} rows, fewer than the compressors' "
                         f"{2 * c + 2 * ci}")
    ends = np.cumsum(sizes)
    return {k: WeightRows(w, int(e - n), int(e)) for k, n, e in zip(X_PROJ_PARTS, sizes, ends)}


def row_merge_views(p: dict) -> dict:
    """The ROW_MERGES weights among p's keys (a whole tree, or one block's keys relative to
    "layers.N.") as WeightRows views under the names of their parts. Splits: wqkv_a = wq_a
    rows, then wkv's (as many as kv_norm has); shared_experts.w13 and experts.w13 (stacked
    [E, 2I, D]) = w1 rows, then w3's (half each). A matmul with a view multiplies by the
    whole stored weight and slices (quant.linear, quant.grouped_linear): the two views'
    calls are one and the same kernel, which XLA computes once."""
    out = {}
    for k, w in p.items():
        for m, (a, b) in ROW_MERGES.items():
            if not (k == m or k.endswith("." + m)):
                continue
            base = k[:len(k) - len(m)]   # "" or "layers.N."
            rows = w.shape[-2]
            nb = (p[base + "attn.kv_norm.weight"].shape[0] if m == "attn.wqkv_a"
                  else rows // 2)
            out[base + a] = WeightRows(w, 0, rows - nb)
            out[base + b] = WeightRows(w, rows - nb, rows)
    return out


# ---------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------
def route(p, x, tokens, cfg: Config, hash_layer: bool, debug=None):
    """Gate scores sqrt(softplus(x W^T)) (fp32, unquantised) -> expert ids [..., k] and
    routing weights [..., k]. debug["router_scores"]: what top-k ranks (score + bias),
    [..., E], on score-routed layers."""
    logits = f32_dot_bf16(x, p["gate.weight"])
    s = jnp.sqrt(jax.nn.softplus(logits))
    if hash_layer:
        idx = p["gate.tid2eid"][tokens]
    else:
        ranked = s + p["gate.bias"].astype(F32)
        _, idx = jax.lax.top_k(ranked, cfg.num_experts_per_tok)
        if debug is not None:
            debug["router_scores"] = ranked
    w = jnp.take_along_axis(s, idx, -1)
    w = w / w.sum(-1, keepdims=True) * cfg.routed_scaling_factor
    return idx, w


def swiglu(h1, h3, limit):
    g = jnp.minimum(h1.astype(F32), limit)
    u = jnp.clip(h3.astype(F32), -limit, limit)
    return jax.nn.silu(g) * u


def expert_ffn(w1, w2, w3, x, weight, cfg: Config, nm: Numerics, xq=None):
    """One SwiGLU expert with clamps; the routing weight is applied BEFORE W2. xq: x's
    padded FP8 simulation (norm_act), if made."""
    h = swiglu(linear(x, w1, nm, xq=xq), linear(x, w3, nm, xq=xq), cfg.swiglu_limit)
    if weight is not None:
        h = h * weight[..., None]
    return linear(h.astype(nm.jdtype), w2, nm, out_dtype=F32)


# Expert parallelism: distributed.py installs a function here while it traces a sharded
# program (same signature as routed_experts); None: all experts on this device.
ROUTED_EXPERTS_HOOK = None


def moe(p, x, tokens, cfg: Config, nm: Numerics, hash_layer: bool, debug=None, xq=None):
    """x [B, T, D], tokens [B, T] -> [B, T, D]. Routing, then the routed experts
    (`routed_experts`, or the expert-parallel hook), then the shared expert. xq: x's padded
    FP8 simulation (norm_act), if made: the experts take it instead of simulating x."""
    idx, w = route(p, x, tokens, cfg, hash_layer, debug)
    if debug is not None:
        debug["router_idx"], debug["router_w"] = idx, w
    routed = ROUTED_EXPERTS_HOOK or routed_experts
    if xq is None:
        out = routed(p, x, idx, w, cfg, nm)
    else:
        rows = math.prod(x.shape[:-1])
        out = routed(p, xq[:rows].reshape(x.shape), idx, w, cfg, nm, presim=True)
    if cfg.n_shared_experts:
        out = out + expert_ffn(p["shared_experts.w1"], p["shared_experts.w2"],
                               p["shared_experts.w3"], x, None, cfg, nm, xq=xq)
    return out.astype(nm.jdtype)


def routed_experts(p, x, idx, w, cfg: Config, nm: Numerics, presim: bool = False):
    """sum_k w[..., k] expert_{idx[..., k]}(x) over the E experts stacked in p["experts.*"]
    (E = their leading dim: all experts, or one device's share; an index outside [0, E)
    combines nothing and reads no weights). x [B, T, D], idx/w [B, T, k] -> [B, T, D] f32.
    presim: x is already FP8-simulated (the act-quant rounding is not applied again).
    Up to PAIR_GROUP_TOKENS tokens: one group per (token, expert) pair (`_moe_pairs`, no
    sort or scatters). Few tokens (decode batches): the pairs are grouped by expert into
    tiles (`expert_schedule`) and each tile reads its expert's stored weights once (the
    Pallas weight-streaming kernel with nm.matmul="pallas"). Many tokens: loop over all E
    experts with a combine mask."""
    E = jax.tree.leaves(p["experts.w1"])[0].shape[0]
    k = idx.shape[-1]
    B, T, D = x.shape
    pairs = B * T * k
    if B * T <= PAIR_GROUP_TOKENS and pairs < E:
        return _moe_pairs(p, x.reshape(B * T, D), idx.reshape(B * T, k),
                          w.reshape(B * T, k), cfg, nm, presim).reshape(B, T, D)
    if pairs < E or (nm.matmul != "xla" and pairs <= KERNEL_MAX_ROWS * k):
        return _moe_scheduled(p, x.reshape(B * T, D), idx.reshape(B * T, k),
                              w.reshape(B * T, k), cfg, nm, 8, presim).reshape(B, T, D)
    comb = jnp.einsum("btk,btke->bte", w, jax.nn.one_hot(idx, E, dtype=F32))  # [B,T,E]

    def one(e, acc):
        sub = lambda wt: jax.tree.map(lambda a: a[e], wt)
        y = expert_ffn(sub(p["experts.w1"]), sub(p["experts.w2"]), sub(p["experts.w3"]), x,
                       comb[..., e], cfg, nm)
        return acc + y

    return jax.lax.fori_loop(0, E, one, jnp.zeros(x.shape, F32))


def expert_schedule(idx_NK, E: int, tile: int):
    """Group (token, expert) pairs by expert into tiles of `tile` rows (static shapes).
    idx_NK int [N, k] -> (slot_expert [S] (-1: empty slot), slot [P], row [P], token [P])
    for the P = N*k pairs; pair j (token j // k) goes to row `row[j]` of tile `slot[j]`.
    Each expert's pairs fill ceil(count/tile) consecutive tiles, so S = ceil(P/tile) +
    min(E, P) always suffices. Indices outside [0, E) land in no tile's expert (-1)."""
    N, k = idx_NK.shape
    P = N * k
    e = idx_NK.reshape(P).astype(jnp.int32)
    e = jnp.where((e >= 0) & (e < E), e, E)  # invalid -> bucket E (computed nowhere)
    tok = jnp.arange(P, dtype=jnp.int32) // k
    order = jnp.argsort(e, stable=True)
    es = e[order]
    counts = jnp.zeros(E + 1, jnp.int32).at[e].add(1)
    ntile = -(-counts // tile)
    first_tile = jnp.cumsum(ntile) - ntile
    first_pair = jnp.cumsum(counts) - counts
    r = jnp.arange(P, dtype=jnp.int32) - first_pair[es]
    slot_sorted = first_tile[es] + r // tile
    S = -(-P // tile) + min(E + 1, P)
    slot_expert = jnp.full(S, -1, jnp.int32).at[slot_sorted].set(jnp.where(es < E, es, -1))
    inv = jnp.argsort(order)  # sorted position of each pair
    return slot_expert, slot_sorted[inv], (r % tile)[inv], tok


# Up to this many tokens, every (token, expert) pair is its own group: no sort and no
# scatters (about 10 small kernels fewer per layer), at the price of reading an expert
# twice when two tokens pick it (uniform routing, 256 experts, k = 6: ~5% more expert
# bytes at 8 tokens, ~20% at 16).
PAIR_GROUP_TOKENS = 8


def _grouped_swiglu(p, X_GMD, expert_G, Wr_GM, cfg: Config, nm: Numerics):
    """The routed-expert FFN over groups: X [G, M, D] (act-quant simulated), group g run by
    expert expert_G[g] (-1: none), rows weighted by Wr [G, M] before W2 -> f32 [G, M, D]."""
    h1 = grouped_linear(X_GMD, expert_G, p["experts.w1"], nm)
    h3 = grouped_linear(X_GMD, expert_G, p["experts.w3"], nm)
    h = swiglu(h1.astype(nm.jdtype), h3.astype(nm.jdtype), cfg.swiglu_limit) * Wr_GM[..., None]
    h = h.astype(nm.jdtype)
    if nm.act_quant:
        h = fp8_block_sim(h, 128)
    return grouped_linear(h, expert_G, p["experts.w2"], nm)


def _moe_pairs(p, x_ND, idx_NK, w_NK, cfg: Config, nm: Numerics, presim=False):
    """Routed experts with one group per (token, expert) pair: x [N, D], idx/w [N, k] ->
    [N, D] f32 (an index outside [0, E) contributes nothing and reads no weights)."""
    N, D = x_ND.shape
    k = idx_NK.shape[1]
    E = jax.tree.leaves(p["experts.w1"])[0].shape[0]
    e = idx_NK.reshape(N * k).astype(jnp.int32)
    e = jnp.where((e >= 0) & (e < E), e, -1)
    xq = fp8_block_sim(x_ND, 128) if nm.act_quant and not presim else x_ND
    X = jnp.repeat(xq, k, axis=0)[:, None, :]  # [P, 1, D]: pair j is token j // k
    y = _grouped_swiglu(p, X, e, w_NK.reshape(N * k, 1).astype(F32), cfg, nm)
    return y.reshape(N, k, D).sum(1)


def _moe_scheduled(p, x_ND, idx_NK, w_NK, cfg: Config, nm: Numerics, tile: int,
                   presim=False):
    """Routed experts over expert tiles: x [N, D], idx/w [N, k] -> [N, D] f32."""
    N, D = x_ND.shape
    k = idx_NK.shape[1]
    P = N * k
    E = jax.tree.leaves(p["experts.w1"])[0].shape[0]
    slot_expert, slot, row, tok = expert_schedule(idx_NK, E, tile)
    S = slot_expert.shape[0]
    xq = fp8_block_sim(x_ND, 128) if nm.act_quant and not presim else x_ND
    # The tiles are gathered, not scattered: each tile row's pair (P: none, a zero row) is
    # a small int scatter, then X and Wr are row gathers (XLA's scatter of rows into the
    # zeroed [S, tile, D] tiles cost ~15 us a layer at B = 64 on an H200,
    # benchmarks/results/session20_h200/run4). The combine stays a scatter-add: as a
    # gather + sum over k (pairs are token-major) XLA fused it with the transpose of the
    # kernel's [S, D, tile] output into one strided kernel, 75 us a layer against 25.
    src = jnp.full((S * tile,), P, jnp.int32).at[slot * tile + row].set(
        jnp.arange(P, dtype=jnp.int32))
    X = jnp.concatenate([xq, jnp.zeros((1, D), xq.dtype)])[jnp.minimum(src // k, N)]
    Wr = jnp.concatenate([w_NK.reshape(-1).astype(F32), jnp.zeros((1,), F32)])[src]
    y = _grouped_swiglu(p, X.reshape(S, tile, D), slot_expert, Wr.reshape(S, tile), cfg, nm)
    return jnp.zeros((N, D), F32).at[tok].add(y[slot, row])
