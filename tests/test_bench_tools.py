"""The benchmark tools that run on the CPU machine too: the launch-cost chain and the
compile-only kernel count."""
import importlib.util
import json

import jax
import pytest

from benchmarks import graph_launch


def test_graph_launch_chain_runs_and_donates(capsys):
    graph_launch.main(["--n", "3", "--calls", "4"])
    lines = [json.loads(s) for s in capsys.readouterr().out.strip().splitlines()]
    assert lines[0]["platform"] == jax.devices()[0].platform
    rows = {r["mode"]: r for r in lines[1:]}
    assert set(rows) == {"fresh", "donated"}
    for r in rows.values():
        assert r["n"] == 3 and r["kernels"] >= 1 and r["sync_us"] > 0


def test_graph_launch_mosaic_chain_computes_its_chain(capsys):
    """The Mosaic-GPU chain (interpreted here) applies its n kernels, and main reports it."""
    import jax.numpy as jnp
    import numpy as np
    x = jax.random.normal(jax.random.key(int(np.random.default_rng().integers(1 << 30))),
                          (64, 256), jnp.float32)
    got = np.asarray(jax.block_until_ready(jax.jit(lambda x: graph_launch.chain_mosaic(x, 3))(x)))
    want = np.asarray(x)
    for _ in range(3):
        want = want * np.float32(0.999) + np.float32(1e-4)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    graph_launch.main(["--n", "1", "--calls", "3", "--kinds", "mosaic", "--modes", "donated"])
    rows = [json.loads(s) for s in capsys.readouterr().out.strip().splitlines()][1:]
    assert [(r["kind"], r["mode"], r["n"]) for r in rows] == [("mosaic", "donated", 1)]


def test_graph_launch_donated_mode_aliases_its_output():
    import jax.numpy as jnp
    f = jax.jit(lambda x, out: graph_launch.chain(x, 2) + 0.0 * out, donate_argnums=(1,))
    x = jnp.ones((8, 16))
    hlo = f.lower(x, x + 1).compile().as_text()
    assert "input_output_alias={ {}: (1, {}" in hlo


def test_aot_anatomy_names_the_missing_plugin():
    """Without the CUDA plugin the compile-only topology fails with a message that says
    what to install (with it, the tool compiles; that needs the plugin, not a GPU)."""
    try:
        installed = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:   # no jax_plugins namespace at all
        installed = False
    if installed:
        pytest.skip("the CUDA plugin is installed here")
    from benchmarks import aot_anatomy
    with pytest.raises(SystemExit, match="CUDA plugin"):
        aot_anatomy.gpu_devices()
