"""Synthetic checkpoints: random, well-conditioned weights in exactly the real on-disk layout.

`make_checkpoint(out, cfg, fmt, seed)` streams the tensors of `describe(cfg)` shard by shard;
values come from `params.init_dense` / `init_expert` + `encode`, so reading the checkpoint
back gives exactly `params.init_params(cfg, seed)` (up to the declared I64 -> int32 of
`tid2eid`). Host memory holds one (non-expert) tensor or one expert at a time; the large
plain tensors (embedding, head) are drawn in row blocks from the same random stream.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np

from dsv4_jax import params as P
from dsv4_jax.config import Config

from . import layout as L
from .safetensors_io import ShardWriter
from .source import check_writable_parent, user_path

FORMATS = ("official", "nvfp4")
INDEX_NAME = "model.safetensors.index.json"
_ROW_BLOCK_INITS = {"linear", "embed", "normal", "small", "norm", "hc_fn"}


def format_config(cfg: Config, fmt: str) -> Config:
    """The config a checkpoint of format `fmt` declares."""
    if fmt == "official":
        return cfg if cfg.linear_dtype == "fp8" else cfg.replace(linear_dtype="fp8", expert_dtype="fp4")
    if fmt == "nvfp4":
        return cfg.replace(linear_dtype="nvfp4", expert_dtype="nvfp4")
    raise ValueError(f"unknown checkpoint format {fmt!r}; choose from {FORMATS}")


def truncate_layers(cfg: Config, n: int) -> Config:
    """The first n blocks of a config (ratio pattern prefix + the MTP entries; a DSpark
    drafter reads the last layers of the n)."""
    if not isinstance(n, (int, np.integer)) or not 1 <= n <= cfg.num_hidden_layers:
        raise ValueError(f"--layers must be in [1, {cfg.num_hidden_layers}], got {n}")
    m = cfg.num_nextn_predict_layers
    ratios = cfg.compress_ratios[:n] + cfg.compress_ratios[cfg.num_hidden_layers:]
    assert len(ratios) == n + m
    kw = {}
    if cfg.dspark:  # a DSpark drafter keeps reading the last layers (layer 0 repeats if few)
        S = cfg.dspark_num_stages
        kw["dspark_target_layer_ids"] = tuple(max(0, n - S + i) for i in range(S))
    return cfg.replace(num_hidden_layers=n, compress_ratios=ratios,
                       num_hash_layers=min(cfg.num_hash_layers, n), **kw)


def _dense_row_blocks(key: str, spec: P.ParamSpec, cfg: Config, seed: int, max_elems: int):
    """init_dense(key) in row blocks, drawing from the same generator in the same order
    (identical values; bounded memory for the embedding and head)."""
    n = int(np.prod(spec.shape))
    if spec.init not in _ROW_BLOCK_INITS or len(spec.shape) != 2 or n <= max_elems:
        yield P.init_dense(key, spec, cfg, seed)
        return
    g = P._rng(seed, key)
    rows, cols = spec.shape
    step = max(1, max_elems // cols)
    for r in range(0, rows, step):
        z = g.standard_normal((min(step, rows - r), cols))
        if spec.init in ("linear", "hc_fn"):
            v = z / np.sqrt(cols)
        elif spec.init == "norm":
            v = 1.0 + 0.1 * z
        elif spec.init == "small":
            v = 0.1 * z
        else:  # embed, normal
            v = z
        yield v.astype(np.float32)


def _fields_np(spec: P.ParamSpec, value: np.ndarray) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in L.from_leaf(P.encode(spec, value)).items()}


def _input_scale() -> np.ndarray:
    # Stands in for ModelOpt's calibration-time activation scale; the engine never reads it.
    return np.asarray(1.0 / 448.0, np.float32)


def plan_shards(tensors: list[L.DiskTensor], shard_bytes: int) -> list[list[L.DiskTensor]]:
    """Greedy split into shards of about `shard_bytes`, tensors of one leaf kept together
    with the leaf's other fields where they fit."""
    shards, cur, size = [], [], 0
    for t in tensors:
        if cur and size + t.nbytes > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += t.nbytes
    if cur:
        shards.append(cur)
    return shards


