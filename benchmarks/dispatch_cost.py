"""Host cost of a jitted call per argument leaf: is the whole-Flash step's host time its
~2300 leaves (1738 weight arrays read, 545 cache arrays donated and written back)?

A program with almost no GPU work (one tiny kernel touching a few leaves, the donated
leaves aliased straight through) is called with

  read L     L read-only leaves (the weights' role)
  donated D  D leaves donated, each returned in place (the cache's role)

on one device or replicated over a mesh of --devices N (each leaf then has N shards), and
timed as host enqueue (median time until the call returns) and pipelined (N_CALLS calls,
one wait, per call). Flash's counts are the default; the last lines repeat them packed
into one leaf each, the floor.

    PYTHONPATH=. python3 benchmarks/dispatch_cost.py [--devices 2]

Prints one JSON line per case. Runs on the CPU too (its numbers are the CPU client's).
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

N_CALLS = 30


def program(n_read: int, n_don: int):
    """(read [L], don [D]) -> don' : don'[0] = don[0] + read[0] + read[-1]; the other
    donated leaves come back as they went in (aliased: no copy, no kernel)."""
    def f(read, don):
        if not don:
            return read[0] + read[-1]
        acc = don[0] + (read[0] + read[-1] if read else 0)
        return [acc] + list(don[1:])
    return jax.jit(f, donate_argnums=(1,))


def time_case(n_read: int, n_don: int, sharding, shape=(8, 128)):
    mk = lambda i: jax.device_put(jnp.full(shape, i % 7, jnp.float32), sharding)
    read = [mk(i) for i in range(n_read)]
    don = [mk(i) for i in range(n_don)]
    f = program(n_read, n_don)
    out = f(read, don)   # compile
    don = out if n_don else don
    jax.block_until_ready(out)
    enq = []
    for _ in range(10):
        t0 = time.perf_counter()
        out = f(read, don)
        enq.append(time.perf_counter() - t0)
        don = out if n_don else don
        jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(N_CALLS):
        out = f(read, don)
        don = out if n_don else don
    jax.block_until_ready(out)
    pipe = (time.perf_counter() - t0) / N_CALLS
    return 1e3 * float(np.median(enq)), 1e3 * pipe


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--read", type=int, default=1738, help="read-only leaves (Flash weights)")
    ap.add_argument("--donated", type=int, default=545, help="donated leaves (Flash cache)")
    a = ap.parse_args(argv)
    devs = np.array(jax.devices()[:a.devices])
    mesh = jax.sharding.Mesh(devs, ("d",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    L, D = a.read, a.donated
    cases = [(1, 1), (L, 1), (1, D), (L, D), (L // 4, D // 4)]
    for n_read, n_don in cases:
        enq, pipe = time_case(n_read, n_don, sh)
        leaves = n_read + n_don
        print(json.dumps({"device": jax.devices()[0].device_kind, "devices": a.devices,
                          "read": n_read, "donated": n_don, "enqueue_ms": round(enq, 3),
                          "pipelined_ms": round(pipe, 3),
                          "us_per_leaf_pipelined": round(1e3 * pipe / leaves, 2)}), flush=True)


if __name__ == "__main__":
    main()
