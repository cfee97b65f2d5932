"""The DSpark drafter of DeepSeek-V4-Flash-0731 as pure functions over the parameter tree
(docs/SPECULATIVE.md, "DSpark"). Its tensors are `mtp.0 .. mtp.{S-1}` (S stages, one per
target layer; param_specs.dspark_specs), each a full V4 block with window-only attention.

Positions. A request's target has processed positions 0..P-1; the anchor a (the last
committed token, drawn from the target's logits at P-1) sits at P, not processed yet. One
draft forward proposes the G = dspark_block_size tokens at P+1 .. P+G; the verify is then
the G + 1 rows [a, d_1..d_G] at P .. P+G, the shape of the MTP verify.

    hid_BTF = target_hidden([X_BTND after each target layer], dtype)    # F = S*D
    X_BTND, hid_BTF = capture_hidden(params, tokens_BT, cfg, nm)      # prefill form
    state = init_state(cfg, B)        # {"kv": [S, B, W, K], "pos": [B, W] int32, -1: empty}
    state = commit(params, state, hid_BTF, pos_BT, valid_BT, cfg, nm)   # committed rows
    out = draft(params, state, anchor_B, anchor_pos_B, cfg, nm[, draw, key])
        out["tokens"] [B, G] int32      d_1..d_G (d_i is the token at P+i)
        out["logits"] [B, G, V] f32     the base logits plus each position's Markov bias
        out["q"] [B, G, V] | None      the draws' distributions (None for greedy)
        out["confidence"] [B, G] f32    the confidence head, sigmoid of its raw score

The drafter, as the public implementations (sglang, vLLM, the ports of DeepSeek's
inference code) compute it:
- target_hidden: the residual after each target layer, averaged over the N hc streams,
  concatenated: [S*D]; main_x = main_norm(main_proj(.)) [D] (stage 0's weights);
- every stage's window ring holds kv_norm(wkv(main_x)), roped at its position (ratio-0
  rope), for the last W committed positions: the SAME main_x for every stage, through
  each stage's own wkv (no mHC, no attn_norm on this path);
- the block [a, noise x (G-1)] at positions P .. P+G-1 (block position i predicts the
  token at P+i+1): embedded and repeated on the N streams, through the S stages; each
  stage attends its ring plus the whole block, no causal mask inside the block; the
  block's own KV is not kept;
- head: hc_head (last stage's) -> norm (last stage's) -> the target's head.weight;
- the Markov head adds markov_w2 . markov_w1[prev] to position i's logits, prev = the
  token drawn at position i-1 (the anchor at i = 0): drawn one position after another;
- confidence_i = sigmoid(proj . [hc_head output_i, markov_w1[prev_i]]).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from . import layers as L
from .config import Config
from .layers.attention import attend, attn_output, q_and_kv
from .layers.compressor import kv_quant_sim
from .quant import Numerics, f32_dot_bf16, linear

F32 = jnp.float32


def with_dspark(cfg: Config, block_size: int = 5, markov_rank: int = 256,
                noise_token_id: int = 128799, num_stages: int = 3) -> Config:
    """`cfg` (a base-V4 config) with a DSpark drafter in the release's shape: `num_stages`
    stages reading the last `num_stages` layers (fewer layers: layer 0 repeats), the MTP
    block dropped. A noise token past the vocabulary becomes the last token id."""
    n = cfg.num_hidden_layers
    noise = noise_token_id if noise_token_id < cfg.vocab_size else cfg.vocab_size - 1
    return cfg.replace(num_nextn_predict_layers=0, compress_ratios=cfg.compress_ratios[:n],
                       dspark_target_layer_ids=tuple(max(0, n - num_stages + i)
                                                     for i in range(num_stages)),
                       dspark_block_size=block_size, dspark_markov_rank=markov_rank,
                       dspark_noise_token_id=noise)


def check_dspark(cfg: Config) -> None:
    if not cfg.dspark:
        raise ValueError("this checkpoint has no DSpark drafter (its config.json has no "
                         "dspark_target_layer_ids: a base-V4 layout, whose mtp.* is an MTP "
                         "block); use the MTP speculation instead")


# ---------------------------------------------------------------------------------------
# The target's hidden states and the stages' window rings
# ---------------------------------------------------------------------------------------
def target_hidden(xs, dtype) -> jax.Array:
    """The drafter's input from the residuals after its target layers (in
    dspark_target_layer_ids order), each [..., N, D]: their means over the N streams,
    concatenated -> [..., S*D] in `dtype`."""
    return jnp.concatenate([jnp.mean(x.astype(F32), -2) for x in xs], -1).astype(dtype)


def capture_hidden(params, tokens, cfg: Config, nm: Numerics):
    """The target's whole-sequence forward (model.forward_hidden, prefill from position 0)
    with the drafter's input captured: tokens [B, T] -> (final residual X [B, T, N, D],
    target_hidden [B, T, S*D]). Reads the per-layer residuals forward_hidden's `debug`
    records; under jit the other debug intermediates are dead code."""
    from . import model
    debug = {}
    X = model.forward_hidden(params, tokens, cfg, nm, debug)
    return X, target_hidden([debug[i]["X"] for i in cfg.dspark_target_layer_ids], nm.jdtype)


def project(params, hid, cfg: Config, nm: Numerics):
    """main_x [..., D] = main_norm(main_proj(hid [..., S*D]))."""
    y = linear(hid.astype(nm.jdtype), params["mtp.0.main_proj"], nm)
    return L.rms_norm(y, params["mtp.0.main_norm.weight"], cfg.rms_norm_eps, nm.jdtype)


def _stage_params(params, s: int) -> dict:
    return L.block_params(params, f"mtp.{s}.")


def window_rows(params, main_x, pos, cfg: Config, nm: Numerics):
    """The ring rows of committed positions: main_x [B, T, D], pos [B, T] ->
    [S, B, T, K], stage s's kv_norm(wkv_s(main_x)) roped (ratio-0 rope) and FP8-simulated
    as the main model's window rows are."""
    freqs = L.rope_freqs(cfg, 0)
    rows = []
    for s in range(cfg.dspark_num_stages):
        ap = L.block_params(_stage_params(params, s), "attn.")
        kv = L.rms_norm(linear(main_x, ap["wkv"], nm), ap["kv_norm.weight"], cfg.rms_norm_eps,
                        nm.jdtype)
        rows.append(kv_quant_sim(L.apply_rope(kv, pos, freqs), cfg, nm))
    return jnp.stack(rows)


