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

from dsv4_jax import config, model as M, params as P, speculative as SP
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
    prefill, _ = SP.engine_programs(eng, Greedy(), 1)
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
# a run is KERNELS[-mesh]: "interpret-mesh" (an expert mesh of two), "on" (the GPU), "off"
for name in runs:
    kernels, mesh = name.split("-")[0], name.endswith("-mesh")
    cs = CacheSpec.for_numerics(nm, max_requests=2, num_blocks=8, max_blocks=2,
                                kernels=kernels, attention_backend="triton")
    e = Engine(cfg, p, numerics=nm, cache_spec=cs, prefill_chunk=32, progress=False,
               mesh=make_mesh(2, expert=2) if mesh else None)
    out[name] = e.generate(prompts, max_new_tokens=4, speculative_tokens=2)
out["plain"] = e.generate(prompts, max_new_tokens=4)
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
    """Greedy with k = 2 (the chained draft steps through the T == 1 kernel path) with the
    kernels interpreted, sharded over an expert mesh of two CPU devices: the tokens of the
    kernels-off run and of greedy without speculation. (One device interpreted runs the same
    kernels: left to the GPU test.)"""
    res = _kernel_runs(["interpret-mesh", "off"],
                       {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert res["interpret-mesh"] == res["off"] == res["plain"], res


@pytest.mark.gpu
def test_speculative_with_kernels_on_the_gpu():
    """The same greedy tokens with the Mosaic kernels compiled for the GPU."""
    res = _kernel_runs(["on", "off"], {})
    assert res["on"] == res["off"] == res["plain"], res
