"""Which GPU generation a kernel package compiles for: Hopper (sm_90a) or Blackwell (sm_100a).

The kernel packages' entry points pick their Mosaic GPU variant by the compute capability
Mosaic GPU itself lowers for: the default device's (a compile-only topology's device when
one is the default, benchmarks/kernel_count.py --spec b200), 9.0 where there is no GPU.
Blackwell's datacenter parts (B200 10.0, B300 10.3) have tcgen05 / TMEM and no wgmma;
consumer Blackwell (12.x) has neither, so it takes no Blackwell kernel here.
"""
from jax.experimental.mosaic.gpu import utils as mgpu_utils


def compute_capability() -> tuple[int, int]:
    """(major, minor) Mosaic GPU lowers for now (outside any kernel's lowering)."""
    a = mgpu_utils.get_arch()
    return a.major, a.minor


def is_blackwell() -> bool:
    """The target has tcgen05 MMA and tensor memory (sm_100a / sm_103a)."""
    return compute_capability()[0] == 10