def init_state(cfg: Config, batch: int, dtype=jnp.bfloat16) -> dict:
    """Empty window rings: {"kv": [S, B, W, K] (`dtype`), "pos": [B, W] int32 (the
    position each slot holds, -1: none)}. W = sliding_window, K = head_dim; slot p % W."""
    S, W, K = cfg.dspark_num_stages, cfg.sliding_window, cfg.head_dim
    return {"kv": jnp.zeros((S, batch, W, K), dtype), "pos": jnp.full((batch, W), -1, jnp.int32)}


def clear(state: dict, slots) -> dict:
    """The rings of the request slots where `slots` [B] bool is set emptied (a new request
    in a recycled slot must not see the last one's rows)."""
    return {"kv": state["kv"], "pos": jnp.where(slots[:, None], -1, state["pos"])}


def append(state: dict, rows, pos, valid) -> dict:
    """Write committed rows into the rings: rows [S, B, T, K], pos [B, T] (distinct per
    request), valid [B, T] bool. Of a request's valid rows only the last W positions are
    written (a prefill longer than the ring keeps its tail; no two rows hit one slot)."""
    W = state["pos"].shape[1]
    last = jnp.max(jnp.where(valid, pos, -1), axis=1, keepdims=True)
    keep = valid & (pos > last - W)
    slot = jnp.where(keep, pos % W, W)  # W: out of bounds, dropped
    b = jnp.arange(pos.shape[0])[:, None]
    kv = state["kv"].at[:, b, slot].set(rows.astype(state["kv"].dtype), mode="drop")
    return {"kv": kv, "pos": state["pos"].at[b, slot].set(pos.astype(jnp.int32), mode="drop")}


def commit(params, state: dict, hid, pos, valid, cfg: Config, nm: Numerics) -> dict:
    """The target's hidden states of committed rows into every stage's ring: hid
    [B, T, S*D] (target_hidden), pos [B, T], valid [B, T] bool (prefill: the prompt's
    rows; after a verify: the a + 1 accepted rows [anchor, d_1..d_a])."""
    return append(state, window_rows(params, project(params, hid, cfg, nm), pos, cfg, nm),
                  pos, valid)


