"""The model runner: what every driver (Engine.generate, Engine.stream, `dsv4 serve`)
runs the model through.

    runner = ModelRunner(cfg, params, numerics=nm, cache_spec=cs)     # one device
    runner = ModelRunner(cfg, params, ..., mesh=mesh)                 # or a mesh / pipeline
    res = runner.execute(StepBatch(prefill=(...), start=(...), run=(...)))  # enqueued
    ... the host works while the device runs ...
    out = res.fetch()                                                 # numpy, waits

It owns the parameters (the NNX module's split state, or the pipeline's stages), the
paged cache, the block table (`bm`, cache.BlockManager: the scheduler decides, the table
lives here) and the compiled programs, and keeps a **device-resident decode state**: each
slot's next token, position, whether it runs, its sampling settings (temperature, top-k,
top-p, min-p, seed) and the index of its next draw. A StepBatch changes only what it
names (a slot starting to decode, the set of slots that run, a block table that grew);
a steady decode step uploads nothing. Sampling runs inside the step program, and the
step's tokens (with their log-probabilities) come back through pinned host memory, so a
driver enqueues step n+1 before it reads step n.

With `set_mode(steps=N)` the plain decode step is N steps in one program
(decode.multi_step_fn): each step emits up to N tokens per row, read once.

Speculative decoding is a mode of the runner (`Speculation(k)`): the decode step is the
MTP draft + verify program of speculative.py with the per-row sampler, and each step
emits 1 .. k+1 tokens per row. `DSpark()`: the same with the DSpark drafter of
V4-Flash-0731 (dspark_runner.py): G = dspark_block_size drafts a step, 1 .. G+1 tokens
per row; its prefill also commits the prompt rows into the drafter's rings.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .cache import BlockManager, CacheSpec, init_cache
from .config import Config
from .decode import host_reader, put_state
from .dspark_runner import DSpark
from .nnx_model import DeepSeekV4
from .programs import Layout, decode_program, step_program, verify_programs
from .params import merge_x_proj as merge_decode_form
from .quant import Numerics
from .serve.sampling import ROW_KEYS, TOP_LOGPROBS, RowSampler, SamplingRows, sample_rows
from .speculative import Speculation
from . import distributed as dist
from . import pipeline as PL
from . import sharding as SH
from . import dspark_runner as DR
from . import speculative as SP


# ---------------------------------------------------------------------------------------
# What a driver asks of one step
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens start .. start+len(tokens)-1 of the request in `slot` (at most the
    runner's chunk), sampled after the last one with `sampling` at draw index `draw`."""
    slot: int
    tokens: tuple[int, ...]
    start: int
    sampling: tuple   # SamplingRows.row(...)
    draw: int = 0


