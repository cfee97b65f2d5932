"""dsv4-jax: DeepSeek-V4 (Flash and Pro) inference in JAX.

Public API: `load`, `Engine` (generate / stream / teacher_forced_logits), the samplers,
`config` presets, `chat` encoding, `embedded_checkpoint()` (the small trained model that
ships with the package).
"""
from . import config, params, quant, chat  # noqa: F401
from .config import Config  # noqa: F401
from .embedded import embedded_checkpoint  # noqa: F401
from .quant import EXACT_COMPILER_OPTIONS, Numerics  # noqa: F401


def load(path, mesh=None, **kw):
    """Load an orbax or safetensors checkpoint -> (Config, params)."""
    from .loading import load as _load
    return _load(path, mesh=mesh, **kw)


def __getattr__(name):  # lazy: keep `import dsv4_jax` light
    if name in ("Engine", "Greedy", "Temperature", "TopK", "TopP", "MinP"):
        from . import generate
        return getattr(generate, name)
    raise AttributeError(name)
