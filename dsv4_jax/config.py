"""Model configuration: a frozen, hashable dataclass read from a HF `config.json`.

Keys follow the official DeepSeek-V4 release (ARCHITECTURE.md section 1). The modern
transformers spelling (`layer_types`, `compress_rates`, `mlp_layer_types`) is accepted too.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

_LAYER_TYPE_TO_RATIO = {"sliding_attention": 0}  # completed from compress_rates below


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    num_hash_layers: int = 3
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    # YaRN (applied to compressed layers only)
    rope_factor: float = 16.0
    rope_original_max_position: int = 65536
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    bos_token_id: int = 0
    eos_token_id: int = 1
    # num_hidden_layers + 1 entries; the last one is the MTP block's.
    compress_ratios: tuple[int, ...] = ()
    num_nextn_predict_layers: int = 1
    # Weight formats: routed experts "fp4" | "fp8" | "nvfp4" | "bf16"; other linears
    # "fp8" | "nvfp4" | "bf16".
    expert_dtype: str = "fp4"
    linear_dtype: str = "fp8"
    name: str = "custom"
    # The DSpark drafter of V4-Flash-0731 (docs/SPECULATIVE.md, DSpark): its `mtp.0..S-1`
    # tensors are S drafter stages, S = len(dspark_target_layer_ids), not MTP blocks; such
    # a config has num_nextn_predict_layers 0 and num_hidden_layers compress_ratios (the
    # release's config.json carries more: from_hf_dict truncates them). () / 0: no drafter.
    dspark_target_layer_ids: tuple[int, ...] = ()  # target layers whose outputs it reads
    dspark_block_size: int = 0  # tokens drafted per forward (the release: 5)
    dspark_markov_rank: int = 0  # rank of the Markov head's bias (the release: 256)
    dspark_noise_token_id: int = 0  # the block's filler token (the release: 128799)

    # ---- derived -------------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    def layer_ratio(self, layer: int) -> int:
        """Compression ratio of block `layer` (layer == num_hidden_layers is the MTP)."""
        return self.compress_ratios[layer]

    def layer_kind(self, layer: int) -> str:
        return {0: "swa", 4: "csa"}.get(self.compress_ratios[layer], "hca")

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hash_layers  # the MTP block (index n) routes normally

    @property
    def dspark(self) -> bool:
        """Whether the checkpoint's mtp.* tensors are a DSpark drafter (V4-Flash-0731)."""
        return len(self.dspark_target_layer_ids) > 0

    @property
    def dspark_num_stages(self) -> int:
        return len(self.dspark_target_layer_ids)

    @property
    def num_blocks_total(self) -> int:
        """Main blocks + MTP blocks."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    # ---- validation ----------------------------------------------------------------
    def __post_init__(self):
        def need(cond, field, msg):
            if not cond:
                raise ValueError(f"invalid config field `{field}`: {msg}")

        for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window",
                  "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "index_n_heads", "index_head_dim", "index_topk", "hc_mult",
                  "hc_sinkhorn_iters"):
            v = getattr(self, f)
            need(_is_int(v) and v > 0, f, f"must be a positive integer, got {v!r}")
        for f in ("rope_original_max_position",):
            v = getattr(self, f)
            need(_is_int(v) and v > 0, f, f"must be a positive integer, got {v!r}")
        for f in ("num_nextn_predict_layers", "num_hash_layers", "n_shared_experts"):
            v = getattr(self, f)
            need(_is_int(v) and v >= 0, f, f"must be a non-negative integer, got {v!r}")
        # a negative or zero eps / theta / factor gives NaN or meaningless logits, silently
        for f in ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "rope_factor",
                  "rope_beta_fast", "rope_beta_slow", "routed_scaling_factor", "swiglu_limit"):
            v = getattr(self, f)
            need(_is_real(v) and math.isfinite(v) and v > 0, f,
                 f"must be a finite number > 0, got {v!r}")
        need(self.rms_norm_eps < 1 and self.hc_eps < 1, "rms_norm_eps" if self.rms_norm_eps >= 1
             else "hc_eps", "an epsilon must be below 1")
        need(self.rope_beta_fast > self.rope_beta_slow, "rope_beta_fast",
             f"must exceed rope_beta_slow ({self.rope_beta_slow}), got {self.rope_beta_fast}")
        for f in ("bos_token_id", "eos_token_id"):
            v = getattr(self, f)
            need(_is_int(v) and 0 <= v < self.vocab_size, f,
                 f"must be a token id in [0, vocab_size={self.vocab_size}), got {v!r}")
        need(self.num_key_value_heads == 1, "num_key_value_heads",
             f"DeepSeek-V4 uses one shared K=V head, got {self.num_key_value_heads}")
        need(0 < self.qk_rope_head_dim < self.head_dim and self.qk_rope_head_dim % 2 == 0,
             "qk_rope_head_dim", f"must be even and inside head_dim, got {self.qk_rope_head_dim}")
        need(self.nope_head_dim % 64 == 0, "head_dim",
             "nope part (head_dim - qk_rope_head_dim) must be a multiple of the 64-wide FP8 block")
        need(self.num_attention_heads % self.o_groups == 0, "o_groups",
             f"{self.num_attention_heads} heads do not split into {self.o_groups} groups")
        need(self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
             "more experts per token than routed experts")
        need(self.n_shared_experts in (0, 1), "n_shared_experts", "only 0 or 1 supported")
        need(self.scoring_func == "sqrtsoftplus", "scoring_func",
             f"only 'sqrtsoftplus' is supported, got {self.scoring_func!r}")
        need(self.index_head_dim & (self.index_head_dim - 1) == 0, "index_head_dim",
             "must be a power of two (Walsh-Hadamard)")
        need(self.hidden_size % 128 == 0, "hidden_size", "must be a multiple of 128 (FP8 blocks)")
        need(self.moe_intermediate_size % 128 == 0, "moe_intermediate_size",
             "must be a multiple of 128")
        need(len(self.compress_ratios) == self.num_hidden_layers + self.num_nextn_predict_layers,
             "compress_ratios", f"needs num_hidden_layers + {self.num_nextn_predict_layers} = "
             f"{self.num_hidden_layers + self.num_nextn_predict_layers} entries, got "
             f"{len(self.compress_ratios)}")
        for r in self.compress_ratios:
            need(r in (0, 4, 128), "compress_ratios", f"entries must be 0, 4 or 128, got {r}")
        need(0 <= self.num_hash_layers <= self.num_hidden_layers, "num_hash_layers",
             "must be within [0, num_hidden_layers]")
        need(self.expert_dtype in ("fp4", "fp8", "nvfp4", "bf16"), "expert_dtype",
             f"unknown {self.expert_dtype!r}")
        need(self.linear_dtype in ("fp8", "nvfp4", "bf16"), "linear_dtype",
             f"unknown {self.linear_dtype!r}")
        self._check_dspark(need)

    def _check_dspark(self, need):
        ids = self.dspark_target_layer_ids
        need(isinstance(ids, tuple) and all(_is_int(i) for i in ids), "dspark_target_layer_ids",
             f"must be a tuple of layer indices, got {ids!r}")
        for f in ("dspark_block_size", "dspark_markov_rank", "dspark_noise_token_id"):
            v = getattr(self, f)
            need(_is_int(v) and v >= 0, f, f"must be a non-negative integer, got {v!r}")
        if not ids:
            need(self.dspark_block_size == 0 and self.dspark_markov_rank == 0, "dspark_block_size"
                 if self.dspark_block_size else "dspark_markov_rank",
                 "set without dspark_target_layer_ids (a DSpark drafter needs its target layers)")
            return
        for i in ids:
            need(0 <= i < self.num_hidden_layers, "dspark_target_layer_ids",
                 f"layer {i} is outside [0, num_hidden_layers={self.num_hidden_layers})")
        need(self.dspark_block_size >= 1, "dspark_block_size",
             f"a DSpark drafter drafts at least 1 token a block, got {self.dspark_block_size}")
        need(self.dspark_markov_rank >= 1, "dspark_markov_rank",
             f"the DSpark Markov head needs a rank >= 1, got {self.dspark_markov_rank}")
        need(self.dspark_noise_token_id < self.vocab_size, "dspark_noise_token_id",
             f"must be a token id in [0, vocab_size={self.vocab_size}), got "
             f"{self.dspark_noise_token_id}")
        need(self.num_nextn_predict_layers == 0, "num_nextn_predict_layers",
             "a DSpark checkpoint's mtp.* tensors are the drafter's stages, not MTP blocks: "
             f"must be 0 with dspark_target_layer_ids, got {self.num_nextn_predict_layers}")

    # ---- IO ------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "custom") -> "Config":
        d = dict(d)
        kw: dict[str, Any] = {}
        fields = {f.name for f in dataclasses.fields(cls)}
        for k in fields:
            if k in d:
                kw[k] = d[k]
        n = d.get("num_hidden_layers", cls.num_hidden_layers)
        nmtp = d.get("num_nextn_predict_layers", 1)
        dspark = bool(d.get("dspark_target_layer_ids"))
        if dspark:  # the mtp.* tensors are the drafter: no MTP block, whatever the file says
            nmtp = 0
            kw["num_nextn_predict_layers"] = 0
            ids = d["dspark_target_layer_ids"]
            if not (isinstance(ids, list) and all(_is_int(i) for i in ids)):
                raise ValueError(f"invalid config field `dspark_target_layer_ids`: must be a "
                                 f"list of layer indices, got {ids!r}")
            kw["dspark_target_layer_ids"] = tuple(ids)
        else:
            kw.pop("dspark_target_layer_ids", None)
        # compress ratios: official list, or modern layer_types + compress_rates.
        if "compress_ratios" in d:
            ratios = list(d["compress_ratios"])
        elif "layer_types" in d:
            rates = {"sliding_attention": 0, "compressed_sparse_attention": 4,
                     "heavily_compressed_attention": 128}
            rates.update(d.get("compress_rates") or {})
            try:
                ratios = [rates[t] for t in d["layer_types"]]
            except KeyError as e:
                raise ValueError(f"invalid config field `layer_types`: unknown type {e}") from None
            ratios += [0] * nmtp
        else:
            raise ValueError("invalid config: neither `compress_ratios` nor `layer_types` given")
        if len(ratios) == n:  # some exports omit the MTP entry
            ratios += [0] * nmtp
        if dspark:  # the release lists its drafter stages' (window-only) entries too
            if len(ratios) < n:
                raise ValueError(f"invalid config field `compress_ratios`: {len(ratios)} "
                                 f"entries for {n} layers")
            ratios = ratios[:n]
        kw["compress_ratios"] = tuple(int(r) for r in ratios)
        if "mlp_layer_types" in d and "num_hash_layers" not in d:
            kw["num_hash_layers"] = sum(t == "hash_moe" for t in d["mlp_layer_types"])
        if "partial_rotary_factor" in d and "qk_rope_head_dim" not in d and d["partial_rotary_factor"]:
            kw["qk_rope_head_dim"] = int(d.get("head_dim", 512) * d["partial_rotary_factor"])
        rs = d.get("rope_scaling") or (d.get("rope_parameters") or {}).get("compress") or {}
        if rs:
            kw["rope_factor"] = float(rs.get("factor", cls.rope_factor))
            kw["rope_original_max_position"] = int(
                rs.get("original_max_position_embeddings", cls.rope_original_max_position))
            kw["rope_beta_fast"] = float(rs.get("beta_fast", cls.rope_beta_fast))
            kw["rope_beta_slow"] = float(rs.get("beta_slow", cls.rope_beta_slow))
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = int(kw["eos_token_id"][0])
        q = d.get("quantization_config") or {}
        if "expert_dtype" not in d:
            ed = q.get("expert_dtype")
            if q.get("quant_algo", "").upper() == "NVFP4" or q.get("quant_method") == "modelopt":
                kw["expert_dtype"] = "nvfp4"
                kw["linear_dtype"] = "nvfp4"
            elif ed is not None:
                kw["expert_dtype"] = ed
            elif q.get("quant_method") == "fp8":
                kw["expert_dtype"] = "fp8"  # Base models: FP8 experts
            elif not q:
                kw["expert_dtype"] = "bf16"
        if "linear_dtype" not in kw and not q and "expert_dtype" not in d:
            kw["linear_dtype"] = "bf16"
        kw["name"] = name
        # type coercions so JSON floats/ints land as declared
        for f in dataclasses.fields(cls):
            if f.name in kw and f.type in ("float",) and kw[f.name] is not None:
                if not _is_real(kw[f.name]):
                    raise ValueError(f"invalid config field `{f.name}`: must be a number, got "
                                     f"{kw[f.name]!r}")
                kw[f.name] = float(kw[f.name])
        return cls(**kw)

    @classmethod
    def from_json(cls, path: str | Path) -> "Config":
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.exists():
            raise FileNotFoundError(f"no config.json at {p}")
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: not valid JSON: {e.msg} at line {e.lineno} column "
                             f"{e.colno}") from None
        if not isinstance(d, dict):
            raise ValueError(f"{p}: must hold a JSON object of config fields, got "
                             f"{type(d).__name__}")
        try:
            return cls.from_hf_dict(d, name=p.parent.name)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{p}: {e}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The official-release style config.json for this config."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["compress_ratios"] = list(self.compress_ratios)
        d["dspark_target_layer_ids"] = list(self.dspark_target_layer_ids)
        if self.dspark:  # as the V4-Flash-0731 release writes it (from_hf_dict reads neither)
            d["compress_ratios"] += [0] * self.dspark_num_stages
            d["num_nextn_predict_layers"] = 1
        else:
            for k in ("dspark_target_layer_ids", "dspark_block_size", "dspark_markov_rank",
                      "dspark_noise_token_id"):
                d.pop(k)
        for k in ("rope_factor", "rope_original_max_position", "rope_beta_fast",
                  "rope_beta_slow", "name", "linear_dtype"):
            d.pop(k)
        d["rope_scaling"] = {"type": "yarn", "factor": self.rope_factor,
                             "original_max_position_embeddings": self.rope_original_max_position,
                             "beta_fast": self.rope_beta_fast, "beta_slow": self.rope_beta_slow}
        d["architectures"] = ["DeepseekV4ForCausalLM"]
        d["model_type"] = "deepseek_v4"
        d["num_key_value_heads"] = 1
        if self.linear_dtype == "fp8":
            d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                        "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
            if self.expert_dtype == "fp4":
                d["quantization_config"]["expert_dtype"] = "fp4"
                d["expert_dtype"] = "fp4"
        elif self.linear_dtype == "nvfp4":
            d["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                        "group_size": 16}
            d.pop("expert_dtype")
        else:
            d.pop("expert_dtype")
        return d

    def replace(self, **kw) -> "Config":
        return dataclasses.replace(self, **kw)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _interleaved_ratios(n: int, head: tuple[int, ...]) -> tuple[int, ...]:
    body = [4 if i % 2 == 0 else 128 for i in range(n - len(head))]
    return tuple(head) + tuple(body) + (0,)


def flash() -> Config:
    return Config(name="flash", compress_ratios=_interleaved_ratios(43, (0, 0)))


def pro() -> Config:
    return Config(name="pro", hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
                  q_lora_rank=1536, o_groups=16, n_routed_experts=384,
                  moe_intermediate_size=3072, routed_scaling_factor=2.5, index_topk=1024,
                  compress_ratios=_interleaved_ratios(61, (128, 128)))


def tiny() -> Config:
    """A CPU-sized model that keeps every feature: SWA, CSA and HCA layers, hash and routed
    MoE layers, the MTP block, head_dim 512, window 128, compression ratios 4 and 128."""
    return Config(name="tiny", vocab_size=1024, hidden_size=256, num_hidden_layers=5,
                  num_attention_heads=8, q_lora_rank=128, o_groups=2, o_lora_rank=128,
                  n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                  num_hash_layers=2, index_n_heads=32, index_topk=16,
                  compress_ratios=(0, 4, 128, 4, 128, 0))


def test() -> Config:
    """The smallest model with every layer kind, for model-math tests: an SWA layer with
    hash routing, a CSA layer (indexer) and an HCA layer with score routing, and the MTP
    block; widths at the formats' minimum (hidden 128, 2 heads in 2 output groups, 128-row
    FP8 blocks), head_dim 512 and index_head_dim 128 as the cache formats store them."""
    return Config(name="test", vocab_size=256, hidden_size=128, num_hidden_layers=3,
                  num_attention_heads=2, q_lora_rank=128, o_groups=2, o_lora_rank=128,
                  n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                  num_hash_layers=1, index_n_heads=4, index_topk=8,
                  compress_ratios=(0, 4, 128, 0))


PRESETS = {"flash": flash, "pro": pro, "tiny": tiny, "test": test}


def get_preset(name: str) -> Config:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None
