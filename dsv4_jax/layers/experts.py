"""The MoE feed-forward: routing (score top-k, or a hash table on the first layers), the
routed experts grouped by expert, and the shared expert.

    y_BTD = moe(p, x_BTD, tokens_BT, cfg, nm, hash_layer[, debug, xq])
    idx_BTk, w_BTk = route(p, x_BTD, tokens_BT, cfg, hash_layer)
    y_BTD = routed_experts(p, x_BTD, idx_BTk, w_BTk, cfg, nm)     # f32
    slot_expert_S, slot_P, row_P, token_P = expert_schedule(idx_NK, E, tile)
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_expert_matmul import (Tuning as GroupedTuning,
                                                  grouped_expert_matmul, tile_layout)

from ..config import Config
from ..quant import (KERNEL_MAX_ROWS, Fp4Weight, Fp8Weight, Numerics, WeightRows,
                     f32_dot_bf16, fp8_block_sim, grouped_linear, linear)

F32 = jnp.float32


def route(p, x, tokens, cfg: Config, hash_layer: bool, debug=None):
    """Gate scores sqrt(softplus(x W^T)) (fp32, unquantised) -> expert ids [..., k] and
    routing weights [..., k]. debug["router_scores"]: what top-k ranks (score + bias),
    [..., E], on score-routed layers."""
    logits = f32_dot_bf16(x, p["gate.weight"])
    s = jnp.sqrt(jax.nn.softplus(logits))
    if hash_layer:
        idx = p["gate.tid2eid"][tokens]
    else:
        ranked = s + p["gate.bias"].astype(F32)
        _, idx = jax.lax.top_k(ranked, cfg.num_experts_per_tok)
        if debug is not None:
            debug["router_scores"] = ranked
    w = jnp.take_along_axis(s, idx, -1)
    w = w / w.sum(-1, keepdims=True) * cfg.routed_scaling_factor
    return idx, w


def swiglu(h1, h3, limit):
    g = jnp.minimum(h1.astype(F32), limit)
    u = jnp.clip(h3.astype(F32), -limit, limit)
    return jax.nn.silu(g) * u


def expert_ffn(w1, w2, w3, x, weight, cfg: Config, nm: Numerics, xq=None):
    """One SwiGLU expert with clamps; the routing weight is applied BEFORE W2. xq: x's
    padded FP8 simulation (norm_act), if made."""
    h = swiglu(linear(x, w1, nm, xq=xq), linear(x, w3, nm, xq=xq), cfg.swiglu_limit)
    if weight is not None:
        h = h * weight[..., None]
    return linear(h.astype(nm.jdtype), w2, nm, out_dtype=F32)


# Expert parallelism: distributed.py installs a function here while it traces a sharded
# program (same signature as routed_experts); None: all experts on this device.
ROUTED_EXPERTS_HOOK = None


def moe(p, x, tokens, cfg: Config, nm: Numerics, hash_layer: bool, debug=None, xq=None):
    """x [B, T, D], tokens [B, T] -> [B, T, D]. Routing, then the routed experts
    (`routed_experts`, or the expert-parallel hook), then the shared expert. xq: x's padded
    FP8 simulation (norm_act), if made: the experts take it instead of simulating x."""
    idx, w = route(p, x, tokens, cfg, hash_layer, debug)
    if debug is not None:
        debug["router_idx"], debug["router_w"] = idx, w
    routed = ROUTED_EXPERTS_HOOK or routed_experts
    if xq is None:
        out = routed(p, x, idx, w, cfg, nm)
    else:
        rows = math.prod(x.shape[:-1])
        out = routed(p, xq[:rows].reshape(x.shape), idx, w, cfg, nm, presim=True)
    if cfg.n_shared_experts:
        out = out + expert_ffn(p["shared_experts.w1"], p["shared_experts.w2"],
                               p["shared_experts.w3"], x, None, cfg, nm, xq=xq)
    return out.astype(nm.jdtype)


def routed_experts(p, x, idx, w, cfg: Config, nm: Numerics, presim: bool = False):
    """sum_k w[..., k] expert_{idx[..., k]}(x) over the E experts stacked in p["experts.*"]
    (E = their leading dim: all experts, or one device's share; an index outside [0, E)
    combines nothing and reads no weights). x [B, T, D], idx/w [B, T, k] -> [B, T, D] f32.
    presim: x is already FP8-simulated (the act-quant rounding is not applied again).
    Up to PAIR_GROUP_TOKENS tokens: one group per (token, expert) pair (`_moe_pairs`, no
    sort or scatters). Few tokens (decode batches): the pairs are grouped by expert into
    tiles (`expert_schedule`) and each tile reads its expert's stored weights once (the
    Pallas weight-streaming kernel with nm.matmul="pallas"). Many tokens: loop over all E
    experts with a combine mask, or, with nm.matmul != "xla" and kernel-shaped FP8 / FP4
    experts (`grouped_kernel_ok`), the pairs sorted by expert into row tiles through the
    grouped expert matmul (`_moe_grouped`: each expert's weights read once per tile of
    PREFILL_TILE rows, at tensor-core rate; nm.grouped_prefill False: the loop)."""
    E = jax.tree.leaves(p["experts.w1"])[0].shape[0]
    k = idx.shape[-1]
    B, T, D = x.shape
    pairs = B * T * k
    if B * T <= PAIR_GROUP_TOKENS and pairs < E:
        return _moe_pairs(p, x.reshape(B * T, D), idx.reshape(B * T, k),
                          w.reshape(B * T, k), cfg, nm, presim).reshape(B, T, D)
    if pairs < E or (nm.matmul != "xla" and pairs <= KERNEL_MAX_ROWS * k):
        return _moe_scheduled(p, x.reshape(B * T, D), idx.reshape(B * T, k),
                              w.reshape(B * T, k), cfg, nm, 8, presim).reshape(B, T, D)
    if nm.grouped_prefill and nm.matmul != "xla" and nm.bf16_operands and all(
            grouped_kernel_ok(p[n]) for n in ("experts.w1", "experts.w3", "experts.w2")):
        return _moe_grouped(p, x.reshape(B * T, D), idx.reshape(B * T, k),
                            w.reshape(B * T, k), cfg, nm, presim).reshape(B, T, D)
    comb = jnp.einsum("btk,btke->bte", w, jax.nn.one_hot(idx, E, dtype=F32))  # [B,T,E]

    def one(e, acc):
        sub = lambda wt: jax.tree.map(lambda a: a[e], wt)
        y = expert_ffn(sub(p["experts.w1"]), sub(p["experts.w2"]), sub(p["experts.w3"]), x,
                       comb[..., e], cfg, nm)
        return acc + y

    return jax.lax.fori_loop(0, E, one, jnp.zeros(x.shape, F32))


def expert_schedule(idx_NK, E: int, tile: int):
    """Group (token, expert) pairs by expert into tiles of `tile` rows (static shapes).
    idx_NK int [N, k] -> (slot_expert [S] (-1: empty slot), slot [P], row [P], token [P])
    for the P = N*k pairs; pair j (token j // k) goes to row `row[j]` of tile `slot[j]`.
    Each expert's pairs fill ceil(count/tile) consecutive tiles, so S = ceil(P/tile) +
    min(E, P) always suffices. Indices outside [0, E) land in no tile's expert (-1)."""
    N, k = idx_NK.shape
    P = N * k
    e = idx_NK.reshape(P).astype(jnp.int32)
    e = jnp.where((e >= 0) & (e < E), e, E)  # invalid -> bucket E (computed nowhere)
    tok = jnp.arange(P, dtype=jnp.int32) // k
    order = jnp.argsort(e, stable=True)
    es = e[order]
    counts = jnp.zeros(E + 1, jnp.int32).at[e].add(1)
    ntile = -(-counts // tile)
    first_tile = jnp.cumsum(ntile) - ntile
    first_pair = jnp.cumsum(counts) - counts
    r = jnp.arange(P, dtype=jnp.int32) - first_pair[es]
    slot_sorted = first_tile[es] + r // tile
    S = -(-P // tile) + min(E + 1, P)
    slot_expert = jnp.full(S, -1, jnp.int32).at[slot_sorted].set(jnp.where(es < E, es, -1))
    inv = jnp.argsort(order)  # sorted position of each pair
    return slot_expert, slot_sorted[inv], (r % tile)[inv], tok


# Up to this many tokens, every (token, expert) pair is its own group: no sort and no
# scatters (about 10 small kernels fewer per layer), at the price of reading an expert
# twice when two tokens pick it (uniform routing, 256 experts, k = 6: ~5% more expert
# bytes at 8 tokens, ~20% at 16).
PAIR_GROUP_TOKENS = 8


def _grouped_swiglu(p, X_GMD, expert_G, Wr_GM, cfg: Config, nm: Numerics):
    """The routed-expert FFN over groups: X [G, M, D] (act-quant simulated), group g run by
    expert expert_G[g] (-1: none), rows weighted by Wr [G, M] before W2 -> f32 [G, M, D]."""
    h1 = grouped_linear(X_GMD, expert_G, p["experts.w1"], nm)
    h3 = grouped_linear(X_GMD, expert_G, p["experts.w3"], nm)
    h = swiglu(h1.astype(nm.jdtype), h3.astype(nm.jdtype), cfg.swiglu_limit) * Wr_GM[..., None]
    h = h.astype(nm.jdtype)
    if nm.act_quant:
        h = fp8_block_sim(h, 128)
    return grouped_linear(h, expert_G, p["experts.w2"], nm)


def _moe_pairs(p, x_ND, idx_NK, w_NK, cfg: Config, nm: Numerics, presim=False):
    """Routed experts with one group per (token, expert) pair: x [N, D], idx/w [N, k] ->
    [N, D] f32 (an index outside [0, E) contributes nothing and reads no weights)."""
    N, D = x_ND.shape
    k = idx_NK.shape[1]
    E = jax.tree.leaves(p["experts.w1"])[0].shape[0]
    e = idx_NK.reshape(N * k).astype(jnp.int32)
    e = jnp.where((e >= 0) & (e < E), e, -1)
    xq = fp8_block_sim(x_ND, 128) if nm.act_quant and not presim else x_ND
    X = jnp.repeat(xq, k, axis=0)[:, None, :]  # [P, 1, D]: pair j is token j // k
    y = _grouped_swiglu(p, X, e, w_NK.reshape(N * k, 1).astype(F32), cfg, nm)
    return y.reshape(N, k, D).sum(1)


def _moe_scheduled(p, x_ND, idx_NK, w_NK, cfg: Config, nm: Numerics, tile: int,
                   presim=False):
    """Routed experts over expert tiles: x [N, D], idx/w [N, k] -> [N, D] f32."""
    N, D = x_ND.shape
    k = idx_NK.shape[1]
    P = N * k
    E = jax.tree.leaves(p["experts.w1"])[0].shape[0]
    slot_expert, slot, row, tok = expert_schedule(idx_NK, E, tile)
    S = slot_expert.shape[0]
    xq = fp8_block_sim(x_ND, 128) if nm.act_quant and not presim else x_ND
    # The tiles are gathered, not scattered: each tile row's pair (P: none, a zero row) is
    # a small int scatter, then X and Wr are row gathers (XLA's scatter of rows into the
    # zeroed [S, tile, D] tiles cost ~15 us a layer at B = 64 on an H200). The combine
    # stays a scatter-add: as a gather + sum over k (pairs are token-major) XLA fused it
    # with the transpose of the kernel's [S, D, tile] output into one strided kernel,
    # 75 us a layer against 25.
    src = jnp.full((S * tile,), P, jnp.int32).at[slot * tile + row].set(
        jnp.arange(P, dtype=jnp.int32))
    X = jnp.concatenate([xq, jnp.zeros((1, D), xq.dtype)])[jnp.minimum(src // k, N)]
    Wr = jnp.concatenate([w_NK.reshape(-1).astype(F32), jnp.zeros((1,), F32)])[src]
    y = _grouped_swiglu(p, X.reshape(S, tile, D), slot_expert, Wr.reshape(S, tile), cfg, nm)
    return jnp.zeros((N, D), F32).at[tok].add(y[slot, row])


# Token rows per tile of the prefill path's grouped expert matmul (its wgmma M side): each
# tile reads its expert's weights once. Each expert wastes under one tile of padding.
PREFILL_TILE = 128


def grouped_kernel_ok(w) -> bool:
    """Whether the grouped expert matmul takes this stacked weight [E, N, K] (a WeightRows
    view: its stored weight): FP8 with K % 256 == 0, FP4 with K % 512 == 0 and K <= 8192;
    N % 128 == 0."""
    w = w.w if isinstance(w, WeightRows) else w
    if not isinstance(w, (Fp8Weight, Fp4Weight)) or len(w.shape) != 3:
        return False
    _, N, K = w.shape
    if isinstance(w, Fp8Weight):
        return N % 128 == 0 and K % 256 == 0
    return N % 128 == 0 and K % 512 == 0 and K <= 8192


@functools.partial(jax.jit, static_argnames=("impl", "exact_fp4", "tm"))
def _grouped_expert_matmul_jit(x_RK, tile_expert_S, w, impl, exact_fp4, tm):
    """One lowered kernel per weight shape in the step (the layers share it)."""
    return grouped_expert_matmul(x_RK, tile_expert_S, w, impl=impl, exact_fp4=exact_fp4,
                                 tuning=GroupedTuning(tm=tm))


def _tiles_linear(x_RK, tile_expert_S, w, nm: Numerics, tm: int):
    """f32 [R, out] = the row tiles of x times their experts' W.T. A WeightRows view: the
    product with the whole stored weight, columns sliced (the two views' calls are one
    after XLA's CSE)."""
    if isinstance(w, WeightRows):
        return _tiles_linear(x_RK, tile_expert_S, w.w, nm, tm)[:, w.start:w.stop]
    return _grouped_expert_matmul_jit(x_RK.astype(jnp.bfloat16), tile_expert_S, w,
                                      impl=nm.matmul, exact_fp4=nm.exact_fp4, tm=tm)


def _moe_grouped(p, x_ND, idx_NK, w_NK, cfg: Config, nm: Numerics, presim=False,
                 tm: int = PREFILL_TILE):
    """Routed experts for many tokens: x [N, D], idx/w [N, k] -> [N, D] f32.

    pairs [P = N k] --sort by expert--> row tiles [S * tm] (tile s: one expert's pairs,
    zero rows after them; schedule.tile_layout) --gather x, weights--> h1, h3 = grouped
    expert matmuls [S tm, I] --swiglu * w--> W2 matmul [S tm, D] --scatter-add by token-->
    [N, D]. The same per-pair math as the dense loop (bf16 rounding points, FP8
    simulation of the W2 input), summed over a token's k experts in pair order."""
    N, D = x_ND.shape
    k = idx_NK.shape[1]
    P = N * k
    E = jax.tree.leaves(p["experts.w1"])[0].shape[0]
    e = idx_NK.reshape(P).astype(jnp.int32)
    e = jnp.where((e >= 0) & (e < E), e, E)            # invalid -> after every expert
    order = jnp.argsort(e, stable=True)
    sizes = jnp.zeros(E + 1, jnp.int32).at[e].add(1)[:E]
    lay = tile_layout(sizes, P, tm)
    pair_R = jnp.concatenate([order.astype(jnp.int32), jnp.full((1,), P, jnp.int32)])[
        lay.src_R]                                      # [S tm]: P for padding rows
    tok_R = jnp.where(pair_R < P, pair_R // k, N)
    xq = fp8_block_sim(x_ND, 128) if nm.act_quant and not presim else x_ND
    X = jnp.concatenate([xq, jnp.zeros((1, D), xq.dtype)])[tok_R]
    Wr = jnp.concatenate([w_NK.reshape(P).astype(F32), jnp.zeros((1,), F32)])[pair_R]
    te = lay.tile_expert_S
    h1 = _tiles_linear(X, te, p["experts.w1"], nm, tm)
    h3 = _tiles_linear(X, te, p["experts.w3"], nm, tm)
    h = swiglu(h1.astype(nm.jdtype), h3.astype(nm.jdtype), cfg.swiglu_limit) * Wr[:, None]
    h = h.astype(nm.jdtype)
    if nm.act_quant:
        h = fp8_block_sim(h, 128)
    y = _tiles_linear(h, te, p["experts.w2"], nm, tm)
    return jnp.zeros((N, D), F32).at[tok_R].add(y, mode="drop")
