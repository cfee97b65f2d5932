"""Speculative decoding with the model's own MTP block (docs/SPECULATIVE.md).

One jitted program per step (`spec_step_fn`), for every request slot at once:
  1. MTP catch-up and draft: the MTP block runs on the rows it has not seen (the main
     model's residuals of the tokens accepted last step, each with the token after it),
     writing its cache; its last row predicts draft 1. Drafts 2..k chain the block on its
     own output (ARCHITECTURE.md section 8) against a copy of its cache that is dropped.
  2. Verify: the main model runs on [token, draft 1..k] (T = k + 1 rows per request).
  3. Accept: greedy keeps the drafts equal to the main model's argmax; sampling keeps
     draft j with probability min(1, p/q) and draws the bonus token from the normalised
     residual max(p - q, 0) (or from p after k accepts). The output is distributed as
     without speculation.
  4. Roll back what the rejected rows wrote (`rollback`): window-ring slots and compressed
     pool entries are restored from copies taken before the verify; the compressor tail
     state is recomputed from the old state for the accepted rows.

The host reads back the emitted tokens and their count one step behind (the next step is
already enqueued), and reserves pool blocks for the rows of the two steps in flight.
"""
from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np

from . import cache as C
from .cache import Cache, CacheSpec, LayerCache, init_layer_cache, layer_structs, split_cmp_state
from .config import Config
from .quant import Numerics
from . import decode as D
from . import layers as L
from . import model as M
from .serve.sampling import ROW_KEYS, filter_logits

F32 = jnp.float32
MAX_DRAFTS = 3


@dataclasses.dataclass(frozen=True)
class Speculation:
    """k: draft tokens per step from the MTP block (1 .. 3; chained past 1)."""
    k: int = 1

    def __post_init__(self):
        check_draft_count(self.k)


def check_draft_count(k) -> None:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_DRAFTS:
        raise ValueError(f"speculative tokens must be an integer in [1, {MAX_DRAFTS}] "
                         f"(0 turns speculation off), got {k!r}")


def check_mtp_config(cfg: Config, k: int) -> None:
    """The config has an MTP block, and its window holds the k + 1 verify rows in distinct
    ring slots (checked before a checkpoint is read)."""
    if cfg.num_nextn_predict_layers < 1:
        raise ValueError("speculative decoding drafts with the MTP block, and this model has "
                         "none (num_nextn_predict_layers = 0); run with speculative tokens 0")
    if cfg.sliding_window <= k:
        raise ValueError(f"speculative decoding with k={k} needs sliding_window > k, "
                         f"got {cfg.sliding_window}")


def check_mtp(cfg: Config, params, spec: Speculation) -> None:
    """Clear errors before any heavy work: check_mtp_config, and the parameters hold the
    MTP block."""
    check_mtp_config(cfg, spec.k)
    if not any(k.startswith("mtp.0.") for k in params):
        raise ValueError("speculative decoding drafts with the MTP block, and this checkpoint "
                         "has none (no `mtp.0.*` parameters); run with speculative tokens 0")


def init_mtp_cache(cfg: Config, cs: CacheSpec) -> LayerCache:
    """The MTP block's own layer cache (window ring, plus pools when its ratio is > 0),
    laid out as a main layer's (docs/KV_CACHE.md) and addressed by the same block table."""
    return init_layer_cache(cfg, cs, cfg.num_hidden_layers)