# ---------------------------------------------------------------------------------------
# The block forward
# ---------------------------------------------------------------------------------------
def block_tokens(anchor, cfg: Config):
    """[B] -> [B, G]: the anchor, then the noise token."""
    G = cfg.dspark_block_size
    noise = jnp.full((anchor.shape[0], G - 1), cfg.dspark_noise_token_id, jnp.int32)
    return jnp.concatenate([anchor.astype(jnp.int32)[:, None], noise], 1)


def attention(ap, x, ring_kv, ring_pos, anchor_pos, cfg: Config, nm: Numerics, xq=None):
    """A stage's attention for the block: x [B, G, D] at positions anchor_pos + 0..G-1
    attends the ring rows ring_kv [B, W, K] of positions [anchor_pos - W, anchor_pos)
    (ring_pos [B, W]) and the whole block (its own KV, not kept) -> [B, G, D]."""
    B, G, _ = x.shape
    W = ring_kv.shape[1]
    freqs = L.rope_freqs(cfg, 0)
    pos = anchor_pos[:, None] + jnp.arange(G)[None, :]
    q, kv, _, _ = q_and_kv(ap, x, pos, freqs, cfg, nm, xq=xq)
    lo = anchor_pos[:, None]
    ring_ok = (ring_pos >= 0) & (ring_pos < lo) & (ring_pos >= lo - W)  # [B, W]
    mask = jnp.concatenate([ring_ok, jnp.ones((B, G), bool)], 1)        # no causal mask
    keys = jnp.concatenate([ring_kv.astype(kv.dtype), kv], 1)           # [B, W + G, K]
    o = attend(q, keys[:, None], jnp.broadcast_to(mask[:, None], (B, G, W + G)),
               ap["attn_sink"], nm)
    return attn_output(ap, o, pos, freqs, cfg, nm)


def stage(bp, X, tokens, ring_kv, ring_pos, anchor_pos, cfg: Config, nm: Numerics):
    """One drafter stage on the block residual X [B, G, N, D]: the mHC sites, the window
    attention, the MoE (score-routed; the stages are no hash layers)."""
    pre, post, C, x, xq = L.hc_site(X, bp["hc_attn_fn"], bp["hc_attn_scale"],
                                    bp["hc_attn_base"], bp["attn_norm.weight"], cfg, nm)
    f = attention(L.block_params(bp, "attn."), x, ring_kv, ring_pos, anchor_pos, cfg, nm, xq)
    X = L.hc_expand(f, X, post, C, nm.jdtype)
    pre, post, C, x, xq = L.hc_site(X, bp["hc_ffn_fn"], bp["hc_ffn_scale"],
                                    bp["hc_ffn_base"], bp["ffn_norm.weight"], cfg, nm)
    f = L.moe(L.block_params(bp, "ffn."), x, tokens, cfg, nm, False, xq=xq)
    return L.hc_expand(f, X, post, C, nm.jdtype)


def forward(params, state: dict, anchor, anchor_pos, cfg: Config, nm: Numerics):
    """The block [anchor, noise x (G-1)] through the S stages -> residual [B, G, N, D].
    anchor [B] int32 (the last committed token), anchor_pos [B] int32 (its position)."""
    tokens = block_tokens(anchor, cfg)
    e = params["embed.weight"][tokens].astype(nm.jdtype)
    X = jnp.broadcast_to(e[..., None, :], (*e.shape[:-1], cfg.hc_mult, e.shape[-1]))
    for s in range(cfg.dspark_num_stages):
        with jax.named_scope(f"dspark{s}"):
            X = stage(_stage_params(params, s), X, tokens, state["kv"][s], state["pos"],
                      anchor_pos, cfg, nm)
    return X


def head(params, X, cfg: Config, nm: Numerics):
    """X [B, G, N, D] -> (base logits [B, G, V] f32, y [B, G, D]: the hc_head output the
    confidence head reads). The last stage's hc_head and norm, the target's head."""
    p = f"mtp.{cfg.dspark_num_stages - 1}."
    y = L.hc_head(X, params[p + "hc_head_fn"], params[p + "hc_head_scale"],
                  params[p + "hc_head_base"], cfg, nm.jdtype)
    h = L.rms_norm(y, params[p + "norm.weight"], cfg.rms_norm_eps, nm.jdtype)
    return f32_dot_bf16(h, params["head.weight"]), y


