"""GPU check of the decode form (params.merge_x_proj) at real shapes: N full-width Flash
layers, every kernel on (weight-streaming matmuls, cache kernels).

1. Per op (the bug detector): at layer 0, each merged weight's row views times x against
   the weights they replace (wq_a / wkv, shared w1 / w3 through quant.linear; the routed
   experts' w1 / w3 through quant.grouped_linear on 6 random experts; the CSA block's
   x-projections). The kernel streams a merged weight with another grid (its K-split
   count follows N), so its f32 partial sums are added in another order: equal to f32
   rounding (rel <= 1e-5), not bit for bit. A wrong row split would be O(1).
2. The decode step: logits and cache from the same random cache with the checkpoint-form
   tree (A), the decode form (B), and, as the noise floor, the checkpoint form with every
   weight-streaming kernel at another K-split count (C: only the summation order changes).
   FP8 activation rounding turns last-bit differences into discrete flips, so |A - B|
   is judged against |A - C|.

    PYTHONPATH=. python3 benchmarks/merge_check.py --layers 4 [--batch 1] [--steps 3]
    CPU smoke run: ... merge_check.py --preset tiny --layers 4 --context 300 --interpret
"""
from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax import config as C, layers as L, params as P
from dsv4_jax.cache import BLOCK_TOKENS, CacheSpec
from dsv4_jax.decode import STEP_COMPILER_OPTIONS, step
from dsv4_jax.quant import Numerics, f32_dot_bf16, fp8_block_sim, grouped_linear, linear
from pallas_kernels.quant_matmul import kernel as QK


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))


def per_op(params, merged, cfg, nm, rng):
    """{name: rel error of the view's product against the part's} at layer 0 (and the
    first CSA layer's x-projections)."""
    out = {}
    D = cfg.hidden_size
    x = fp8_block_sim(jnp.asarray(rng.standard_normal((1, 1, D)), jnp.bfloat16), 128)
    views = L.block_params(merged, "layers.0.")
    lin = jax.jit(lambda x, w: linear(x, w, nm))
    for n in ("attn.wq_a", "attn.wkv", "ffn.shared_experts.w1", "ffn.shared_experts.w3"):
        if "layers.0." + n in params:
            out[n] = _rel(lin(x, params["layers.0." + n]), lin(x, views[n]))
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    X = fp8_block_sim(jnp.asarray(rng.standard_normal((k, 8, D)), jnp.bfloat16), 128)
    ids = jnp.asarray(rng.choice(E, k, replace=False), jnp.int32)
    gl = jax.jit(lambda X, e, w: grouped_linear(X, e, w, nm))
    for n in ("ffn.experts.w1", "ffn.experts.w3"):
        out[n] = _rel(gl(X, ids, params["layers.0." + n]), gl(X, ids, views[n]))
    csa = [i for i in range(cfg.num_hidden_layers) if cfg.layer_ratio(i) == 4]
    if csa:
        ap = L.block_params(L.block_params(merged, f"layers.{csa[0]}.attn."), "")
        dot = jax.jit(f32_dot_bf16)
        xf = x.astype(jnp.float32)
        for n in P.X_PROJ_PARTS:
            out[n] = _rel(dot(xf, params[f"layers.{csa[0]}.attn." + n]), dot(xf, ap[n]))
    return out


