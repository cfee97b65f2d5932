"""safetensors (official FP8/FP4 or NVFP4 layout) -> orbax, streamed under a memory budget.

Output layout (DST):
  config.json                the converted model's config (formats after --expert-dtype/--dtype)
  source_config.json         the source's config.json, verbatim
  tokenizer*.json, generation_config.json, ...   copied from the source
  parts/globals/, parts/layers.N/, parts/mtp.J/  one folder per conversion unit, each with
      part.json              {chunks: {cK: [param keys]}, bytes}
      cK/                    an orbax (StandardCheckpointer) checkpoint: a flat dict
                             {param key: array | {field: array}} (fields of the quant type)
  .convert_state.json        source fingerprint + options (resume guard)
  dsv4_checkpoint.json       the manifest, written LAST (atomic rename): without it the
                             directory is an unfinished conversion and `load` refuses it.

A part is written under `parts/<name>.tmp` and renamed when all its chunks are saved, so a
rerun skips finished parts and redoes at most the one that was interrupted. Chunks group
whole leaves so that the chunk's arrays plus the process's baseline stay under the budget
(the arrays are read into 64-byte aligned buffers that jax and orbax use without copying);
the floor is therefore set by the largest single leaf (a Flash layer's stacked expert w1:
1.2 GB; Pro: 4.7 GB).
"""
from __future__ import annotations

import gc
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from dsv4_jax import params as P
from dsv4_jax.config import Config

from . import formats as F
from . import layout as L
from .errors import CheckpointError, MemoryBudgetError
from .safetensors_io import aligned_empty
from .source import SIDE_FILES, Source, open_source

MANIFEST = "dsv4_checkpoint.json"
STATE = ".convert_state.json"
FORMAT_VERSION = 1
_SLACK = 256 << 20  # transient per-expert buffers, tensorstore bookkeeping


def parse_bytes(s: str | int) -> int:
    """'8G', '512M', '3.5GiB', 1234 -> bytes."""
    if isinstance(s, int):
        return s
    t = s.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        if t and t[-1] in mult:
            return int(float(t[:-1]) * mult[t[-1]])
        return int(float(t))
    except ValueError:
        raise ValueError(f"cannot read a byte size from {s!r} (e.g. 8G, 512M)") from None


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def output_config(cfg: Config, expert_dtype: str | None, dtype: str | None) -> Config:
    if dtype not in (None, "bf16"):
        raise ValueError(f"--dtype must be bf16 (or omitted to keep stored precision), got {dtype!r}")
    if expert_dtype not in (None, "fp8", "bf16"):
        raise ValueError(f"--expert-dtype must be fp8 or bf16, got {expert_dtype!r}")
    if dtype == "bf16":
        if expert_dtype not in (None, "bf16"):
            raise ValueError("--dtype bf16 dequantises everything; it cannot keep fp8 experts")
        return cfg.replace(linear_dtype="bf16", expert_dtype="bf16")
    if expert_dtype == "fp8" and cfg.expert_dtype not in ("fp4", "fp8"):
        raise ValueError(f"--expert-dtype fp8 is lossless only from fp4 experts; this checkpoint "
                         f"has {cfg.expert_dtype} experts (use --expert-dtype bf16)")
    return cfg.replace(expert_dtype=expert_dtype) if expert_dtype else cfg


# ---------------------------------------------------------------------------------------
# One leaf: read in stored format, convert if asked, return storage fields (numpy)
# ---------------------------------------------------------------------------------------
def _in_fields(spec: P.ParamSpec) -> tuple[str, ...]:
    return tuple(L.field_shapes(spec))


def convert_leaf(src: Source, key: str, spec_in: P.ParamSpec, spec_out: P.ParamSpec) -> dict:
    """The leaf `key` as a dict of numpy fields in `spec_out`'s storage format."""
    if spec_in.fmt == spec_out.fmt:
        return {f: src.read_field(key, f) for f in _in_fields(spec_in)}
    out = {f: aligned_empty(s.shape, s.dtype) for f, s in
           L.from_leaf(P.storage_structs(spec_out)).items()}
    stacked = L.is_expert_key(key)
    for e in range(spec_in.shape[0]) if stacked else (None,):
        rng = range(e, e + 1) if stacked else None
        fin = {f: src.read_field(key, f, rng) for f in _in_fields(spec_in)}
        if stacked:
            fin = {f: v[0] for f, v in fin.items()}
        name = f"{key}[{e}]" if stacked else key
        if spec_out.fmt == "fp8" and spec_in.fmt == "fp4":
            w, s = F.fp4_to_fp8(fin["packed"], fin["scale"], name)
            fout = {"w": w, "scale": s}
        elif spec_out.fmt == "bf16":
            fout = {"value": F.encode_bf16(F.dequant(spec_in.fmt, fin))}
        else:
            raise CheckpointError(f"{key}: no conversion from {spec_in.fmt} to {spec_out.fmt}")
        for f, v in fout.items():
            if stacked:
                out[f][e] = v
            else:
                out[f][...] = v
    return out


