"""The model as Flax NNX modules, for exploration and for users who live in NNX.

The modules hold the parameters (as `nnx.Param`, one per sub-layer, values exactly the
functional parameter tree) and call the same pure functions as `model.forward`, so both
give bit-identical results. The jitted decode path works on the flat dict
(`to_params()` / `nnx.split`), per STYLE.md.

    m = DeepSeekV4.from_params(cfg, params)
    logits = m(tokens)                       # [B, T, V]
    graphdef, state = nnx.split(m)           # the usual NNX split / merge
"""
from __future__ import annotations

from flax import nnx

from .config import Config
from .quant import Numerics
from . import layers as L
from . import model as M


class Block(nnx.Module):
    """One transformer block: mHC -> attention -> mHC -> MoE."""

    def __init__(self, cfg: Config, layer: int, params: dict):
        self.cfg, self.layer = cfg, layer
        self.attn = nnx.Param(L.block_params(params, "attn."))
        self.ffn = nnx.Param(L.block_params(params, "ffn."))
        self.mix = nnx.Param({k: v for k, v in params.items()
                              if not k.startswith(("attn.", "ffn."))})  # mHC + norms

    def flat(self) -> dict:
        out = dict(self.mix.get_value())
        out.update({"attn." + k: v for k, v in self.attn.get_value().items()})
        out.update({"ffn." + k: v for k, v in self.ffn.get_value().items()})
        return out

    def __call__(self, X, tokens, nm: Numerics = Numerics(), debug=None):
        """X [B, T, N, D] residual, tokens [B, T] (hash routing) -> new residual."""
        ratio = self.cfg.layer_ratio(self.layer)
        attn = lambda ap, x, xq=None: L.attention_prefill(ap, x, self.cfg, nm, ratio, debug,
                                                          xq=xq)
        return M.block(self.flat(), X, tokens, self.layer, self.cfg, nm, attn, debug)


class DeepSeekV4(nnx.Module):
    def __init__(self, cfg: Config, params: dict):
        self.cfg = cfg
        self.embed = nnx.Param(params["embed.weight"])
        self.layers = nnx.List([Block(cfg, i, L.block_params(params, f"layers.{i}."))
                                for i in range(cfg.num_hidden_layers)])
        self.head = nnx.Param({k: params[k] for k in
                               ("norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale",
                                "head.weight")})
        self.mtp = nnx.Param({k: v for k, v in params.items() if k.startswith("mtp.")})

    @classmethod
    def from_params(cls, cfg: Config, params: dict) -> "DeepSeekV4":
        return cls(cfg, params)

    def to_params(self) -> dict:
        """The flat functional parameter tree (same arrays, no copies)."""
        out = {"embed.weight": self.embed.get_value(), **self.head.get_value(), **self.mtp.get_value()}
        for i, b in enumerate(self.layers):
            out.update({f"layers.{i}." + k: v for k, v in b.flat().items()})
        return out

    def __call__(self, tokens, nm: Numerics = Numerics(), debug=None):
        """tokens [B, T] -> logits [B, T, V] f32 (whole sequence from position 0)."""
        p = {"embed.weight": self.embed.get_value(), **self.head.get_value()}
        X = M.embed(p, tokens, self.cfg, nm)
        for i, b in enumerate(self.layers):
            ldbg = {} if debug is not None else None
            X = b(X, tokens, nm, ldbg)
            if debug is not None:
                ldbg["X"] = X
                debug[i] = ldbg
        return M.head(p, X, self.cfg, nm)
