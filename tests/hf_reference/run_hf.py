"""Run the `transformers` DeepSeek-V4 port as a float32 CPU reference (runs in .venv-ref).

    run_hf.py [--mode MODE] [--layer N] [--which attn|ffn] MODEL_DIR INPUT OUT

MODEL_DIR holds an HF `config.json` and (except for modes shapes/rename) `model.safetensors`
with float32 weights in HF naming (`checkpoints/hf_names.py`). Routed experts may be given
per expert (`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`) or already stacked as
the port holds them (`mlp.experts.gate_up_proj` [E,2I,d], `mlp.experts.down_proj` [E,d,I]).
`mlp.gate.tid2eid` may be any number type; it is cast to int64. Loading is strict: a missing,
unexpected or wrongly shaped tensor is an error naming it. `quantization_config` in the config
is ignored (weights must already be dequantised).

Modes (INPUT and OUT are .npz unless said otherwise; B batch, T tokens, d hidden):
  full     INPUT `tokens` int [B,T]. One forward over the whole sequence, no cache. OUT:
           `logits` [B,T,V]; `final_hidden` [B,T,d] (norm(hc_head(X)), the lm_head input);
           `hidden.embed` [B,T,4,d]; per layer i: `hidden.layer{i}` [B,T,4,d] (residual after
           the layer), `attn_out.layer{i}` / `ffn_out.layer{i}` [B,T,d] (sub-layer output f
           before the mHC post/comb mix), `hc_attn.post.layer{i}` [B,T,4],
           `hc_attn.comb.layer{i}` [B,T,4,4], `hc_attn.x.layer{i}` [B,T,d] (collapsed input,
           before the RMSNorm), same three for `hc_ffn`; `router_idx.layer{i}` int32 [B,T,k]
           (sorted ascending per token) and `router_w.layer{i}` [B,T,k] (matching weights,
           routed_scaling_factor included); compressor layers: `compressed_kv.layer{i}`
           [B,n,512] (entries after norm + rope); CSA layers: `indexer_topk.layer{i}` int32
           [B,T,k'] (k' = min(index_topk, T//4); selected entries sorted ascending, -1 =
           no entry, placed last).
  decode   INPUT `tokens` [B,T]; --prefill P (default T//2) and --chunk C (default 1). Runs
           the port's own cache path: one forward over tokens[:, :P], then forwards of C tokens
           at a time with the cache. OUT `logits` [B,T,V] (rows < P from the prefill).
  shapes   OUT is .json {name: [shape, dtype]} of the port's state_dict for the config.
  moe      INPUT `x` [B,T,d] (the normed MoE input), `tokens` [B,T] (hash layers). OUT `y`,
           `router_idx`, `router_w`. Needs --layer.
  mhc      INPUT `X` [B,T,4,d]. OUT `post` [B,T,4], `comb` [B,T,4,4], `collapsed` [B,T,d].
           Needs --layer and --which attn|ffn.
  attn     INPUT `x` [B,T,d] (normed attention input, positions 0..T-1, no cache). OUT `y`
           [B,T,d]; CSA layers also `indexer_topk`; compressor layers `compressed_kv`.
           Needs --layer.
  head     INPUT `X` [B,T,4,d]. OUT `y` (hc_head) [B,T,d], `normed` [B,T,d], `logits`.
  load_official  MODEL_DIR/model.safetensors in OFFICIAL names; loads it with the port's own
           `from_pretrained` renaming. OUT: every state_dict tensor (float32 / int64) plus
           `__missing__` / `__unexpected__` (string arrays). Used to test hf_names.
  rename   INPUT .json list of official names; OUT .json {official: port name} from the port's
           conversion rules (FP8 quantizer's `.scale` rename first, as in from_pretrained).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch



def _load_hf_names():
    """checkpoints/hf_names.py by file path (pure Python; the package __init__ may need jax)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "checkpoints", "hf_names.py")
    spec = importlib.util.spec_from_file_location("dsv4_hf_reference_hf_names", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


hf_names = _load_hf_names()

from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M  # noqa: E402


def load_config(model_dir: str) -> DeepseekV4Config:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)  # weights arrive dequantised
    cfg.pop("torch_dtype", None)
    cfg.pop("dtype", None)
    return DeepseekV4Config(**cfg, attn_implementation="eager", experts_implementation="eager")


def build_model(config: DeepseekV4Config) -> DeepseekV4ForCausalLM:
    torch.manual_seed(0)  # the init is overwritten by the strict load; seed only for stability
    model = DeepseekV4ForCausalLM(config).to(torch.float32).eval()
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    assert model.config._experts_implementation == "eager", model.config._experts_implementation
    return model


