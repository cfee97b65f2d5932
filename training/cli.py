"""`python -m training {prepare,train,export,plot,all}`: bad flags and inputs exit 2 with
one line naming them (dsv4_jax.errors.run_command), a failure while working exits 1,
Ctrl-C exits 130.

    python -m training all --out runs/small      # the shipped model: prepare, train, export
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from dsv4_jax.errors import UsageError, run_command

from .config import MODELS, TrainConfig

DEFAULTS = TrainConfig()


def _add_train_flags(ap):
    g = ap.add_argument_group("training")
    g.add_argument("--model", choices=sorted(MODELS), default=DEFAULTS.model,
                   help="model config (training/config.py; default %(default)s)")
    for flag, field, typ in (("--steps", "steps", int), ("--batch-size", "batch_size", int),
                             ("--seq-len", "seq_len", int), ("--lr", "lr", float),
                             ("--warmup-steps", "warmup_steps", int),
                             ("--weight-decay", "weight_decay", float),
                             ("--mtp-weight", "mtp_weight", float),
                             ("--indexer-weight", "indexer_weight", float),
                             ("--eval-every", "eval_every", int),
                             ("--eval-batches", "eval_batches", int),
                             ("--checkpoint-every", "checkpoint_every", int),
                             ("--seed", "seed", int),
                             ("--max-minutes", "max_minutes", float)):
        g.add_argument(flag, dest=field, type=typ, default=getattr(DEFAULTS, field),
                       help=f"default {getattr(DEFAULTS, field)}")
    g.add_argument("--no-qat", action="store_true",
                   help="no FP8/FP4 fake quantisation of the weights in the forward")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_prepare_flags(ap):
    g = ap.add_argument_group("data")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="tokenizer vocabulary (default: the model's vocab_size)")
    g.add_argument("--stdlib", default=None,
                   help="the Python standard library directory (default: this interpreter's)")
    g.add_argument("--exclude-tests", action="store_true",
                   help="leave out the stdlib's test directories")


def _train_config(a) -> TrainConfig:
    kw = {f.name: getattr(a, f.name) for f in dataclasses.fields(TrainConfig)
          if hasattr(a, f.name)}
    kw["qat"] = not a.no_qat
    return TrainConfig(**kw)


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m training", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="corpus manifest, tokenizer and token streams")
    p.add_argument("--data", required=True, help="output directory")
    p.add_argument("--model", choices=sorted(MODELS), default=DEFAULTS.model)
    _add_prepare_flags(p)
    p = sub.add_parser("train", help="train on a prepared data directory")
    p.add_argument("--data", required=True, help="directory written by `prepare`")
    p.add_argument("--run", required=True, help="output: log.jsonl, master.npz, summary.json")
    _add_train_flags(p)
    p = sub.add_parser("export", help="training run -> release-format checkpoint directory")
    p.add_argument("run", help="training run directory")
    p.add_argument("out", help="new or empty output directory")
    p.add_argument("--data", default=None, help="prepared data directory (default: the "
                   "run's own)")
    p = sub.add_parser("plot", help="loss curves of a run's log.jsonl as a PNG")
    p.add_argument("run", help="training run directory")
    p.add_argument("out", help="PNG file")
    p = sub.add_parser("all", help="prepare + train + export + plot into one directory")
    p.add_argument("--out", required=True, help="directory: data/, run/, model/, loss.png")
    _add_prepare_flags(p)
    _add_train_flags(p)
    return ap


def _prepare(a, model: str):
    from . import data as D
    vocab = a.vocab_size if a.vocab_size is not None else MODELS[model]().vocab_size
    if vocab > MODELS[model]().vocab_size:
        raise UsageError(f"--vocab-size {vocab} exceeds the model's vocab_size "
                         f"{MODELS[model]().vocab_size}")
    m = D.prepare(a.data, vocab, a.stdlib, include_tests=not a.exclude_tests)
    print(f"wrote {a.data}: {len(m['files'])} files, corpus sha256 {m['corpus_sha256'][:16]}...")


def _train(a):
    from .train import train
    tcfg = _train_config(a)
    s = train(a.data, a.run, tcfg, progress=not a.no_progress)
    print(json.dumps({k: s[k] for k in ("steps", "train_seconds", "tokens_per_second")}
                     | {"heldout_ppl": s["heldout_final"]["ppl"],
                        "mtp_top1": s["heldout_final"]["mtp_top1"]}))


def _export(a):
    from .export import export_run
    r = export_run(a.run, a.out, a.data)
    print(f"wrote {r['path']}: {r['tensors']} tensors, {r['bytes'] / 1e6:.2f} MB")


def _plot(a):
    from .plot import plot
    plot(a.run, a.out)
    print(f"wrote {a.out}")


def _all(a):
    out = Path(a.out)
    a.data, a.run = str(out / "data"), str(out / "run")
    if (out / "data" / "manifest.json").exists():
        print(f"{a.data}: prepared already (delete it to prepare again)")
    else:
        _prepare(a, a.model)
    _train(a)
    a.out, a.data = str(out / "model"), None
    _export(a)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib missing: no loss.png (pip install -e '.[notebooks]')")
        return
    a.out = str(out / "loss.png")
    _plot(a)


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    fn = {"prepare": lambda: _prepare(a, a.model), "train": lambda: _train(a),
          "export": lambda: _export(a), "plot": lambda: _plot(a), "all": lambda: _all(a)}[a.cmd]
    kept = {"train": "the last checkpoint in the run directory (master.npz)",
            "all": "what finished: data/, the last checkpoint in run/"}.get(a.cmd,
                                                                          "nothing complete")
    return run_command(f"training {a.cmd}", fn, on_interrupt=kept)


if __name__ == "__main__":
    sys.exit(main())
