"""Speculative decoding with the DSpark drafter of V4-Flash-0731 (dspark.py) as a mode of
the ModelRunner (`runner.set_mode(DSpark())`; docs/SPECULATIVE.md, "DSpark").

G = cfg.dspark_block_size drafts a step. Each step is one jitted program (`step_fn`) over
every request slot, on the runner's device decode state:
  1. Draft: the block [anchor, noise x (G-1)] at P .. P+G-1 through the drafter's stages
     against its window rings (dspark.draft); the Markov head draws d_1..d_G one position
     after another, each row with its own sampling settings and keys; q (each position's
     distribution, speculative.row_probs) enters the acceptance rule.
  2. Verify: [anchor, d_1..d_G] at P .. P+G (G + 1 rows) through the main model
     (speculative.verify_layers), the residuals after the drafter's target layers
     captured. With the kernels on, each layer's attention takes the G + 1 rows in parts
     of at most decode.KERNEL_ROWS (speculative.split_attention): the kernels take at most
     KERNEL_ROWS rows a request (at most one compressed CSA entry completes per part), and
     a part that follows another attends the cache as the one before wrote it, so the
     result is that of G + 1 one-row steps. The rest of each layer (mHC, the MoE) runs
     once on all G + 1 rows, and the cache is read through the kernels, not gathered
     whole as the XLA path does. Kernels off: one XLA pass of G + 1 rows (the prefill path).
  3. Accept (speculative.accept_rows): greedy rows keep the drafts equal to the target's
     argmax and take its next argmax; sampled rows the standard rule (output distributed
     as without speculation). n = a + 1 tokens are emitted.
  4. Roll back the rejected rows' cache writes (verify_layers' undo), commit the kept rows
     [anchor, d_1..d_a] (their captured hidden states) into the rings, and the last
     emitted token (the bonus) becomes the next anchor at P + n.
A prefill chunk also commits its prompt rows into the rings (`prefill_fn`).

The decode state (on the device, donated to each step): the runner's common entries (pos,
run, table, draw, the sampling rows), anchor [R], out / lp [R, G+1], n_out [R], top_ids /
top_lp [R, G+1, K], conf [R, G] (the confidence head's estimate per draft), and the
drafter's rings dsp_kv [S, R, W, K], dsp_pos [R, W].
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from . import decode as D
from . import dspark as DS
from . import model as M
from . import speculative as SP
from .cache import CacheSpec
from .config import Config
from .quant import Numerics
from .serve.sampling import ROW_KEYS, draw_rows


@dataclasses.dataclass(frozen=True)
class DSpark:
    """The runner's DSpark mode: the V4-Flash-0731 drafter's block of dspark_block_size
    drafts verified per step (its programs: programs.verify_programs)."""


F32 = jnp.float32


def check(cfg: Config, params=None) -> None:
    """Clear errors before any heavy work: a DSpark config (dspark.check_dspark), a window
    that holds the G + 1 verify rows in distinct ring slots, and (given) parameters that
    hold the drafter."""
    DS.check_dspark(cfg)
    G = cfg.dspark_block_size
    if cfg.sliding_window <= G:
        raise ValueError(f"DSpark speculation verifies {G + 1} rows a step and needs "
                         f"sliding_window > {G}, got {cfg.sliding_window}")
    if params is not None and "mtp.0.main_proj" not in params:
        raise ValueError("DSpark speculation drafts with the DSpark drafter, and these "
                         "parameters have none (no `mtp.0.main_proj`)")


def attn_rows(cs: CacheSpec) -> int:
    """Rows per attention call of the verify: the kernels' limit when they run."""
    return D.KERNEL_ROWS if cs.kernels != "off" else 0


def decode_state(cfg: Config, R: int, nm: Numerics, n_top: int) -> dict:
    """The DSpark entries of the runner's decode state (numpy, see the module docstring)."""
    G = cfg.dspark_block_size
    T = G + 1
    S, W, K = cfg.dspark_num_stages, cfg.sliding_window, cfg.head_dim
    return {"run": np.zeros(R, np.int32), "anchor": np.zeros(R, np.int32),
            "out": np.zeros((R, T), np.int32), "n_out": np.zeros(R, np.int32),
            "lp": np.zeros((R, T), np.float32),
            "top_ids": np.zeros((R, T, n_top), np.int32),
            "top_lp": np.zeros((R, T, n_top), np.float32),
            "conf": np.zeros((R, G), np.float32),
            "dsp_kv": np.zeros((S, R, W, K), nm.jdtype),
            "dsp_pos": np.full((R, W), -1, np.int32)}


def row_draw(rows):
    """The draft draw of per-row sampling: rows {name: [R]} -> draw(logits [R, V], keys
    [R]) -> (token [R] int32, q [R, V]). A greedy row's q is its one-hot argmax."""
    def draw(logits, keys):
        q = SP.row_probs(rows, logits)
        return jax.vmap(jax.random.categorical)(keys, jnp.log(q)).astype(jnp.int32), q
    return draw


