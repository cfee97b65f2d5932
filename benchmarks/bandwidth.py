"""The device's ceilings, as every benchmark here measures them (benchmarks.common):

    PYTHONPATH=. python -m benchmarks.bandwidth [--repeat 3] [--tensor]

Prints, per repeat and for 1 and 2 GiB buffers, the HBM bandwidth three ways (a copy and
an `a + 1` pass count bytes read + written, a max-reduction bytes read; each the best of
3 rounds of 10 back-to-back calls after 0.5 s of warm-up) in GB/s; the largest is the
ceiling the decode floor and every "% of ceiling" divide by. --tensor adds the dense BF16
matmul throughput (an [8192]^3 matmul, TFLOP/s).
"""
import argparse

import jax

from benchmarks.common import hbm_bandwidth, tensor_peak


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tensor", action="store_true", help="also the dense BF16 matmul peak")
    a = ap.parse_args(argv)
    print("device", jax.devices()[0].device_kind)
    for r in range(a.repeat):
        for gib in (1, 2):
            bw = {k: round(v / 1e9) for k, v in hbm_bandwidth(gib << 30).items()}
            print(f"repeat {r}, {gib} GiB: HBM GB/s {bw}", flush=True)
        if a.tensor:
            print(f"repeat {r}: dense BF16 {tensor_peak() / 1e12:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
