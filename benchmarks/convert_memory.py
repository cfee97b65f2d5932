"""Peak host memory and throughput of `dsv4 convert` on synthetic full-width checkpoints.

For each --layers N: writes a synthetic checkpoint of the preset (official FP8/FP4 layout,
experts drawn directly in stored format), then converts it once per --budgets entry, each in
a fresh process (`python -m checkpoints convert`). Peak RSS is measured twice: the child's
own getrusage (in the manifest) and the parent polling /proc/<pid>/status every 50 ms.
Prints a markdown table (also written to --out if given) and deletes the multi-GB files
afterwards.

  python benchmarks/convert_memory.py --preset flash --layers 1 3 --budgets 2.5G 8G \
      --workdir /tmp/bench_convert
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from checkpoints.convert import MANIFEST, parse_bytes  # noqa: E402
from checkpoints.synthetic import make_checkpoint, truncate_layers  # noqa: E402
from dsv4_jax.config import get_preset  # noqa: E402


def _rss_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_convert(src: Path, dst: Path, budget: str, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "checkpoints", "convert", str(src), str(dst),
           "--memory-budget", budget, "--quiet", *extra]
    t0 = time.time()
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"})
    polled = 0
    while p.poll() is None:
        polled = max(polled, _rss_of(p.pid))
        time.sleep(0.05)
    out, err = p.communicate()
    wall = time.time() - t0
    if p.returncode:
        raise RuntimeError(f"convert failed ({p.returncode}):\n{out}\n{err[-3000:]}")
    s = json.loads((dst / MANIFEST).read_text())["summary"]
    return {"budget": parse_bytes(budget), "peak_rss": s["peak_rss_bytes"], "polled_rss": polled,
            "seconds": s["seconds"], "wall": wall, "bytes": s["converted_source_bytes"],
            "gbps": s["gb_per_s"], "chunk": s["chunk_bytes"]}


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--budgets", nargs="+", default=["3.5G", "8G"])
    ap.add_argument("--workdir", default="/tmp/bench_convert")
    ap.add_argument("--out", default=None, help="also write the table to this file")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic sources")
    ap.add_argument("--reuse", action="store_true", help="reuse kept sources")
    ap.add_argument("--convert-args", default="", help="extra convert flags, e.g. '--expert-dtype fp8'")
    a = ap.parse_args()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in a.layers:
        src = work / f"{a.preset}_L{n}"
        if a.reuse and (src / "model.safetensors.index.json").exists():
            idx = json.loads((src / "model.safetensors.index.json").read_text())
            info = {"bytes": idx["metadata"]["total_size"]}
            wt = float("nan")
        else:
            if src.exists():
                shutil.rmtree(src)
            cfg = truncate_layers(get_preset(a.preset), n)
            t0 = time.time()
            info = make_checkpoint(src, cfg, "official", seed=0, fast_experts=True)
            wt = time.time() - t0
            print(f"wrote {info['bytes'] / 1e9:.2f} GB ({info['shards']} shards) in {wt:.0f} s "
                  f"({info['bytes'] / 1e9 / wt:.2f} GB/s)", flush=True)
        for b in a.budgets:
            dst = work / f"{a.preset}_L{n}_orbax"
            if dst.exists():
                shutil.rmtree(dst)
            r = run_convert(src, dst, b, a.convert_args.split())
            r.update(options=a.convert_args or "(stored precision)", layers=n, src_bytes=info["bytes"], out_disk=disk_bytes(dst), write_s=wt)
            rows.append(r)
            print(json.dumps(r), flush=True)
            shutil.rmtree(dst)
        if not a.keep:
            shutil.rmtree(src)
    write_table(rows, a, Path(a.out) if a.out else None)


def write_table(rows, a, out: Path | None):
    G = 2 ** 30
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    lines = [
        "# Checkpoint conversion: peak host memory and throughput",
        "",
        f"`dsv4 convert` (safetensors official FP8/FP4 layout -> orbax, stored precision kept) on "
        f"synthetic `{a.preset}` checkpoints at full width, `make-checkpoint --preset {a.preset} "
        f"--layers N --fast-experts` (N main blocks + the MTP block + embedding/head).",
        f"Host: {platform.machine()}, {os.cpu_count()} CPU cores, "
        f"{mem / G:.0f} GiB RAM, no GPU; CPU jax. Command: `python benchmarks/convert_memory.py "
        f"--preset {a.preset} --layers {' '.join(map(str, a.layers))} --budgets {' '.join(a.budgets)}` "
        f"(+ `--convert-args '--expert-dtype fp8'` rows where listed). GB = 1e9 bytes, GiB = 2^30.",
        "",
        "| blocks (main+MTP) | checkpoint size | convert options | --memory-budget | chunk size | "
        "peak RSS (getrusage) | peak RSS (polled) | time | throughput |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layers']}+1 | {r['src_bytes'] / 1e9:.2f} GB | {r.get('options', '(stored precision)')} | "
            f"{r['budget'] / G:.1f} GiB | "
            f"{r['chunk'] / G:.2f} GiB | {r['peak_rss'] / G:.2f} GiB | {r['polled_rss'] / G:.2f} GiB | "
            f"{r['seconds']:.1f} s | {r['bytes'] / 1e9 / r['seconds']:.2f} GB/s |")
    lines += [
        "",
        "Reading the table: peak RSS follows the budget, not the checkpoint size (1+1 and 3+1 "
        "blocks peak the same). The converter groups whole arrays of one part (globals, one "
        "layer, the MTP block) into orbax chunks of at most budget - process baseline - 256 MiB; "
        "arrays are read into 64-byte aligned buffers that jax and orbax use without a copy, and "
        "each chunk is freed before the next is read. A part is never merged with another, so "
        "with a large budget the peak is one full layer (~3.6 GB for Flash) plus the baseline. "
        "The floor is the largest single array group (a Flash layer's stacked expert `w1`: "
        "1.07 GB packed + 0.13 GB scales; Pro: 4.7 GB): below it `convert` refuses with a "
        "`MemoryBudgetError` naming the array and the minimum budget.",
        "",
        "Throughput is source bytes / conversion time (validation of every header included); "
        "on a small machine shared with other jobs the spread between rows is mostly noise. "
        "The source was written just before, so reads largely come from the page cache; a cold "
        "read is bounded by the disk instead. Page cache is not counted in RSS (reads use "
        "positional file reads into preallocated arrays, not mmap). Output is uncompressed orbax "
        "(FP8/FP4 bytes compress by only ~9% and zstd doubled a save's memory and time).",
    ]
    text = "\n".join(lines) + "\n"
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
