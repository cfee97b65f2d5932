"""DSpark speculation on one GPU, kernels on: exactness, then cost, in one run.

    PYTHONPATH=. python3 -m benchmarks.gpu_check_dspark [--layers 10] [--context 4096]

1. Exactness (Flash shapes cut to 4 layers: SWA, SWA, CSA, HCA; a random DSpark drafter on
   the last 3): greedy Engine.generate with speculative_tokens="dspark" equals plain greedy
   token for token, for 3 requests (the verify's 6 rows run through the kernels in parts
   of 4 + 2: speculative.split_attention). Also the same with oracle drafts (the plain
   continuation with a wrong token at a fixed random fifth of the positions), so that
   acceptances of every length and their rollbacks are exercised on the kernel path.
2. The split verify against the one-pass XLA verify: verify_layers with the kernels (parts
   of 4 + 2) vs kernels off, same cache: the residuals' largest relative difference.
3. Cost: benchmarks.decode_bench.bench at Flash shapes (--layers layers, B = 1): the plain
   stream step and the DSpark step, and tokens/s at acceptance lengths 2.8 / 3.5 / 5
   (target: >= 2.5x the plain tokens/s at 3.5).
"""
from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import decode_bench as DB
from dsv4_jax import config as C, dspark as DS, params as P, speculative as SP
from dsv4_jax.cache import CacheSpec
from dsv4_jax.generate import Engine
from dsv4_jax.quant import Numerics


def _cfg(layers: int):
    base = C.flash()
    ratios = (0, 0, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128)[:layers]
    cfg = base.replace(num_hidden_layers=layers, compress_ratios=ratios + (0,),
                       num_hash_layers=min(base.num_hash_layers, layers))
    return DS.with_dspark(cfg)


def exactness(seed: int = 0) -> dict:
    cfg = _cfg(4)
    nm = Numerics(act_quant=True, dtype="bfloat16")
    params = P.init_params_device(cfg, seed, include_mtp=True)
    cs = CacheSpec.for_numerics(nm, max_requests=3, num_blocks=12, max_blocks=4, kernels="on")
    eng = Engine(cfg, params, numerics=nm, cache_spec=cs, prefill_chunk=128, progress=False)
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(0, cfg.vocab_size, n)) for n in (120, 7, 300)]
    n_new = 40
    want = eng.generate(prompts, max_new_tokens=n_new)
    got = eng.generate(prompts, max_new_tokens=n_new, speculative_tokens="dspark")
    res = {"random_drafter_equal": got == want,
           "random_drafter_tokens_per_step": eng.acceptance["overall"]}
    # oracle drafts: a fresh engine (the drafter is traced into its program)
    e2 = Engine(cfg, params, numerics=nm, cache_spec=cs, prefill_chunk=128, progress=False)
    table = np.zeros((cs.max_requests, cs.capacity + 8), np.int32)
    for s, (p, w) in enumerate(zip(prompts, want)):
        table[s, :len(p) + len(w)] = p + w
    wrong = jnp.asarray(rng.random(table.shape[1]) < 0.2)
    G, V = cfg.dspark_block_size, cfg.vocab_size
    real = DS.draft

    def oracle(params, state, anchor, anchor_pos, cfg, nm, draw=None, key=None):
        at = anchor_pos[:, None] + 1 + jnp.arange(G)[None]
        tok = jnp.take_along_axis(jnp.asarray(table), at, 1)
        tok = jnp.where(wrong[at], (tok + 1) % V, tok).astype(jnp.int32)
        return {"tokens": tok, "logits": None, "q": jax.nn.one_hot(tok, V),
                "confidence": jnp.zeros(tok.shape)}
    DS.draft = oracle
    try:
        got2 = e2.generate(prompts, max_new_tokens=n_new, speculative_tokens="dspark")
    finally:
        DS.draft = real
    res.update(oracle_equal=got2 == want, oracle_tokens_per_step=e2.acceptance["overall"])
    if got != want or got2 != want:
        for i, (a, b, c) in enumerate(zip(want, got, got2)):
            d1 = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
            d2 = next((j for j, (x, y) in enumerate(zip(a, c)) if x != y), None)
            print(f"  request {i}: first difference random drafter at {d1}, oracle at {d2}")
    # the split kernel verify vs the one-pass XLA verify on the same cache
    lens = [len(p) for p in prompts]
    for p in prompts:   # a fresh block table: slots 0, 1, 2
        eng.prefill(eng.bm.admit(len(p)), p)
    T = G + 1
    eng.bm.ensure_many({s: n + T for s, n in enumerate(lens)})
    toks = jnp.asarray(rng.integers(0, V, (3, T)), jnp.int32)
    args = (toks, jnp.asarray(lens, jnp.int32), jnp.full(3, T, jnp.int32),
            jnp.asarray(eng.bm.table))
    flat = eng.runner.params
    X = {}
    for name, c in (("kernels", cs), ("xla", dataclasses.replace(cs, kernels="off"))):
        f = jax.jit(lambda p, cache, c=c, rows=4 if c.kernels != "off" else 0:
                    SP.verify_layers(p, cache, *args, cfg, c, nm, attn_rows=rows)[0])
        X[name] = np.asarray(f(flat, jax.tree.map(jnp.copy, eng.cache)), np.float32)
    eng.release_all()
    res["split_kernel_vs_xla_rel"] = float(np.abs(X["kernels"] - X["xla"]).max()
                                           / np.abs(X["xla"]).max())
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    print(f"device: {jax.devices()[0].device_kind}")
    ex = exactness()
    print("exactness: " + ", ".join(f"{k} {v}" for k, v in ex.items()), flush=True)
    base = C.flash()   # as `dsv4 bench decode --layers N` cuts it
    n = a.layers
    cfg = DS.with_dspark(base.replace(num_hidden_layers=n,
                                      compress_ratios=base.compress_ratios[:n] + (0,),
                                      num_hash_layers=min(base.num_hash_layers, n)))
    params = P.merge_x_proj(P.init_params_device(cfg, 0, include_mtp=True), cfg, consume=True)
    r = DB.bench(cfg, params, 1, a.context, "on", a.steps, spec_k="dspark", what=("stream",))
    base = r["ms_stream"]
    print(f"flash {a.layers} layers, B=1, ctx {a.context}: plain stream step {base:.2f} ms, "
          f"DSpark step {r['ms_spec']:.2f} ms ({r['ms_spec'] / base:.2f}x; one at a time "
          f"{r['ms_spec_sync']:.2f} ms)")
    for L in (2.8, 3.5, 5.0):
        print(f"  acceptance length {L}: {L / r['ms_spec'] * 1e3:.1f} tokens/s = "
              f"{L * base / r['ms_spec']:.2f}x plain ({1e3 / base:.1f} tokens/s)")
    ok = ex["random_drafter_equal"] and ex["oracle_equal"]
    print("PASS" if ok else "FAIL")


if __name__ == "__main__":
    main()
