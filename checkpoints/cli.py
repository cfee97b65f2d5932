"""Command-line entry points: `make-checkpoint`, `convert`, `inspect`.

`register(subparsers)` adds them to an argparse subparsers object (the `dsv4` CLI does);
`main(argv)` runs them standalone (`python -m checkpoints ...`)."""
from __future__ import annotations

import argparse
import shlex


def _make_checkpoint(a) -> int:
    from dsv4_jax.config import get_preset
    from .convert import parse_bytes
    from .synthetic import make_checkpoint, truncate_layers
    # every flag is checked before anything is drawn or written
    shard_bytes = parse_bytes(a.shard_size, "--shard-size")
    if a.seed < 0:
        raise ValueError(f"--seed must be an integer >= 0, got {a.seed}")
    cfg = get_preset(a.preset)
    if a.layers is not None:
        cfg = truncate_layers(cfg, a.layers)
    if a.dspark:  # the V4-Flash-0731 layout: mtp.0-2 are a DSpark drafter
        from dsv4_jax.dspark import with_dspark
        cfg = with_dspark(cfg)
    s = make_checkpoint(a.out, cfg, a.format, a.seed, shard_bytes=shard_bytes,
                        progress=not a.quiet, fast_experts=a.fast_experts)
    print(f"wrote {s['tensors']} tensors ({s['bytes'] / 1e9:.3f} GB) in {s['shards']} shard{'s' * (s['shards'] != 1)} "
          f"to {s['path']} ({a.format} format{', DSpark drafter' if a.dspark else ''})")
    return 0


def _convert(a) -> int:
    from .convert import convert, parse_bytes
    budget = parse_bytes(a.memory_budget, "--memory-budget")
    s = convert(a.src, a.dst, expert_dtype=a.expert_dtype, dtype=a.dtype,
                memory_budget=budget, overwrite=a.overwrite, progress=not a.quiet)
    print(f"converted {s['converted_source_bytes'] / 1e9:.3f} GB in {s['seconds']:.1f} s "
          f"({s['gb_per_s']} GB/s), peak RSS {s['peak_rss_bytes'] / 2**30:.2f} GiB "
          f"(budget {s['memory_budget_bytes'] / 2**30:.2f} GiB) -> {a.dst}")
    return 0


def _inspect(a) -> int:
    from .inspection import format_report, inspect, to_json
    info = inspect(a.path)
    print(to_json(info) if a.json else format_report(info, tensors=a.tensors, match=a.match))
    return 0


def _abs(p: str) -> str:
    from .source import user_path
    return shlex.quote(str(user_path(p)))


def _on_interrupt(a) -> str:
    """The Ctrl-C line: what the interrupted command leaves behind and how to go on."""
    if a.checkpoint_cmd == "convert":
        flags = "".join(f" --{f.replace('_', '-')} {shlex.quote(str(getattr(a, f)))}"
                        for f in ("expert_dtype", "dtype", "memory_budget")
                        if getattr(a, f) is not None)
        # without --overwrite, which would throw the finished parts away
        return (f"the parts finished so far are kept in {_abs(a.dst)} (not marked complete); "
                f"to resume, run: dsv4 convert {_abs(a.src)} {_abs(a.dst)}{flags}")
    if a.checkpoint_cmd == "make-checkpoint":
        return (f"nothing was kept ({_abs(a.out)} is written under a temporary name and "
                "renamed only when complete); run the same command again to start over")
    return "nothing was written"


def register(subparsers) -> None:
    p = subparsers.add_parser("make-checkpoint", help="write a synthetic checkpoint in the real "
                              "on-disk format (random, well-conditioned weights)")
    p.add_argument("out", help="output directory (must not exist or be empty)")
    p.add_argument("--preset", choices=("tiny", "flash", "pro"), default="tiny")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N blocks")
    p.add_argument("--format", choices=("official", "nvfp4"), default="official",
                   help="official FP8/FP4 release layout, or NVFP4 (ModelOpt, HF names)")
    p.add_argument("--dspark", action="store_true",
                   help="the V4-Flash-0731 layout: a DSpark drafter (3 stages mtp.0-2, block "
                        "5, Markov rank 256) in place of the MTP block")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-size", default="4G", help="target bytes per shard file (e.g. 4G)")
    p.add_argument("--fast-experts", action="store_true",
                   help="draw routed experts directly in their stored format (much faster for "
                        "flash/pro; experts then differ from params.init_params)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_make_checkpoint, checkpoint_cmd="make-checkpoint")

    p = subparsers.add_parser("convert", help="HF-layout safetensors (official FP8/FP4 or "
                              "NVFP4) -> orbax checkpoint, streamed and resumable")
    p.add_argument("src", help="safetensors checkpoint directory")
    p.add_argument("dst", help="orbax output directory (rerun to resume)")
    p.add_argument("--expert-dtype", choices=("fp8", "bf16"), default=None,
                   help="fp8: lossless FP4 -> FP8 experts (Hopper); bf16: dequantise experts")
    p.add_argument("--dtype", choices=("bf16",), default=None,
                   help="bf16: dequantise every weight (exploration)")
    p.add_argument("--memory-budget", default="8G",
                   help="peak host memory to stay under (e.g. 8G); the floor is the largest "
                        "single array group plus the process itself")
    p.add_argument("--overwrite", action="store_true", help="discard an existing output")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_convert, checkpoint_cmd="convert")

    p = subparsers.add_parser("inspect", help="names, shapes, dtypes and bytes per layer type "
                              "of a safetensors directory or orbax checkpoint (no data read)")
    p.add_argument("path")
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    p.add_argument("--match", default=None, help="with --tensors: only names containing this")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_inspect, checkpoint_cmd="inspect")


def run(args) -> int:
    """Run a parsed command under the `dsv4` exit convention (dsv4_jax.errors): bad input
    exits 2 and a failure 1, each with one line; Ctrl-C exits 130 saying what was kept."""
    from dsv4_jax.errors import run_command
    return run_command(args.checkpoint_cmd, lambda: args.func(args),
                       on_interrupt=_on_interrupt(args))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m checkpoints", description=__doc__)
    register(ap.add_subparsers(dest="command", required=True))
    return run(ap.parse_args(argv))