class other_splits:
    """While active, every weight-streaming kernel traced uses the next smaller valid K-split
    count than its default (only the order of its f32 partial sums changes)."""

    def __enter__(self):
        self.orig = QK.default_splits

        def alt(fmt, G, N, K, tn=QK.TN, tkp=QK.TKP, **kw):
            s = self.orig(fmt, G, N, K, tn, tkp, **kw)
            ok = [t for t in range(1, s) if QK._valid_split(fmt, K, t, tkp)]
            return max(ok) if ok else s
        QK.default_splits = alt
        jax.clear_caches()   # re-trace the kernels' jits

    def __exit__(self, *exc):
        QK.default_splits = self.orig
        jax.clear_caches()


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--interpret", action="store_true",
                    help="CPU smoke run: the kernels in the Mosaic GPU interpreter")
    a = ap.parse_args(argv)
    from benchmarks.decode_bench import random_cache
    cfg = C.get_preset(a.preset)
    n = a.layers
    cfg = cfg.replace(num_hidden_layers=n, compress_ratios=cfg.compress_ratios[:n] + (0,),
                      num_hash_layers=min(cfg.num_hash_layers, n))
    kern = "interpret" if a.interpret else "on"
    nm = Numerics(True, "bfloat16", matmul="interpret" if a.interpret else "pallas")
    B, ctx = a.batch, a.context
    mb = -(-(ctx + 40) // BLOCK_TOKENS)
    cs = CacheSpec.for_numerics(nm, max_requests=B, num_blocks=B * mb, max_blocks=mb,
                                kernels=kern)
    params = P.init_params_device(cfg, a.seed)
    merged = P.merge_x_proj(params, cfg)
    new = sorted(set(merged) - set(params))
    print(f"{jax.devices()[0].device_kind}: {n} {a.preset} layers, B={B}, ctx={ctx}, seed "
          f"{a.seed}; decode form adds {len(new)} weights, e.g. {new[:4]}", flush=True)
    rng = np.random.default_rng(a.seed)
    ops = per_op(params, merged, cfg, nm, rng)
    print("per op, rel error of view vs part: " +
          ", ".join(f"{k} {v:.1e}" for k, v in ops.items()), flush=True)
    ok = all(v <= 1e-5 for v in ops.values())

    table = jnp.arange(B * mb, dtype=jnp.int32).reshape(B, mb)
    toks = [jnp.asarray(rng.integers(0, cfg.vocab_size, (B, 1)), jnp.int32)
            for _ in range(a.steps)]

    def run(tree):
        f = jax.jit(functools.partial(step, cfg=cfg, cs=cs, nm=nm),
                    compiler_options=STEP_COMPILER_OPTIONS)
        c, out = random_cache(cfg, cs, B, ctx, jax.random.key(a.seed)), []
        for s, tok in enumerate(toks):
            args = (tok, jnp.arange(B, dtype=jnp.int32), jnp.full((B,), ctx + s, jnp.int32),
                    jnp.ones((B,), jnp.int32), table)
            lg, c = f(tree, c, *args)
            out.append((np.asarray(lg), [_bits(v) for v in jax.tree.leaves(c)]))
        return out

    A, Bm = run(params), run(merged)
    with other_splits():
        Cs = run(params)
    worst = 0.0
    for s in range(a.steps):
        (la, ca), (lb, cb), (lc, cc) = A[s], Bm[s], Cs[s]
        nd = lambda x, y: sum(not np.array_equal(u, v) for u, v in zip(x, y))
        rab, rac = _rel(la, lb), _rel(la, lc)
        print(f"step {s}: logits rel |A-B| {rab:.1e} (bits equal {np.array_equal(la, lb)}), "
              f"noise floor |A-C| {rac:.1e}; argmax A/B/C {la.argmax(-1).tolist()}/"
              f"{lb.argmax(-1).tolist()}/{lc.argmax(-1).tolist()}; cache arrays differing "
              f"A-B {nd(ca, cb)}, A-C {nd(ca, cc)} of {len(ca)}; finite "
              f"{bool(np.isfinite(lb).all())}", flush=True)
        ok &= bool(np.isfinite(lb).all())
        worst = max(worst, rab / max(rac, 1e-12) if rac else (0.0 if rab == 0 else np.inf))
    print(f"worst step |A-B| / |A-C|: {worst:.2f}")
    print("MERGE CHECK", "PASS" if ok else "FAIL", "(per op within f32 rounding)" if ok else "")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
