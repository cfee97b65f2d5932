"""The `dsv4` command line end to end on the tiny preset: a synthetic checkpoint, conversion,
inspection, generation from the converted checkpoint, and teacher-forced logits that equal
the engine's."""
import json

import numpy as np
import pytest

from dsv4_jax import cli, config, params as P
from pallas_kernels import formats as kvformat
from dsv4_jax.generate import Engine
from dsv4_jax.quant import Numerics


def run(argv):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
        raise SystemExit(0)
    return e.value.code


def test_cli_end_to_end(tmp_path, capsys):
    src, dst = tmp_path / "src", tmp_path / "dst"
    seed = 401
    assert run(["make-checkpoint", "--preset", "tiny", "--seed", str(seed), "--quiet", str(src)]) in (0, None)
    assert run(["convert", str(src), str(dst), "--quiet"]) in (0, None)
    assert run(["inspect", str(dst)]) in (0, None)
    assert "csa" in capsys.readouterr().out
    assert run(["convert", str(tmp_path / "nope"), str(tmp_path / "x")]) == 2  # clear error
    tokens = np.random.default_rng(402).integers(0, 1024, (2, 20)).astype(np.int32)
    np.save(tmp_path / "t.npy", tokens)
    out = tmp_path / "o.npz"
    assert run(["logits", "--checkpoint", str(dst), "--tokens", str(tmp_path / "t.npy"),
                "--prefill-len", "15", "--act-quant", "off", "--dtype", "float32",
                "--out", str(out)]) in (0, None)
    got = np.load(out)["logits"]
    assert got.shape == (2, 6, 1024)
    cfg = config.tiny()
    eng = Engine(cfg, P.init_params(cfg, seed), numerics=Numerics(False, "float32"))
    np.testing.assert_allclose(got, eng.teacher_forced_logits(tokens, 15), rtol=1e-5, atol=1e-5)
    capsys.readouterr()
    assert run(["generate", "--checkpoint", str(dst), "--user", "hi", "--max-new-tokens", "3",
                "--act-quant", "off", "--dtype", "float32"]) in (0, None)
    cap = capsys.readouterr()
    assert "tokens/s" in cap.err
    json.loads(cap.out.strip().splitlines()[-1])  # the parsed completion


def test_kernel_flags_need_hopper(capsys):
    """auto picks the pure-JAX paths off a Hopper GPU; asking for the kernels there fails
    with a message naming the device."""
    import jax
    if jax.default_backend() == "gpu":
        pytest.skip("CPU-only check")
    msg = None
    try:
        cli.main(["generate", "--prompt", "hi", "--max-new-tokens", "1", "--matmul", "pallas"])
    except SystemExit as e:
        msg = str(e.code)
    assert msg and "Hopper" in msg and "cpu" in msg


def test_index_format_flag():
    """--index-format picks the cached indexer keys' format (with --act-quant on; raw rows
    otherwise); a bad value is refused by the parser."""
    cfg = config.tiny()
    params = P.init_params(cfg, 0)
    for argv, want in ((["--index-format", "nvfp4"], "nvfp4"), ([], "fp4"),
                       (["--index-format", "fp8", "--act-quant", "off"], "raw")):
        args = cli.build_parser().parse_args(["generate", "--prompt", "hi", *argv])
        args.mesh = None
        eng = cli._engine(args, cfg, params)
        assert eng.cs.index_format == want, argv
        if want != "raw":
            assert set(eng.cache["L1"]["idx"]) == set(kvformat.index_key_fields(want))
    assert run(["generate", "--prompt", "hi", "--index-format", "fp6"]) == 2


def test_compiled_programs_are_cached_on_disk(tmp_path, capsys):
    """--compile-cache DIR: the generate program lands in DIR (jax's persistent cache)."""
    import jax
    from jax._src import compilation_cache
    cache = tmp_path / "xla"
    suite_dir = jax.config.jax_compilation_cache_dir   # the suite's own cache (conftest)
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()   # jax binds its cache directory once per process
    try:
        assert run(["generate", "--prompt", "hello", "--max-new-tokens", "3",
                    "--compile-cache", str(cache)]) in (0, None)
    finally:  # later tests in this process must not write into the deleted tmp dir
        jax.config.update("jax_compilation_cache_dir", suite_dir)
        compilation_cache.reset_cache()
    assert cache.is_dir() and any(cache.iterdir()), "no compiled program was written"
    capsys.readouterr()


def test_generate_on_a_mesh_equals_single_device(tiny_generate):
    """`dsv4 generate --devices 2` (2 virtual CPU devices, experts split, the checkpoint
    loaded into its shards) prints the same greedy completion as one device (the shared
    single-device run of conftest's tiny_generate); a mesh axis without --devices is a
    clear error."""
    import subprocess
    env, gen, single = tiny_generate
    env = dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    mesh = subprocess.run(gen + ["--devices", "2"], env=env, capture_output=True, text=True,
                          timeout=900)
    assert mesh.returncode == 0, mesh.stderr[-2000:]
    assert "--- prompt" in single.stdout and single.stdout == mesh.stdout
    assert "mesh {'data': 1, 'expert': 2, 'model': 1}" in mesh.stderr
    assert "mesh" not in single.stderr
    bad = subprocess.run(gen + ["--expert", "2"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode != 0 and "--expert needs --devices" in bad.stderr