@dataclasses.dataclass(frozen=True)
class RowStart:
    """A slot that starts decoding at position `pos`: it feeds `token` first (the device
    token of an earlier step's final prefill chunk, StepResult.first_token, or a host
    int: a token fed again), and its draws continue at index `draw`; a multi-step
    decode stops the row before draw index `end` (its max_tokens)."""
    slot: int
    token: object
    pos: int
    sampling: tuple
    draw: int = 1
    end: int = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One step: prefill chunks (run first, in order), slots that start decoding, and the
    slots the decode step runs (every slot not listed idles). An empty `run` runs no
    decode step."""
    prefill: tuple[PrefillChunk, ...] = ()
    start: tuple[RowStart, ...] = ()
    run: tuple[int, ...] = ()


@dataclasses.dataclass
class StepResult:
    """The device outputs of one executed StepBatch; fetch() waits and returns numpy.
    prefill[i]: (token, logprob, top ids [K], top logprobs [K]) of chunk i; decode: per
    slot (tokens [R, T], count [R] of emitted tokens (1 without speculation), logprobs
    [R, T], top ids [R, T, K], top logprobs [R, T, K]) or None."""
    prefill: list
    decode: tuple | None
    several: bool = False   # decode holds [R, T] tokens with counts (speculative, multi-step)

    def first_token(self, i: int):
        """Prefill chunk i's sampled token, on the device ([1] int32): a RowStart's token."""
        return self.prefill[i][0]

    def fetch(self):
        pre = [tuple(np.asarray(a)[0] for a in p) for p in self.prefill]
        if self.decode is None:
            return pre, None
        if self.several:
            return pre, tuple(np.asarray(a) for a in self.decode)
        tok, lp, ti, tl = (np.asarray(a) for a in self.decode)
        return pre, (tok[:, None], np.ones(len(tok), np.int32), lp[:, None], ti[:, None],
                     tl[:, None])


# ---------------------------------------------------------------------------------------
# The runner
# ---------------------------------------------------------------------------------------
class ModelRunner:
    """Parameters, cache, block table and compiled programs of one model on one layout
    (one device, a mesh or a pipeline), plus the device decode state."""

    def __init__(self, cfg: Config, params, *, numerics: Numerics = Numerics(),
                 cache_spec: CacheSpec | None = None, chunk: int = 128, mesh=None,
                 pipeline: "PL.Pipeline | None" = None, merge_x_proj: bool = True):
        if merge_x_proj:
            params = merge_decode_form(params, cfg)   # a no-op on a merged tree
        if chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {chunk}")
        if mesh is not None and pipeline is not None:
            raise ValueError("Engine: give a mesh or a pipeline, not both")
        self.cfg, self.nm, self.chunk = cfg, numerics, chunk
        self.cs = cache_spec or CacheSpec.for_numerics(numerics)
        check_kernel_device(self.nm, self.cs, pipeline.devices if pipeline is not None else
                            mesh.devices.flat if mesh is not None else jax.devices()[:1])
        self.mesh, self.pipeline = mesh, pipeline
        self.mtp_cache = None     # the MTP block's cache (speculation), made on first use
        self.programs = {}        # compiled programs built on first use, by kind and form
        self.dstate = None        # the device decode state (execute), made on first use
        self._mode = None         # (sampler, Speculation | DSpark | None, steps) of dstate
        self._host = None         # what dstate's run / table rows hold, as uploaded
        self._h = {}              # speculative prefill: each slot's last main residual
        if pipeline is not None:
            # no NNX module: it would keep every array alive on one device besides the stages
            self.model = self.graphdef = None
            self.state = PL.split_params(params, pipeline)
            self.cache = PL.init_cache(cfg, self.cs, pipeline)
            self.bm = BlockManager(cfg, self.cs)
        else:
            self.cache = init_cache(cfg, self.cs)
            if mesh is None:
                # placed (committed) as the step returns it: an uncommitted cache makes the
                # second step compile again (a 4-layer Flash check lost ~36 s a step to it on
                # the H100)
                self.cache = jax.device_put(self.cache, jax.devices()[0])
                self.bm = BlockManager(cfg, self.cs)
            elif dist.is_tensor_mesh(mesh):
                # the tensor layout: heads and expert columns split, the cache replicated
                # (self.params is then in dist.tensor_form, the w1 / w3 row merges permuted)
                params = dist.shard_tensor_params(params, mesh)
                self.cache = SH.shard_cache(self.cache, cfg, self.cs, mesh)
                self.bm = BlockManager(cfg, self.cs)
            else:
                params = SH.shard_params(params, cfg, mesh)
                self.cache = SH.shard_cache(self.cache, cfg, self.cs, mesh)
                self.bm = dist.DataParallelBlockManager(cfg, self.cs,
                                                        dist.data_groups(self.cs, mesh))
            # the model as an NNX module; the compiled programs take its split state
            self.model = DeepSeekV4.from_params(cfg, params)
            self.graphdef, self.state = nnx.split(self.model)
        # a checkpoint loaded without its MTP block steps without it (the shardings of a
        # mesh's programs follow the tree they are given)
        self.layout = Layout.of(cfg, params, mesh, pipeline)
        self.state_sharding = self.layout.state_sharding()
        self.step = step_program(self.layout, self.graphdef, self.cs, numerics)

    # ---- the plain step --------------------------------------------------------------
    @property
    def params(self) -> dict:
        """The flat parameter tree the module (or the pipeline's stages) holds."""
        if self.pipeline is not None:
            return {k: v for part in self.state for k, v in part.items()}
        return self.model.to_params()

    @property
    def interpreted(self) -> bool:
        """Kernels run in the Mosaic GPU interpreter (CPU tests): its callbacks run jax ops,
        and a second step dispatched while one is in flight can deadlock the CPU client."""
        return "interpret" in (self.nm.matmul, self.cs.kernels)

    def check_tokens(self, toks) -> None:
        toks = np.asarray(toks)
        if toks.size and (toks.dtype == bool or not np.issubdtype(toks.dtype, np.integer)):
            raise ValueError(f"token ids must be integers, got {toks.dtype}")
        if toks.size and (toks.min() < 0 or toks.max() >= self.cfg.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.cfg.vocab_size}), got "
                             f"[{toks.min()}, {toks.max()}]")

    def run_step(self, tokens, slots, pos, nvalid):
        """The cached step on tokens [B, T] at pos [B] in slots [B] (the first nvalid [B]
        real) -> logits [B, V]; the cache is updated."""
        logits, self.cache = self.step(self.state, self.cache, jnp.asarray(tokens, jnp.int32),
                                       jnp.asarray(slots, jnp.int32), jnp.asarray(pos, jnp.int32),
                                       jnp.asarray(nvalid, jnp.int32), jnp.asarray(self.bm.table))
        return logits

    def stream_program(self, sampler):
        """The stream step (decode.stream_step_fn) of this layout with `sampler` (a fixed
        generate.py sampler, or serve.sampling.RowSampler)."""
        return decode_program(self.layout, self.graphdef, self.cs, self.nm, sampler)

    def spec_programs(self, sampler, k: int):
        """The MTP (prefill, step) for this layout (programs.verify_programs)."""
        key = ("speculative", sampler, k)
        if key not in self.programs:
            self.check_speculation(k)
            self.programs[key] = verify_programs(self.layout, self.graphdef, self.cs, self.nm,
                                                 sampler, Speculation(k))
        return self.programs[key]

    def ensure_mtp_cache(self) -> None:
        """The MTP block's cache, placed as a main layer's of its ratio."""
        if self.mtp_cache is not None:
            return
        mc = SP.init_mtp_cache(self.cfg, self.cs)
        if self.mesh is None:
            self.mtp_cache = jax.device_put(mc, jax.devices()[0])
        else:
            self.mtp_cache = jax.device_put(mc, SP.mtp_cache_shardings(
                self.cfg, self.cs, SH.cache_shardings(self.cfg, self.cs, self.mesh), self.mesh))

    def check_speculation(self, k: int) -> None:
        """Clear errors before any heavy work: k, the layout and the MTP block."""
        spec = SP.Speculation(k)
        if self.pipeline is not None:
            raise ValueError("speculative decoding runs on one device or a mesh, not a "
                             "pipeline layout")
        if dist.is_tensor_mesh(self.mesh):
            raise ValueError("speculative decoding does not run in the tensor layout yet")
        SP.check_mtp(self.cfg, self.model.mtp.get_value(), spec)

    # ---- the scheduler's step: prefill chunks + the decode step, sampled per row ------
    def dspark_programs(self):
        """The DSpark (prefill, step) (programs.verify_programs); one device only."""
        if ("dspark",) not in self.programs:
            self.check_dspark()
            self.programs[("dspark",)] = verify_programs(
                self.layout, self.graphdef, self.cs, self.nm, RowSampler(TOP_LOGPROBS), DSpark())
        return self.programs[("dspark",)]

    def check_dspark(self) -> None:
        """Clear errors before any heavy work: the layout, the config and the drafter."""
        if self.pipeline is not None or self.mesh is not None:
            raise ValueError("DSpark speculative decoding runs on one device, not a mesh or "
                             "a pipeline layout")
        DR.check(self.cfg, self.model.mtp.get_value())

    def set_mode(self, speculation: "Speculation | DSpark | None" = None,
                 steps: int = 1) -> None:
        """Decode plainly (None), `steps` decode steps a program, or speculatively (MTP
        drafts or DSpark); drops the decode state (call with no slot decoding)."""
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"decode steps a program must be an integer >= 1, got {steps!r}")
        if steps > 1 and speculation is not None:
            raise ValueError("several decode steps a program and speculative decoding do "
                             "not combine (a speculative step already emits several tokens)")
        if steps > 1 and self.pipeline is not None:
            raise ValueError("several decode steps a program run on one device or a mesh, "
                             "not a pipeline layout")
        if isinstance(speculation, DSpark):
            self.check_dspark()
        elif speculation is not None:
            self.check_speculation(speculation.k)
        mode = (RowSampler(TOP_LOGPROBS), speculation, steps)
        if mode != self._mode:
            self._mode, self.dstate, self._host = mode, None, None

    @property
    def speculation(self) -> "Speculation | DSpark | None":
        return None if self._mode is None else self._mode[1]

    @property
    def several(self) -> bool:
        """A decode step emits [R, T] tokens with counts (speculative or multi-step)."""
        return self.speculation is not None or self.steps > 1

    def _reader(self):
        """The decode state's token reader of this mode."""
        if not self.several:
            return _read_plain
        return functools.partial(_read_several, multi_step=self.speculation is None)

    @property
    def steps(self) -> int:
        """Plain decode steps one decode program runs (set_mode)."""
        return 1 if self._mode is None else self._mode[2]

    def _prefill_program(self):
        """(state, cache, [mcache,] tokens [1, C], slot / pos / nvalid [1], table, rows
        {name: [1]}, draws [1] [, h_prev]) -> sampled outputs (in the step's program but
        for MTP speculation and a pipeline)."""
        spec = self.speculation
        key = ("prefill", spec)
        if key in self.programs:
            return self.programs[key]
        if isinstance(spec, DSpark):
            pre, _ = self.dspark_programs()

            def run(rows, draws, *a):   # the drafter's rings live in the decode state
                st = self._ensure_dstate()
                self.cache, kv, rp, out = pre(self.state, self.cache, st["dsp_kv"],
                                              st["dsp_pos"], *a, rows, draws)
                self.dstate = dict(st, dsp_kv=kv, dsp_pos=rp)
                return out, None
        elif spec is not None:
            self.ensure_mtp_cache()
            pre, _ = self.spec_programs(RowSampler(TOP_LOGPROBS), spec.k)

            def run(rows, draws, *a):
                logits, h, self.cache, self.mtp_cache = pre(self.state, self.cache,
                                                            self.mtp_cache, *a)
                return sample_rows(logits, rows, draws, n_top=TOP_LOGPROBS), h
        else:
            prog = step_program(self.layout, self.graphdef, self.cs, self.nm, TOP_LOGPROBS)

            def run(rows, draws, *a):
                self.cache, out = prog(self.state, self.cache, *a, rows, draws)
                return out, None
        self.programs[key] = run
        return run

    def _init_dstate(self):
        R, cfg = self.cs.max_requests, self.cfg
        spec = self.speculation
        st = {"pos": np.zeros(R, np.int32), "table": self.bm.table.copy(),
              "draw": np.zeros(R, np.int32), **SamplingRows.empty(R).take(np.arange(R))}
        if spec is None:
            st.update(tok=np.zeros((R, 1), np.int32), nvalid=np.zeros(R, np.int32),
                      lp=np.zeros(R, np.float32), top_ids=np.zeros((R, TOP_LOGPROBS), np.int32),
                      top_lp=np.zeros((R, TOP_LOGPROBS), np.float32),
                      end=np.zeros(R, np.int32))
            if self.steps > 1:
                N = self.steps
                st.update(out=np.zeros((R, N), np.int32), n_out=np.zeros(R, np.int32),
                          out_lp=np.zeros((R, N), np.float32),
                          out_top_ids=np.zeros((R, N, TOP_LOGPROBS), np.int32),
                          out_top_lp=np.zeros((R, N, TOP_LOGPROBS), np.float32))
        elif isinstance(spec, DSpark):
            st.update(DR.decode_state(cfg, R, self.nm, TOP_LOGPROBS))
        else:
            T = spec.k + 1
            st.update(run=np.zeros(R, np.int32), pend_n=np.zeros(R, np.int32),
                      pend_tok=np.zeros((R, T), np.int32),
                      pend_X=np.zeros((R, T, cfg.hc_mult, cfg.hidden_size), self.nm.jdtype),
                      out=np.zeros((R, T), np.int32), n_out=np.zeros(R, np.int32),
                      lp=np.zeros((R, T), np.float32),
                      top_ids=np.zeros((R, T, TOP_LOGPROBS), np.int32),
                      top_lp=np.zeros((R, T, TOP_LOGPROBS), np.float32),
                      i=np.asarray(1, np.int32))
        # a replayed token's upload ([1] int32) lowers a small program once: now, not
        # while serving
        put_state(np.zeros(1, np.int32), self.state_sharding)
        return {n: put_state(v, self.state_sharding) for n, v in st.items()}

    def _decode_program(self):
        spec = self.speculation
        if spec is None:
            return decode_program(self.layout, self.graphdef, self.cs, self.nm,
                                  RowSampler(TOP_LOGPROBS), self.steps)
        if isinstance(spec, DSpark):
            return self.dspark_programs()[1]
        _, step = self.spec_programs(RowSampler(TOP_LOGPROBS), spec.k)

        def run(state, cache, st):
            cache, self.mtp_cache, st = step(state, cache, self.mtp_cache, st)
            return cache, st
        return run

    def execute(self, batch: StepBatch) -> StepResult:
        """Enqueue one step: the prefill chunks, the rows that start decoding, then the
        decode step of `batch.run` -> its StepResult (device arrays, not waited for). The
        block table must already hold every block the step writes; bm.length advances
        by what the step writes (a speculative or multi-step row: by what the host has
        read, see `advance`)."""
        if self._mode is None:
            self.set_mode(None)
        spec = self.speculation
        R, C = self.cs.max_requests, self.chunk
        pre_prog = self._prefill_program()
        pre_out = []
        for c in batch.prefill:
            if len(c.tokens) > C:
                raise ValueError(f"a prefill chunk holds at most {C} tokens, got {len(c.tokens)}")
            buf = np.zeros((1, C), np.int32)
            buf[0, :len(c.tokens)] = c.tokens
            args = (jnp.asarray(buf), jnp.asarray([c.slot], jnp.int32),
                    jnp.asarray([c.start], jnp.int32), jnp.asarray([len(c.tokens)], jnp.int32),
                    jnp.asarray(self.bm.table))
            if isinstance(spec, Speculation):
                args += (self._h_prev(c),)
            out, h = pre_prog(_one_row(c.sampling), jnp.asarray([c.draw], jnp.int32), *args)
            self.bm.advance(c.slot, len(c.tokens))
            if isinstance(spec, Speculation):
                self._h[c.slot] = h
            pre_out.append(out)
            if self.interpreted:
                jax.block_until_ready(out)
        dec = None
        if batch.start or batch.run:
            st = self._ensure_dstate()
            for s in batch.start:
                tok = s.token   # placed as a prefill's token, or the start compiles again
                if isinstance(tok, (int, np.integer)):
                    tok = put_state(np.asarray([tok], np.int32), self.state_sharding)
                args = (st, jnp.int32(s.slot), tok, jnp.int32(s.pos), jnp.int32(s.draw),
                        _one_row(s.sampling))
                st = (_start_row(*args, jnp.int32(s.end)) if spec is None else
                      _start_dspark_row(*args) if isinstance(spec, DSpark) else
                      _start_spec_row(*args, self._h[s.slot]))
            run = np.zeros(R, np.int32)
            run[list(batch.run)] = 1
            name = "nvalid" if spec is None else "run"
            if not np.array_equal(self._host["run"], run):
                st = dict(st, **{name: put_state(run, self.state_sharding)})
            if not np.array_equal(self._host["table"], self.bm.table):
                st = dict(st, table=put_state(self.bm.table, self.state_sharding))
            self._host = {"table": self.bm.table.copy(), "run": run}
            if batch.run:
                self.cache, st = self._decode_program()(self.state, self.cache, st)
                dec = self._reader()(st)
                if not self.several:
                    for s in batch.run:
                        self.bm.advance(s, 1)
                if self.interpreted:
                    jax.block_until_ready(dec)
            self.dstate = st
        return StepResult(pre_out, dec, self.several)

    def _ensure_dstate(self) -> dict:
        if self.dstate is None:
            self.dstate = self._init_dstate()
            self._host = {"table": self.bm.table.copy(),
                          "run": np.zeros(self.cs.max_requests, np.int32)}
            # the token reader loads before the decode step first runs: XLA drops every
            # loaded program's CUDA graphs when a new one loads, and the step would
            # re-record its graphs at its second run
            jax.block_until_ready(self._reader()(self.dstate))
        return self.dstate

    def advance(self, slot: int, n: int) -> None:
        """A speculative or multi-step row emitted n tokens (read back): they are in its
        cache now."""
        self.bm.advance(slot, n)

    def _h_prev(self, c: PrefillChunk):
        """The main residual at position start - 1 of a speculative prefill chunk."""
        if c.start == 0 or c.slot not in self._h:
            return put_state(np.zeros((1, self.cfg.hc_mult, self.cfg.hidden_size),
                                      self.nm.jdtype), self.state_sharding)
        return self._h[c.slot]


