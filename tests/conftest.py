import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# the CLI keeps compiled programs under ~/.cache by default; tests ask for it explicitly
os.environ.setdefault("DSV4_COMPILE_CACHE", "off")


def _have_gpu():
    try:
        import jax
        return jax.default_backend() == "gpu"
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _have_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_generate(tmp_path_factory):
    """(env, cmd, single): the `dsv4 generate` command line (greedy, 6 new tokens) for a tiny
    checkpoint that `dsv4 make-checkpoint` writes with a fresh seed, and that command's
    completed run on one device (stdout: the reference the multi-device runs must print).
    env: the environment both ran in (one CPU device); session scope, so the checkpoint is
    written and the single-device run made once for every test comparing against it."""
    import subprocess
    import numpy as np

    env = dict(os.environ, PYTHONPATH=ROOT, DSV4_COMPILE_CACHE="off", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    ck = tmp_path_factory.mktemp("tiny_generate") / "ck"
    seed = str(int(np.random.default_rng().integers(1000)))
    base = [sys.executable, "-m", "dsv4_jax"]
    subprocess.run(base + ["make-checkpoint", "--preset", "tiny", "--seed", seed,
                           "--quiet", str(ck)], env=env, check=True, capture_output=True,
                   timeout=600)
    cmd = base + ["generate", "--checkpoint", str(ck), "--prompt", "one two three",
                  "--max-new-tokens", "6"]
    single = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert single.returncode == 0, single.stderr[-2000:]
    assert "--- prompt" in single.stdout and "mesh" not in single.stderr
    return env, cmd, single
