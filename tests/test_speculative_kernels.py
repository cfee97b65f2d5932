"""Speculative decoding, the longer CPU checks: the MTP drafts against the whole-sequence
MTP forward, and the speculative step with the Pallas kernels on (the Mosaic GPU
interpreter) on one device and sharded over an expert mesh of two CPU devices. The tiny
preset cut to three layers (SWA, CSA, HCA) and the MTP block; random weights drawn from
seeded keys."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import config, decode as D, model as M, params as P, speculative as SP
from dsv4_jax.cache import CacheSpec
from dsv4_jax.generate import Engine, Greedy
from dsv4_jax.quant import Numerics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F32 = Numerics(act_quant=False, dtype="float32")


def _cfg(**kw):
    return config.tiny().replace(num_hidden_layers=3, compress_ratios=(0, 4, 128, 0),
                                 num_hash_layers=1, **kw)


@pytest.mark.slow
def test_mtp_drafts_match_the_whole_sequence_mtp():
    """The MTP block run by the speculative prefill (one token behind the main model,
    across a chunk boundary, its 16-token window wrapped) and then on the pending row
    gives the logits of model.mtp_forward over the whole sequence at the last position."""
    cfg = _cfg(sliding_window=16)
    params = P.init_params(cfg, 3806)
    cs = CacheSpec.for_numerics(F32, max_requests=1, num_blocks=4, max_blocks=3)
    eng = Engine(cfg, params, numerics=F32, cache_spec=cs, prefill_chunk=32, progress=False)
    rng = np.random.default_rng(3806)
    P_LEN = 45   # two prefill chunks of 32
    seq = rng.integers(0, cfg.vocab_size, (1, P_LEN + 1)).astype(np.int32)
    prefill, _ = eng.runner.spec_programs(Greedy(), 1)
    eng.mtp_cache = SP.init_mtp_cache(cfg, cs)
    s = eng.bm.admit(P_LEN)
    h0 = jnp.zeros((1, cfg.hc_mult, cfg.hidden_size), jnp.float32)
    _, h = SP._prefill(eng, prefill, s, seq[0, :P_LEN], h0)
    last = jax.jit(lambda mc, h, t: SP.mtp_head(params, SP.mtp_layer(
        params, mc, h[:, None], t[:, None], jnp.asarray([s]), jnp.asarray([P_LEN - 1]),
        jnp.ones(1, jnp.int32), jnp.asarray(eng.bm.table), cfg, cs, F32)[0][:, 0], cfg, F32))
    got = np.asarray(last(eng.mtp_cache, h[None], jnp.asarray(seq[:, P_LEN])))[0]
    want = np.asarray(jax.jit(lambda t: M.mtp_forward(
        params, M.forward_hidden(params, t[:, :-1], cfg, F32), t[:, 1:], cfg, F32)[0, -1])(
        jnp.asarray(seq)))
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 1e-4, err


_KERNEL_SCRIPT = r'''
import json, sys
import numpy as np
from dsv4_jax import config, params as P
from dsv4_jax.cache import CacheSpec
from dsv4_jax.distributed import make_mesh
from dsv4_jax.generate import Engine
from dsv4_jax.quant import Numerics
cfg = config.tiny().replace(num_hidden_layers=3, compress_ratios=(0, 4, 128, 0),
                            num_hash_layers=1)
seed, runs = int(sys.argv[1]), sys.argv[2].split(",")
p = P.init_params(cfg, seed)
nm = Numerics(True, "bfloat16")
rng = np.random.default_rng(seed)
# request 0 crosses CSA block ends during decode; request 1 starts short
prompts = [rng.integers(0, cfg.vocab_size, 61).tolist(), rng.integers(0, cfg.vocab_size, 9).tolist()]
out = {}
# a run is KERNELS[-mesh]: "interpret-mesh" (an expert mesh of two), "on" (the GPU), "off";
# each generates with and without speculation on the same engine
for name in runs:
    kernels, mesh = name.split("-")[0], name.endswith("-mesh")
    cs = CacheSpec.for_numerics(nm, max_requests=2, num_blocks=8, max_blocks=2,
                                kernels=kernels, attention_backend="triton")
    e = Engine(cfg, p, numerics=nm, cache_spec=cs, prefill_chunk=32, progress=False,
               mesh=make_mesh(2, expert=2) if mesh else None)
    out[name] = e.generate(prompts, max_new_tokens=4, speculative_tokens=2)
    out[name + "/plain"] = e.generate(prompts, max_new_tokens=4)
print(json.dumps(out))
'''


def _kernel_runs(runs, env):
    proc = subprocess.run([sys.executable, "-c", _KERNEL_SCRIPT, "3903", ",".join(runs)],
                          env=dict(os.environ, PYTHONPATH=ROOT, **env), capture_output=True,
                          text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_speculative_with_kernels_on_an_expert_mesh():
    """Greedy with k = 2 with the kernels interpreted (the verify's 3 rows, the MTP
    catch-up and the chained drafts all through the kernel path), sharded over an expert
    mesh of two CPU devices: the tokens of greedy without speculation on the same kernels.
    (The XLA path may pick other tokens: its attention rounds differently, and this tiny
    random model has near ties.)"""
    res = _kernel_runs(["interpret-mesh"],
                       {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert res["interpret-mesh"] == res["interpret-mesh/plain"], res


@pytest.mark.gpu
def test_speculative_with_kernels_on_the_gpu():
    """The same greedy tokens with and without speculation, the Mosaic kernels compiled
    for the GPU, and with the kernels off."""
    res = _kernel_runs(["on", "off"], {})
    assert res["on"] == res["on/plain"], res
    assert res["off"] == res["off/plain"], res


@pytest.mark.slow
def test_kernel_path_on_verify_rows_equals_one_row_steps():
    """The kernel path on T = 3 rows of every request (a speculative verify with k = 2)
    leaves the cache bit for bit as three one-row decode steps leave it, and gives their
    residuals, with the kernels interpreted: request 0's rows cross the window ring's wrap
    (positions 126..128), the HCA block end (127) and a CSA block end; request 1 runs only
    2 of its 3 rows."""
    cfg = _cfg()
    params = P.init_params(cfg, 3904)
    nm = Numerics(True, "bfloat16")
    cs = CacheSpec.for_numerics(nm, max_requests=2, num_blocks=6, max_blocks=3,
                                kernels="interpret", attention_backend="triton")
    eng = Engine(cfg, params, numerics=nm, cache_spec=cs, prefill_chunk=64, progress=False)
    rng = np.random.default_rng(3904)
    lens = [126, 37]
    for n in lens:
        eng.prefill(eng.bm.admit(n), rng.integers(0, cfg.vocab_size, n))
    T = 3
    eng.bm.ensure_many({s: n + T for s, n in enumerate(lens)})
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, T)), jnp.int32)
    pos = jnp.asarray(lens, jnp.int32)
    nvalid = jnp.asarray([3, 2], jnp.int32)
    table = jnp.asarray(eng.bm.table)
    slots = jnp.arange(2)
    layers = range(cfg.num_hidden_layers)

    def run(cache, tok, p, nv):
        X = M.embed(params, tok, cfg, nm)
        return D.step_layers(params, cache, X, tok, slots, p, nv, table, layers, cfg, cs, nm)

    run = jax.jit(run)
    Xa, ca = run(jax.tree.map(jnp.copy, eng.cache), tokens, pos, nvalid)
    cb, Xb = jax.tree.map(jnp.copy, eng.cache), []
    for j in range(T):
        X, cb = run(cb, tokens[:, j:j + 1], pos + j, (j < nvalid).astype(jnp.int32))
        Xb.append(X[:, 0])
    for (pa, a), (pb, b) in zip(jax.tree_util.tree_flatten_with_path(ca)[0],
                                jax.tree_util.tree_flatten_with_path(cb)[0]):
        assert pa == pb
        a, b = np.asarray(a), np.asarray(b)
        if jax.tree_util.keystr(pa).endswith(".cst"):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())
        else:
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), \
                f"cache {jax.tree_util.keystr(pa)} differs"
    Xa, Xb = np.asarray(Xa, np.float32), np.asarray(jnp.stack(Xb, 1), np.float32)
    for b in range(2):
        n = int(nvalid[b])
        np.testing.assert_allclose(Xa[b, :n], Xb[b, :n], rtol=0, atol=1e-2 * np.abs(Xb).max())
