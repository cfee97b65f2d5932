"""The tensor layout (distributed.make_tensor_mesh: heads and expert columns split over a
"model" mesh, the cache replicated) against one device, through ModelRunner, on 2, 4 and
8 CPU virtual devices.

Each case runs in a subprocess (this file as a script with
XLA_FLAGS=--xla_force_host_platform_device_count=8, as tests/test_sharding.py does) that
writes JSON; the tests assert on it. The model: the tiny preset cut to one layer of each
kind (SWA with hash routing, CSA, HCA), with 8 output groups so that 8 devices split them
and an expert width whose FP8 shared-expert rows split into whole 128-row scale blocks.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT, CHUNK = 9, 16


def _cfg(config, inter):
    return config.tiny().replace(num_hidden_layers=3, compress_ratios=(0, 4, 128, 0),
                                 num_hash_layers=1, o_groups=8, moe_intermediate_size=inter)


def _lockstep_interpreter():
    """jax 0.11.2's Mosaic GPU interpreter checks, as one device's kernel ends, that no
    barrier of any device is still allocated, while the other devices of a shard_map may
    still be inside the same kernel (a spurious AssertionError). Wait there for every device
    first (the interpreter's own cross-device threading.Barrier; every device runs the same
    kernels in the same order and already meets at the kernel's clean-up barrier)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as G
    check = G._assert_no_barriers_allocated

    def after_every_device(token):
        G._get_shared_memory().barrier.wait()
        return check(token)
    G._assert_no_barriers_allocated = after_every_device


def _drive(runner, prompt, steps):
    """Prefill two requests (chunks of CHUNK through the XLA path), then `steps` greedy
    decode steps of both slots -> (tokens [steps, 2], logits [2 + steps, B, V])."""
    import jax
    logits = []
    for s in range(2):
        runner.bm.admit(PROMPT)
        runner.bm.ensure(s, PROMPT + steps)
        buf = np.zeros((1, CHUNK), np.int32)
        buf[0, :PROMPT] = prompt[s]
        logits.append(np.asarray(runner.run_step(buf, [s], [0], [PROMPT])))
    tok = logits[0][0].argmax(-1), logits[1][0].argmax(-1)
    cur, pos, out = np.asarray(tok, np.int32), PROMPT, []
    for _ in range(steps):
        lg = np.asarray(runner.run_step(cur[:, None], [0, 1], [pos, pos], [1, 1]))
        jax.block_until_ready(runner.cache)
        logits.append(lg)
        cur = lg.argmax(-1).astype(np.int32)
        out.append(cur)
        pos += 1
    return np.stack(out), logits


def _rel(a, b):
    return float(max(np.abs(x - y).max() / np.abs(y).max() for x, y in zip(a, b)))


def _collectives(hlo: str) -> dict:
    import re
    out = {}
    for m in re.finditer(r"\b(all-reduce|all-gather|all-to-all|collective-permute|"
                         r"reduce-scatter)(-start)?\(", hlo):
        out[m.group(1)] = out.get(m.group(1), 0) + 1
    return out


def worker(mode, devices, steps, out_path):
    import jax
    import jax.numpy as jnp
    from dsv4_jax import config, distributed as DI, params as P
    from dsv4_jax.cache import CacheSpec
    from dsv4_jax.quant import Numerics
    from dsv4_jax.runner import ModelRunner, PrefillChunk, RowStart, StepBatch
    from dsv4_jax.serve.sampling import SamplingParams, SamplingRows

    assert len(jax.devices()) == 8, jax.devices()
    res = {}
    rng = np.random.default_rng(52)
    if mode == "xla":   # f32, no FP8 simulation: every difference is a reordered f32 sum
        cfg = _cfg(config, 1024)
        nm = Numerics(act_quant=False, dtype="float32")
        cs = CacheSpec.for_numerics(nm, max_requests=2, num_blocks=8, max_blocks=2)
    else:               # the trained numerics, every kernel in the Mosaic GPU interpreter
        _lockstep_interpreter()
        # one CSA layer (every cache kernel: window and compressed scatters, indexer top-k,
        # sparse attention; and the weight-streaming matmuls): interpreting is the cost
        cfg = _cfg(config, 256 if max(devices) <= 2 else 1024).replace(
            num_hidden_layers=1, compress_ratios=(4, 0), num_hash_layers=0)
        nm = Numerics(True, "bfloat16", matmul="interpret")
        cs = CacheSpec.for_numerics(nm, max_requests=2, num_blocks=8, max_blocks=2,
                                    kernels="interpret")
    params = P.init_params(cfg, 52)
    prompt = rng.integers(0, cfg.vocab_size, (2, PROMPT)).astype(np.int32)
    mk = lambda mesh=None, nm=nm, cs=cs: ModelRunner(cfg, params, numerics=nm, cache_spec=cs,
                                                     chunk=CHUNK, mesh=mesh)
    ref_tok, ref_lg = _drive(mk(), prompt, steps)
    if mode == "kernels":   # the yardstick of rounding: one device, the XLA path
        nx = Numerics(True, "bfloat16")
        _, x_lg = _drive(mk(nm=nx, cs=CacheSpec.for_numerics(nx, max_requests=2, num_blocks=8,
                                                            max_blocks=2)), prompt, steps)
        res["rel_xla_vs_kernels"] = _rel(x_lg, ref_lg)
    for n in devices:
        r = mk(DI.make_tensor_mesh(n))
        tok, lg = _drive(r, prompt, steps)
        res[n] = {"tokens_equal": bool((tok == ref_tok).all()), "rel": _rel(lg, ref_lg),
                  "steps": steps}
        wq = r.params["layers.0.attn.wq_b"].w
        res[n]["wq_b_rows"] = int(wq.addressable_shards[0].data.shape[0])
        if mode == "xla" and n == 2:
            i32 = lambda *s: jnp.zeros(s, jnp.int32)
            hlo = r.step.lower(r.state, r.cache, i32(2, 1), i32(2), i32(2), i32(2),
                               i32(2, 2)).compile().as_text()
            res[n]["collectives"] = _collectives(hlo)
            # the scheduler's path: a StepBatch with in-program greedy sampling
            r2, r1 = mk(DI.make_tensor_mesh(n)), mk()
            greedy = SamplingRows.row(SamplingParams(temperature=0.0), 0)
            toks = []
            for r_ in (r1, r2):
                got = []
                pre = tuple(PrefillChunk(s, tuple(int(t) for t in prompt[s]), 0, greedy)
                            for s in range(2))
                for s in range(2):
                    r_.bm.admit(PROMPT)
                    r_.bm.ensure(s, PROMPT + 6)
                res_ = r_.execute(StepBatch(prefill=pre))
                firsts = [res_.first_token(i) for i in range(2)]
                b = StepBatch(start=tuple(RowStart(s, firsts[s], PROMPT, greedy)
                                          for s in range(2)), run=(0, 1))
                for _ in range(5):
                    got.append(r_.execute(b).fetch()[1][0][:, 0].tolist())
                    b = StepBatch(run=(0, 1))
                toks.append(got)
            res[n]["execute_tokens"] = toks
        print(mode, n, res[n], flush=True)
    with open(out_path, "w") as f:
        json.dump(res, f)


def _run(tmp_path, mode, devices, steps, timeout):
    out = tmp_path / f"{mode}.json"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, __file__, mode, ",".join(map(str, devices)),
                        str(steps), str(out)], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return {k: v for k, v in json.loads(out.read_text()).items()}


