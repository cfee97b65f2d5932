"""The DeepSeek-V4 forward pass over whole sequences (prefill from position 0, no cache).

`forward(params, tokens, cfg, nm)` -> logits [B, T, V] (f32). The cached prefill/decode
path lives in `decode.py` and shares every building block in `layers/`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import Config
from .quant import f32_dot_bf16, Numerics, linear
from . import layers as L


def embed(params, tokens, cfg: Config, nm: Numerics):
    """tokens [B, T] -> residual X [B, T, N, D] (the embedding repeated on N streams)."""
    e = params["embed.weight"][tokens].astype(nm.jdtype)
    return jnp.broadcast_to(e[..., None, :], (*e.shape[:-1], cfg.hc_mult, e.shape[-1]))


def block(bp, X, tokens, layer: int, cfg: Config, nm: Numerics, attn_fn, debug=None):
    """One transformer block on the hc residual X [B, T, N, D] -> (new X, aux).
    `attn_fn(ap, x)` computes attention on the normed input (prefill or cached decode) and
    returns (out [B, T, D], aux): aux is whatever else the attention made (the cached
    step's new layer cache; None without a cache), handed back as is.
    `attn_fn(ap, x, xq=xq)` when the norm also made x's padded FP8 simulation for the
    matmul kernels (L.norm_act)."""
    with jax.named_scope("attn"):
        pre, post, C, x, xq = L.hc_site(X, bp["hc_attn_fn"], bp["hc_attn_scale"],
                                        bp["hc_attn_base"], bp["attn_norm.weight"], cfg, nm)
        ap = L.block_params(bp, "attn.")
        f, aux = attn_fn(ap, x) if xq is None else attn_fn(ap, x, xq=xq)
        X = L.hc_expand(f, X, post, C, nm.jdtype)
    if debug is not None:
        debug["hc_attn"] = (pre, post, C)
    with jax.named_scope("ffn"):
        pre, post, C, x, xq = L.hc_site(X, bp["hc_ffn_fn"], bp["hc_ffn_scale"],
                                        bp["hc_ffn_base"], bp["ffn_norm.weight"], cfg, nm)
        mdbg = {} if debug is not None else None
        f = L.moe(L.block_params(bp, "ffn."), x, tokens, cfg, nm, cfg.is_hash_layer(layer),
                  mdbg, xq=xq)
        X = L.hc_expand(f, X, post, C, nm.jdtype)
    if debug is not None:
        debug["hc_ffn"] = (pre, post, C)
        debug.update(mdbg)
    return X, aux


def head(params, X, cfg: Config, nm: Numerics, prefix=""):
    """hc head -> final RMSNorm -> logits in fp32."""
    with jax.named_scope("head"):
        y = L.hc_head(X, params[prefix + "hc_head_fn"], params[prefix + "hc_head_scale"],
                      params[prefix + "hc_head_base"], cfg, nm.jdtype)
        y = L.rms_norm(y, params[prefix + "norm.weight"], cfg.rms_norm_eps, nm.jdtype)
        return f32_dot_bf16(y, params["head.weight"])


def forward_hidden(params, tokens, cfg: Config, nm: Numerics = Numerics(), debug=None):
    """tokens [B, T] -> final residual X [B, T, N, D] (before the head)."""
    X = embed(params, tokens, cfg, nm)
    for i in range(cfg.num_hidden_layers):
        bp = L.block_params(params, f"layers.{i}.")
        ratio = cfg.layer_ratio(i)
        ldbg = {} if debug is not None else None
        attn = lambda ap, x, r=ratio, d=ldbg, xq=None: (
            L.attention_prefill(ap, x, cfg, nm, r, d, xq=xq), None)
        with jax.named_scope(f"layer{i}_{cfg.layer_kind(i)}"):
            X, _ = block(bp, X, tokens, i, cfg, nm, attn, ldbg)
        if debug is not None:
            ldbg["X"] = X
            debug[i] = ldbg
    return X


def forward(params, tokens, cfg: Config, nm: Numerics = Numerics(), debug=None):
    """tokens [B, T] int32 -> logits [B, T, V] float32."""
    return head(params, forward_hidden(params, tokens, cfg, nm, debug), cfg, nm)


def mtp_input(params, X_main, next_tokens, cfg: Config, nm: Numerics, j: int = 0):
    """The MTP block's input residual: X_main [B, T, N, D] (the main model's final residual
    at positions t, or the block's own output when drafts are chained), next_tokens [B, T]
    (the tokens at t+1) -> X [B, T, N, D] = e_proj(enorm(embed)) + h_proj(hnorm(X_main))."""
    p = f"mtp.{j}."
    e = L.rms_norm(params["embed.weight"][next_tokens], params[p + "enorm.weight"],
                   cfg.rms_norm_eps, nm.jdtype)
    h = L.rms_norm(X_main, params[p + "hnorm.weight"], cfg.rms_norm_eps, nm.jdtype)
    return (linear(e, params[p + "e_proj"], nm)[..., None, :].astype(jnp.float32)
            + linear(h, params[p + "h_proj"], nm).astype(jnp.float32)).astype(nm.jdtype)


def mtp_forward(params, X_main, next_tokens, cfg: Config, nm: Numerics = Numerics(), j: int = 0):
    """The MTP block over a whole sequence: X_main [B, T, N, D] the main model's final
    residual at positions t, next_tokens [B, T] the tokens at t+1 -> logits [B, T, V] for
    the token at t+2."""
    p = f"mtp.{j}."
    X = mtp_input(params, X_main, next_tokens, cfg, nm, j)
    layer = cfg.num_hidden_layers + j
    ratio = cfg.layer_ratio(layer)
    bp = L.block_params(params, p)
    attn = lambda ap, x, xq=None: (L.attention_prefill(ap, x, cfg, nm, ratio, xq=xq), None)
    with jax.named_scope(f"mtp{j}"):
        X, _ = block(bp, X, next_tokens, layer, cfg, nm, attn)
    return head(params, X, cfg, nm, prefix=p)
