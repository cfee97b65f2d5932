"""Shared by the benchmark scripts: the ceilings every result is judged against (HBM
bandwidth, dense BF16 tensor throughput), a timing helper, and the kernel count of a
compiled program (read from its optimised HLO)."""
from __future__ import annotations

import glob
import math
import re
import statistics
import tempfile
import time
from collections import Counter

import jax
import jax.numpy as jnp


def median_seconds(call, iters: int = 10) -> float:
    """Median wall time of `call()` (blocked until its results are ready) over `iters` runs,
    after one warm-up run."""
    jax.block_until_ready(call())
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def profile_times(progs, n=3):
    """progs: [(name, compiled program, its argument)], each already run once. Traces n
    calls of each (10 ms pause between calls) -> {name: dict(busy, span, top, events)} per
    call: busy = sum of the GPU stream events' durations (kernels + copies), span = first
    start to last end, top = the 3 longest event names with their time, per = every event
    name with its time, in seconds."""
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        for _, f, arg in progs:
            for _ in range(n):
                jax.block_until_ready(f(arg))
                time.sleep(0.01)   # calls are told apart by this pause
    path = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0]
    prof = jax.profiler.ProfileData.from_file(path)
    gpu = any(pl_.name.startswith("/device:GPU") for pl_ in prof.planes)
    evs = []
    for plane in prof.planes:
        if gpu and not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if gpu and "stream" not in line.name.lower():
                continue
            for ev in line.events:
                if not gpu and "hlo_op" not in dict(ev.stats):   # CPU: the thunks only
                    continue
                evs.append((ev.start_ns, ev.end_ns, ev.name))
    evs.sort()
    calls, end = [], -1e30
    for e in evs:
        if e[0] - end > 5e6:
            calls.append([])
        calls[-1].append(e)
        end = max(end, e[1])
    if len(calls) != n * len(progs):
        raise RuntimeError(f"profile: {len(calls)} event groups for {n * len(progs)} calls")
    out = {}
    for i, (name, _, _) in enumerate(progs):
        group = calls[i * n:(i + 1) * n]
        per = Counter()
        for c in group:
            for e in c:
                per[e[2]] += e[1] - e[0]
        out[name] = dict(busy=sum(per.values()) / n * 1e-9,
                         span=sum(max(e[1] for e in c) - c[0][0] for c in group) / n * 1e-9,
                         per=[(k[:80], v / n * 1e-9) for k, v in per.most_common()],
                         events=sum(len(c) for c in group) / n)
        out[name]["top"] = out[name]["per"][:3]
    return out


def gpu_seconds(f, args, n: int = 5) -> float:
    """GPU time of one call of f(*args) (already compiled or jittable): the mean over n
    traced calls of the summed GPU stream events (kernels + copies), so the host's dispatch
    (tens of microseconds a call) does not count, as it does not inside a step's CUDA graph."""
    for _ in range(3):
        y = f(*args)
    jax.block_until_ready(y)
    r = profile_times([("f", lambda a: f(*a), args)], n=n)
    return r["f"]["busy"]