# ---------------------------------------------------------------------------------------
# Sampler distributions
# ---------------------------------------------------------------------------------------
def sampler_logits(sampler, logits):
    """The logits a sampler draws from (scaled and masked, -inf outside its support):
    jax.random.categorical(key, sampler_logits(s, l)) is s.get_next_tokens(l, key) for
    the generate.py samplers (tests/test_speculative.py checks it). Greedy: its one-hot
    argmax as 0 / -inf."""
    name = type(sampler).__name__
    if name == "Greedy":
        hot = jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1], dtype=bool)
        return jnp.where(hot, 0.0, -jnp.inf)
    lg = logits / sampler.temperature
    if name == "Temperature":
        return lg
    if name == "TopK":
        kth = jax.lax.top_k(lg, min(sampler.k, lg.shape[-1]))[0][..., -1:]
        return jnp.where(lg >= kth, lg, -jnp.inf)
    if name == "TopP":
        probs = jax.nn.softmax(lg, -1)
        sp = jnp.sort(probs, -1)[..., ::-1]
        cum = jnp.cumsum(sp, -1)
        n_keep = jnp.sum((cum - sp) < sampler.p, -1, keepdims=True)
        thresh = jnp.take_along_axis(sp, n_keep - 1, -1)
        return jnp.where(probs >= thresh, lg, -jnp.inf)
    if name == "MinP":
        probs = jax.nn.softmax(lg, -1)
        return jnp.where(probs >= sampler.p * probs.max(-1, keepdims=True), lg, -jnp.inf)
    raise ValueError(f"speculative sampling does not know the sampler {sampler!r}")


def draft_tokens(sampler, logits, key):
    """A draft from the MTP logits [B, V] -> (token [B] int32, q [B, V] its distribution)."""
    if type(sampler).__name__ == "Greedy":
        return jnp.argmax(logits, -1).astype(jnp.int32), None
    lg = sampler_logits(sampler, logits)
    return (jax.random.categorical(key, lg, -1).astype(jnp.int32), jax.nn.softmax(lg, -1))


def accept(sampler, logits, drafts, q, key):
    """Speculative acceptance. logits [B, k+1, V] (the main model at the verify rows),
    drafts [B, k] int32, q [B, k, V] (the drafts' distributions; None for greedy) ->
    (out [B, k+1] int32: the accepted drafts then the bonus token, n [B] int32 in 1..k+1:
    how many of out are emitted)."""
    B, T, V = logits.shape
    k = T - 1
    j = jnp.arange(T)[None, :]
    if type(sampler).__name__ == "Greedy":
        tgt = jnp.argmax(logits, -1).astype(jnp.int32)                      # [B, T]
        ok = drafts == tgt[:, :k]
        a = jnp.sum(jnp.cumprod(ok, -1), -1).astype(jnp.int32)
        return tgt, a + 1   # tgt[:, :a] are the drafts themselves
    ku, kb = jax.random.split(key)
    p = jax.nn.softmax(sampler_logits(sampler, logits), -1)                # [B, T, V]
    pd = jnp.take_along_axis(p[:, :k], drafts[..., None], -1)[..., 0]       # [B, k]
    qd = jnp.take_along_axis(q, drafts[..., None], -1)[..., 0]
    u = jax.random.uniform(ku, (B, k))
    ok = u * qd < pd                     # accept with probability min(1, p / q)
    a = jnp.sum(jnp.cumprod(ok, -1), -1).astype(jnp.int32)                  # [B]
    # the bonus row: residual max(p - q, 0) after a rejection, p itself after k accepts
    resid = jnp.concatenate([jnp.maximum(p[:, :k] - q, 0.0), p[:, k:]], 1)  # [B, T, V]
    r = jnp.take_along_axis(resid, a[:, None, None], 1)[:, 0]               # [B, V]
    pa = jnp.take_along_axis(p, a[:, None, None], 1)[:, 0]
    r = jnp.where(jnp.sum(r, -1, keepdims=True) > 0, r, pa)   # (p == q: float round-off)
    bonus = jax.random.categorical(kb, jnp.log(r), -1).astype(jnp.int32)
    dpad = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], 1)
    out = jnp.where(j < a[:, None], dpad, bonus[:, None])
    return out, a + 1


