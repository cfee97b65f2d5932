"""The model as a Flax NNX module, and its compiled programs.

`DeepSeekV4` holds the parameters (`nnx.Param`, one group per sub-layer, values exactly
the arrays of the flat parameter tree) and exposes the three ways the model runs:

    m = DeepSeekV4.from_params(cfg, params)
    logits = m(tokens)                                   # whole sequence [B, T] -> [B, T, V]
    logits, cache = m.prefill(cache, chunk, slot, pos, nvalid, block_table, cs=cs, nm=nm)
    logits, cache = m.decode_step(cache, tokens, slots, pos, nvalid, block_table, cs=cs, nm=nm)

Each calls the same pure functions as the functional API (model.forward, decode.step),
so both give bit-identical results. The compiled programs are `jax.jit` over the split
module: the graph definition is static, the parameter state and the cache are arguments
and the cache is donated (programs.py, for every layout). One XLA program per step.
"""
from __future__ import annotations

import jax
from flax import nnx

from .config import Config
from .cache import CacheSpec
from .quant import Numerics
from . import decode as D
from . import layers as L
from . import model as M
from . import params as P

HEAD_KEYS = ("norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale", "head.weight")


class Block(nnx.Module):
    """One transformer block: mHC -> attention -> mHC -> MoE. Parameters as three groups:
    `attn` (names under "attn."), `ffn` (under "ffn."), `mix` (mHC mixing and norms)."""

    def __init__(self, cfg: Config, layer: int, params: dict):
        self.cfg, self.layer = cfg, layer
        self.attn = nnx.Param(P.block_params(params, "attn."))
        self.ffn = nnx.Param(P.block_params(params, "ffn."))
        self.mix = nnx.Param({k: v for k, v in params.items()
                              if not k.startswith(("attn.", "ffn."))})

    def flat(self) -> dict:
        """The block's parameters by name relative to the block (same arrays)."""
        out = dict(self.mix.get_value())
        out.update({"attn." + k: v for k, v in self.attn.get_value().items()})
        out.update({"ffn." + k: v for k, v in self.ffn.get_value().items()})
        return out

    def __call__(self, X, tokens, nm: Numerics = Numerics(), debug=None):
        """X [B, T, N, D] residual, tokens [B, T] (hash routing) -> new residual."""
        ratio = self.cfg.layer_ratio(self.layer)
        attn = lambda ap, x, xq=None: (L.attention_prefill(ap, x, self.cfg, nm, ratio, debug,
                                                           xq=xq), None)
        return M.block(self.flat(), X, tokens, self.layer, self.cfg, nm, attn, debug)[0]


class DeepSeekV4(nnx.Module):
    """The whole model: embedding, `layers` (Block), head, and the MTP block's parameters
    (`mtp`: the draft model of speculative decoding, speculative.py; no plain step runs
    it)."""

    def __init__(self, cfg: Config, params: dict):
        self.cfg = cfg
        self.embed = nnx.Param(params["embed.weight"])
        self.layers = nnx.List([Block(cfg, i, P.block_params(params, f"layers.{i}."))
                                for i in range(cfg.num_hidden_layers)])
        self.head = nnx.Param({k: params[k] for k in HEAD_KEYS})
        self.mtp = nnx.Param({k: v for k, v in params.items() if k.startswith("mtp.")})

    @classmethod
    def from_params(cls, cfg: Config, params: dict) -> "DeepSeekV4":
        """From a flat parameter tree (params.init_params, loading.load; described or in
        decode form, params.merge_x_proj). The arrays are shared, not copied."""
        return cls(cfg, params)

    def to_params(self) -> dict:
        """The flat functional parameter tree (same arrays, no copies)."""
        out = {"embed.weight": self.embed.get_value(), **self.head.get_value(),
               **self.mtp.get_value()}
        for i, b in enumerate(self.layers):
            out.update({f"layers.{i}." + k: v for k, v in b.flat().items()})
        return out

    # ---- whole sequence ----------------------------------------------------------------
    def forward(self, tokens, nm: Numerics = Numerics(), debug=None):
        """tokens [B, T] -> logits [B, T, V] f32 (whole sequence from position 0, no
        cache). debug: a dict filled per layer with intermediate values."""
        p = {"embed.weight": self.embed.get_value(), **self.head.get_value()}
        X = M.embed(p, tokens, self.cfg, nm)
        for i, b in enumerate(self.layers):
            ldbg = {} if debug is not None else None
            with jax.named_scope(f"layer{i}_{self.cfg.layer_kind(i)}"):
                X = b(X, tokens, nm, ldbg)
            if debug is not None:
                ldbg["X"] = X
                debug[i] = ldbg
        return M.head(p, X, self.cfg, nm)

    __call__ = forward

    # ---- with the paged cache ----------------------------------------------------------
    def step(self, cache, tokens, slots, pos, nvalid, block_table, *, cs: CacheSpec,
             nm: Numerics):
        """T new tokens for each of B batch rows against the cache (decode.step): tokens
        [B, T] int32, slots / pos / nvalid [B] int32, block_table [R, MAXB] int32 ->
        (logits [B, V] f32 at each row's last valid token, new cache)."""
        return D.step(self.to_params(), cache, tokens, slots, pos, nvalid, block_table,
                      self.cfg, cs, nm)

    def prefill(self, cache, tokens, slot, pos, nvalid, block_table, *, cs: CacheSpec,
                nm: Numerics):
        """One prefill chunk of one request: tokens [1, T] (the first nvalid[0] real),
        slot / pos / nvalid [1] -> (logits [1, V] after the last real token, new cache)."""
        return self.step(cache, tokens, slot, pos, nvalid, block_table, cs=cs, nm=nm)

    def decode_step(self, cache, tokens, slots, pos, nvalid, block_table, *, cs: CacheSpec,
                    nm: Numerics):
        """One decode step of every request slot: tokens [R, 1], slots = arange(R), pos [R]
        (each slot's position), nvalid [R] (1 = the slot runs, 0 = it idles) ->
        (logits [R, V], new cache)."""
        return self.step(cache, tokens, slots, pos, nvalid, block_table, cs=cs, nm=nm)


# ---------------------------------------------------------------------------------------
# Compiled programs over the split module: nnx.split(model) -> (graphdef, state)
# ---------------------------------------------------------------------------------------
def apply_step(graphdef, state, cache, tokens, slots, pos, nvalid, block_table, *,
               cs: CacheSpec, nm: Numerics):
    """DeepSeekV4.step of the module nnx.merge(graphdef, state): the pure function the
    step programs compile."""
    return nnx.merge(graphdef, state).step(cache, tokens, slots, pos, nvalid, block_table,
                                           cs=cs, nm=nm)


def state_of(cfg: Config, tree: dict):
    """The module state for a flat tree of any leaves (arrays, shardings, structs): e.g. the
    state's shardings from sharding.param_shardings."""
    return nnx.split(DeepSeekV4.from_params(cfg, tree))[1]
