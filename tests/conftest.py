import os
import shutil
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# the CLI keeps compiled programs under ~/.cache by default; tests ask for it explicitly
os.environ.setdefault("DSV4_COMPILE_CACHE", "off")

# Seeds of the shared models (fixtures built once per test run, below) and of the tiny checkpoint.
TINY_SEED = 20
TEST_SEED = 21
CHECKPOINT_SEED = 22


def _have_gpu():
    try:
        import jax
        return jax.default_backend() == "gpu"
    except Exception:
        return False


def pytest_configure(config):
    """jax's persistent compilation cache in one directory per test run: tests that build
    the same program through different jitted functions (a forward of the same model and
    shapes, an engine's step) compile it once (CPU compilation is most of the suite's time).
    A loaded program is the compiled one, bit for bit. Programs compiling under a second
    stay in memory only. xdist workers inherit the controller's directory."""
    import jax
    d = os.environ.get("DSV4_TEST_XLA_CACHE")
    if d is None:
        d = tempfile.mkdtemp(prefix="dsv4-test-xla-")
        os.environ["DSV4_TEST_XLA_CACHE"] = d
        config._dsv4_xla_cache = d  # made here: removed at the end
    jax.config.update("jax_compilation_cache_dir", d)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def pytest_unconfigure(config):
    d = getattr(config, "_dsv4_xla_cache", None)
    if d:
        shutil.rmtree(d, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if _have_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model():
    """(cfg, params): the `tiny` preset with seeded random weights, built once per run."""
    from dsv4_jax import config, params as P
    cfg = config.tiny()
    return cfg, P.init_params(cfg, TINY_SEED)


@pytest.fixture(scope="session")
def test_preset_model():
    """(cfg, params): the `test` preset (every layer kind at the smallest widths) with
    seeded random weights, built once per run."""
    from dsv4_jax import config, params as P
    cfg = config.test()
    return cfg, P.init_params(cfg, TEST_SEED)


@pytest.fixture(scope="session")
def tiny_generate(tmp_path_factory):
    """(env, cmd, single): the `dsv4 generate` command line (greedy, 6 new tokens) for a tiny
    checkpoint that `dsv4 make-checkpoint` writes, and that command's completed run on one
    device (stdout: the reference the multi-device runs must print). env: the environment
    both ran in (one CPU device); built once per test run, so the checkpoint is written and the
    single-device run made once for every test comparing against it."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=ROOT, DSV4_COMPILE_CACHE="off", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    ck = tmp_path_factory.mktemp("tiny_generate") / "ck"
    base = [sys.executable, "-m", "dsv4_jax"]
    subprocess.run(base + ["make-checkpoint", "--preset", "tiny", "--seed", str(CHECKPOINT_SEED),
                           "--quiet", str(ck)], env=env, check=True, capture_output=True,
                   timeout=600)
    cmd = base + ["generate", "--checkpoint", str(ck), "--prompt", "one two three",
                  "--max-new-tokens", "6"]
    single = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert single.returncode == 0, single.stderr[-2000:]
    assert "--- prompt" in single.stdout and "mesh" not in single.stderr
    return env, cmd, single
