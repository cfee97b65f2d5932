"""The on-disk tensors of every parameter: one table, used by the synthetic writer, the
converter's key classifier, the direct safetensors loader and `inspect`.

Two namings:
  official  release names (`layers.3.attn.wq_a.weight` + `.scale`, experts per expert
            `layers.3.ffn.experts.17.w1.weight`), CHECKPOINT_FORMAT.md section A
  hf        transformers names (`model.layers.3.self_attn.q_a_proj.weight`), section B;
            NVFP4 linears carry `weight` / `weight_scale` / `weight_scale_2` / `input_scale`

Per leaf format (ParamSpec.fmt) the fields of the in-memory quant type map to tensors:
  fp8    w -> `.weight` F8_E4M3,  scale -> `.scale` (hf: `.weight_scale_inv`) F8_E8M0 [o/128, i/128]
  fp4    packed -> `.weight` I8 [o, i/2],  scale -> `.scale` F8_E8M0 [o, i/32]
  nvfp4  packed -> `.weight` U8 [o, i/2],  scale -> `.weight_scale` F8_E4M3 [o, i/16],
         scale2 -> `.weight_scale_2` F32 [],  (`.input_scale` F32 [] optional, never used)
  bf16 / f32 plain tensors; i32 (`gate.tid2eid`) is I64 on disk.
Stacked expert leaves `layers.N.ffn.experts.wK` [E, o, i] are E per-expert tensor groups.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Iterator

import numpy as np

from dsv4_jax import quant as Q
from dsv4_jax.config import Config
from dsv4_jax.params import ParamSpec, describe

from . import hf_names
from .errors import DrafterMismatchError

NAMINGS = ("official", "hf")
# Last component of a module-path key (a quantisable linear): its tensors are `<key>.weight`...
_MODULE_LEAF = re.compile(r"(^|\.)(wq_a|wq_b|wkv|wo_a|wo_b|w1|w2|w3|e_proj|h_proj|main_proj)$")
_EXPERT_KEY = re.compile(r"^(layers|mtp)\.(\d+)\.ffn\.experts\.(w[123])$")
_MTP_NAME = {"official": re.compile(r"^mtp\.(\d+)\."), "hf": re.compile(r"^(?:model\.)?mtp\.(\d+)\.")}

# Fields of each quant type, in write order: (field, official suffix); hf_names maps the
# official `.scale` to `.weight_scale_inv`, NVFP4 suffixes keep their spelling.
_FIELDS = {
    "fp8": (("w", "weight"), ("scale", "scale")),
    "fp4": (("packed", "weight"), ("scale", "scale")),
    "nvfp4": (("packed", "weight"), ("scale", "weight_scale"), ("scale2", "weight_scale_2")),
}
_PLAIN_DISK_DTYPE = {"bf16": "BF16", "f32": "F32", "i32": "I64"}
_FIELD_DTYPE = {("fp8", "w"): "F8_E4M3", ("fp8", "scale"): "F8_E8M0",
                ("fp4", "packed"): "I8", ("fp4", "scale"): "F8_E8M0",
                ("nvfp4", "packed"): "U8", ("nvfp4", "scale"): "F8_E4M3",
                ("nvfp4", "scale2"): "F32"}
QUANT_CLASS = {"fp8": Q.Fp8Weight, "fp4": Q.Fp4Weight, "nvfp4": Q.NvFp4Weight}


@dataclasses.dataclass(frozen=True)
class DiskTensor:
    """One tensor on disk and where it goes in the parameter tree."""
    name: str  # on-disk tensor name
    key: str  # parameter key (describe(cfg))
    field: str  # "value" for plain leaves, else the quant type's field; "input_scale" is ignored
    expert: int | None  # expert index inside a stacked expert leaf
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]  # on-disk shape
    optional: bool = False

    @property
    def nbytes(self) -> int:
        from .safetensors_io import DTYPES
        return int(np.prod(self.shape, dtype=np.int64)) * DTYPES[self.dtype].itemsize


def is_module_key(key: str) -> bool:
    return bool(_MODULE_LEAF.search(key))


def is_expert_key(key: str) -> bool:
    return bool(_EXPERT_KEY.match(key))


def field_shapes(spec: ParamSpec) -> dict[str, tuple[int, ...]]:
    """Stored shape of each field of a (non-stacked or stacked) leaf."""
    *lead, o, i = spec.shape if len(spec.shape) >= 2 else (None, *spec.shape)
    lead = tuple(lead)
    if spec.fmt == "fp8":
        return {"w": spec.shape, "scale": (*lead, -(-o // 128), -(-i // 128))}
    if spec.fmt == "fp4":
        return {"packed": (*lead, o, i // 2), "scale": (*lead, o, i // 32)}
    if spec.fmt == "nvfp4":
        return {"packed": (*lead, o, i // 2), "scale": (*lead, o, i // 16), "scale2": lead}
    return {"value": spec.shape}


def _official_tensor_name(key: str, suffix: str, expert: int | None) -> str:
    if expert is None:
        return f"{key}.{suffix}"
    head, w = key.rsplit(".", 1)  # layers.N.ffn.experts / w1
    return f"{head}.{expert}.{w}.{suffix}"


def _hf_name(official: str) -> str:
    """HF name of an official tensor name; NVFP4 suffixes ride on the module's name."""
    for sfx in ("weight_scale_2", "weight_scale", "input_scale"):
        if official.endswith("." + sfx):
            return hf_names.official_to_hf(official[: -len(sfx)] + "weight")[: -len("weight")] + sfx
    return hf_names.official_to_hf(official)