def pack_state(model: DeepseekV4ForCausalLM, tensors: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """HF-named arrays -> the port's state_dict (stack per-expert weights), checking shapes."""
    ref = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, np.ndarray] = {}  # packed name -> bool [E, 3] (gate, up, down) seen
    unexpected = []
    for name, arr in tensors.items():
        slot = hf_names.packed_expert_slot(name)
        if slot is not None:
            packed, e, part = slot
            if packed not in ref:
                unexpected.append(name)
                continue
            if packed not in out:
                out[packed] = torch.empty_like(ref[packed])
                filled[packed] = np.zeros((ref[packed].shape[0], 2), bool)
            t = out[packed]
            if not 0 <= e < t.shape[0]:
                unexpected.append(name)
                continue
            inter = ref[packed].shape[1] // 2 if part != "down" else None
            dst = {"gate": lambda: t[e, :inter], "up": lambda: t[e, inter:], "down": lambda: t[e]}[part]()
            if tuple(arr.shape) != tuple(dst.shape):
                raise ValueError(f"{name}: shape {arr.shape}, port expects {tuple(dst.shape)}")
            dst.copy_(torch.from_numpy(np.asarray(arr, np.float32)))
            filled[packed][e, 0 if part in ("gate", "down") else 1] = True
            continue
        if name not in ref:
            unexpected.append(name)
            continue
        if tuple(arr.shape) != tuple(ref[name].shape):
            raise ValueError(f"{name}: shape {arr.shape}, port expects {tuple(ref[name].shape)}")
        out[name] = torch.from_numpy(np.ascontiguousarray(arr)).to(ref[name].dtype)
    if unexpected:
        raise KeyError(f"unexpected tensors for this config: {sorted(unexpected)}")
    for packed, seen in filled.items():
        need = seen if packed.endswith("gate_up_proj") else seen[:, :1]
        if not need.all():
            missing = np.argwhere(~need)[:, 0].tolist()
            raise KeyError(f"{packed}: experts {sorted(set(missing))} incomplete")
    missing = sorted(set(ref) - set(out))
    if missing:
        raise KeyError(f"missing tensors for this config: {missing}")
    return out


def load_model(model_dir: str) -> DeepseekV4ForCausalLM:
    from safetensors.numpy import load_file

    model = build_model(load_config(model_dir))
    state = pack_state(model, load_file(os.path.join(model_dir, "model.safetensors")))
    result = model.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys, result
    return model


