"""The `dsv4` command line end to end on the tiny preset (its first three layers): a synthetic checkpoint, conversion,
inspection, generation from the converted checkpoint, and teacher-forced logits that equal
the engine's."""
import json

import numpy as np
import pytest

from dsv4_jax import cli, config, params as P
from pallas_kernels import formats as kvformat
from dsv4_jax.cache import CacheSpec
from dsv4_jax.generate import Engine
from dsv4_jax.quant import Numerics
from checkpoints.synthetic import truncate_layers


def run(argv):
    """The exit status of `dsv4 ARGV` (argparse's own errors raise SystemExit)."""
    try:
        return cli.main(argv)
    except SystemExit as e:
        return e.code


def test_cli_end_to_end(tmp_path, capsys, monkeypatch):
    """Relative paths throughout (the working directory is tmp_path)."""
    monkeypatch.chdir(tmp_path)
    seed = 401
    # one layer of each kind (SWA, CSA, HCA): the commands do not depend on the depth
    assert run(["make-checkpoint", "--preset", "tiny", "--layers", "3", "--seed", str(seed),
                "--quiet", "src"]) == 0
    assert run(["convert", "src", "dst", "--quiet"]) == 0
    assert run(["inspect", "dst"]) == 0
    assert "csa" in capsys.readouterr().out
    assert run(["convert", "nope", "x"]) == 2  # clear error
    tokens = np.random.default_rng(402).integers(0, 1024, (2, 20)).astype(np.int32)
    np.save(tmp_path / "t.npy", tokens)
    assert run(["logits", "--checkpoint", "dst", "--tokens", "t.npy", "--prefill-len", "15",
                "--act-quant", "off", "--dtype", "float32", "--out", "o.npz"]) == 0
    got = np.load(tmp_path / "o.npz")["logits"]
    assert got.shape == (2, 6, 1024)
    cfg = truncate_layers(config.tiny(), 3)
    nm = Numerics(False, "float32")
    # the cache the CLI sized for these tokens: the same programs (compiled once)
    cs = CacheSpec.for_numerics(nm, max_requests=4, num_blocks=64, max_blocks=16)
    eng = Engine(cfg, P.init_params(cfg, seed), numerics=nm, cache_spec=cs)
    np.testing.assert_allclose(got, eng.teacher_forced_logits(tokens, 15), rtol=1e-5, atol=1e-5)
    capsys.readouterr()
    assert run(["generate", "--checkpoint", "dst", "--user", "hi", "--max-new-tokens", "3",
                "--act-quant", "off", "--dtype", "float32"]) == 0
    cap = capsys.readouterr()
    assert "tokens/s" in cap.err
    json.loads(cap.out.strip().splitlines()[-1])  # the parsed completion


def test_kernel_flags_need_hopper(capsys):
    """auto picks the pure-JAX paths off a Hopper GPU; asking for the kernels there is a
    usage error naming the flag and the device."""
    import jax
    if jax.default_backend() == "gpu":
        pytest.skip("CPU-only check")
    for flag in (["--matmul", "pallas"], ["--kernels", "on"]):
        assert run(["generate", "--prompt", "hi", "--max-new-tokens", "1", *flag]) == 2
        err = capsys.readouterr().err
        assert " ".join(flag) in err and "Hopper" in err and "cpu" in err


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
            assert set(eng.cache[1].idx) == set(kvformat.index_key_fields(want))
    assert run(["generate", "--prompt", "hi", "--index-format", "fp6"]) == 2


@pytest.mark.slow  # ~65 s: two CLI runs
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
                    "--compile-cache", str(cache)]) == 0
    finally:  # later tests in this process must not write into the deleted tmp dir
        jax.config.update("jax_compilation_cache_dir", suite_dir)
        compilation_cache.reset_cache()
    assert cache.is_dir() and any(cache.iterdir()), "no compiled program was written"
    capsys.readouterr()


@pytest.mark.slow  # ~145 s with its fixture: subprocesses
def test_generate_on_two_devices_equals_single_device(tiny_generate):
    """`dsv4 generate --devices 2` over 2 virtual CPU devices (the layers split across the
    devices: the default at few request slots; the checkpoint loaded straight onto each
    stage's device) prints the same greedy completion as one device (conftest's
    tiny_generate). The expert mesh through the CLI: test_sharding's two-process run. A
    mesh axis without --devices, or with the pipeline, is a clear error."""
    import subprocess
    env, gen, single = tiny_generate
    env = dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    assert "--- prompt" in single.stdout
    two = subprocess.run(gen + ["--devices", "2"], env=env, capture_output=True, text=True,
                         timeout=900)
    assert two.returncode == 0, two.stderr[-2000:]
    assert single.stdout == two.stdout
    note = "pipeline stages at layers (0, 4, 5)"
    assert note in two.stderr and note not in single.stderr
    for extra, msg in ((["--expert", "2"], "--expert needs --devices"),
                       (["--devices", "2", "--layout", "pipeline", "--expert", "2"],
                        "--layout mesh")):
        bad = subprocess.run(gen + extra, env=env, capture_output=True, text=True, timeout=300)
        assert bad.returncode == 2 and msg in bad.stderr, bad.stderr[-500:]
