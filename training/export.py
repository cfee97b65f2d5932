"""Master weights -> a checkpoint directory in the release on-disk format, the one
`dsv4_jax.load`, `dsv4 convert` and `dsv4 generate --checkpoint DIR` read:

    config.json                      the model config (quantization_config: FP8 e4m3 with
                                     ue8m0 128 x 128 block scales, expert_dtype fp4)
    model-00001-of-00001.safetensors official tensor names (checkpoints/layout.py): FP8
                                     linears + e8m0 scales, FP4 experts (packed e2m1 +
                                     e8m0 per 32), bf16 / f32 rest, tid2eid as I64
    model.safetensors.index.json, generation_config.json
    tokenizer.json                   the BPE tokenizer the model was trained with
    training.json                    data source, licence, corpus and tokenizer sha256,
                                     training settings and final held-out metrics
Values are encoded by params.encode (the same numpy encoders as the synthetic writer and
the converter); the table of disk tensors, the shard planner, the safetensors writer and
the write-to-`.partial`-then-rename protocol are checkpoints/'s own.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from checkpoints import layout as CL
from checkpoints import synthetic as S
from checkpoints.safetensors_io import ShardWriter
from checkpoints.source import user_path
from dsv4_jax import params as PI
from dsv4_jax.config import Config


def _disk_arrays(key: str, spec: PI.ParamSpec, value: np.ndarray) -> dict[str, np.ndarray]:
    """{disk tensor name: array} of one parameter in `spec`'s stored format."""
    fields = {k: np.asarray(v) for k, v in CL.from_leaf(PI.encode(spec, value)).items()}
    out = {}
    for t in CL.leaf_tensors(key, spec, "official"):
        arr = fields[t.field] if t.expert is None else fields[t.field][t.expert]
        out[t.name] = arr.astype(np.int64) if t.dtype == "I64" else arr
    return out


def write_checkpoint(out: str | os.PathLike, cfg: Config, values: dict[str, np.ndarray],
                     tokenizer: str | os.PathLike | None = None,
                     extra: dict | None = None, shard_bytes: int = 4 << 30) -> dict:
    """Write `values` ({param name: logical f32 / int32 value}, every name of
    describe(cfg)) as a release-format checkpoint of `cfg` (linear_dtype "fp8",
    expert_dtype "fp4" for the release format) into `out` (new or empty directory).
    -> {"path", "bytes" (all files), "tensor_bytes", "tensors"}."""
    out = user_path(out)
    specs = PI.describe(cfg, include_mtp=True)
    missing = sorted(set(specs) - set(values))
    unknown = sorted(set(values) - set(specs))
    if missing or unknown:
        raise ValueError(f"export: values do not match the config: missing {missing[:5]}, "
                         f"unknown {unknown[:5]}")
    tensors = [t for k, s in specs.items() for t in CL.leaf_tensors(k, s, "official")]
    shards = S.plan_shards(tensors, shard_bytes)
    with S.atomic_output(out, "`python -m training export`") as tmp:
        weight_map, total, cache = {}, 0, {}
        for si, shard in enumerate(shards):
            fname = f"model-{si + 1:05d}-of-{len(shards):05d}.safetensors"
            with ShardWriter(tmp / fname, [(t.name, t.dtype, t.shape) for t in shard],
                             {"format": "pt"}) as w:
                for t in shard:
                    if t.key not in cache:
                        cache.clear()
                        cache[t.key] = _disk_arrays(t.key, specs[t.key], values[t.key])
                    w.write(t.name, cache[t.key][t.name].reshape(t.shape))
                    weight_map[t.name] = fname
                    total += t.nbytes
        (tmp / S.INDEX_NAME).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
             "do_sample": True, "temperature": 1.0, "top_p": 1.0}, indent=2))
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / "tokenizer.json")
        if extra is not None:
            (tmp / "training.json").write_text(json.dumps(extra, indent=1))
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    return {"path": str(out), "bytes": size, "tensor_bytes": total, "tensors": len(tensors)}


def release_config(cfg: Config) -> Config:
    """The release format of a model config: FP8 linears, FP4 experts."""
    return cfg.replace(linear_dtype="fp8", expert_dtype="fp4")


def provenance(data: Path | None, state: dict) -> dict:
    """training.json: where the text came from and how the model was trained."""
    rec = {"train": state.get("train"), "step": state.get("step"),
           "summary": state.get("summary")}
    if data is not None and (Path(data) / "manifest.json").exists():
        m = json.loads((Path(data) / "manifest.json").read_text())
        rec["data"] = {k: m.get(k) for k in ("source", "licence", "licence_sha256", "python",
                                             "include_tests", "heldout_rule", "corpus_sha256",
                                             "totals", "tokens", "tokenizer_sha256")}
        rec["data"]["files"] = len(m.get("files", []))
    return rec


def export_run(run: str | os.PathLike, out: str | os.PathLike,
               data: str | os.PathLike | None = None) -> dict:
    """A training run directory (training.train) -> release-format checkpoint at `out`.
    `data`: the prepared data directory (its tokenizer.json and manifest); default: the
    one recorded in the run's state.json."""
    from .train import STATE, load_checkpoint
    run = user_path(run)
    cfg, master, frozen = load_checkpoint(run)
    state = json.loads((run / STATE).read_text())
    data = Path(data) if data is not None else (Path(state["data"]) if state.get("data") else None)
    tok = data / "tokenizer.json" if data is not None else None
    if tok is not None and not tok.exists():
        raise FileNotFoundError(f"--data {data}: no tokenizer.json")
    values = {**master, **frozen}
    return write_checkpoint(out, release_config(cfg), values, tok, provenance(data, state))