def row_probs(rows, logits):
    """Each request's sampling distribution under its own settings (serve.sampling rows
    {name: [R]}): logits [R, ..., V] -> probabilities [R, ..., V]; a greedy row
    (temperature 0) is its one-hot argmax, so the stochastic accept rule below is then
    exactly greedy verification."""
    shp, V = logits.shape, logits.shape[-1]
    n = int(np.prod(shp[1:-1], dtype=np.int64))
    rep = lambda a: jnp.repeat(a, n)
    lg = filter_logits(logits.reshape(-1, V), *(rep(rows[k]) for k in ROW_KEYS[:4]))
    hot = jax.nn.one_hot(jnp.argmax(logits, -1), V, dtype=F32)
    greedy = (rows["temperature"] == 0).reshape(shp[0], *([1] * (len(shp) - 1)))
    return jnp.where(greedy, hot, jax.nn.softmax(lg.reshape(shp), -1))


def accept_rows(rows, logits, drafts, q, key_u, key_b):
    """accept() with per-request settings and keys: logits [R, k+1, V], drafts [R, k],
    q [R, k, V] (row_probs of the draft logits), key_u / key_b [R] -> (out [R, k+1], n [R])."""
    B, T, V = logits.shape
    k = T - 1
    j = jnp.arange(T)[None, :]
    p = row_probs(rows, logits)                                             # [B, T, V]
    pd = jnp.take_along_axis(p[:, :k], drafts[..., None], -1)[..., 0]       # [B, k]
    qd = jnp.take_along_axis(q, drafts[..., None], -1)[..., 0]
    u = jax.vmap(lambda kk: jax.random.uniform(kk, (k,)))(key_u)
    ok = u * qd < pd
    a = jnp.sum(jnp.cumprod(ok, -1), -1).astype(jnp.int32)
    resid = jnp.concatenate([jnp.maximum(p[:, :k] - q, 0.0), p[:, k:]], 1)
    r = jnp.take_along_axis(resid, a[:, None, None], 1)[:, 0]
    pa = jnp.take_along_axis(p, a[:, None, None], 1)[:, 0]
    r = jnp.where(jnp.sum(r, -1, keepdims=True) > 0, r, pa)
    bonus = jax.vmap(jax.random.categorical)(key_b, jnp.log(r)).astype(jnp.int32)
    dpad = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], 1)
    return jnp.where(j < a[:, None], dpad, bonus[:, None]), a + 1


# ---------------------------------------------------------------------------------------
# The MTP block against its cache
# ---------------------------------------------------------------------------------------
def mtp_layer(params, mcache: LayerCache, X_main, tokens, slots, pos, nvalid, block_table,
              cfg: Config, cs: CacheSpec, nm: Numerics):
    """The MTP block on T rows per batch row: X_main [B, T, N, D] (the main model's final
    residual at positions pos .. pos+T-1), tokens [B, T] (the token after each) ->
    (its output residual [B, T, N, D], new MTP cache). Row j predicts the token at
    pos + j + 2 (mtp_head)."""
    B, T = tokens.shape
    tok_pos = pos[:, None] + jnp.arange(T)[None, :]
    valid = jnp.arange(T)[None, :] < nvalid[:, None]
    bt_rows = block_table[slots]
    n = cfg.num_hidden_layers
    ratio = cfg.layer_ratio(n)
    attn = lambda ap, x, xq=None: D.attention_cached(ap, mcache, x, tok_pos, valid, slots, pos,
                                                     nvalid, bt_rows, cfg, cs, nm, ratio, xq)
    with jax.named_scope("mtp0"):
        X = M.mtp_input(params, X_main, tokens, cfg, nm)
        return M.block(L.block_params(params, "mtp.0."), X, tokens, n, cfg, nm, attn)


def mtp_head(params, X, cfg: Config, nm: Numerics):
    """The MTP block's residual [..., N, D] -> logits [..., V] f32."""
    return M.head(params, X, cfg, nm, prefix="mtp.0.")


