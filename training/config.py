"""The models and the training run, as frozen dataclasses.

`small()` is the model meant to ship: every DeepSeek-V4 feature (mHC, SWA + CSA + HCA layers
with their compressors and the indexer, hash-routed and score-routed MoE with the shared
expert, the MTP block) at a width whose release-format export (FP8 linears, FP4 experts,
bf16/f32 rest) plus tokenizer.json stays under 8 MB. `smoke()` is the same layout at the
smallest widths, for CPU tests.
"""
from __future__ import annotations

import dataclasses

from dsv4_jax.config import Config


def small() -> Config:
    """4 blocks + MTP at hidden 128, vocab 4096: two SWA layers with hash routing, a CSA
    layer (compressor ratio 4 + indexer) and an HCA layer (ratio 128) with score routing,
    8 routed experts (2 per token) + the shared expert; the MTP block is SWA. head_dim 512,
    index_head_dim 128 and window 128 are what the cache formats and kernels need.
    Measured export: 7.34 MB of safetensors, 7.64 MB with tokenizer.json (docs/TRAINING.md)."""
    return Config(name="dsv4-small-stdlib", vocab_size=4096, hidden_size=128,
                  num_hidden_layers=4, num_attention_heads=2, q_lora_rank=128, o_groups=2,
                  o_lora_rank=128, n_routed_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=128, num_hash_layers=2, index_n_heads=8,
                  index_topk=16, compress_ratios=(0, 0, 4, 128, 0))


def smoke() -> Config:
    """The layout of `small` at CPU-test size: SWA (hash), CSA, HCA + MTP, vocab 512, and
    2 Sinkhorn iterations (20 take 13 of a CPU compile's 35 s of the training step)."""
    return Config(name="dsv4-smoke", vocab_size=512, hidden_size=128, num_hidden_layers=3,
                  num_attention_heads=2, q_lora_rank=128, o_groups=2, o_lora_rank=128,
                  n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                  num_hash_layers=1, index_n_heads=4, index_topk=8, hc_sinkhorn_iters=2,
                  compress_ratios=(0, 4, 128, 0))


MODELS = {"small": small, "smoke": smoke}


def training_form(cfg: Config) -> Config:
    """The config the training forward runs: every linear and expert as a plain bf16
    weight (the FP8/FP4 storage types are not differentiable; their rounding is applied to
    the master weights as fake quantisation instead, see training/quantize.py)."""
    return cfg.replace(linear_dtype="bf16", expert_dtype="bf16")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run. Loss = CE(next token) + mtp_weight * CE(MTP: token t+2)
    + indexer_weight * KL(attention on the selected compressed entries || indexer)."""
    model: str = "small"
    steps: int = 6000
    batch_size: int = 32
    seq_len: int = 512
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # DeepSeek-V3 weights its MTP loss 0.3 for most of training (0.1 at the end); the
    # DSV4 spec gives no value.
    mtp_weight: float = 0.3
    indexer_weight: float = 0.1
    # Auxiliary-loss-free balancing (DeepSeek-V3): each step every score-routed gate bias
    # moves by this much towards equal expert loads; no gradient reaches the bias.
    bias_update_rate: float = 1e-3
    # Round the master weights to their export formats (FP8 / FP4) in the forward, with
    # a straight-through gradient, so the exported model computes what was trained.
    qat: bool = True
    eval_every: int = 250
    eval_batches: int = 8
    checkpoint_every: int = 1000
    seed: int = 0
    # Stop (evaluate, checkpoint, export as usual) once training has run this long, so a
    # slower machine still ends inside its time slot; the summary records the early stop.
    max_minutes: float = 20.0

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"invalid training field `model`: {self.model!r}; choose from "
                             f"{sorted(MODELS)}")
        for f in ("steps", "batch_size", "seq_len", "eval_every", "eval_batches",
                  "checkpoint_every"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"invalid training field `{f}`: must be an integer >= 1, "
                                 f"got {v!r}")
        for f in ("warmup_steps", "seed"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"invalid training field `{f}`: must be an integer >= 0, "
                                 f"got {v!r}")
        for f in ("lr", "grad_clip", "max_minutes"):
            if not getattr(self, f) > 0:
                raise ValueError(f"invalid training field `{f}`: must be > 0")
        for f in ("min_lr_ratio", "weight_decay", "mtp_weight", "indexer_weight",
                  "bias_update_rate"):
            if not getattr(self, f) >= 0:
                raise ValueError(f"invalid training field `{f}`: must be >= 0")
        if self.seq_len < 128:
            raise ValueError("invalid training field `seq_len`: at least 128, so that the "
                             "HCA layer (ratio 128) has a compressed entry")

    def model_config(self) -> Config:
        return MODELS[self.model]()

    def replace(self, **kw) -> "TrainConfig":
        return dataclasses.replace(self, **kw)
