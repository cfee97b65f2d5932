"""The HBM ceiling as benchmarks.common measures it, against the earlier measurement.

  PYTHONPATH=. python3 benchmarks/bandwidth.py [--repeat 3]
Prints, per repeat: hbm_bandwidth (copy / a+1 / read, best of 3 rounds of 10 back-to-back
calls after 0.5 s of warm-up) and legacy_copy_bandwidth (median of 10 synchronised `a + 1`
calls after one warm-up, used up to 2026-11-25), for 1 and 2 GiB, in GB/s.
"""
import argparse

import jax

from benchmarks.common import hbm_bandwidth, legacy_copy_bandwidth

ap = argparse.ArgumentParser()
ap.add_argument("--repeat", type=int, default=3)
a = ap.parse_args()
print("device", jax.devices()[0].device_kind)
for r in range(a.repeat):
    for gib in (1, 2):
        old = legacy_copy_bandwidth(gib << 30) / 1e9
        new = {k: round(v / 1e9) for k, v in hbm_bandwidth(gib << 30).items()}
        print(f"repeat {r} {gib} GiB: legacy a+1 {old:.0f} | hbm_bandwidth {new}", flush=True)