@pytest.mark.slow  # ~140 s: 2 and 8 virtual devices, XLA path (test_tensor_pspecs_and_form stays)
def test_tensor_layout_matches_one_device(tmp_path):
    """XLA path, f32: 16 greedy steps on 2 and 8 devices give one device's tokens and
    logits to f32 rounding; the compiled step has two all-reduces a layer and one
    all-gather (the logits); the StepBatch path samples the same tokens."""
    res = _run(tmp_path, "xla", (2, 8), 16, 900)
    for n in ("2", "8"):
        assert res[n]["tokens_equal"], res[n]
        assert res[n]["rel"] < 1e-5, res[n]
        assert res[n]["wq_b_rows"] == 8 * 512 // int(n)   # query heads split
    assert res["2"]["collectives"] == {"all-reduce": 2 * 3, "all-gather": 1}, res["2"]
    one, tp = res["2"]["execute_tokens"]
    assert one == tp and len(one) == 5


def test_tensor_pspecs_and_form():
    """Which stored fields split (block scales with their weights), the w1 / w3 row pairing
    (device d's rows are its w1 chunk then its w3 chunk), and clear errors."""
    import jax
    from jax.sharding import PartitionSpec as P
    from dsv4_jax import config, distributed as DI, params as PR
    cfg = _cfg(config, 256)
    params = PR.merge_x_proj(PR.init_params(cfg, 3), cfg)
    sp = DI.tensor_pspecs(params, 2)
    assert sp["layers.1.attn.wq_b"].w == P("model", None)
    assert sp["layers.1.attn.wq_b"].scale == P("model", None)
    assert sp["layers.1.attn.wo_b"].w == P(None, "model")
    assert sp["layers.1.ffn.experts.w13"].packed == P(None, "model", None)
    assert sp["layers.1.ffn.experts.w2"].scale == P(None, None, "model")
    assert sp["head.weight"] == P("model", None)
    for k in ("embed.weight", "layers.1.attn.wqkv_a", "layers.1.attn.indexer.wq_b",
              "layers.1.ffn.gate.weight"):
        assert all(s == P() for s in jax.tree.leaves(sp[k], is_leaf=lambda x: isinstance(x, P)))
    n = 2
    tf = DI.tensor_form(params, n)
    w, t = (np.asarray(x["layers.1.ffn.shared_experts.w13"].w, np.float32) for x in (params, tf))
    I = w.shape[0] // 2
    c = I // n
    for d in range(n):   # device d's contiguous rows: w1 chunk d, then w3 chunk d
        np.testing.assert_array_equal(t[2 * c * d: 2 * c * d + c], w[c * d: c * (d + 1)])
        np.testing.assert_array_equal(t[2 * c * d + c: 2 * c * (d + 1)],
                                      w[I + c * d: I + c * (d + 1)])
    back = DI.tensor_form(tf, n, inverse=True)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8) if a.dtype.itemsize == 1
                                      else np.asarray(a),
                                      np.asarray(b).view(np.uint8) if b.dtype.itemsize == 1
                                      else np.asarray(b))
    with pytest.raises(ValueError, match="o_groups"):
        DI.tensor_config(config.tiny(), 4)          # 2 output groups
    with pytest.raises(ValueError, match="does not split"):
        DI.tensor_pspecs(params, 4)                 # FP8 w13: 256 / 4 = 64-row halves