def leaf_tensors(key: str, spec: ParamSpec, naming: str) -> Iterator[DiskTensor]:
    """The disk tensors of one leaf, in file order (per expert: all fields of expert e)."""
    if naming not in NAMINGS:
        raise ValueError(f"unknown naming {naming!r}; choose from {NAMINGS}")
    name = (lambda o: o) if naming == "official" else _hf_name
    stacked = is_expert_key(key)
    experts = range(spec.shape[0]) if stacked else (None,)
    if spec.quantized:
        fshape = field_shapes(spec)
        for e in experts:
            for f in _FIELDS[spec.fmt]:
                shp = fshape[f[0]][1:] if stacked else fshape[f[0]]
                yield DiskTensor(name(_official_tensor_name(key, f[1], e)), key, f[0], e,
                                 _FIELD_DTYPE[(spec.fmt, f[0])], tuple(shp))
            if spec.fmt == "nvfp4":
                yield DiskTensor(name(_official_tensor_name(key, "input_scale", e)), key,
                                 "input_scale", e, "F32", (), optional=True)
    elif is_module_key(key):  # an unquantised linear (bf16 model): `<key>.weight`
        for e in experts:
            shp = spec.shape[1:] if stacked else spec.shape
            yield DiskTensor(name(_official_tensor_name(key, "weight", e)), key, "value", e,
                             _PLAIN_DISK_DTYPE[spec.fmt], tuple(shp))
    else:
        yield DiskTensor(name(key), key, "value", None, _PLAIN_DISK_DTYPE[spec.fmt], spec.shape)


def expected_tensors(cfg: Config, naming: str) -> dict[str, DiskTensor]:
    """Every tensor a checkpoint for `cfg` holds (MTP blocks the config declares included)."""
    out: dict[str, DiskTensor] = {}
    for key, spec in describe(cfg, include_mtp=True).items():
        for t in leaf_tensors(key, spec, naming):
            assert t.name not in out, f"name clash on {t.name}"
            out[t.name] = t
    return out


def extra_mtp_index(name: str, cfg: Config, naming: str) -> int | None:
    """The MTP block index of a tensor from an MTP block the config does not declare.
    None for a DSpark config: a stage it does not declare is a mismatch, not a block to
    skip."""
    m = _MTP_NAME[naming].match(name)
    if m and not cfg.dspark and int(m.group(1)) >= cfg.num_nextn_predict_layers:
        return int(m.group(1))
    return None


# Tensors (or parameter keys) under mtp.J. that only one drafter layout has.
_DRAFTER_ONLY = {"dspark": ("main_proj", "main_norm.", "markov_head.", "confidence_head."),
                 "mtp": ("e_proj", "h_proj", "enorm.", "hnorm.")}
_MTP_SUFFIX = re.compile(r"^(?:model\.)?mtp\.\d+\.(.+)$")


