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
from .errors import CheckpointError, IncompleteCheckpointError, MemoryBudgetError, NonFiniteError
from .safetensors_io import aligned_empty
from .source import (SIDE_FILES, Source, check_writable_parent, open_source, read_json,
                     user_path)

MANIFEST = "dsv4_checkpoint.json"
STATE = ".convert_state.json"
FORMAT_VERSION = 1
_SLACK = 256 << 20  # transient per-expert buffers, tensorstore bookkeeping


def parse_bytes(s: str | int, what: str = "byte size") -> int:
    """'8G', '512M', '3.5GiB', 1234 -> bytes, at least 1. `what` names the flag or argument
    in the error (e.g. '--memory-budget')."""
    n = None
    if isinstance(s, int) and not isinstance(s, bool):
        n = s
    elif isinstance(s, str):
        t = s.strip().upper().removesuffix("IB").removesuffix("B")
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
        m = mult.get(t[-1:], 1)
        try:
            n = int(float(t[:-1] if m > 1 else t) * m)
        except (ValueError, OverflowError):  # garbage, nan, inf
            n = None
    if n is None or n < 1:
        raise ValueError(f"{what} must be a positive number of bytes such as 8G, 512M or "
                         f"1048576, got {s!r}")
    return n


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


def check_finite(src: Source, key: str, field: str, arr: np.ndarray, expert: int | None = None):
    """Raise NonFiniteError naming the source tensor and file if `arr` (the field `field` of
    leaf `key`, as read; a stacked expert array or one expert's slice) holds NaN/inf or e8m0
    NaN scales. Stacked arrays are checked expert by expert to name the first bad one."""
    stacked = L.is_expert_key(key) and expert is None and arr.ndim > 0
    for e, a in (enumerate(arr) if stacked else ((expert, arr),)):
        n = F.nonfinite_count(a)
        if n:
            t = next(t for t in src.by_leaf[key] if t.field == field and t.expert == e)
            what = "NaN scale bytes (0xFF)" if a.dtype == F.NONFINITE_E8M0 else "NaN/inf values"
            raise NonFiniteError(f"{src.path / src.where[t.name]}: tensor {t.name!r} holds {n} "
                                 f"{what}; the source is damaged (re-download that file)")


def convert_leaf(src: Source, key: str, spec_in: P.ParamSpec, spec_out: P.ParamSpec) -> dict:
    """The leaf `key` as a dict of numpy fields in `spec_out`'s storage format. Every array
    read is checked for NaN/inf (NonFiniteError names the source tensor and file), and so is
    every converted array, before anything is written."""
    if spec_in.fmt == spec_out.fmt:
        out = {}
        for f in _in_fields(spec_in):
            out[f] = src.read_field(key, f)
            check_finite(src, key, f, out[f])
        return out
    out = {f: aligned_empty(s.shape, s.dtype) for f, s in
           L.from_leaf(P.storage_structs(spec_out)).items()}
    stacked = L.is_expert_key(key)
    for e in range(spec_in.shape[0]) if stacked else (None,):
        rng = range(e, e + 1) if stacked else None
        fin = {f: src.read_field(key, f, rng) for f in _in_fields(spec_in)}
        if stacked:
            fin = {f: v[0] for f, v in fin.items()}
        for f, v in fin.items():
            check_finite(src, key, f, v, e)
        name = f"{key}[{e}]" if stacked else key
        if spec_out.fmt == "fp8" and spec_in.fmt == "fp4":
            w, s = F.fp4_to_fp8(fin["packed"], fin["scale"], name)
            fout = {"w": w, "scale": s}
        elif spec_out.fmt == "bf16":
            fout = {"value": F.encode_bf16(F.dequant(spec_in.fmt, fin))}
        else:
            raise CheckpointError(f"{key}: no conversion from {spec_in.fmt} to {spec_out.fmt}")
        for f, v in fout.items():
            if F.nonfinite_count(v):  # e.g. a finite FP4 value times a huge scale
                raise NonFiniteError(f"{name}: converting {spec_in.fmt} -> {spec_out.fmt} "
                                     f"gives NaN/inf in {f!r} (scales out of range)")
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
    """{key: ArrayMetadata | {field: ArrayMetadata}} of one chunk, from metadata only;
    IncompleteCheckpointError naming the chunk if it is missing or unreadable."""
    path = Path(path).absolute()  # orbax reads nothing from a relative path
    if not path.is_dir():
        raise IncompleteCheckpointError(f"{path}: chunk directory missing (a damaged copy?)")
    try:
        m = orbax_checkpointer().metadata(path)
        tree = m.item_metadata.tree if hasattr(m, "item_metadata") else m.tree
        return dict(tree)
    except Exception as e:  # orbax / tensorstore raise many types for a damaged chunk
        raise IncompleteCheckpointError(f"{path}: unreadable orbax chunk "
                                        f"({type(e).__name__}: {str(e)[:200]})") from None