def test_cli_layout_tensor_refusals():
    """`--layout tensor` refuses other mesh axes, and a model whose heads, groups or weight
    blocks do not split, before any weight is read."""
    import argparse
    from dsv4_jax import cli, config
    from dsv4_jax.errors import UsageError
    base = dict(devices=2, layout="tensor", expert=None, model=None, data=None,
                max_requests=1)
    for kw, cfg, msg in (({"expert": 2}, _cfg(config, 256), "drop --expert"),
                         ({"model": 4}, _cfg(config, 256), "drop --expert"),
                         ({}, config.tiny(), "multiple of 128"),   # 64-column expert halves
                         ({"devices": 4}, config.tiny(), "o_groups")):
        with pytest.raises(UsageError, match=msg):
            cli._prepare_layout(argparse.Namespace(**dict(base, **kw)), cfg)


@pytest.mark.slow
def test_tensor_layout_kernels_interpreted(tmp_path):
    """Every kernel on (window / compressed scatters, indexer top-k, sparse attention,
    weight-streaming matmuls: the Mosaic GPU interpreter), trained numerics, one CSA layer,
    2 devices, one decode step after the prefill (~100 s on 2 CPU cores: interpreting is
    the cost): one device's greedy tokens, and logits no further from one device's than one
    device's own XLA path is from its kernels (the FP8 activation simulation turns a
    reordered bf16 sum into a different FP8 rounding downstream)."""
    res = _run(tmp_path, "kernels", (2,), 1, 1800)
    assert res["2"]["tokens_equal"], res
    assert res["2"]["rel"] <= max(2 * res["rel_xla_vs_kernels"], 1e-2), res


# ~10 more minutes on 2 CPU cores: beyond the suite's budget, so run on request
# (DSV4_TEST_TP_INTERPRET=1 pytest -k interpreted_4_and_8)
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DSV4_TEST_TP_INTERPRET"),
                    reason="~10 min of interpreted kernels: DSV4_TEST_TP_INTERPRET=1 runs it")
def test_tensor_layout_kernels_interpreted_4_and_8(tmp_path):
    """As above on 4 and 8 devices, two decode steps."""
    res = _run(tmp_path, "kernels", (4, 8), 2, 3000)
    for n in ("4", "8"):
        assert res[n]["tokens_equal"], res
        assert res[n]["rel"] <= max(2 * res["rel_xla_vs_kernels"], 1e-2), res


if __name__ == "__main__":
    worker(sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3]),
           sys.argv[4])