def draft_and_accept(params, base_logits, anchor, target_logits, rows, keys, cfg: Config):
    """Steps 1 (the Markov draws) and 3 (the acceptance) on given logits, for every row:
    base_logits [R, G, V] (the drafter head's, before the Markov bias), anchor [R],
    target_logits [R, G+1, V] (the main model at [anchor, d_1..d_G]; a test fixes them),
    keys [R] (each row's step key) -> (drafts [R, G], q [R, G, V], out [R, G+1], n [R])."""
    sub = lambda j: jax.vmap(lambda kk: jax.random.fold_in(kk, j))(keys)
    drafts, _, q, _ = DS.markov_sample(params, base_logits, anchor, cfg, row_draw(rows),
                                       key=sub(1))
    out, n = SP.accept_rows(rows, target_logits, drafts, q, sub(2), sub(3))
    return drafts, q, out, n


# ---------------------------------------------------------------------------------------
# The programs
# ---------------------------------------------------------------------------------------
def prefill_fn(params, cache, kv, rpos, tokens, slot, pos, nvalid, block_table, rows, draws,
               cfg: Config, cs: CacheSpec, nm: Numerics, n_top: int):
    """One prefill chunk of one request (tokens [1, C] at pos [1], nvalid [1] real, slot
    [1]) with its rows committed into the drafter's rings kv [S, R, W, K] / rpos [R, W]
    (a chunk at position 0 first empties the slot's rings) -> (cache, kv, rpos, the
    sampled outputs at its last row: serve.sampling.draw_rows)."""
    ids = cfg.dspark_target_layer_ids
    X = M.embed(params, tokens, cfg, nm)
    X, cache, hs = D.step_layers(params, cache, X, tokens, slot, pos, nvalid, block_table,
                                 range(cfg.num_hidden_layers), cfg, cs, nm, capture=ids)
    logits = D.step_head(params, X, nvalid, cfg, nm)
    C = tokens.shape[1]
    ring = DS.clear({"kv": kv[:, slot], "pos": rpos[slot]}, pos == 0)
    tp = pos[:, None] + jnp.arange(C)[None, :]
    ring = DS.commit(params, ring, DS.target_hidden(hs, nm.jdtype), tp,
                     jnp.arange(C)[None, :] < nvalid[:, None], cfg, nm)
    kv = kv.at[:, slot].set(ring["kv"].astype(kv.dtype))
    rpos = rpos.at[slot].set(ring["pos"])
    return cache, kv, rpos, draw_rows(logits, rows, draws, n_top=n_top)


def step_fn(cfg: Config, cs: CacheSpec, nm: Numerics, n_top: int):
    """-> run(params, cache, st) -> (cache, st'): one DSpark step of every running slot of
    the decode state (module docstring); st'.out / st'.n_out hold what it emitted.
    params: the flat tree (the main model and the drafter). Jit it with cache and st
    donated."""
    G = cfg.dspark_block_size
    T = G + 1
    ids = cfg.dspark_target_layer_ids
    split = attn_rows(cs)

    def run(params, cache, st):
        R = st["pos"].shape[0]
        runs = st["run"] > 0
        rows = {n: st[n] for n in ROW_KEYS}
        # a request's draws depend on its seed and token index only
        rkey = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(
            st["seed"], st["draw"])
        sub = lambda j: jax.vmap(lambda kk: jax.random.fold_in(kk, j))(rkey)
        pos, anchor = st["pos"], st["anchor"]
        rings = {"kv": st["dsp_kv"], "pos": st["dsp_pos"]}
        # 1. draft G tokens at P+1 .. P+G
        with jax.named_scope("dspark_draft"):
            d = DS.draft(params, rings, anchor, pos, cfg, nm, draw=row_draw(rows), key=sub(1))
        drafts = d["tokens"]                                               # [R, G]
        # 2. verify [anchor, drafts] at P .. P+G
        vtok = jnp.concatenate([anchor[:, None], drafts], 1)                # [R, T]
        nvalid = jnp.where(runs, T, 0).astype(jnp.int32)
        X, cache, undo, hs = SP.verify_layers(params, cache, vtok, pos, nvalid, st["table"],
                                              cfg, cs, nm, attn_rows=split, capture=ids)
        logits = M.head(params, X, cfg, nm)                                 # [R, T, V]
        # 3. accept, 4. roll back the rejected rows, commit the kept ones into the rings
        out, n = SP.accept_rows(rows, logits, drafts, d["q"], sub(2), sub(3))
        n = jnp.where(runs, n, 0)
        cache = undo(cache, n)
        with jax.named_scope("dspark_commit"):
            tp = pos[:, None] + jnp.arange(T)[None, :]
            rings = DS.commit(params, rings, DS.target_hidden(hs, nm.jdtype), tp,
                              jnp.arange(T)[None, :] < n[:, None], cfg, nm)
        logp = jax.nn.log_softmax(logits.astype(F32), -1)
        top_lp, top_ids = jax.lax.top_k(logp, n_top)
        bonus = out[jnp.arange(R), jnp.maximum(n - 1, 0)]
        new = dict(st, pos=pos + n, draw=st["draw"] + n, out=out, n_out=n,
                   lp=jnp.take_along_axis(logp, out[..., None], -1)[..., 0],
                   top_ids=top_ids.astype(jnp.int32), top_lp=top_lp,
                   conf=jnp.where(runs[:, None], d["confidence"], st["conf"]),
                   anchor=jnp.where(runs, bonus, anchor),
                   dsp_kv=rings["kv"].astype(st["dsp_kv"].dtype), dsp_pos=rings["pos"])
        return cache, new
    return run
