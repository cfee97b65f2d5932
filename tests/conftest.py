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
