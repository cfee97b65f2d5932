"""The compiled programs of the model: one builder per program kind, each valid for every
layout. Everything that jits the model's step is here; the modules below provide the
pure functions (decode.step, the sharded / tensor / staged forms, the speculative bodies).

    lay = Layout(cfg)                                  # one device
    lay = Layout(cfg, mesh=mesh, ...)                  # a mesh (expert / data / model axes)
    lay = Layout(cfg, mesh=make_tensor_mesh(n))        # the tensor layout
    lay = Layout(cfg, pipeline=pipe)                   # layers split over devices
    lay = Layout.of(cfg, params, mesh=..., pipeline=...)   # the form from the tree

    step_program(lay, graphdef, cs, nm)                # a prefill chunk / a raw step
        (state, cache, tokens [B, T], slots / pos / nvalid [B], table [R, MAXB])
        -> (logits [B, V] f32, cache)
    step_program(lay, graphdef, cs, nm, n_top=K)       # the same, sampled per row
        (..., table, rows {name: [B]}, draws [B]) -> (cache, serve.sampling outputs)
    decode_program(lay, graphdef, cs, nm, sampler)     # the stream step on a device state
        (state, cache, st) -> (cache, st')
    decode_program(lay, graphdef, cs, nm, sampler, steps=N)   # N of them in one program
    verify_programs(lay, graphdef, cs, nm, sampler, spec)   # MTP Speculation(k) or DSpark()
        -> (prefill, step), speculative.py / dspark_runner.py signatures
    generate_loop(lay, graphdef, cs, nm, cap)          # Engine.generate's fused loop (one device)

`state` is the module state of nnx.split(DeepSeekV4.from_params(cfg, params)) (a list of
stage trees for a pipeline: pipeline.split_params); `split(cfg, params)` makes the pair.
Caches and decode states are donated; every program compiles once per argument shapes.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .cache import CacheSpec
from .config import Config
from .decode import STEP_COMPILER_OPTIONS, multi_step_fn, stream_step_fn
from .nnx_model import DeepSeekV4, apply_step
from .param_specs import x_proj_is_merged
from .quant import Numerics
from .serve.sampling import draw_rows, draw_tokens, sample_rows
from . import distributed as dist
from . import dspark_runner as DR
from . import pipeline as PL
from . import sharding as SH
from . import speculative as SP

OPTS = dict(compiler_options=STEP_COMPILER_OPTIONS)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the model runs. mesh None and pipeline None: one device. A mesh: GSPMD with
    expert parallelism (data-parallel where the batch splits, distributed.py), or the
    tensor layout for a tensor mesh (distributed.make_tensor_mesh). include_mtp /
    x_proj_merged: the parameter tree's form on a mesh (its shardings follow the tree)."""
    cfg: Config
    mesh: Mesh | None = None
    pipeline: PL.Pipeline | None = None
    include_mtp: bool = True
    x_proj_merged: bool = True

    def __post_init__(self):
        if self.mesh is not None and self.pipeline is not None:
            raise ValueError("a layout has a mesh or a pipeline, not both")

    @classmethod
    def of(cls, cfg: Config, params: dict, mesh=None, pipeline=None) -> "Layout":
        """The layout of a parameter tree on a mesh / pipeline (its form read off the keys)."""
        if mesh is None:
            return cls(cfg, pipeline=pipeline)
        return cls(cfg, mesh=mesh, include_mtp=any(k.startswith("mtp.") for k in params),
                   x_proj_merged=x_proj_is_merged(params))

    @property
    def kind(self) -> str:
        """"single", "mesh", "tensor" or "pipeline"."""
        if self.pipeline is not None:
            return "pipeline"
        if self.mesh is None:
            return "single"
        return "tensor" if dist.is_tensor_mesh(self.mesh) else "mesh"

    def replicated(self):
        return None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())

    def state_sharding(self):
        """Where the small inputs and the decode state live."""
        if self.pipeline is not None:
            return self.pipeline.sharding(self.pipeline.n - 1)
        return self.replicated()