def _best_seconds(f, args, calls: int, rounds: int, warm_s: float) -> float:
    """Seconds a call of f(*args): `warm_s` of back-to-back calls first (clocks ramp up: a
    cold first measurement read 2.2 TB/s on an H200 whose copies reach 4.1-4.4), then the
    best of `rounds` rounds of `calls` calls enqueued back to back and blocked once (the
    host's dispatch hides behind the device)."""
    jax.block_until_ready(f(*args))
    t_end = time.perf_counter() + warm_s
    while time.perf_counter() < t_end:
        for _ in range(4):
            y = f(*args)
        jax.block_until_ready(y)   # the last result only: f may donate the earlier ones
    best = math.inf
    for _ in range(rounds):
        t0 = time.perf_counter()
        y = None
        for _ in range(calls):
            y = f(*args)
        jax.block_until_ready(y)
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def hbm_bandwidth(nbytes: int = 1 << 30, calls: int = 10, rounds: int = 3,
                  warm_s: float = 0.5) -> dict:
    """The HBM ceiling, measured three ways on the default device -> {name: bytes/s}:
    "copy" (jnp.copy, bytes read + written), "a+1" (elementwise f32 pass, read + written),
    "read" (a max-reduction: bytes read); "ceiling" is the largest."""
    x = jax.random.normal(jax.random.key(7), (nbytes // 4 // 4096, 4096), jnp.float32)
    passes = (("copy", jnp.copy, 2), ("a+1", lambda a: a + 1.0, 2), ("read", jnp.max, 1))
    out = {name: n_io * x.nbytes / _best_seconds(jax.jit(fn), (x,), calls, rounds, warm_s)
           for name, fn, n_io in passes}
    out["ceiling"] = max(out.values())
    return out


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """The ceiling of hbm_bandwidth (bytes/s): what every "% of bandwidth" divides by."""
    return hbm_bandwidth(nbytes)["ceiling"]


def tensor_peak(n: int = 8192, calls: int = 10, rounds: int = 3, warm_s: float = 0.5) -> float:
    """The dense BF16 tensor-core ceiling, measured (flop/s): an [n, n] @ [n, n] bf16 matmul
    (f32 accumulation, as the kernels' wgmma) timed as hbm_bandwidth times its passes.
    cuBLAS reaches 676-706 TFLOP/s on an H100 / H200, not the datasheet's 989: that is
    what counts."""
    ka, kb = jax.random.split(jax.random.key(11))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(x.dtype))
    return 2.0 * n ** 3 / _best_seconds(f, (a, b), calls, rounds, warm_s)


# HLO opcodes that launch a kernel of their own: fusions, custom calls (the Pallas kernels,
# library GEMMs) and the few ops XLA leaves unfused
KERNEL_OPS = ("fusion", "custom-call", "dot", "scatter", "gather", "copy", "sort")


def op_sources(hlo_text: str) -> dict[str, tuple[str, str, str]]:
    """HLO instruction name -> (opcode, label, op_name) for every ENTRY instruction of an
    optimised HLO module. label = 'opcode: last two op_name parts' (custom calls add their
    result type: the kernels share one op name); without op_name metadata, the
    instruction's name in brackets (it says what it fuses)."""
    entry = hlo_text[hlo_text.index("ENTRY"):]
    out = {}
    for line in entry.splitlines():
        # result type: one word, or a tuple (a multi-output fusion: a kernel too)
        m = re.search(r"%?([\w.-]+) = (?:\(.*?\)|\S+) ([\w-]+)\(", line)
        if not m:
            continue
        name = re.search(r'op_name="([^"]+)"', line)
        if name is None:
            base = re.sub(r"[.]\d+$", "", m.group(1))
            out[m.group(1)] = (m.group(2), f"{m.group(2)}: <{base}>", "")
            continue
        parts = [p for p in name.group(1).split("/") if not p.startswith("jit(")]
        label = f"{m.group(2)}: " + "/".join(parts[-2:])[:80]
        if m.group(2) == "custom-call":
            label += " -> " + re.search(r" = (\(.*?\)|\S+) ", line).group(1)[:60]
        out[m.group(1)] = (m.group(2), label, name.group(1))
    return out


def kernels_by_source(hlo_text: str) -> tuple[int, Counter]:
    """(number of kernel-launching ENTRY instructions, Counter of their labels)."""
    src = Counter(label for op, label, _ in op_sources(hlo_text).values() if op in KERNEL_OPS)
    return sum(src.values()), src


def kernels_by_layer(hlo_text: str) -> Counter:
    """Counter: layer index -> kernels whose op_name names that layer (`layer3_csa/...`);
    key None for the rest (embedding, head, the step's own bookkeeping)."""
    out = Counter()
    for op, _, op_name in op_sources(hlo_text).values():
        if op in KERNEL_OPS:
            m = re.search(r"(?:^|/)layer(\d+)_", op_name)
            out[int(m.group(1)) if m else None] += 1
    return out