def drafter_tensors(names) -> dict[str, list[str]]:
    """{"dspark": [...], "mtp": [...]}: the names (tensor names in either naming, or
    parameter keys) that only a DSpark drafter / only a base-V4 MTP block has."""
    out = {k: [] for k in _DRAFTER_ONLY}
    for n in names:
        m = _MTP_SUFFIX.match(n)
        if m:
            for kind, heads in _DRAFTER_ONLY.items():
                if m.group(1).startswith(heads):
                    out[kind].append(n)
    return out


def layout_name(cfg: Config) -> str:
    """The checkpoint layout a config declares, as `inspect` names it."""
    if cfg.dspark:
        return (f"V4-Flash-0731 (DSpark drafter: {cfg.dspark_num_stages} stages mtp.0-"
                f"{cfg.dspark_num_stages - 1}, block {cfg.dspark_block_size}, Markov rank "
                f"{cfg.dspark_markov_rank}, target layers "
                f"{list(cfg.dspark_target_layer_ids)})")
    if cfg.num_nextn_predict_layers:
        return f"base V4 ({cfg.num_nextn_predict_layers} MTP block)"
    return "base V4 (no drafter)"


def check_drafter(cfg: Config, names, where) -> None:
    """Raise DrafterMismatchError if the mtp.* names (tensors or parameter keys) are the
    other drafter layout than the config declares: a base-V4 config meeting the DSpark
    drafter would read its stages as MTP blocks (a known silent failure of other engines),
    a DSpark config meeting an MTP block has no drafter to run."""
    found = drafter_tensors(names)
    if not cfg.dspark and found["dspark"]:
        raise DrafterMismatchError(
            f"{where}: the tensors hold a DSpark drafter (e.g. "
            f"{', '.join(repr(n) for n in sorted(found['dspark'])[:3])}: the V4-Flash-0731 "
            "layout, whose mtp.* are drafter stages), but config.json declares no DSpark "
            "drafter (no dspark_target_layer_ids) and reads mtp.* as MTP blocks; use the "
            "config.json that came with these tensors")
    if cfg.dspark and found["mtp"]:
        raise DrafterMismatchError(
            f"{where}: config.json declares a DSpark drafter (dspark_target_layer_ids "
            f"{list(cfg.dspark_target_layer_ids)}: the V4-Flash-0731 layout), but the "
            f"tensors hold a base-V4 MTP block (e.g. "
            f"{', '.join(repr(n) for n in sorted(found['mtp'])[:3])}); use the config.json "
            "that came with these tensors")


def detect_naming(names) -> str | None:
    """'official' or 'hf' from the tensor names, None if neither (a foreign checkpoint)."""
    names = list(names)
    if any(n.startswith("model.layers.") or n == "model.embed_tokens.weight" for n in names):
        return "hf"
    if any(n.startswith("layers.") for n in names) or "embed.weight" in names:
        return "official"
    return None


def part_of(key: str) -> str:
    """Conversion unit of a parameter key: `layers.N`, `mtp.J` (an MTP block or a DSpark
    stage) or `globals`."""
    m = re.match(r"^(layers|mtp)\.(\d+)\.", key)
    return f"{m.group(1)}.{m.group(2)}" if m else "globals"


def category(key: str) -> str:
    """Coarse parameter type for size reports."""
    k = re.sub(r"^(layers|mtp)\.\d+\.", "", key)
    if k.startswith("ffn.experts."):
        return "routed experts"
    if k.startswith("ffn.shared_experts."):
        return "shared expert"
    if k.startswith("ffn.gate."):
        return "router"
    if k.startswith("attn.indexer."):
        return "indexer"
    if k.startswith("attn.compressor."):
        return "compressor"
    if k.startswith("attn."):
        return "attention"
    if k.startswith("hc_"):
        return "hyper-connections"
    if k in ("embed.weight", "head.weight"):
        return "embedding/head"
    if k in ("e_proj", "h_proj"):
        return "mtp projections"
    if k == "main_proj" or k.startswith(("markov_head.", "confidence_head.")):
        return "dspark heads"
    return "norms"


def to_leaf(fmt: str, fields: dict):
    """Field dict -> in-memory leaf (quant type or plain array)."""
    if fmt in QUANT_CLASS:
        return QUANT_CLASS[fmt](**fields)
    return fields["value"]


def from_leaf(leaf) -> dict:
    """In-memory leaf -> field dict (what the orbax tree stores)."""
    if Q.is_quantized(leaf):
        return {f.name: getattr(leaf, f.name) for f in dataclasses.fields(leaf)}
    return {"value": leaf}
