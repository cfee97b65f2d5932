"""Per-request sampling as data: one compiled program samples every batch row with its own
temperature, top-k, top-p, min-p and seed, and returns the log-probabilities the OpenAI API
asks for. Changing a request's settings changes array values, never the program.

    sp = SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=64)
    rows = SamplingRows.empty(R); rows.set(slot, sp)
    out = sample_rows(logits_BV, rows.device(slots), steps_B, n_top=TOP_LOGPROBS)

The per-row filters run in the order temperature -> top-k -> top-p -> min-p (each on the
distribution the previous one left); a row with one filter matches the fixed samplers of
generate.py (TopK, TopP, MinP) in which tokens it may draw. temperature 0 is greedy: the
argmax of the raw logits, the same token as generate.Greedy.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

# top_logprobs are computed for this many tokens in the program (the OpenAI API's limit)
TOP_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's decoding settings (OpenAI names). temperature 0: greedy. top_k 0 (or
    -1): off; top_p 1: off; min_p 0: off. seed None: drawn by the server. max_tokens: new
    tokens at most. stop: strings that end the text (not included in it); stop_token_ids:
    ids that end generation (besides the model's end-of-text ids unless ignore_eos).
    logprobs: return each token's log-probability; top_logprobs: and the k likeliest."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self):
        check_sampling(self)


def _num(v, name, kind=float):
    if isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else int):
        raise ValueError(f"{name} must be {'a number' if kind is float else 'an integer'}, "
                         f"got {v!r}")
    if kind is float and not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v!r}")
    return v


def check_sampling(sp: SamplingParams) -> None:
    """ValueError naming the field when a value is impossible."""
    if _num(sp.temperature, "temperature") < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {sp.temperature}")
    if not 0 < _num(sp.top_p, "top_p") <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {sp.top_p}")
    if _num(sp.top_k, "top_k", int) < -1:
        raise ValueError(f"top_k must be >= 1, or 0 / -1 for off, got {sp.top_k}")
    if not 0 <= _num(sp.min_p, "min_p") <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {sp.min_p}")
    if sp.seed is not None:
        _num(sp.seed, "seed", int)
    if _num(sp.max_tokens, "max_tokens", int) < 1:
        raise ValueError(f"max_tokens must be >= 1, got {sp.max_tokens}")
    if not 0 <= _num(sp.top_logprobs, "top_logprobs", int) <= TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be in [0, {TOP_LOGPROBS}], got {sp.top_logprobs}")
    if not all(isinstance(s, str) and s for s in sp.stop):
        raise ValueError(f"stop must be non-empty strings, got {sp.stop!r}")
    for t in sp.stop_token_ids:
        _num(t, "stop_token_ids", int)


def seed_word(seed: int) -> int:
    """A request's seed as the uint32 the program's key is made from."""
    return int(seed) % (1 << 32)


@dataclasses.dataclass
class SamplingRows:
    """Host arrays [R] of the sampling settings by cache slot (what the program reads)."""
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    seed: np.ndarray

    @classmethod
    def empty(cls, R: int) -> "SamplingRows":
        return cls(np.zeros(R, np.float32), np.zeros(R, np.int32), np.ones(R, np.float32),
                   np.zeros(R, np.float32), np.zeros(R, np.uint32))

    def set(self, slot: int, sp: SamplingParams, seed: int) -> None:
        self.temperature[slot] = sp.temperature
        self.top_k[slot] = max(sp.top_k, 0)
        self.top_p[slot] = sp.top_p
        self.min_p[slot] = sp.min_p
        self.seed[slot] = seed_word(seed)

    @staticmethod
    def row(sp: SamplingParams, seed: int) -> tuple:
        """One request's settings as the values of a row (temperature, top_k, top_p, min_p,
        seed word)."""
        return (float(sp.temperature), max(int(sp.top_k), 0), float(sp.top_p),
                float(sp.min_p), seed_word(seed))

    def take(self, slots) -> dict:
        """The rows of `slots` as a dict of arrays [B] (the program's `rows` argument)."""
        return {f.name: getattr(self, f.name)[slots] for f in dataclasses.fields(self)}


def filter_logits(logits_BV, temperature_B, top_k_B, top_p_B, min_p_B):
    """Scaled logits [B, V] f32 with the tokens each row may not draw at -inf (greedy rows
    are scaled by 1: their draw is replaced by the argmax)."""
    V = logits_BV.shape[-1]
    t = jnp.where(temperature_B > 0, temperature_B, 1.0)
    lg = logits_BV.astype(jnp.float32) / t[:, None]
    # top-k: keep tokens at or above the k-th largest (k = 0: all)
    k = jnp.where((top_k_B <= 0) | (top_k_B > V), V, top_k_B)
    kth = jnp.take_along_axis(jnp.sort(lg, -1)[:, ::-1], k[:, None] - 1, -1)
    lg = jnp.where(lg >= kth, lg, -jnp.inf)
    # top-p: the smallest prefix (by probability) with mass >= p; p = 1: off (rounding
    # in the cumulative sum would otherwise drop tail tokens)
    probs = jax.nn.softmax(lg, -1)
    sp = jnp.sort(probs, -1)[:, ::-1]
    n_keep = jnp.sum((jnp.cumsum(sp, -1) - sp) < top_p_B[:, None], -1, keepdims=True)
    thresh = jnp.take_along_axis(sp, jnp.maximum(n_keep, 1) - 1, -1)
    lg = jnp.where((top_p_B[:, None] >= 1) | (probs >= thresh), lg, -jnp.inf)
    # min-p: tokens with at least p x the likeliest token's probability
    probs = jax.nn.softmax(lg, -1)
    return jnp.where(probs >= min_p_B[:, None] * probs.max(-1, keepdims=True), lg, -jnp.inf)


def draw_tokens(logits_BV, rows, steps_B):
    """-> tokens [B] int32. Row b draws with key fold_in(key(seed[b]), steps[b]): a
    request's draws depend on its seed and its token index only, not on its batch. The
    filters (two sorts of [B, V]) run only when a sampled row has one, and the draw only
    when a row samples: a greedy batch costs its argmax (the skipped work would leave
    every row's token unchanged)."""
    t = rows["temperature"]
    sampled = t > 0
    filtered = sampled & ((rows["top_k"] > 0) | (rows["top_p"] < 1) | (rows["min_p"] > 0))
    greedy = jnp.argmax(logits_BV, -1).astype(jnp.int32)

    def draw(_):
        def scaled(_):
            return logits_BV.astype(jnp.float32) / jnp.where(sampled, t, 1.0)[:, None]
        lg = jax.lax.cond(jnp.any(filtered),
                          lambda _: filter_logits(logits_BV, t, rows["top_k"], rows["top_p"],
                                                  rows["min_p"]), scaled, None)
        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(rows["seed"],
                                                                                steps_B)
        drawn = jax.vmap(jax.random.categorical)(keys, lg)
        return jnp.where(sampled, drawn, greedy).astype(jnp.int32)
    return jax.lax.cond(jnp.any(sampled), draw, lambda _: greedy, None)


def draw_rows(logits_BV, rows, steps_B, *, n_top: int):
    """-> (tokens [B] int32 (draw_tokens), logprob of each token [B] f32, top ids
    [B, n_top] int32, top logprobs [B, n_top] f32)."""
    tok = draw_tokens(logits_BV, rows, steps_B)
    logp = jax.nn.log_softmax(logits_BV.astype(jnp.float32), -1)   # the model's own
    tok_lp = jnp.take_along_axis(logp, tok[:, None], -1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logp, n_top)
    return tok, tok_lp, top_ids.astype(jnp.int32), top_lp


# One program per logits shape [B, V]: the decode step's [R, V] and a prefill's [1, V].
sample_rows = jax.jit(draw_rows, static_argnames=("n_top",))

ROW_KEYS = ("temperature", "top_k", "top_p", "min_p", "seed")


@dataclasses.dataclass(frozen=True)
class RowSampler:
    """The per-row sampler as a stream step's sampler (decode.stream_step_fn): each slot
    draws with its own settings, held in the step's device state (st[name] [R] for
    ROW_KEYS), at its own draw index st["draw"] [R]; the step also writes each token's
    logprob st["lp"] [R] and the n_top likeliest (st["top_ids"] / st["top_lp"] [R, n_top])."""
    n_top: int = TOP_LOGPROBS

    def draw(self, logits_RV, st):
        """-> (tokens [R], the state's updated entries)."""
        tok, lp, ti, tl = draw_rows(logits_RV, {k: st[k] for k in ROW_KEYS}, st["draw"],
                                       n_top=self.n_top)
        return tok, {"lp": lp, "top_ids": ti, "top_lp": tl,
                     "draw": st["draw"] + (st["nvalid"] > 0)}