# ---------------------------------------------------------------------------------------
# The Markov head, sampled position by position, and the confidence head
# ---------------------------------------------------------------------------------------
def _markov_key(cfg: Config) -> str:
    return f"mtp.{cfg.dspark_num_stages - 1}.markov_head."


def markov_embed(params, prev, cfg: Config):
    """markov_w1[prev]: [...] -> [..., r] f32."""
    return params[_markov_key(cfg) + "markov_w1.weight"][prev].astype(F32)


def markov_bias(params, prev, cfg: Config):
    """The Markov head's bias after token `prev`: [...] -> [..., V] f32 (w2 . w1[prev])."""
    w2 = params[_markov_key(cfg) + "markov_w2.weight"]
    return jnp.einsum("...r,vr->...v", markov_embed(params, prev, cfg), w2.astype(F32),
                      precision="highest")


def greedy(logits, key):
    """A draw: logits [B, V] -> (argmax [B] int32, None: its distribution is one-hot)."""
    del key
    return jnp.argmax(logits, -1).astype(jnp.int32), None


Draw = Callable  # (logits [B, V] f32, key | None) -> (token [B] int32, q [B, V] | None)


def markov_sample(params, base_logits, anchor, cfg: Config, draw: Draw = greedy, key=None):
    """The block's tokens drawn one position after another: position i's logits are
    base_logits[:, i] + markov_bias(prev_i), prev_0 = anchor, prev_i = the token drawn at
    i-1. base_logits [B, G, V] f32, anchor [B] -> (tokens [B, G] int32, logits [B, G, V],
    q [B, G, V] or None (draw's), prev [B, G] int32). `draw` e.g. greedy, or the
    speculative sampler's draft draw (its q enters the acceptance rule). key: one key
    (position i draws with split(key, G)[i]) or one per batch row [B] (row b's position i:
    split(key[b], G)[i]; draw then gets keys [B])."""
    G = base_logits.shape[1]
    if key is None:
        keys = None
    elif key.ndim == 0:
        keys = jax.random.split(key, G)                                     # [G]
    else:
        keys = jnp.swapaxes(jax.vmap(lambda k: jax.random.split(k, G))(key), 0, 1)  # [G, B]

    def step(prev, xs):
        lg, k = xs
        lg = lg + markov_bias(params, prev, cfg)
        tok, q = draw(lg, k)
        return tok, (tok, lg, q, prev)

    _, (tok, lg, q, prev) = jax.lax.scan(step, anchor.astype(jnp.int32),
                                         (jnp.swapaxes(base_logits, 0, 1), keys))
    sw = lambda a: None if a is None else jnp.swapaxes(a, 0, 1)
    return sw(tok), sw(lg), sw(q), sw(prev)


def confidence(params, y, prev, cfg: Config):
    """The confidence head: y [B, G, D] (hc_head output), prev [B, G] (the Markov inputs)
    -> sigmoid(proj . [y, markov_w1[prev]]) [B, G] f32, per position its estimate that
    the draft there is accepted."""
    w = params[f"mtp.{cfg.dspark_num_stages - 1}.confidence_head.proj.weight"]
    feats = jnp.concatenate([y.astype(F32), markov_embed(params, prev, cfg)], -1)
    raw = jnp.einsum("bgi,oi->bgo", feats, w.astype(F32), precision="highest")[..., 0]
    return jax.nn.sigmoid(raw)


def draft(params, state: dict, anchor, anchor_pos, cfg: Config, nm: Numerics,
          draw: Draw = greedy, key=None) -> dict:
    """One draft: the block forward, the head, the Markov draws, the confidence ->
    {"tokens" [B, G] int32, "logits" [B, G, V] f32, "q" [B, G, V] | None,
     "confidence" [B, G] f32} (module docstring). `state` is only read."""
    base, y = head(params, forward(params, state, anchor, anchor_pos, cfg, nm), cfg, nm)
    tok, lg, q, prev = markov_sample(params, base, anchor, cfg, draw, key)
    return {"tokens": tok, "logits": lg, "q": q, "confidence": confidence(params, y, prev, cfg)}