def make_checkpoint(out: str | os.PathLike, cfg: Config, fmt: str = "official", seed: int = 0,
                    shard_bytes: int = 4 << 30, row_block_elems: int = 1 << 25,
                    progress: bool = False, fast_experts: bool = False) -> dict:
    """Write a synthetic checkpoint of `cfg` in format `fmt` ("official" | "nvfp4") to `out`.

    `fast_experts`: draw routed experts directly in their stored format (random e2m1 codes /
    e4m3 values with scales that give ~1/sqrt(in) weights) instead of encoding
    `params.init_expert` values: ~100x faster for full-width presets, but the experts then
    differ from `params.init_params`. Returns a summary dict (shards, tensors, bytes).

    The files are written into `OUT.partial` (marked by a `.dsv4_make_checkpoint` file) and
    renamed to `out` only when complete; on any failure or interrupt the partial directory
    is removed, so `out` either is a whole checkpoint or does not exist."""
    out = user_path(out)
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed (--seed) must be an integer >= 0, got {seed!r}")
    if not isinstance(shard_bytes, (int, np.integer)) or shard_bytes < 1:
        raise ValueError(f"shard size (--shard-size) must be a positive number of bytes, "
                         f"got {shard_bytes!r}")
    cfg = format_config(cfg, fmt)
    naming = "official" if fmt == "official" else "hf"
    with atomic_output(out, "`dsv4 make-checkpoint`") as tmp:
        summary = _write_all(tmp, cfg, fmt, naming, seed, shard_bytes, row_block_elems,
                             progress, fast_experts)
    return {"path": str(out), **summary}


PARTIAL_MARK = ".dsv4_make_checkpoint"