def _np(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    return t.numpy().astype(np.int32) if not t.is_floating_point() else t.float().numpy()


def _sorted_routing(idx: torch.Tensor, w: torch.Tensor, shape) -> tuple[np.ndarray, np.ndarray]:
    order = idx.argsort(dim=-1)
    idx, w = idx.gather(-1, order), w.gather(-1, order)
    return _np(idx).reshape(*shape, -1), _np(w).reshape(*shape, -1)


def _sorted_topk(idx: torch.Tensor) -> np.ndarray:
    big = torch.iinfo(idx.dtype).max
    key = torch.where(idx < 0, torch.full_like(idx, big), idx)
    return _np(torch.where(key == big, -1, key.sort(dim=-1).values))


def _hook_all(model, out: dict, record_intermediates: bool):
    """Register forward hooks that copy intermediates into `out`; returns the handles."""
    handles = []

    def rec(key, fn):
        def hook(mod, args, res):
            out[key] = fn(mod, args, res)
        return hook

    for i, layer in enumerate(model.model.layers):
        handles.append(layer.register_forward_hook(rec(f"hidden.layer{i}", lambda m, a, r: _np(r))))
        if not record_intermediates:
            continue
        handles.append(layer.self_attn.register_forward_hook(rec(f"attn_out.layer{i}", lambda m, a, r: _np(r[0]))))
        handles.append(layer.mlp.register_forward_hook(rec(f"ffn_out.layer{i}", lambda m, a, r: _np(r))))
        for which in ("attn", "ffn"):
            hc = getattr(layer, f"{which}_hc")
            handles.append(hc.register_forward_hook(rec(f"hc_{which}.post.layer{i}", lambda m, a, r: _np(r[0]))))
            handles.append(hc.register_forward_hook(rec(f"hc_{which}.comb.layer{i}", lambda m, a, r: _np(r[1]))))
            handles.append(hc.register_forward_hook(rec(f"hc_{which}.x.layer{i}", lambda m, a, r: _np(r[2]))))

        def gate_hook(i):
            def hook(mod, args, res):
                x = args[0]
                idx, w = _sorted_routing(res[2], res[1], x.shape[:-1])
                out[f"router_idx.layer{i}"], out[f"router_w.layer{i}"] = idx, w
            return hook
        handles.append(layer.mlp.gate.register_forward_hook(gate_hook(i)))
        comp = layer.self_attn.compressor
        if comp is not None:
            handles.append(comp.register_forward_hook(
                rec(f"compressed_kv.layer{i}", lambda m, a, r: _np(r[0][:, 0]))))
            if isinstance(comp, M.DeepseekV4CSACompressor):
                handles.append(comp.indexer.register_forward_hook(
                    rec(f"indexer_topk.layer{i}", lambda m, a, r: _sorted_topk(r))))
    return handles


def run_full(model, tokens: np.ndarray) -> dict[str, np.ndarray]:
    ids = torch.from_numpy(np.asarray(tokens, np.int64))
    if ids.ndim != 2:
        raise ValueError(f"tokens must be [B, T], got shape {tuple(ids.shape)}")
    out: dict[str, np.ndarray] = {}
    handles = _hook_all(model, out, record_intermediates=True)
    final = {}
    handles.append(model.lm_head.register_forward_hook(
        lambda m, a, r: final.__setitem__("final_hidden", _np(a[0]))))
    try:
        with torch.no_grad():
            res = model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    out["logits"] = _np(res.logits)
    out["final_hidden"] = final["final_hidden"]
    with torch.no_grad():
        out["hidden.embed"] = _np(model.model.embed_tokens(ids)[:, :, None].expand(-1, -1, model.config.hc_mult, -1))
    return out


def run_decode(model, tokens: np.ndarray, prefill: int | None, chunk: int) -> dict[str, np.ndarray]:
    ids = torch.from_numpy(np.asarray(tokens, np.int64))
    if ids.ndim != 2:
        raise ValueError(f"tokens must be [B, T], got shape {tuple(ids.shape)}")
    T = ids.shape[1]
    P = T // 2 if prefill is None else prefill
    if not 1 <= P <= T or chunk < 1:
        raise ValueError(f"need 1 <= prefill <= T={T} and chunk >= 1, got {P}, {chunk}")
    logits = []
    with torch.no_grad():
        res = model(input_ids=ids[:, :P], use_cache=True)
        logits.append(res.logits)
        cache = res.past_key_values
        for t in range(P, T, chunk):
            res = model(input_ids=ids[:, t:t + chunk], past_key_values=cache, use_cache=True)
            cache = res.past_key_values
            logits.append(res.logits)
    return {"logits": _np(torch.cat(logits, dim=1))}


def _positions(model, x: torch.Tensor):
    T = x.shape[1]
    pos = torch.arange(T)[None].expand(x.shape[0], -1)
    pe = {k: model.model.rotary_emb(x, position_ids=pos, layer_type=k) for k in ("main", "compress")}
    from transformers.masking_utils import create_sliding_window_causal_mask
    mask = create_sliding_window_causal_mask(config=model.config, inputs_embeds=x, attention_mask=None,
                                             past_key_values=None, position_ids=pos)
    return pos, pe, mask


def run_component(model, mode: str, inp: dict, layer: int | None, which: str | None) -> dict[str, np.ndarray]:
    L = model.config.num_hidden_layers
    if mode != "head" and (layer is None or not 0 <= layer < L):
        raise ValueError(f"--layer must be in [0, {L}) for mode {mode}, got {layer}")
    out: dict[str, np.ndarray] = {}
    with torch.no_grad():
        if mode == "moe":
            x = torch.from_numpy(np.asarray(inp["x"], np.float32))
            mlp = model.model.layers[layer].mlp
            ids = torch.from_numpy(np.asarray(inp["tokens"], np.int64)) if "tokens" in inp else None
            if mlp.is_hash and ids is None:
                raise ValueError(f"layer {layer} is a hash layer: INPUT needs `tokens`")
            rec = {}
            h = mlp.gate.register_forward_hook(lambda m, a, r: rec.__setitem__("r", r))
            try:
                out["y"] = _np(mlp(x, input_ids=ids))
            finally:
                h.remove()
            out["router_idx"], out["router_w"] = _sorted_routing(rec["r"][2], rec["r"][1], x.shape[:-1])
        elif mode == "mhc":
            if which not in ("attn", "ffn"):
                raise ValueError(f"--which must be attn or ffn, got {which!r}")
            X = torch.from_numpy(np.asarray(inp["X"], np.float32))
            post, comb, collapsed = getattr(model.model.layers[layer], f"{which}_hc")(X)
            out.update(post=_np(post), comb=_np(comb), collapsed=_np(collapsed))
        elif mode == "attn":
            x = torch.from_numpy(np.asarray(inp["x"], np.float32))
            attn = model.model.layers[layer].self_attn
            pos, pe, mask = _positions(model, x)
            handles = []
            if attn.compressor is not None:
                handles.append(attn.compressor.register_forward_hook(
                    lambda m, a, r: out.__setitem__("compressed_kv", _np(r[0][:, 0]))))
                if isinstance(attn.compressor, M.DeepseekV4CSACompressor):
                    handles.append(attn.compressor.indexer.register_forward_hook(
                        lambda m, a, r: out.__setitem__("indexer_topk", _sorted_topk(r))))
            try:
                out["y"] = _np(attn(x, position_embeddings=pe, position_ids=pos, attention_mask=mask)[0])
            finally:
                for h in handles:
                    h.remove()
        elif mode == "head":
            X = torch.from_numpy(np.asarray(inp["X"], np.float32))
            y = model.model.hc_head(X)
            normed = model.model.norm(y)
            out.update(y=_np(y), normed=_np(normed), logits=_np(model.lm_head(normed)))
        else:
            raise ValueError(f"unknown mode {mode!r}")
    return out


def run_load_official(model_dir: str) -> dict[str, np.ndarray]:
    import logging
    import transformers

    transformers.logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    cfg = load_config(model_dir)
    model, info = DeepseekV4ForCausalLM.from_pretrained(
        model_dir, config=cfg, dtype=torch.float32, output_loading_info=True)
    out = {k: (v.float().numpy() if v.is_floating_point() else v.numpy()) for k, v in model.state_dict().items()}
    out["__missing__"] = np.array(sorted(info["missing_keys"]), dtype=str)
    out["__unexpected__"] = np.array(sorted(info["unexpected_keys"]), dtype=str)
    out["__mismatched__"] = np.array(sorted(str(x) for x in info["mismatched_keys"]), dtype=str)
    return out


def run_rename(model_dir: str, names: list[str]) -> dict[str, str]:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    model = build_model(load_config(model_dir))
    transforms = get_model_conversion_mapping(model)
    # The FP8 quantizer prepends this rename for checkpoints with `.scale` block scales.
    renamings = [WeightRenaming(source_patterns=r"^(.+)\.scale", target_patterns=r"\1.weight_scale_inv")]
    renamings += [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta = model.state_dict()
    return {n: rename_source_key(n, renamings, converters, model.base_model_prefix, meta)[0] for n in names}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="full",
                    choices=["full", "decode", "shapes", "moe", "mhc", "attn", "head", "load_official", "rename"])
    ap.add_argument("--layer", type=int, default=None)
    ap.add_argument("--which", default=None)
    ap.add_argument("--prefill", type=int, default=None)
    ap.add_argument("--chunk", type=int, default=1)
    ap.add_argument("model_dir")
    ap.add_argument("input")
    ap.add_argument("out")
    a = ap.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

    if a.mode == "shapes":
        model = build_model(load_config(a.model_dir))
        res = {k: [list(v.shape), str(v.dtype).replace("torch.", "")] for k, v in model.state_dict().items()}
        with open(a.out, "w") as f:
            json.dump(res, f)
        return 0
    if a.mode == "rename":
        with open(a.input) as f:
            names = json.load(f)
        with open(a.out, "w") as f:
            json.dump(run_rename(a.model_dir, names), f)
        return 0
    if a.mode == "load_official":
        np.savez(a.out, **run_load_official(a.model_dir))
        return 0

    model = load_model(a.model_dir)
    inp = dict(np.load(a.input))
    if a.mode == "full":
        if "tokens" not in inp:
            raise KeyError(f"{a.input} has no `tokens` array (has {sorted(inp)})")
        res = run_full(model, inp["tokens"])
    elif a.mode == "decode":
        if "tokens" not in inp:
            raise KeyError(f"{a.input} has no `tokens` array (has {sorted(inp)})")
        res = run_decode(model, inp["tokens"], a.prefill, a.chunk)
    else:
        res = run_component(model, a.mode, inp, a.layer, a.which)
    np.savez(a.out, **res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
