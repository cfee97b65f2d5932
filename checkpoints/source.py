"""Open a HF-layout safetensors checkpoint directory and validate it completely before any
tensor data is read: config, index, every shard header (truncation), and the
classification of every tensor name against the parameter description.

`open_source(dir)` -> `Source`; `Source.read_field(key, field, experts)` reads one field of
one leaf (or a range of experts) in its stored format, converting only I64 -> int32.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from dsv4_jax.config import Config

from . import layout as L
from .errors import (CheckpointError, DtypeMismatchError, ForeignCheckpointError,
                     IndexMismatchError, MissingKeyError, ShapeMismatchError, UnknownKeyError)
from .safetensors_io import DTYPES, SafetensorsFile, aligned_empty

INDEX_NAME = "model.safetensors.index.json"
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
              "special_tokens_map.json", "chat_template.jinja", "LICENSE", "README.md")
_V4_ARCH = "DeepseekV4ForCausalLM"


def _names(names, n=5) -> str:
    names = sorted(names)
    more = f" (and {len(names) - n} more)" if len(names) > n else ""
    return ", ".join(repr(x) for x in names[:n]) + more


def user_path(path) -> Path:
    """A path the user gave, made absolute: `~` expanded, relative to the working directory,
    symlinks resolved (orbax needs absolute paths, and the resume guard compares them)."""
    return Path(path).expanduser().resolve()


def checkpoint_dir(path, hint: str) -> Path:
    """user_path(path), which must be an existing directory; `hint` says what a checkpoint
    directory holds, for the error when it is a file."""
    path = user_path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint directory")
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is a file; {hint}")
    return path


def check_writable_parent(out: Path, label: str, start: Path | None = None) -> None:
    """The nearest existing folder at or above `start` (default: `out` itself) is a
    writable directory."""
    parent = out if start is None else start
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise NotADirectoryError(f"{label} {out}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{label} {out}: {parent} is not writable")


def read_json(p: Path, err=CheckpointError, what: str = "JSON file"):
    """The parsed JSON file `p`; an unreadable / non-UTF-8 / malformed file is `err` naming it."""
    try:
        return json.loads(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise err(f"{p}: not a UTF-8 {what} (byte {e.start}: {e.reason})") from None
    except json.JSONDecodeError as e:
        raise err(f"{p}: not a valid {what} ({e})") from None


def read_config(path: Path) -> tuple[Config, dict]:
    p = path / "config.json"
    if not p.is_file():
        raise ForeignCheckpointError(f"{path}: no config.json (not a HF-layout checkpoint)")
    raw = read_json(p, ForeignCheckpointError, "config.json")
    if not isinstance(raw, dict):
        raise ForeignCheckpointError(f"{p}: config.json must hold a JSON object, got "
                                     f"{type(raw).__name__}")
    mt, arch = raw.get("model_type"), raw.get("architectures") or []
    if mt != "deepseek_v4" and _V4_ARCH not in arch:
        raise ForeignCheckpointError(
            f"{p}: not a DeepSeek-V4 checkpoint (model_type={mt!r}, architectures={arch})")
    try:
        cfg = Config.from_hf_dict(raw, name=path.name)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ForeignCheckpointError(f"{p}: config does not describe a valid DeepSeek-V4 "
                                     f"model: {type(e).__name__}: {e}") from None
    return cfg, raw


@dataclasses.dataclass
class Source:
    path: Path
    cfg: Config
    raw_config: dict
    naming: str  # "official" | "hf"
    fmt: str  # "official" | "nvfp4" (what `make-checkpoint --format` calls it)
    files: dict[str, SafetensorsFile]  # shard file name -> header
    where: dict[str, str]  # tensor name -> shard file name
    by_leaf: dict[str, list[L.DiskTensor]]  # param key -> its disk tensors (present ones)
    skipped: dict[str, list[str]]  # reason -> tensor names (extra MTP blocks)
    total_bytes: int

    @property
    def layout(self) -> str:
        """The drafter layout: base V4 (MTP) or V4-Flash-0731 (DSpark), layout.layout_name."""
        return L.layout_name(self.cfg)

    def fingerprint(self) -> str:
        """Cheap identity of the source: index + config + shard sizes."""
        h = hashlib.sha256()
        h.update(json.dumps(self.raw_config, sort_keys=True).encode())
        for f in sorted(self.files):
            h.update(f"{f}:{self.files[f].path.stat().st_size};".encode())
            h.update(json.dumps({k: [i.dtype, i.shape] for k, i in self.files[f].infos.items()},
                                sort_keys=True).encode())
        return h.hexdigest()[:16]

    def tensor(self, t: L.DiskTensor):
        f = self.files[self.where[t.name]]
        return f, f.info(t.name)

    def read_field(self, key: str, field: str, experts: range | None = None) -> np.ndarray:
        """One field of leaf `key` in its stored dtype/shape (I64 narrowed to int32 with a
        range check). For stacked experts, `experts` selects a range (default all)."""
        ts = [t for t in self.by_leaf[key] if t.field == field]
        if not ts:
            raise MissingKeyError(f"{self.path}: no tensor for field {field!r} of {key!r}")
        if ts[0].expert is None:
            f, info = self.tensor(ts[0])
            arr = f.read(ts[0].name)
            return self._narrow(ts[0], arr)
        experts = experts if experts is not None else range(len(ts))
        by_e = {t.expert: t for t in ts}
        t0 = by_e[experts.start] if len(experts) else ts[0]
        out = aligned_empty((len(experts), *t0.shape), DTYPES[t0.dtype])
        for j, e in enumerate(experts):
            f, _ = self.tensor(by_e[e])
            f.read(by_e[e].name, out=out[j:j + 1].reshape(t0.shape))  # a view, also for 0-d
        return out

    def _narrow(self, t: L.DiskTensor, arr: np.ndarray) -> np.ndarray:
        if t.dtype == "I64":
            lo, hi = int(arr.min(initial=0)), int(arr.max(initial=0))
            bound = self.cfg.n_routed_experts if t.name.endswith("tid2eid") else 2 ** 31
            if lo < 0 or hi >= bound:
                raise CheckpointError(f"{self.path}: {t.name} holds values in [{lo}, {hi}], "
                                      f"outside [0, {bound}) (cannot narrow to int32 expert ids)")
            return arr.astype(np.int32)
        return arr


def open_source(path, *, naming: str | None = None) -> Source:
    """Validate a safetensors checkpoint directory (headers only; no tensor data read)."""
    path = checkpoint_dir(path, "a checkpoint is a directory (config.json, *.safetensors)")
    cfg, raw = read_config(path)
    files, where = _open_shards(path)
    naming = naming or L.detect_naming(where)
    if naming is None:
        raise ForeignCheckpointError(f"{path}: tensor names are not DeepSeek-V4 names in either "
                                     f"the official or the HF spelling (e.g. {_names(where, 3)})")
    if naming == "hf" and cfg.linear_dtype == "fp8" and any(n.endswith(".weight_scale") for n in where):
        raise ForeignCheckpointError(f"{path}: NVFP4 tensors (`weight_scale`) but config.json has "
                                     "no modelopt NVFP4 quantization_config")
    fmt = "nvfp4" if cfg.linear_dtype == "nvfp4" else "official"
    L.check_drafter(cfg, where, path)  # before the per-name errors: name the real problem
    expected = L.expected_tensors(cfg, naming)
    by_leaf: dict[str, list[L.DiskTensor]] = {}
    unknown, skipped = [], {}
    for name, fname in where.items():
        t = expected.get(name)
        if t is None:
            j = L.extra_mtp_index(name, cfg, naming)
            if j is not None:
                skipped.setdefault(f"MTP block {j} (config declares "
                                   f"{cfg.num_nextn_predict_layers})", []).append(name)
            else:
                unknown.append(name)
            continue
        info = files[fname].info(name)
        if info.dtype != t.dtype:
            raise DtypeMismatchError(f"{path}: tensor {name!r} ({fname}) is {info.dtype}, the "
                                     f"{cfg.linear_dtype}/{cfg.expert_dtype} format needs {t.dtype}")
        if info.shape != t.shape:
            raise ShapeMismatchError(f"{path}: tensor {name!r} ({fname}) has shape {list(info.shape)}, "
                                     f"config.json implies {list(t.shape)}")
        by_leaf.setdefault(t.key, []).append(t)
    if unknown:
        raise UnknownKeyError(f"{path}: {len(unknown)} tensor name(s) not in the DeepSeek-V4 "
                              f"parameter description ({naming} naming): {_names(unknown)}")
    missing = [n for n, t in expected.items() if n not in where and not t.optional]
    if missing:
        raise MissingKeyError(f"{path}: {len(missing)} tensor(s) the config needs are missing: "
                              f"{_names(missing)}")
    total = sum(f.infos[n].nbytes for n, fn in where.items() for f in (files[fn],))
    return Source(path, cfg, raw, naming, fmt, files, where, by_leaf, skipped, total)


def _open_shards(path: Path) -> tuple[dict[str, SafetensorsFile], dict[str, str]]:
    idx_path = path / INDEX_NAME
    if not idx_path.exists():
        single = path / "model.safetensors"
        if not single.exists():
            raise ForeignCheckpointError(f"{path}: neither {INDEX_NAME} nor model.safetensors")
        f = SafetensorsFile(single)
        return {single.name: f}, {n: single.name for n in f.keys()}
    idx = read_json(idx_path, IndexMismatchError, "index")
    wm = idx.get("weight_map") if isinstance(idx, dict) else None
    meta = idx.get("metadata") if isinstance(idx, dict) else None
    if not (isinstance(wm, dict) and all(isinstance(v, str) for v in wm.values())
            and isinstance(meta or {}, dict)):
        raise IndexMismatchError(f"{idx_path}: not a valid index (needs a `weight_map` of "
                                 "tensor name -> shard file)")
    files: dict[str, SafetensorsFile] = {}
    for fname in sorted(set(wm.values())):
        p = path / fname
        if Path(fname).name != fname or not p.is_file():
            raise IndexMismatchError(f"{idx_path}: lists shard {fname!r} which does not exist")
        files[fname] = SafetensorsFile(p)
    for name, fname in wm.items():
        if name not in files[fname]:
            raise IndexMismatchError(f"{idx_path}: says {name!r} is in {fname}, which does not hold it")
    listed = set(wm)
    for fname, f in files.items():
        extra = [n for n in f.keys() if n not in listed]
        if extra:
            raise IndexMismatchError(f"{idx_path}: shard {fname} holds tensors the index does not "
                                     f"list: {_names(extra)}")
    stray = sorted(p.name for p in path.glob("*.safetensors") if p.name not in files)
    if stray:
        raise IndexMismatchError(f"{idx_path}: shard file(s) on disk not referenced by the index: "
                                 f"{_names(stray)}")
    total = (meta or {}).get("total_size")
    actual = sum(i.nbytes for f in files.values() for i in f.infos.values())
    if total is not None and (not isinstance(total, (int, str)) or str(total) != str(actual)):
        raise IndexMismatchError(f"{idx_path}: metadata.total_size is {total}, the shards hold "
                                 f"{actual} bytes of tensors")
    return files, dict(wm)
