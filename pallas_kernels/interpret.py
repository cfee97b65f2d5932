"""The Mosaic GPU interpreter (CPU) as the kernels take it: `gpu_interpret_params`."""
from jax.experimental.pallas import mosaic_gpu as plgpu

# jax imports its Pallas interpreter lazily, while lowering the first interpreted kernel, and
# that import registers a flag of jit's trace context: every program traced before it was then
# traced and compiled again on its next call (an interpreted decode step compiled twice).
# Imported here, with the kernels, the flag exists before any program is traced.
try:
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # noqa: F401
except ImportError:  # a jax without it has no such flag either
    pass


def gpu_interpret_params(interpret):
    """interpret: None, a bool, or plgpu.InterpretGPUParams -> plgpu.kernel's argument (None:
    compile for the GPU)."""
    if interpret is None or interpret is False:
        return None
    return plgpu.InterpretGPUParams() if interpret is True else interpret