def split(cfg: Config, params: dict):
    """A flat parameter tree (arrays or ShapeDtypeStructs) -> (graphdef, state)."""
    return nnx.split(DeepSeekV4.from_params(cfg, params))


def _step_fn(lay: Layout, graphdef, cs: CacheSpec, nm: Numerics):
    """The unjitted step of a non-pipeline layout: (state, cache, tokens, slots, pos,
    nvalid, table) -> (logits, cache)."""
    if lay.kind == "single":
        return functools.partial(apply_step, graphdef, cs=cs, nm=nm)
    if lay.kind == "tensor":
        stp = dist.tensor_step_fn(lay.cfg, cs, nm, lay.mesh)
        return lambda state, *a: stp(nnx.merge(graphdef, state).to_params(), *a)
    apply = lambda state, *a: apply_step(graphdef, state, *a[:-1], cs=a[-1], nm=nm)
    return dist.data_parallel_step_fn(lay.cfg, cs, nm, lay.mesh, apply)[0]


def _shardings(lay: Layout, cs: CacheSpec):
    """(state, cache) shardings of a mesh layout (the tensor layout: state as placed by
    shard_tensor_params, i.e. not given; the cache replicated)."""
    rep = lay.replicated()
    if lay.kind == "tensor":
        return None, rep
    return (dist.state_shardings(lay.cfg, lay.mesh, lay.include_mtp, lay.x_proj_merged),
            SH.cache_shardings(lay.cfg, cs, lay.mesh))


def _jit(lay: Layout, fn, cs: CacheSpec, n_small: int, outs: str, donate, head=("s", "c")):
    """jit fn with the layout's shardings. head: the leading arguments ("s" state, "c" the
    cache, "m" the MTP cache), then n_small replicated ones; outs: the outputs, "r"
    replicated, "c" / "m" as the caches."""
    if lay.mesh is None:
        return jax.jit(fn, donate_argnums=donate, **OPTS)
    rep = lay.replicated()
    ssh, csh = _shardings(lay, cs)
    msh = SP.mtp_cache_shardings(lay.cfg, cs, csh, lay.mesh) if lay.kind == "mesh" else rep
    by = {"s": ssh, "c": csh, "m": msh, "r": rep}
    ins = tuple(by[h] for h in head) + (rep,) * n_small
    kw = {} if ssh is None else dict(in_shardings=ins)
    return jax.jit(fn, donate_argnums=donate, out_shardings=tuple(by[o] for o in outs),
                   **kw, **OPTS)


# ---------------------------------------------------------------------------------------
# 1. The step: a prefill chunk, or any tokens [B, T] against the cache
# ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def step_program(lay: Layout, graphdef, cs: CacheSpec, nm: Numerics, n_top: int | None = None):
    """The cached step (see the module docstring); n_top: sampled per row in the same
    program (serve.sampling: the tokens, their log-probabilities and the n_top best).
    graphdef None for a pipeline (its stages are pure functions of their trees)."""
    if lay.kind == "pipeline":
        pipe = lay.pipeline
        progs = [jax.jit(PL.stage_fn(lay.cfg, cs, nm, pipe, s), donate_argnums=(1,), **OPTS)
                 for s in range(pipe.n)]
        step = PL.PipelineStep(pipe, progs)
        if n_top is None:
            return step

        def sampled(state, cache, tokens, slots, pos, nvalid, table, rows, draws):
            logits, cache = step(state, cache, tokens, slots, pos, nvalid, table)
            return cache, sample_rows(logits, rows, draws, n_top=n_top)
        return sampled
    stp = _step_fn(lay, graphdef, cs, nm)
    if n_top is None:
        prog = _jit(lay, stp, cs, 5, "rc", (1,))
        groups = dist.data_groups(cs, lay.mesh) if lay.kind == "mesh" else 1
        return prog if groups == 1 else DataParallelStep(prog, cs, groups)

    def sampled_step(state, cache, tokens, slots, pos, nvalid, table, rows, draws):
        logits, cache = stp(state, cache, tokens, slots, pos, nvalid, table)
        return cache, draw_rows(logits, rows, draws, n_top=n_top)
    return _jit(lay, sampled_step, cs, 7, "cr", (1,))