# ---------------------------------------------------------------------------------------
# Verify with rollback
# ---------------------------------------------------------------------------------------
def rollback(lc: LayerCache, snap: LayerCache, ap, x, pos, nvalid, keep, bt_rows, ratio,
             cfg: Config, cs: CacheSpec, nm: Numerics) -> LayerCache:
    """Undo one layer's writes by the verify rows j >= keep[b] (of nvalid[b] written):
    ring slots and completed pool entries get their snapshot back (cache.restore_rejected);
    the compressor state is recomputed from the state before the step (snap.cst) over the
    `keep` accepted rows of x [B, T, D] (the layer's attention input). Exact: the cache
    ends as if only the accepted rows had been stepped."""
    B, T = x.shape[:2]
    lc = C.restore_rejected(lc, snap, pos, nvalid, keep, bt_rows, ratio, cfg, cs)
    if ratio > 0:
        # the accepted rows' state: the compressor update again with nvalid = keep. Its
        # projections are the verify's own (same operands: XLA merges them); its entries
        # are unused (dead code).
        tok_pos = pos[:, None] + jnp.arange(T)[None, :]
        freqs = L.rope_freqs(cfg, ratio)
        st = split_cmp_state(snap.cst, cfg, ratio)
        D._compressor_update(ap, st, x, tok_pos, pos, keep, ratio, freqs, cfg, nm, "", cs)
        if ratio == 4:
            D._compressor_update(ap, st, x, tok_pos, pos, keep, ratio, freqs, cfg, nm, "i", cs)
        lc = C.write_state(lc, jnp.arange(B), st, cfg, ratio)
    return lc


def verify_layers(params, cache: Cache, tokens, pos, nvalid, block_table, cfg: Config,
                  cs: CacheSpec, nm: Numerics, attn_rows: int = 0,
                  capture: tuple[int, ...] = ()):
    """The main model on T rows of every request slot (batch row b = slot b): tokens
    [R, T] at positions pos [R] .. pos+T-1, the first nvalid [R] real -> (X [R, T, N, D],
    new cache, undo) where undo(cache, keep [R]) rolls every layer back to its first
    keep[b] rows (keep <= nvalid).
    attn_rows (static, 0: all T at once): each layer's cached attention takes the rows in
    consecutive parts of at most this many (`split_attention`), e.g. decode.KERNEL_ROWS so
    that a verify longer than the kernels take still runs through them.
    capture (static): layer ids whose output residual is returned too -> (X, cache, undo,
    [X after layer i, [R, T, N, D], for i in capture])."""
    B, T = tokens.shape
    slots = jnp.arange(B)
    tok_pos = pos[:, None] + jnp.arange(T)[None, :]
    valid = jnp.arange(T)[None, :] < nvalid[:, None]
    bt_rows = block_table[slots]

    def attend(i, ap, lc, x, xq):
        ratio = cfg.layer_ratio(i)
        snap = C.verify_snapshot(lc, pos, nvalid, bt_rows, T, ratio, cfg, cs)
        # the layer's writes (in place, by the kernels) then follow the snapshot's reads in
        # the program's order; without it XLA copies the ring and pools before each write
        snap, lc = jax.lax.optimization_barrier((snap, lc))
        snap = snap.replace(cst=lc.cst)   # the state before the step, for the rollback
        if attn_rows and T > attn_rows:
            out, new = split_attention(ap, lc, x, pos, nvalid, bt_rows, attn_rows, cfg, cs, nm,
                                       ratio)
        else:
            out, new = D.attention_cached(ap, lc, x, tok_pos, valid, slots, pos, nvalid,
                                          bt_rows, cfg, cs, nm, ratio, xq)
        return out, new, (snap, ap, x)

    X = M.embed(params, tokens, cfg, nm)
    layers = range(cfg.num_hidden_layers)
    X, new_cache, saved, captured = D.layer_loop(params, cache, X, tokens, layers, cfg, nm,
                                                 attend, capture=capture)

    def undo(cache, keep):
        out = {}
        for i in layers:
            snap, ap, x = saved[i]
            with jax.named_scope(f"rollback{i}"):
                out[i] = rollback(cache[i], snap, ap, x, pos, nvalid, keep, bt_rows,
                                  cfg.layer_ratio(i), cfg, cs, nm)
        return cache.replace_layers(out)
    if capture:
        return X, new_cache, undo, captured
    return X, new_cache, undo