def read_manifest(path: Path) -> dict:
    """The manifest of the finished conversion at `path` (absolute), checked against the
    files: IncompleteCheckpointError naming what is missing, malformed or unfinished."""
    mpath = path / MANIFEST
    if not mpath.exists():
        n = len(list((path / "parts").glob("*/part.json")))
        raise IncompleteCheckpointError(
            f"{path}: no {MANIFEST}: the conversion did not finish ({n} part{'s' * (n != 1)} done); run "
            "`dsv4 convert` with the same arguments again to resume it")
    m = read_json(mpath, IncompleteCheckpointError, "manifest")
    if not isinstance(m, dict) or m.get("format") != "dsv4-orbax" or m.get("version") != FORMAT_VERSION:
        got = (m.get("format"), m.get("version")) if isinstance(m, dict) else type(m).__name__
        raise IncompleteCheckpointError(f"{mpath}: unknown format/version {got!r}, expected "
                                        f"('dsv4-orbax', {FORMAT_VERSION})")
    parts = m.get("parts")
    if not (isinstance(parts, dict) and all(
            isinstance(pm, dict) and isinstance(pm.get("chunks"), dict)
            and all(isinstance(keys, list) for keys in pm["chunks"].values())
            for pm in parts.values())):
        raise IncompleteCheckpointError(f"{mpath}: malformed `parts` (needs "
                                        "{part: {chunks: {cK: [param keys]}}})")
    for part, pm in parts.items():
        for c in pm["chunks"]:
            if not (path / "parts" / part / c).is_dir():
                raise IncompleteCheckpointError(f"{path / 'parts' / part / c}: missing, but "
                                                f"{MANIFEST} lists it (a damaged copy?)")
    return m


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
    budget = parse_bytes(memory_budget, "memory budget (--memory-budget)")
    src, dst = user_path(src), user_path(dst)
    check_dst(src, dst)
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

    options = {"expert_dtype": cfg_out.expert_dtype, "linear_dtype": cfg_out.linear_dtype}
    state = {"source": str(source.path.resolve()), "fingerprint": source.fingerprint(),
             "options": options, "version": FORMAT_VERSION}
    _prepare_dst(dst, state, overwrite, log)
    if (dst / MANIFEST).exists():
        log(f"{dst}: conversion already complete")
        return read_json(dst / MANIFEST, IncompleteCheckpointError, "manifest")["summary"]

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
            done_parts[part] = read_json(pdir / "part.json", IncompleteCheckpointError, "part file")
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
                                             "layout": source.layout,
                                             "fingerprint": state["fingerprint"]},
                "options": options, "parts": done_parts,
                "skipped": {r: n for r, n in source.skipped.items()}, "summary": summary}
    _atomic_json(dst / MANIFEST, manifest)  # last: marks the checkpoint complete
    return summary


def check_dst(src: Path, dst: Path):
    """Refuse destinations that cannot hold the output before anything is read or written:
    an existing file, the source itself, a folder inside the source or around it, a
    destination (or the first existing folder above it) that is not writable."""
    if dst.exists() and not dst.is_dir():
        raise NotADirectoryError(f"destination {dst} is an existing file; convert writes a "
                                 "directory there (give a new or empty directory)")
    if dst == src or src in dst.parents:
        raise CheckpointError(f"destination {dst} is inside the source {src}; give a "
                              "directory outside it")
    if dst in src.parents:
        raise CheckpointError(f"destination {dst} contains the source {src}; give a "
                              "directory outside it")
    check_writable_parent(dst, "destination")


_DISCARD = "parts.discard"  # `parts` renamed here by --overwrite, then deleted


def _entries(dst: Path) -> list[Path]:
    # the state file's temporary name: a run interrupted while creating DST leaves it
    return [p for p in dst.iterdir() if p.name != STATE + ".tmp"]


def _prepare_dst(dst: Path, state: dict, overwrite: bool, log):
    sp = dst / STATE
    ours = sp.exists() or (dst / MANIFEST).exists()
    if dst.exists() and _entries(dst) and not ours:
        raise CheckpointError(f"{dst} exists, is not empty and holds no dsv4 conversion "
                              f"(no {STATE}); " + ("refusing to delete it with --overwrite"
                                                   if overwrite else "give a new or empty directory"))
    if dst.exists() and overwrite:
        # unmark, then drop the parts in one rename: an interrupt anywhere leaves a directory
        # that a rerun (with or without --overwrite) recognises and cleans up
        (dst / MANIFEST).unlink(missing_ok=True)
        if (dst / "parts").exists():
            os.replace(dst / "parts", dst / _DISCARD)
        for p in _entries(dst):
            if p.name != STATE:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        sp.unlink(missing_ok=True)
    if dst.exists() and _entries(dst):
        if (dst / _DISCARD).exists():
            shutil.rmtree(dst / _DISCARD)
        old = read_json(sp, CheckpointError, "conversion state") if sp.exists() else None
        if old != state:
            diff = [k for k in state if not isinstance(old, dict) or old.get(k) != state[k]]
            raise CheckpointError(f"{dst} holds a conversion with different {', '.join(diff)}; "
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