def _leaf_bytes(spec: P.ParamSpec) -> int:
    import jax
    return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
               for s in jax.tree.leaves(P.storage_structs(spec)))


def plan_parts(specs: dict[str, P.ParamSpec], chunk_bytes: int) -> dict[str, list[list[str]]]:
    """part -> chunks (lists of keys), each chunk's arrays under chunk_bytes where possible."""
    parts: dict[str, list[list[str]]] = {}
    sizes: dict[str, int] = {}
    for key, spec in specs.items():
        part = L.part_of(key)
        chunks = parts.setdefault(part, [[]])
        b = _leaf_bytes(spec)
        if chunks[-1] and sizes.get(part, 0) + b > chunk_bytes:
            chunks.append([])
            sizes[part] = 0
        chunks[-1].append(key)
        sizes[part] = sizes.get(part, 0) + b
    return parts


def orbax_checkpointer():
    """A synchronous orbax checkpointer (no background threads: a chunk's memory is released
    as soon as `save` returns). No compression: FP8/FP4 bytes barely compress (~9%) and
    zstd doubled the host memory of a save and cost most of its time."""
    import orbax.checkpoint as ocp
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))


def chunk_metadata(path: Path) -> dict:
    """{key: ArrayMetadata | {field: ArrayMetadata}} of one chunk, from metadata only."""
    m = orbax_checkpointer().metadata(path)
    return dict(m.item_metadata.tree if hasattr(m, "item_metadata") else m.tree)


def restore_chunk(path: Path, target: dict) -> dict:
    """Restore one chunk onto the shardings carried by `target`'s ShapeDtypeStructs."""
    import orbax.checkpoint as ocp
    args = ocp.args.PyTreeRestore(item=target,
                                  restore_args=ocp.checkpoint_utils.construct_restore_args(target))
    return orbax_checkpointer().restore(path, args=args)


def _save_chunk(path: Path, tree: dict):
    """Save one chunk. The numpy leaves are 64-byte aligned, so device_put wraps them
    without a copy and orbax writes straight from those buffers."""
    import jax
    import orbax.checkpoint as ocp
    tree = jax.device_put(tree, jax.local_devices(backend="cpu")[0])  # host, even on GPU machines
    orbax_checkpointer().save(path, args=ocp.args.PyTreeSave(tree))


