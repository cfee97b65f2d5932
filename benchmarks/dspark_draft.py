"""The DSpark drafter (dsv4_jax/dspark.py) at Flash shapes on one GPU: correctness of the
kernel path against the XLA path of the same math, and the draft's cost against the MTP
draft it replaces, in one run.

    PYTHONPATH=. python3 -m benchmarks.dspark_draft [--batch 1 8 32] [--iters 20]

Parameters: one Flash layer plus the drafter's 3 stages (256 FP4 experts each), random on
the device (params.init_params_device); rings filled with W = 128 committed rows.
Correctness (B = 1, 8): the draft with the Pallas matmul kernels (the bf16 + FP8-activation
numerics the engine decodes with) against the same draft with XLA matmuls: base-logit
error relative to their scale, token agreement; and both against an f32 run without
activation rounding (the numerics the CPU numpy test pins down), as a yardstick.
Timing (kernels on): one draft (G = 5 rows through 3 stages, the head, 5 Markov draws,
the confidence head), a commit of G + 1 accepted rows into the rings, and the MTP draft
it replaces (model.mtp_forward: the MTP block + head on one row per request).
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import median_seconds
from checkpoints.synthetic import truncate_layers
from dsv4_jax import dspark as D
from dsv4_jax import params as P
from dsv4_jax.config import get_preset
from dsv4_jax.quant import Numerics


def setup(cfg, B: int, nm: Numerics, params, seed: int = 0):
    """Rings holding positions 0..W-1 of random target hidden states; anchors at W."""
    W, F = cfg.sliding_window, cfg.dspark_num_stages * cfg.hidden_size
    g = np.random.default_rng(seed)
    hid = jnp.asarray(g.standard_normal((B, W, F)), jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(W, dtype=jnp.int32), (B, W))
    commit = jax.jit(functools.partial(D.commit, cfg=cfg, nm=nm))
    st = commit(params, D.init_state(cfg, B), hid, pos, jnp.ones((B, W), bool))
    anchor = jnp.asarray(g.integers(0, cfg.vocab_size, B), jnp.int32)
    return st, anchor, jnp.full((B,), W, jnp.int32)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--preset", default="flash", help="tiny: a CPU smoke run of this script")
    a = ap.parse_args(argv)
    print(f"device: {jax.devices()[0].device_kind}")
    base = truncate_layers(get_preset(a.preset), 1)
    cfg = D.with_dspark(base)
    params = P.init_params_device(cfg, seed=0, include_mtp=True)
    params = P.merge_x_proj(params, cfg, consume=True)   # the decode form
    gpu = jax.default_backend() == "gpu"
    nm_k = Numerics(matmul="pallas" if gpu else "xla")
    if not gpu:
        print("  (no GPU: 'kernels' runs the XLA matmuls; the comparison is then trivial)")
    nm_x = Numerics(matmul="xla")
    nm_f = Numerics(act_quant=False, dtype="float32", matmul="xla")

    print("correctness (base logits: max |a - b| / max |b|; tokens: greedy agreement)")
    ok = True
    for B in [b for b in a.batch if b <= 8] or [1]:
        outs = {}
        for name, nm in (("kernels", nm_k), ("xla", nm_x), ("f32", nm_f)):
            st, anchor, apos = setup(cfg, B, nm, params)
            fwd = jax.jit(functools.partial(D.forward, cfg=cfg, nm=nm))
            hd = jax.jit(functools.partial(D.head, cfg=cfg, nm=nm))
            base_lg, _ = hd(params, fwd(params, st, anchor, apos))
            out = jax.jit(functools.partial(D.draft, cfg=cfg, nm=nm))(params, st, anchor, apos)
            outs[name] = (np.asarray(base_lg, np.float32), np.asarray(out["tokens"]),
                          np.asarray(out["confidence"]))
        for x, y in (("kernels", "xla"), ("kernels", "f32"), ("xla", "f32")):
            e = np.abs(outs[x][0] - outs[y][0]).max() / np.abs(outs[y][0]).max()
            agree = (outs[x][1] == outs[y][1]).mean()
            finite = np.isfinite(outs[x][0]).all() and np.isfinite(outs[x][2]).all()
            print(f"  B={B:<3} {x:>7} vs {y:<4} rel err {e:.2e}  tokens agree {agree:.2f}  "
                  f"finite {finite}")
            ok &= bool(finite)
            if (x, y) == ("kernels", "xla"):
                ok &= bool(e < 2e-2)
    print(f"  kernel path matches the XLA path: {'PASS' if ok else 'FAIL'}")

    print("timing, kernels on (median ms)")
    base_params = None
    try:
        from dsv4_jax import model
        base_params = P.init_params_device(base, seed=1, include_mtp=True)
        base_params = {k: v for k, v in base_params.items()
                       if k.startswith("mtp.") or k in ("embed.weight", "head.weight")}
    except Exception as e:  # the comparison is optional: the draft's own cost still prints
        print(f"  (MTP comparison unavailable: {type(e).__name__}: {e})")
    for B in a.batch:
        st, anchor, apos = setup(cfg, B, nm_k, params)
        draft = jax.jit(functools.partial(D.draft, cfg=cfg, nm=nm_k))
        t_draft = median_seconds(lambda: draft(params, st, anchor, apos), a.iters)
        G = cfg.dspark_block_size
        hid = jnp.ones((B, G + 1, cfg.dspark_num_stages * cfg.hidden_size), jnp.bfloat16)
        pos = apos[:, None] + jnp.arange(G + 1, dtype=jnp.int32)[None, :]
        commit = jax.jit(functools.partial(D.commit, cfg=cfg, nm=nm_k))
        t_commit = median_seconds(lambda: commit(params, st, hid, pos,
                                                 jnp.ones((B, G + 1), bool)), a.iters)
        line = f"  B={B:<3} draft {t_draft * 1e3:7.3f}  commit {G + 1} rows {t_commit * 1e3:7.3f}"
        if base_params is not None:
            try:
                X = jnp.ones((B, 1, base.hc_mult, base.hidden_size), jnp.bfloat16)
                nxt = jnp.zeros((B, 1), jnp.int32)
                mtp = jax.jit(functools.partial(model.mtp_forward, cfg=base, nm=nm_k))
                t_mtp = median_seconds(lambda: mtp(base_params, X, nxt), a.iters)
                line += f"  | MTP draft (1 row) {t_mtp * 1e3:7.3f}"
            except Exception as e:
                line += f"  | MTP n/a ({type(e).__name__})"
        print(line)


if __name__ == "__main__":
    main()