def split_attention(ap, lc, x, pos, nvalid, bt_rows, rows: int, cfg: Config, cs: CacheSpec,
                    nm: Numerics, ratio: int):
    """One layer's cached attention on the T rows x [R, T, D] (at pos [R] .. pos+T-1, the
    first nvalid [R] real) as consecutive parts of at most `rows` rows: part p is the
    step of rows p*rows .. at pos + p*rows, against the cache the parts before it wrote.
    The same as one T-row step (a row sees the rows before it, never those after), and
    each part fits the kernel path (T <= decode.KERNEL_ROWS: at most one compressed entry
    completes per request and part). The projections of q / kv run per part (XLA may merge
    them); the rest of the layer (mHC, MoE) still runs once on all T rows.
    -> (out [R, T, D], new layer cache)."""
    B, T = x.shape[:2]
    slots = jnp.arange(B)
    outs = []
    for s in range(0, T, rows):
        n = min(rows, T - s)
        p_pos = pos + s
        nv = jnp.clip(nvalid - s, 0, n).astype(jnp.int32)
        tok_pos = p_pos[:, None] + jnp.arange(n)[None, :]
        valid = jnp.arange(n)[None, :] < nv[:, None]
        o, lc = D.attention_cached(ap, lc, x[:, s:s + n], tok_pos, valid, slots, p_pos, nv,
                                   bt_rows, cfg, cs, nm, ratio)
        outs.append(o)
    return jnp.concatenate(outs, 1), lc


# ---------------------------------------------------------------------------------------
# The programs
# ---------------------------------------------------------------------------------------
def prefill_fn(params, cache, mcache, tokens, slot, pos, nvalid, block_table, h_prev,
               cfg: Config, cs: CacheSpec, nm: Numerics):
    """One prefill chunk of one request with the MTP block kept in step: tokens [1, C] at
    pos [1] (nvalid [1] real), h_prev [1, N, D] the main residual at pos - 1 (unused at
    pos 0) -> (logits [1, V], residual at the chunk's last token [1, N, D], cache, mcache).
    The MTP rows lag one token (each needs the token after it): this chunk writes MTP
    positions pos-1 .. pos+nvalid-2; the last prompt position waits for the first sampled
    token (the first decode step's catch-up)."""
    n = cfg.num_hidden_layers
    X = M.embed(params, tokens, cfg, nm)
    X, cache = D.step_layers(params, cache, X, tokens, slot, pos, nvalid, block_table,
                             range(n), cfg, cs, nm)
    logits = D.step_head(params, X, nvalid, cfg, nm)
    first = (pos[0] == 0)
    shifted = jnp.concatenate([h_prev[:, None], X[:, :-1]], 1)
    X_in = jnp.where(first, X, shifted)
    tok_in = jnp.where(first, jnp.concatenate([tokens[:, 1:], tokens[:, :1] * 0], 1), tokens)
    mpos = jnp.where(first, 0, pos - 1)
    mn = jnp.where(first, nvalid - 1, nvalid)
    _, mcache = mtp_layer(params, mcache, X_in, tok_in, slot, mpos, mn, block_table, cfg, cs,
                          nm)
    last = X[jnp.arange(1), jnp.maximum(nvalid - 1, 0)]
    return logits, last, cache, mcache