class DataParallelStep:
    """A mesh's step whose batch splits over "data" (distributed.data_parallel_step_fn):
    called with host slot arrays, it first checks that each chunk of rows uses its own
    group's slots (no device synchronisation). Everything else is the jitted program's."""

    def __init__(self, jitted, cs: CacheSpec, groups: int):
        self.jitted, self.cs, self.groups = jitted, cs, groups

    def __call__(self, state, cache, tokens, slots, *rest):
        if isinstance(slots, np.ndarray):
            dist.check_data_parallel_batch(slots, self.cs, self.groups)
        return self.jitted(state, cache, tokens, slots, *rest)

    def __getattr__(self, name):
        return getattr(self.jitted, name)


# ---------------------------------------------------------------------------------------
# 2. The decode step on a device-resident state (decode.stream_step_fn)
# ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def decode_program(lay: Layout, graphdef, cs: CacheSpec, nm: Numerics, sampler,
                   steps: int = 1):
    """(state, cache, st) -> (cache, st'): one decode step of every running slot of st,
    the next tokens sampled in the program (sampler: a generate.py sampler or
    serve.sampling.RowSampler); the cache and st donated, so nothing moves between steps.
    A pipeline samples on its last stage's device, where st lives. steps > 1 (RowSampler,
    not a pipeline): that many steps in the program (decode.multi_step_fn)."""
    if steps > 1:
        if lay.kind == "pipeline" or not hasattr(sampler, "draw"):
            raise ValueError("several decode steps a program run with the per-row sampler "
                             "on one device or a mesh, not a pipeline layout")
        fn = multi_step_fn(stream_step_fn(_step_fn(lay, graphdef, cs, nm), sampler), steps)
        return _jit(lay, fn, cs, 1, "cr", (1, 2))
    if lay.kind == "pipeline":
        pipe = lay.pipeline
        fns = [PL.stage_fn(lay.cfg, cs, nm, pipe, s) for s in range(pipe.n)]
        progs = [jax.jit(f, donate_argnums=(1,), **OPTS) for f in fns[:-1]]
        last = fns[-1]
        lastp = jax.jit(stream_step_fn(lambda pX, c, *a: last(pX[0], c, pX[1], *a), sampler),
                        donate_argnums=(1, 2), **OPTS)
        return PL.PipelineStream(pipe, progs, lastp)
    return _jit(lay, stream_step_fn(_step_fn(lay, graphdef, cs, nm), sampler), cs, 1, "cr",
                (1, 2))


# ---------------------------------------------------------------------------------------
# 3. Speculative decoding: the draft + verify step and its prefill
# ---------------------------------------------------------------------------------------
def verify_programs(lay: Layout, graphdef, cs: CacheSpec, nm: Numerics, sampler, spec):
    """(prefill, step) of speculative decoding, on the module state.
    spec = speculative.Speculation(k) (MTP drafts): prefill(state, cache, mcache, tokens
    [1, C], slot, pos, nvalid [1], table, h_prev [1, N, D]) -> (logits, last residual,
    cache, mcache); step(state, cache, mcache, st) -> (cache, mcache, st'). One device or
    an expert mesh.
    spec = dspark_runner.DSpark() (sampler: serve.sampling.RowSampler): prefill(state, cache, kv, rpos, tokens, slot,
    pos, nvalid, table, rows, draws) -> (cache, kv, rpos, sampled); step(state, cache, st)
    -> (cache, st'). One device. Not memoised: the runner keeps its pair (a drafter
    patched in a test traces anew)."""
    cfg = lay.cfg
    flat = lambda state: nnx.merge(graphdef, state).to_params()
    if isinstance(spec, DR.DSpark):
        if lay.kind != "single":
            raise ValueError("DSpark speculative decoding runs on one device, not a mesh or "
                             "a pipeline layout")
        pre_ = functools.partial(DR.prefill_fn, cfg=cfg, cs=cs, nm=nm, n_top=sampler.n_top)
        stp_ = DR.step_fn(cfg, cs, nm, sampler.n_top)
        return (jax.jit(lambda s, *a: pre_(flat(s), *a), donate_argnums=(1, 2, 3), **OPTS),
                jax.jit(lambda s, c, st: stp_(flat(s), c, st), donate_argnums=(1, 2), **OPTS))
    if lay.kind not in ("single", "mesh"):
        raise ValueError(f"speculative decoding runs on one device or an expert mesh, not "
                         f"the {lay.kind} layout")
    pre_ = functools.partial(SP.prefill_fn, cfg=cfg, cs=cs, nm=nm)
    stp_ = SP.spec_step_fn(cfg, cs, nm, sampler, spec.k)

    def in_mesh(f):
        if lay.mesh is None:
            return f

        def g(*a):
            with dist.expert_parallel(cfg, lay.mesh):
                return f(*a)
        return g
    pre = in_mesh(lambda s, c, m, *a: pre_(flat(s), c, m, *a))
    stp = in_mesh(lambda s, c, m, st: stp_(flat(s), c, m, st))
    return (_jit(lay, pre, cs, 6, "rrcm", (1, 2), head=("s", "c", "m")),
            _jit(lay, stp, cs, 1, "cmr", (1, 2, 3), head=("s", "c", "m")))


