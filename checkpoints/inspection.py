"""`dsv4 inspect PATH`: names, shapes, dtypes and bytes per parameter type / layer kind of a
safetensors directory or an orbax checkpoint from `dsv4 convert`, from headers and
metadata only (no tensor data is read)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from . import layout as L
from .errors import CheckpointError, IncompleteCheckpointError
from .source import checkpoint_dir


def _human(n: float) -> str:
    for u in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or u == "TiB":
            return f"{n:.1f} {u}" if u != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _layer_kind(key: str, cfg) -> str:
    part = L.part_of(key)
    if part == "globals":
        return "globals"
    kind, idx = part.split(".")
    if kind == "mtp":
        return "dspark" if cfg is not None and cfg.dspark else "mtp"
    return {0: "swa", 4: "csa", 128: "hca"}[cfg.layer_ratio(int(idx))] if cfg else "layers"


def inspect(path) -> dict:
    """{kind, format, layout, config, tensors: [{name, key, dtype, shape, bytes}], notes}
    (layout: the drafter layout, base V4 MTP or V4-Flash-0731 DSpark) for a
    safetensors directory or a finished orbax checkpoint. Anything that `convert` or `load`
    would refuse (corrupt or truncated header, index mismatch, foreign model, unfinished or
    damaged conversion) raises its CheckpointError instead of a report."""
    from .convert import MANIFEST, STATE
    path = checkpoint_dir(path, "inspect takes a checkpoint directory (safetensors or orbax)")
    if (path / MANIFEST).exists() or (path / STATE).exists() or (path / "parts").exists():
        return _inspect_orbax(path)
    if (path / "config.json").exists() or any(path.glob("*.safetensors")):
        return _inspect_safetensors(path)
    raise CheckpointError(f"{path}: neither a safetensors checkpoint directory (config.json + "
                          f"*.safetensors) nor a dsv4 orbax checkpoint ({MANIFEST})")


def _inspect_safetensors(path: Path) -> dict:
    from .source import open_source
    src = open_source(path)
    notes = [f"{len(names)} tensors of {reason} (skipped by convert)"
             for reason, names in src.skipped.items()]
    classified = {t.name: key for key, ts in src.by_leaf.items() for t in ts}
    tensors = []
    for name, fname in src.where.items():
        i = src.files[fname].info(name)
        tensors.append({"name": name, "key": classified.get(name), "dtype": i.dtype,
                        "shape": list(i.shape), "bytes": i.nbytes, "file": fname})
    return {"path": str(path), "kind": "safetensors",
            "format": f"{src.fmt} ({src.naming} names)", "layout": src.layout,
            "config": src.cfg, "tensors": tensors, "notes": notes}


def _inspect_orbax(path: Path) -> dict:
    from .convert import MANIFEST, chunk_metadata, read_manifest
    from .source import read_config
    manifest = read_manifest(path)
    cfg, _ = read_config(path)
    tensors = []
    for part, pm in manifest["parts"].items():
        for c, keys in pm["chunks"].items():
            meta = chunk_metadata(path / "parts" / part / c)
            missing = [k for k in keys if k not in meta]
            if missing:
                raise IncompleteCheckpointError(f"{path / 'parts' / part / c}: lacks "
                                                f"{missing[:3]}, which {MANIFEST} lists there")
            for key, m in meta.items():
                fields = m if isinstance(m, dict) else {"": m}
                for f, a in fields.items():
                    n = int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
                    tensors.append({"name": key + (f".{f}" if f else ""), "key": key,
                                    "dtype": str(np.dtype(a.dtype)), "shape": list(a.shape),
                                    "bytes": n, "file": f"parts/{part}/{c}"})
    src = manifest.get("source") or {}
    fmt = (f"orbax, converted from {src.get('format')}-format safetensors "
           f"({src.get('naming')} names)")
    L.check_drafter(cfg, [t["key"] for t in tensors], path)
    return {"path": str(path), "kind": "orbax", "format": fmt, "layout": L.layout_name(cfg),
            "config": cfg, "tensors": tensors, "notes": []}


def summarize(info: dict) -> dict:
    """Bytes and counts per parameter category and per layer kind."""
    cfg = info["config"]
    by_cat, by_kind = {}, {}
    for t in info["tensors"]:
        key = t["key"]
        cat = L.category(key) if key else "unclassified"
        kind = _layer_kind(key, cfg) if key else "unclassified"
        for d, k in ((by_cat, cat), (by_kind, kind)):
            n, b = d.get(k, (0, 0))
            d[k] = (n + 1, b + t["bytes"])
    return {"by_category": by_cat, "by_layer_kind": by_kind,
            "total_bytes": sum(t["bytes"] for t in info["tensors"]),
            "count": len(info["tensors"])}


def format_report(info: dict, tensors: bool = False, match: str | None = None) -> str:
    s = summarize(info)
    cfg = info["config"]
    lines = [f"{info['path']}: {info['kind']}, {info['format']}",
             f"  layout: {info['layout']}",
             f"  {s['count']} tensors, {_human(s['total_bytes'])}"]
    if cfg is not None:
        drafter = (f"{cfg.dspark_num_stages} DSpark stages" if cfg.dspark
                   else f"{cfg.num_nextn_predict_layers} MTP")
        lines.append(f"  config: {cfg.num_hidden_layers} layers + {drafter}, d={cfg.hidden_size}, heads={cfg.num_attention_heads}, "
                     f"experts={cfg.n_routed_experts} (top {cfg.num_experts_per_tok}), "
                     f"vocab={cfg.vocab_size}, linear={cfg.linear_dtype}, "
                     f"experts={cfg.expert_dtype}")
    for title, d in (("by parameter type", s["by_category"]), ("by layer kind", s["by_layer_kind"])):
        lines.append(f"  {title}:")
        for k, (n, b) in sorted(d.items(), key=lambda kv: -kv[1][1]):
            lines.append(f"    {k:<20} {n:>7} tensors {_human(b):>12}")
    for note in info["notes"]:
        lines.append(f"  note: {note}")
    if tensors:
        lines.append("  tensors:")
        for t in info["tensors"]:
            if match and match not in t["name"]:
                continue
            lines.append(f"    {t['name']:<64} {t['dtype']:<14} {str(t['shape']):<22} "
                         f"{_human(t['bytes']):>10}")
    return "\n".join(lines)


def to_json(info: dict) -> str:
    out = dict(info)
    out["config"] = info["config"].to_hf_dict() if info["config"] is not None else None
    out["summary"] = summarize(info)
    return json.dumps(out, indent=1)