def init_spec_state(k: int, cfg: Config, tokens_R, h_R, pos_R, run_R, block_table, key,
                    sharding=None):
    """The device state of a speculative stream (R request slots):
    pend_X [R, k+1, N, D] / pend_tok [R, k+1] / pend_n [R]: the MTP rows not yet run (the
      main residual at positions pos - pend_n .. pos - 1, each with the token after it;
      the last token is the one the next verify feeds), pos [R] (tokens in the cache),
    run [R] (1: the slot decodes), table [R, MAXB], key, i (step counter for the keys),
    out [R, k+1] / n_out [R]: the last step's emitted tokens and their count.
    Starts after the prefill: one pending row, (h_R [R, N, D], tokens_R [R])."""
    R = len(pos_R)
    h_R = np.asarray(h_R)
    pX = np.zeros((R, k + 1, cfg.hc_mult, cfg.hidden_size), h_R.dtype)
    pX[:, 0] = h_R
    ptok = np.zeros((R, k + 1), np.int32)
    ptok[:, 0] = np.asarray(tokens_R, np.int32)
    st = {"pend_tok": ptok, "pend_n": np.ones(R, np.int32),
          "pos": np.asarray(pos_R, np.int32), "run": np.asarray(run_R, np.int32),
          "table": np.asarray(block_table, np.int32), "i": np.asarray(1, np.int32),
          "out": np.zeros((R, k + 1), np.int32), "n_out": np.zeros(R, np.int32)}
    st["pend_X"] = pX
    st = {n: D.put_state(v, sharding) for n, v in st.items()}
    st["key"] = jax.random.wrap_key_data(D.put_state(np.asarray(jax.random.key_data(key)),
                                                     sharding), impl=jax.random.key_impl(key))
    return st


def spec_step_fn(cfg: Config, cs: CacheSpec, nm: Numerics, sampler, k: int):
    """-> run(params, cache, mcache, st) -> (cache, mcache, st'): one speculative step of
    every running slot (module docstring); st'.out / st'.n_out hold what it emitted.
    params: the flat tree (main and MTP). Jit it with cache, mcache and st donated."""
    T = k + 1

    per_row = hasattr(sampler, "draw")   # serve.sampling.RowSampler: settings in st

    def run(params, cache, mcache, st):
        R = st["pos"].shape[0]
        slots = jnp.arange(R, dtype=jnp.int32)
        runs = st["run"] > 0
        if per_row:   # a request's draws depend on its seed and token index only
            rows = {n: st[n] for n in ROW_KEYS}
            rkey = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(
                st["seed"], st["draw"])
            sub = lambda j: jax.vmap(lambda kk: jax.random.fold_in(kk, j))(rkey)

            def draft(logits, j):
                qj = row_probs(rows, logits)
                return (jax.vmap(jax.random.categorical)(sub(j + 1), jnp.log(qj))
                        .astype(jnp.int32), qj)
        else:
            key = jax.random.fold_in(st["key"], st["i"])
            kd = jax.random.split(jax.random.fold_in(key, 1), k)
            draft = lambda logits, j: draft_tokens(sampler, logits, kd[j])
        pend_n = jnp.where(runs, st["pend_n"], 0)
        pos = st["pos"]
        # 1. MTP catch-up over the pending rows; the last one drafts token pos + 1
        Xm, mcache = mtp_layer(params, mcache, st["pend_X"], st["pend_tok"], slots,
                               pos - st["pend_n"], pend_n, st["table"], cfg, cs, nm)
        last = jnp.maximum(st["pend_n"] - 1, 0)
        h = Xm[slots, last]                                                 # [R, N, D]
        tok = st["pend_tok"][slots, last]                                   # [R]
        d, q = draft(mtp_head(params, h, cfg, nm), 0)
        drafts, qs = [d], [q]
        mc = mcache   # chained drafts write a copy that is dropped
        for j in range(1, k):
            Xc, mc = mtp_layer(params, mc, h[:, None], d[:, None], slots, pos + j - 1,
                               runs.astype(jnp.int32), st["table"], cfg, cs, nm)
            h = Xc[:, 0]
            d, q = draft(mtp_head(params, h, cfg, nm), j)
            drafts.append(d)
            qs.append(q)
        drafts = jnp.stack(drafts, 1)                                       # [R, k]
        q = None if qs[0] is None else jnp.stack(qs, 1)                     # [R, k, V]
        # 2. verify [token, drafts] on the main model
        vtok = jnp.concatenate([tok[:, None], drafts], 1)                   # [R, T]
        nvalid = jnp.where(runs, T, 0).astype(jnp.int32)
        X, cache, undo = verify_layers(params, cache, vtok, pos, nvalid, st["table"], cfg, cs,
                                       nm)
        logits = M.head(params, X, cfg, nm)                                 # [R, T, V]
        # 3. accept, 4. roll back the rejected rows
        extra = {}
        if per_row:
            out, n = accept_rows(rows, logits, drafts, q, sub(k + 1), sub(k + 2))
            logp = jax.nn.log_softmax(logits.astype(F32), -1)
            top_lp, top_ids = jax.lax.top_k(logp, sampler.n_top)
            extra = dict(lp=jnp.take_along_axis(logp, out[..., None], -1)[..., 0],
                         top_ids=top_ids.astype(jnp.int32), top_lp=top_lp,
                         draw=st["draw"] + jnp.where(runs, n, 0))
        else:
            out, n = accept(sampler, logits, drafts, q, jax.random.fold_in(key, 2))
        n = jnp.where(runs, n, 0)
        cache = undo(cache, n)
        new = dict(st, **extra, pos=pos + n, i=st["i"] + 1, out=out, n_out=n,
                   pend_X=jnp.where(runs[:, None, None, None], X.astype(st["pend_X"].dtype),
                                    st["pend_X"]),
                   pend_tok=jnp.where(runs[:, None], out, st["pend_tok"]),
                   pend_n=jnp.where(runs, n, st["pend_n"]))
        return cache, mcache, new
    return run