def check_kernel_device(nm: Numerics, cs: CacheSpec, devices) -> None:
    """The compiled Mosaic GPU kernels (Numerics.matmul "pallas", CacheSpec.kernels "on")
    run on Hopper (sm_90) or datacenter Blackwell (sm_100) GPUs: refuse them elsewhere
    before the cache is built (the interpreter, "interpret", runs anywhere)."""
    asked = [f for f, on in (("Numerics.matmul='pallas'", nm.matmul == "pallas"),
                             ("CacheSpec.kernels='on'", cs.kernels == "on")) if on]
    if not asked:
        return
    for d in devices:
        cc = str(getattr(d, "compute_capability", "") or "")
        if d.platform != "gpu" or cc.split(".")[0] not in ("9", "10"):
            raise ValueError(f"{' and '.join(asked)} need{'s' * (len(asked) == 1)} a Hopper "
                             f"or Blackwell (sm_100) GPU, "
                             f"and {d.device_kind} ({d.platform}) is not one; use 'xla' / "
                             f"'off' (or 'interpret' to run the kernels in the interpreter)")


# ---------------------------------------------------------------------------------------
# Programs
# ---------------------------------------------------------------------------------------
def _one_row(sampling: tuple) -> dict:
    """SamplingRows.row(...) -> the program's rows argument for one row ({name: [1]})."""
    t, k, p, m, seed = sampling
    return {"temperature": np.asarray([t], np.float32), "top_k": np.asarray([k], np.int32),
            "top_p": np.asarray([p], np.float32), "min_p": np.asarray([m], np.float32),
            "seed": np.asarray([seed], np.uint32)}


