"""Peak host memory of `dsv4_jax.load` on a synthetic full-width checkpoint (CPU jax).

Writes a synthetic checkpoint of the preset (official FP8/FP4 layout, experts drawn in
stored format; `--experts` cuts the routed experts to keep it a few GB), converts it to
orbax once, then loads each form in a fresh process, with and without the numerics check.
Each child reports its RSS after imports and backend start (a first transfer and compile:
the baseline), its peak RSS
(getrusage) and the bytes of the loaded arrays; the parent also polls /proc every 20 ms.
On a CPU backend the loaded arrays are host memory, so the figure to read is
  overhead = peak - baseline - loaded bytes (on GPU: peak - baseline),
which `load` keeps bounded independently of the model size (docs/CHECKPOINTS.md).

  python benchmarks/load_memory.py --preset flash --layers 1 --experts 64 \
      --workdir /tmp/bench_load [--pythonpath OTHER_CHECKOUT]

`--pythonpath` loads with another checkout's code (e.g. an older commit unpacked with
`git archive COMMIT | tar -x -C DIR`) on the same checkpoints, for a before/after.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.convert_memory import _rss_of  # noqa: E402

_CHILD = r"""
import json, resource, sys
def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
import jax, numpy as np
from dsv4_jax import loading
# start the backend fully (on GPU the CUDA libraries and context take GBs of RSS) first
jax.jit(lambda a: a * 2)(jax.device_put(np.ones(1 << 20, np.float32))).block_until_ready()
base = rss()
cfg, params = loading.load(sys.argv[1], numerics_check=sys.argv[2] == "1")
jax.block_until_ready(params)
n = sum(x.nbytes for x in jax.tree.leaves(params))
on_host = jax.default_backend() == "cpu"
print(json.dumps({"baseline": base, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "params_bytes": n, "host_params": n if on_host else 0,
                  "backend": jax.default_backend()}))
"""


def run_load(path: Path, check: bool, pythonpath: Path, platform: str) -> dict:
    p = subprocess.Popen([sys.executable, "-c", _CHILD, str(path), "1" if check else "0"],
                         cwd=pythonpath, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(pythonpath), "JAX_PLATFORMS": platform})
    polled = 0
    while p.poll() is None:
        polled = max(polled, _rss_of(p.pid))
        time.sleep(0.02)
    out, err = p.communicate()
    if p.returncode:
        raise RuntimeError(f"load failed ({p.returncode}):\n{err[-3000:]}")
    r = json.loads(out.strip().splitlines()[-1])
    r["polled"] = polled
    r["overhead"] = r["peak"] - r["baseline"] - r["host_params"]
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--experts", type=int, default=64, help="routed experts (0: the preset's)")
    ap.add_argument("--workdir", default="/tmp/bench_load")
    ap.add_argument("--pythonpath", default=str(ROOT), help="checkout whose code loads")
    ap.add_argument("--platform", default="cpu", help="JAX_PLATFORMS of the loading process")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints (reused next time)")
    a = ap.parse_args()
    from checkpoints.convert import MANIFEST, convert
    from checkpoints.synthetic import INDEX_NAME, make_checkpoint, truncate_layers
    from dsv4_jax.config import get_preset
    work = Path(a.workdir)
    src, dst = work / "safetensors", work / "orbax"
    if not (src / INDEX_NAME).exists():
        cfg = truncate_layers(get_preset(a.preset), a.layers)
        if a.experts:
            cfg = cfg.replace(n_routed_experts=a.experts)
        make_checkpoint(src, cfg, "official", seed=0, fast_experts=True)
    if not (dst / MANIFEST).exists():
        convert(src, dst, memory_budget="4G", progress=False)
    G = 2 ** 30
    print(f"code: {a.pythonpath}; checkpoint: {a.preset} --layers {a.layers} "
          f"--experts {a.experts or 'all'}; loads on {a.platform}")
    print("| checkpoint | numerics check | baseline | loaded arrays | peak RSS | polled | "
          "overhead (peak - baseline - arrays on host) |")
    print("|---|---|---|---|---|---|---|")
    for path in (src, dst):
        for check in (False, True):
            r = run_load(path, check, Path(a.pythonpath), a.platform)
            print(f"| {path.name} | {'on' if check else 'off'} | {r['baseline'] / G:.2f} GiB | "
                  f"{r['params_bytes'] / G:.2f} GiB | {r['peak'] / G:.2f} GiB | "
                  f"{r['polled'] / G:.2f} GiB | {r['overhead'] / G:.2f} GiB |", flush=True)
    if not a.keep:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
