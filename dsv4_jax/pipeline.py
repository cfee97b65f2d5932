"""Layers split across devices: the multi-GPU layout for small batches.

Expert parallelism reads every attention weight on every device and all-reduces each layer;
at batch 1 that makes two GPUs slower than one. Here device s holds the consecutive layers
[bounds[s], bounds[s+1]) and their cache (the first also the embedding, the last the head
and the MTP block), so each weight byte is read on one device only. A step runs stage by
stage: one jitted program per device, and between stages the residual X [B, T, N, D]
(32 KB at B=1) moves device to device with `jax.device_put`, as does the small step state
(tokens, positions, block table). Nothing waits on the host: the stages are enqueued back
to back and each device starts when its input arrives.

At batch 1 the stages run one after another, so a token takes the sum of the stages' times:
the floor is every byte of the model read once at one device's bandwidth. Larger batches
would overlap stages on different micro-batches; this layout does not (yet).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .cache import Cache, CacheSpec, init_cache as full
from .config import Config
from .decode import step_head, step_layers
from .quant import Numerics
from . import model as M
from . import param_specs as PS

_FIRST = ("embed.",)
_LAST = ("norm.", "hc_head_", "head.", "mtp.")


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """Stage s runs layers range(bounds[s], bounds[s + 1]) on devices[s]."""
    bounds: tuple[int, ...]
    devices: tuple

    def __post_init__(self):
        b = self.bounds
        if len(b) != len(self.devices) + 1 or b[0] != 0 or any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError(f"Pipeline: bounds {b} must rise from 0 with one stage (at least "
                             f"one layer) per device ({len(self.devices)} devices)")

    @property
    def n(self) -> int:
        return len(self.devices)

    def layers(self, s: int) -> range:
        return range(self.bounds[s], self.bounds[s + 1])

    def stage_of(self, key: str | int) -> int:
        """The stage holding parameter `key` (or layer `key`'s cache, an int)."""
        if isinstance(key, int):
            i = key
        elif key.startswith(_FIRST):
            return 0
        elif key.startswith(_LAST):
            return self.n - 1
        else:
            i = int(key.split(".")[1])
        return int(np.searchsorted(self.bounds, i, side="right")) - 1

    @classmethod
    def balanced(cls, cfg: Config, devices, stages: int | None = None) -> "Pipeline":
        """Layers split so that each device holds about the same parameter bytes (the
        embedding counts toward the first stage, the head and MTP block toward the last).
        stages: how many stages the caller asked for; fewer devices than that (a slice of
        jax.devices() past its end) is an error, not a shorter pipeline."""
        devices = tuple(devices)
        n, L = len(devices), cfg.num_hidden_layers
        if stages is not None and n != stages:
            raise ValueError(f"Pipeline: {stages} stages asked for, and {n} "
                             f"device{'s' * (n != 1)} given ({len(jax.devices())} visible)")
        if not 1 <= n <= L:
            raise ValueError(f"Pipeline: {n} devices for {L} layers")
        sizes = _stored_bytes(cfg)
        cum = sizes["first"] + np.cumsum([sizes[i] for i in range(L)])  # through layer i
        total = cum[-1] + sizes["last"]
        bounds = [0]
        for s in range(1, n):   # stage s starts after the layer that crosses s/n of the bytes
            b = int(np.searchsorted(cum, s * total / n)) + 1
            bounds.append(min(max(b, bounds[-1] + 1), L - (n - s)))
        return cls(tuple(bounds) + (L,), devices)

    def param_shardings(self, cfg: Config, include_mtp: bool = True,
                        x_proj_merged: bool = False) -> dict:
        """name -> sharding tree (each leaf on its stage's device), shaped like
        params.abstract_params: draw or load each array straight onto its device."""
        return {k: jax.tree.map(lambda _, k=k: self.sharding(self.stage_of(k)), v)
                for k, v in PS.abstract_params(cfg, include_mtp, x_proj_merged).items()}

    def sharding(self, s: int):
        return jax.sharding.SingleDeviceSharding(self.devices[s])


def _stored_bytes(cfg: Config) -> dict:
    """Parameter bytes by layer (int keys), of the embedding ("first") and of the head and
    MTP block ("last")."""
    out = {"first": 0, "last": 0}
    for k, v in PS.abstract_params(cfg, include_mtp=True).items():
        b = sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(v))
        key = (int(k.split(".")[1]) if k.startswith("layers.") else
               "first" if k.startswith(_FIRST) else "last")
        out[key] = out.get(key, 0) + b
    return out


def split_params(params: dict, pipe: Pipeline) -> list[dict]:
    """Flat parameter tree -> one tree per stage, each array on its stage's device (a
    no-op move for arrays already there)."""
    parts = [{} for _ in range(pipe.n)]
    for k, v in params.items():
        parts[pipe.stage_of(k)][k] = v
    return [jax.device_put(p, pipe.devices[s]) for s, p in enumerate(parts)]