# ---------------------------------------------------------------------------------------
# 4. Engine.generate's fused loop
# ---------------------------------------------------------------------------------------
def _loop_fn(apply, R: int, cap: int):
    """run(p, cache, tok0, active, pos0, table, rows, max_new, stops) -> (tokens [R, cap],
    generated counts [R], cache): a while_loop over decode steps apply(p, cache, tokens,
    slots, pos, nvalid, table) -> (logits, cache), each sampled per row with its settings
    rows {name: [R]} (serve.sampling.draw_tokens; the token after i generated ones is draw
    i, as in the serving scheduler); a request stops on a token of stops [S] int32 (padded
    with -1) or at max_new (int32 scalar, <= cap) tokens."""
    def run(p, cache, tok0, active, pos0, table, rows, max_new, stops):
        out = jnp.zeros((R, cap), jnp.int32).at[:, 0].set(tok0)
        n_gen = jnp.where(active, 1, 0)
        running = active & ~jnp.isin(tok0, stops)

        def cond(c):
            return jnp.any(c[3]) & (c[5] < max_new)

        def body(c):
            cache, tok, pos, running, out, i, n_gen = c
            logits, cache = apply(p, cache, tok[:, None], jnp.arange(R), pos,
                                  running.astype(jnp.int32), table)
            nxt = draw_tokens(logits, rows, jnp.full(R, i, jnp.int32))
            out = out.at[:, i].set(jnp.where(running, nxt, 0))
            n_gen = n_gen + running
            pos = pos + running
            running = running & ~jnp.isin(nxt, stops) & (i + 1 < max_new)
            return cache, nxt, pos, running, out, i + 1, n_gen

        c = jax.lax.while_loop(cond, body, (cache, tok0, pos0, running, out, jnp.int32(1), n_gen))
        return c[4], c[6], c[0]
    return run


@functools.lru_cache(maxsize=None)
def generate_loop(lay: Layout, graphdef, cs: CacheSpec, nm: Numerics, cap: int):
    """jit(while_loop over decode steps) on the module state: (state, cache, tok0 [R],
    active [R] bool, pos0 [R], table [R, MAXB], rows {name: [R]} (serve.sampling.ROW_KEYS),
    max_new int32, stops [S] int32) -> (tokens [R, cap], counts [R], cache), the cache
    donated; one compilation per output width cap and stop-list length S. One device
    only."""
    if lay.kind != "single":
        raise ValueError(f"the fused generate loop runs on one device, not the {lay.kind} "
                         "layout (Engine.generate there goes through the stream)")
    run = _loop_fn(_step_fn(lay, graphdef, cs, nm), cs.max_requests, cap)
    return jax.jit(run, donate_argnums=(1,), **OPTS)