@contextlib.contextmanager
def atomic_output(out: Path, writer: str):
    """Yields OUT.partial (marked by PARTIAL_MARK, naming `writer`) to write a checkpoint
    into, renamed to `out` when the block completes; removed on any error or Ctrl-C, so
    `out` either is whole or does not exist. `out` must pass check_out."""
    tmp = check_out(out)
    if tmp.exists():  # left by a killed run (check_out made sure it is one of ours)
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / PARTIAL_MARK).write_text(f"an unfinished {writer}; safe to delete\n")
    try:
        yield tmp
        (tmp / PARTIAL_MARK).unlink()
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_out(out: Path) -> Path:
    """Refuse an output that exists (unless an empty directory) or cannot be created;
    -> the temporary directory to write into."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"output {out} is an existing file; give a new or empty directory")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"output {out} exists and is not empty; give a new or empty "
                              "directory")
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists() and not (tmp / PARTIAL_MARK).exists():
        raise FileExistsError(f"{tmp} exists and was not made by make-checkpoint; move it away "
                              "(the checkpoint is written there first)")
    check_writable_parent(out, "output", start=out.parent)
    return tmp


def _write_all(tmp: Path, cfg: Config, fmt: str, naming: str, seed: int, shard_bytes: int,
               row_block_elems: int, progress: bool, fast_experts: bool) -> dict:
    specs = P.describe(cfg, include_mtp=True)
    tensors = [t for k, s in specs.items() for t in L.leaf_tensors(k, s, naming)]
    shards = plan_shards(tensors, shard_bytes)
    m = len(shards)
    weight_map, total = {}, 0
    bar = _progress(sum(t.nbytes for t in tensors), progress)
    cache: dict = {}  # (key, expert) -> field arrays of the leaf being written
    for si, shard in enumerate(shards):
        fname = f"model-{si + 1:05d}-of-{m:05d}.safetensors"
        with ShardWriter(tmp / fname, [(t.name, t.dtype, t.shape) for t in shard],
                         {"format": "pt"}) as w:
            for t in shard:
                _write_tensor(w, t, specs[t.key], cfg, seed, cache, row_block_elems, fast_experts)
                weight_map[t.name] = fname
                total += t.nbytes
                bar.update(t.nbytes)
    bar.close()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2))
    (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "do_sample": True,
         "temperature": 1.0, "top_p": 1.0}, indent=2))
    return {"format": fmt, "shards": m, "tensors": len(tensors), "bytes": total}


def _write_tensor(w: ShardWriter, t: L.DiskTensor, spec: P.ParamSpec, cfg: Config, seed: int,
                  cache: dict, row_block_elems: int, fast_experts: bool = False):
    if t.field == "value" and t.expert is None and spec.fmt in ("bf16", "f32"):
        blocks = _dense_row_blocks(t.key, spec, cfg, seed, row_block_elems)
        cur = next(blocks)
        for nxt in blocks:  # one block of lookahead so the writer knows the last one
            w.write_rows(t.name, np.asarray(P.encode(spec, cur)), last=False)
            cur = nxt
        w.write_rows(t.name, np.asarray(P.encode(spec, cur)), last=True)
        return
    ck = (t.key, t.expert)
    if ck not in cache:
        cache.clear()
        if t.expert is None:
            fields = _fields_np(spec, P.init_dense(t.key, spec, cfg, seed))
        elif fast_experts:
            fields = _fast_expert(t.key, spec, seed, t.expert)
        else:
            value = P.init_expert(t.key, spec, cfg, seed, t.expert)
            sub = P.ParamSpec(spec.shape[1:], spec.fmt, spec.axes[1:], spec.init)
            fields = _fields_np(sub, value)
        if spec.fmt == "nvfp4":
            fields["input_scale"] = _input_scale()
        cache[ck] = fields
    arr = cache[ck][t.field]
    if t.dtype == "I64":
        arr = arr.astype(np.int64)
    w.write(t.name, arr.reshape(t.shape))


_E2M1_RMS = float(np.sqrt(np.mean(P.Q.E2M1_TABLE ** 2)))  # of uniformly random codes


def _fast_expert(key: str, spec: P.ParamSpec, seed: int, e: int) -> dict[str, np.ndarray]:
    """One expert's stored fields drawn directly (random codes, scales near 1/sqrt(in))."""
    import zlib
    g = np.random.default_rng([seed, zlib.crc32(f"{key}.{e}".encode()), 1])
    o, i = spec.shape[1:]
    target = 1.0 / np.sqrt(i)  # rms of the logical weight, as init_expert
    if spec.fmt in ("fp4", "nvfp4"):
        packed = g.integers(0, 256, (o, i // 2), dtype=np.uint8)
        if spec.fmt == "fp4":
            ex = np.round(np.log2(target / _E2M1_RMS)) + g.integers(-1, 2, (o, i // 32))
            return {"packed": packed.view(np.int8),
                    "scale": (ex + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)}
        s = g.uniform(0.5, 1.0, (o, i // 16)).astype(ml_dtypes.float8_e4m3fn)
        g2 = np.asarray(target / (_E2M1_RMS * 0.75), np.float32)
        return {"packed": packed, "scale": s, "scale2": g2, "input_scale": _input_scale()}
    if spec.fmt == "fp8":
        w = (g.standard_normal((o, i), dtype=np.float32) * 32).astype(ml_dtypes.float8_e4m3fn)
        ex = int(np.round(np.log2(target / 32)))
        sc = np.full((-(-o // 128), -(-i // 128)), ex + 127, np.uint8)
        return {"w": w, "scale": sc.view(ml_dtypes.float8_e8m0fnu)}
    if spec.fmt == "bf16":
        return {"value": (g.standard_normal((o, i), dtype=np.float32) * target).astype(ml_dtypes.bfloat16)}
    raise ValueError(f"{key}: no fast expert draw for format {spec.fmt!r}")


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress(total: int, on: bool, desc: str = "write"):
    if not on:
        return _NoBar()
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc)