def init_cache(cfg: Config, cs: CacheSpec, pipe: Pipeline) -> list[Cache]:
    """The empty cache as one Cache per stage (its layers, Cache.part), each made on its
    stage's device."""
    make = lambda s: jax.jit(lambda: full(cfg, cs).part(pipe.layers(s)),
                             out_shardings=pipe.sharding(s))()
    return [make(s) for s in range(pipe.n)]


def stage_fn(cfg: Config, cs: CacheSpec, nm: Numerics, pipe: Pipeline, s: int):
    first, last = s == 0, s == pipe.n - 1

    def run(p, cache, X, tokens, slots, pos, nvalid, table):
        if first:
            X = M.embed(p, tokens, cfg, nm)
        X, cache = step_layers(p, cache, X, tokens, slots, pos, nvalid, table, pipe.layers(s),
                               cfg, cs, nm)
        return (step_head(p, X, nvalid, cfg, nm) if last else X), cache
    return run


class PipelineStep:
    """step(params list, caches list, tokens [B, T], slots, pos, nvalid [B], table) ->
    (logits [B, V] f32, caches list): decode.step run stage by stage. progs[s]: stage s's
    jitted stage_fn, its cache donated (programs.step_program builds them)."""

    def __init__(self, pipe: Pipeline, progs):
        self.pipe, self.progs = pipe, list(progs)

    def __call__(self, params, caches, tokens, slots, pos, nvalid, table):
        X, new = None, []
        for s, dev in enumerate(self.pipe.devices):
            inputs = jax.device_put((X, tokens, slots, pos, nvalid, table), dev)
            X, c = self.progs[s](params[s], caches[s], *inputs)
            new.append(c)
        return X, new

    def compile(self, params, caches, tokens, slots, pos, nvalid, table):
        """Every stage compiled ahead of time for these arguments' shapes -> (a
        PipelineStep of the compiled stages, each stage's optimised HLO text). This one is
        left as it is (programs.py memoises it)."""
        X, exes = None, []
        for s in range(self.pipe.n):
            args = _placed((params[s], caches[s], X, tokens, slots, pos, nvalid, table),
                           self.pipe.sharding(s))
            exes.append(self.progs[s].lower(*args).compile())
            X = jax.eval_shape(self.progs[s], *args)[0]
        return PipelineStep(self.pipe, exes), [e.as_text() for e in exes]


class PipelineStream:
    """stream(params list, caches list, st) -> (caches list, st'): the stream step
    (decode.stream_step_fn) with the layers split across devices. st lives on the last
    device, where the next tokens are sampled; the earlier stages read a copy. progs: the
    jitted stage_fn of every stage but the last; last: the last stage's stream step
    ((params, X), cache, st) -> (cache, st') (programs.decode_program builds them)."""

    def __init__(self, pipe: Pipeline, progs, last):
        self.pipe, self.progs, self.last = pipe, list(progs), last
        self._slots = {}   # stage -> arange(R) on its device

    def __call__(self, params, caches, st):
        R = st["tok"].shape[0]
        X, new = None, []
        for s in range(self.pipe.n - 1):
            dev = self.pipe.devices[s]
            if s not in self._slots:
                self._slots[s] = jax.device_put(jnp.arange(R, dtype=jnp.int32), dev)
            tok, pos, nvalid, table, X = jax.device_put(
                (st["tok"], st["pos"], st["nvalid"], st["table"], X), dev)
            X, c = self.progs[s](params[s], caches[s], X, tok, self._slots[s], pos, nvalid,
                                 table)
            new.append(c)
        X = jax.device_put(X, self.pipe.devices[-1])
        c, st = self.last((params[-1], X), caches[-1], st)
        return new + [c], st

    def compile(self, params, caches, st):
        """As PipelineStep.compile, for the stream step: -> (a compiled PipelineStream,
        texts)."""
        R = st["tok"].shape[0]
        slots = jax.ShapeDtypeStruct((R,), jnp.int32)
        X, exes = None, []
        for s in range(self.pipe.n - 1):
            args = _placed((params[s], caches[s], X, st["tok"], slots, st["pos"],
                            st["nvalid"], st["table"]), self.pipe.sharding(s))
            exes.append(self.progs[s].lower(*args).compile())
            X = jax.eval_shape(self.progs[s], *args)[0]
        last = self.last.lower(*_placed(((params[-1], X), caches[-1], st),
                                         self.pipe.sharding(self.pipe.n - 1))).compile()
        return PipelineStream(self.pipe, exes, last), [e.as_text() for e in exes + [last]]


def _placed(tree, sharding):
    """Abstract values of `tree` as they sit on one stage's device."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                        tree)