def _atomic_json(path: Path, obj):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def convert(src, dst, *, expert_dtype: str | None = None, dtype: str | None = None,
            memory_budget: int | str = "8G", overwrite: bool = False, progress: bool = True,
            log=None) -> dict:
    """Convert the safetensors checkpoint at `src` to an orbax checkpoint at `dst`.

    Validates everything first (nothing is written on bad input), then streams part by
    part under `memory_budget` (bytes or '8G'); resumes an interrupted conversion of the
    same source with the same options. Returns a summary (bytes, seconds, GB/s, peak RSS)."""
    log = log or (lambda *a: print(*a, file=sys.stderr))
    t0 = time.time()
    budget = parse_bytes(memory_budget)
    source = open_source(src)
    cfg_in = source.cfg
    cfg_out = output_config(cfg_in, expert_dtype, dtype)
    out_hf = cfg_out.to_hf_dict()
    if Config.from_hf_dict(out_hf, name=cfg_out.name) != cfg_out:
        raise CheckpointError(f"internal: config {cfg_out} does not survive config.json")
    specs_in = P.describe(cfg_in, include_mtp=True)
    specs_out = P.describe(cfg_out, include_mtp=True)
    for reason, names in source.skipped.items():
        log(f"skipping {len(names)} tensors of {reason}, e.g. {names[0]}")

    # memory plan: the chunk's arrays + slack must fit next to the baseline
    base = rss_bytes()
    chunk_bytes = budget - base - _SLACK
    biggest = max(specs_out, key=lambda k: _leaf_bytes(specs_out[k]))
    need = _leaf_bytes(specs_out[biggest])
    if chunk_bytes < need:
        raise MemoryBudgetError(
            f"memory budget {budget / 2**30:.2f} GiB is too small: the largest array group "
            f"{biggest!r} needs {need / 2**30:.2f} GiB on top of the process's "
            f"{base / 2**30:.2f} GiB and {_SLACK >> 20} MiB of working space; use at least "
            f"{(base + _SLACK + need) / 2**30:.1f}G")
    plan = plan_parts(specs_out, chunk_bytes)

    dst = Path(dst)
    options = {"expert_dtype": cfg_out.expert_dtype, "linear_dtype": cfg_out.linear_dtype}
    state = {"source": str(source.path.resolve()), "fingerprint": source.fingerprint(),
             "options": options, "version": FORMAT_VERSION}
    _prepare_dst(dst, state, overwrite, log)
    if (dst / MANIFEST).exists():
        log(f"{dst}: conversion already complete")
        return json.loads((dst / MANIFEST).read_text())["summary"]

    parts_dir = dst / "parts"
    parts_dir.mkdir(exist_ok=True)
    for stale in parts_dir.glob("*.tmp"):
        shutil.rmtree(stale)
    total_in = source.total_bytes
    bar = _bar(total_in, progress)
    done_parts, read_bytes = {}, 0
    src_bytes = {}
    for key in specs_in:
        src_bytes.setdefault(L.part_of(key), 0)
        src_bytes[L.part_of(key)] += sum(t.nbytes for t in source.by_leaf[key])
    for part, chunks in plan.items():
        pdir = parts_dir / part
        if (pdir / "part.json").exists():
            done_parts[part] = json.loads((pdir / "part.json").read_text())
            bar.update(src_bytes[part])
            continue
        tmp = parts_dir / (part + ".tmp")
        tmp.mkdir()
        meta = {"chunks": {}, "bytes": 0}
        for ci, keys in enumerate(chunks):
            tree = {}
            for key in keys:
                fields = convert_leaf(source, key, specs_in[key], specs_out[key])
                tree[key] = fields["value"] if "value" in fields else fields
                meta["bytes"] += sum(v.nbytes for v in fields.values())
                del fields  # else the last leaf outlives its chunk (one array over budget)
            _save_chunk(tmp / f"c{ci}", tree)
            del tree
            gc.collect()  # orbax's save leaves reference cycles that pin the chunk's arrays
            meta["chunks"][f"c{ci}"] = keys
            chunk_in = sum(t.nbytes for k in keys for t in source.by_leaf[k])
            read_bytes += chunk_in
            bar.update(chunk_in)
        _atomic_json(tmp / "part.json", meta)
        os.replace(tmp, pdir)
        done_parts[part] = meta
    bar.close()

    for name in SIDE_FILES:
        if (source.path / name).exists():
            shutil.copy2(source.path / name, dst / name)
    (dst / "source_config.json").write_text(json.dumps(source.raw_config, indent=2))
    _atomic_json(dst / "config.json", out_hf)
    secs = time.time() - t0
    summary = {"source_bytes": total_in, "converted_source_bytes": read_bytes,
               "output_bytes": sum(p["bytes"] for p in done_parts.values()),
               "seconds": round(secs, 2),
               "gb_per_s": round(read_bytes / 1e9 / secs, 3) if secs > 0 else None,
               "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "memory_budget_bytes": budget, "chunk_bytes": chunk_bytes}
    manifest = {"format": "dsv4-orbax", "version": FORMAT_VERSION, "complete": True,
                "config": out_hf, "source": {"path": state["source"], "format": source.fmt,
                                             "naming": source.naming,
                                             "fingerprint": state["fingerprint"]},
                "options": options, "parts": done_parts,
                "skipped": {r: n for r, n in source.skipped.items()}, "summary": summary}
    _atomic_json(dst / MANIFEST, manifest)  # last: marks the checkpoint complete
    return summary


def _prepare_dst(dst: Path, state: dict, overwrite: bool, log):
    sp = dst / STATE
    if dst.exists() and overwrite:
        if not (sp.exists() or (dst / MANIFEST).exists()) and any(dst.iterdir()):
            raise CheckpointError(f"{dst} is not a dsv4 conversion output; refusing to delete it")
        shutil.rmtree(dst)
    if dst.exists() and any(dst.iterdir()):
        if not sp.exists():
            raise CheckpointError(f"{dst} exists, is not empty and holds no dsv4 conversion")
        old = json.loads(sp.read_text())
        if old != state:
            diff = [k for k in state if old.get(k) != state[k]]
            raise CheckpointError(f"{dst} holds a conversion with a different {', '.join(diff)}; "
                                  "pass --overwrite to start again")
        if not (dst / MANIFEST).exists():
            n = len(list((dst / "parts").glob("*/part.json"))) if (dst / "parts").exists() else 0
            log(f"{dst}: resuming an interrupted conversion ({n} parts already done)")
        return
    dst.mkdir(parents=True, exist_ok=True)
    _atomic_json(sp, state)


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _bar(total: int, on: bool):
    if not on:
        return _NoBar()
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="convert",
                file=sys.stderr)
