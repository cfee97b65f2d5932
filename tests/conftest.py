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


@pytest.fixture
def tiny_generate_cmd(tmp_path):
    """make(env) -> the `dsv4 generate` command line (greedy, 6 new tokens) for a tiny
    checkpoint that `dsv4 make-checkpoint` writes with a fresh seed (run under `env`)."""
    import subprocess
    import numpy as np

    def make(env):
        ck = tmp_path / "ck"
        seed = str(int(np.random.default_rng().integers(1000)))
        base = [sys.executable, "-m", "dsv4_jax"]
        subprocess.run(base + ["make-checkpoint", "--preset", "tiny", "--seed", seed,
                               "--quiet", str(ck)], env=env, check=True, capture_output=True,
                       timeout=600)
        return base + ["generate", "--checkpoint", str(ck), "--prompt", "one two three",
                       "--max-new-tokens", "6"]
    return make