def _set_rows(st, slot, pos, draw, rows1):
    st = dict(st, pos=st["pos"].at[slot].set(pos), draw=st["draw"].at[slot].set(draw))
    for k in ROW_KEYS:
        st[k] = st[k].at[slot].set(rows1[k][0])
    return st


@functools.partial(jax.jit, donate_argnums=(0,))
def _start_row(st, slot, tok1, pos, draw, rows1, end):
    """The plain decode state with `slot` starting at token tok1 [1] (device) at pos; a
    multi-step decode stops it before draw index `end`."""
    st = _set_rows(st, slot, pos, draw, rows1)
    return dict(st, tok=st["tok"].at[slot, 0].set(tok1[0]), end=st["end"].at[slot].set(end))


@functools.partial(jax.jit, donate_argnums=(0,))
def _start_spec_row(st, slot, tok1, pos, draw, rows1, h1):
    """The speculative state with `slot` starting after its prefill: one pending MTP row
    (the main residual h1 [1, N, D] at pos - 1, with the first token tok1 [1])."""
    st = _set_rows(st, slot, pos, draw, rows1)
    return dict(st, pend_n=st["pend_n"].at[slot].set(1),
                pend_tok=st["pend_tok"].at[slot, 0].set(tok1[0]),
                pend_X=st["pend_X"].at[slot, 0].set(h1[0].astype(st["pend_X"].dtype)))


@functools.partial(jax.jit, donate_argnums=(0,))
def _start_dspark_row(st, slot, tok1, pos, draw, rows1):
    """The DSpark state with `slot` starting after its prefill: its anchor is tok1 [1] at
    pos (the prefill committed the rings)."""
    st = _set_rows(st, slot, pos, draw, rows1)
    return dict(st, anchor=st["anchor"].at[slot].set(tok1[0]))




def _read_plain(st):
    """-> (tokens [R], logprobs [R], top ids [R, K], top logprobs [R, K]) in pinned host
    memory."""
    return host_reader("tok", "lp", "top_ids", "top_lp")(st)


def _read_several(st, multi_step: bool):
    """-> (tokens [R, T], counts [R], logprobs [R, T], top ids / logprobs [R, T, K]) of a
    speculative (T = k+1 or G+1) or multi-step (T = steps) decode state."""
    if multi_step:
        return host_reader("out", "n_out", "out_lp", "out_top_ids", "out_top_lp")(st)
    return host_reader("out", "n_out", "lp", "top_ids", "top_lp")(st)