def mtp_cache_shardings(cfg: Config, cs: CacheSpec, cache_sh: Cache, mesh):
    """The MTP cache's shardings: those of a main layer of the same ratio (same arrays),
    else replicated."""
    r = cfg.layer_ratio(cfg.num_hidden_layers)
    for i in range(cfg.num_hidden_layers):
        if cfg.layer_ratio(i) == r:
            return cache_sh[i]
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.tree.map(lambda _: rep, layer_structs(cfg, cs, cfg.num_hidden_layers))


# ---------------------------------------------------------------------------------------
# The host side (the serving scheduler drives the runner's speculative mode)
# ---------------------------------------------------------------------------------------
def _prefill(eng, prog, slot: int, prompt, h0):
    """Engine.prefill with the MTP block: chunk by chunk -> (last logits [V], last main
    residual [N, D])."""
    prompt = np.asarray(prompt, np.int32)
    eng.check_tokens(prompt)
    h, logits = h0, None
    for s in range(0, len(prompt), eng.chunk):
        part = prompt[s:s + eng.chunk]
        eng.bm.ensure(slot, s + len(part))
        buf = np.zeros((1, eng.chunk), np.int32)
        buf[0, :len(part)] = part
        logits, h, eng.cache, eng.mtp_cache = prog(
            eng.state, eng.cache, eng.mtp_cache, jnp.asarray(buf), jnp.asarray([slot], jnp.int32),
            jnp.asarray([s], jnp.int32), jnp.asarray([len(part)], jnp.int32),
            jnp.asarray(eng.bm.table), h)
        eng.bm.advance(slot, len(part))
    return logits[0], h[0]


def acceptance_report(steps, emitted) -> dict:
    """Mean tokens emitted per step (accepted drafts + 1), per request and overall."""
    per = [e / s if s else float("nan") for s, e in zip(steps, emitted)]
    tot = sum(steps)
    return {"per_request": per, "overall": sum(emitted) / tot if tot else float("nan"),
            "steps": list(steps)}
