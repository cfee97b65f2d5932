"""The pipeline layout (layers split across devices): the same logits and tokens as one
device, and stages balanced by the bytes they hold. Two virtual CPU devices in a
subprocess (the test process has one)."""
import json
import os
import subprocess
import sys

import pytest

from dsv4_jax import config as C
from dsv4_jax.pipeline import Pipeline

_SCRIPT = r'''
import json, sys
import numpy as np, jax
from dsv4_jax import config as C, params as P
from dsv4_jax.generate import Engine
from dsv4_jax.pipeline import Pipeline
from dsv4_jax.quant import Numerics
seed = int(sys.argv[1])
cfg = C.test()
params = P.init_params(cfg, seed)
nm = Numerics(act_quant=True, dtype="bfloat16")
pipe = Pipeline(bounds=(0, 2, 3), devices=tuple(jax.devices()[:2]))
one = Engine(cfg, params, numerics=nm, progress=False, prefill_chunk=16)
two = Engine(cfg, params, numerics=nm, progress=False, prefill_chunk=16, pipeline=pipe)
toks = np.random.default_rng(seed).integers(0, cfg.vocab_size, (2, 24))
la, lb = one.teacher_forced_logits(toks, 19), two.teacher_forced_logits(toks, 19)
placed = sorted({str(d) for part in two.state for v in jax.tree.leaves(part)
                 for d in v.devices()})
where = {k: str(next(iter(v.devices())))
         for k, v in two.params.items() if k in ("embed.weight", "head.weight",
                                                  "layers.0.attn_norm.weight",
                                                  "layers.2.attn_norm.weight")}
print(json.dumps({"dlogits": float(np.abs(la - lb).max()), "scale": float(np.abs(la).max()),
                  "shape": list(la.shape), "placed": placed,
                  "where": where, "free": len(two.bm.free)}))
'''


@pytest.mark.slow  # ~90 s: two stages on CPU devices
def test_pipeline_equals_one_device():
    """Teacher-forced logits (prefill chunks + decode steps) equal to the last bit; every
    array on its stage's device. (The stream through the pipeline: tests/test_cli.py's
    two-device generate prints the same tokens as one device.)"""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, "907"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["shape"] == [2, 6, C.test().vocab_size] and r["scale"] > 0.1
    assert r["dlogits"] == 0.0
    assert len(r["placed"]) == 2
    w = r["where"]
    assert w["embed.weight"] == w["layers.0.attn_norm.weight"] != w["head.weight"]
    assert w["layers.2.attn_norm.weight"] == w["head.weight"]


def test_balanced_stages():
    flash = C.flash()
    devs = [object() for _ in range(8)]
    p2 = Pipeline.balanced(flash, devs[:2])
    assert p2.bounds[0] == 0 and p2.bounds[-1] == flash.num_hidden_layers
    # the head (1 GB) and MTP block sit on the last stage: it gets fewer layers
    assert p2.bounds[1] - p2.bounds[0] > p2.bounds[2] - p2.bounds[1]
    p8 = Pipeline.balanced(C.pro(), devs)
    sizes = [len(p8.layers(s)) for s in range(8)]
    assert sum(sizes) == 61 and max(sizes) - min(sizes) <= 3
    assert p2.stage_of("embed.weight") == 0 and p2.stage_of("mtp.0.norm.weight") == 1
    assert p2.stage_of(f"layers.{p2.bounds[1]}.attn_norm.weight") == 1
    assert p2.stage_of(p2.bounds[1] - 1) == 0   # layer i's cache
    with pytest.raises(ValueError, match="bounds"):
        Pipeline(bounds=(0, 3, 3), devices=(1, 2))
    with pytest.raises(ValueError, match="devices"):
        Pipeline.balanced(C.test(), devs[:4])
    # a slice of the visible devices shorter than the stages asked for
    with pytest.raises(ValueError, match="2 stages asked for, and 1 device given"):
        Pipeline.balanced(flash, devs[:1], stages=2)
