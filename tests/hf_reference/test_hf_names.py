"""checkpoints/hf_names.py against the spec's name list and the transformers port itself.

The port checks run the port in .venv-ref (via harness/run_hf.py) and are skipped when it is
missing: its real state_dict names/shapes, its own checkpoint-renaming rules, and its own
`from_pretrained` loading of an official-named checkpoint (values must land where our map
says, including the w1/w3 -> gate_up_proj stacking)."""
from __future__ import annotations

import json
import os
import subprocess
import tempfile

import numpy as np
import pytest

from . import harness, tiny

SEED = 49

hf_names = harness.hf_names
needs_ref = pytest.mark.skipif(not harness.have_reference(), reason="reference env (.venv-ref) missing")

QUANT_SUFFIXES = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight",
                  "attn.wo_b.weight", "attn.indexer.wq_b.weight", "e_proj.weight", "h_proj.weight")


def _official_names(cfg, include_mtp=True, scales=True) -> list[str]:
    names = list(tiny.official_shapes(cfg, include_mtp))
    if scales:  # every FP8/FP4 linear also ships `.scale`
        names += [n[: -len("weight")] + "scale" for n in names
                  if n.endswith(QUANT_SUFFIXES) or ".experts." in n or ".shared_experts." in n]
    return names


def test_every_official_name_round_trips():
    cfg = tiny.tiny_config()
    names = _official_names(cfg)
    hf = [hf_names.official_to_hf(n) for n in names]
    assert len(set(hf)) == len(hf), "two official names map to one HF name"
    for n, h in zip(names, hf):
        assert hf_names.hf_to_official(h) == n
    # spot checks written from the port's conversion_mapping entry
    assert hf_names.official_to_hf("layers.2.attn.indexer.compressor.ape") == \
        "model.layers.2.self_attn.compressor.indexer.position_bias"
    assert hf_names.official_to_hf("layers.0.ffn.experts.5.w3.scale") == \
        "model.layers.0.mlp.experts.5.up_proj.weight_scale_inv"
    assert hf_names.packed_expert_slot("model.layers.3.mlp.experts.5.up_proj.weight") == \
        ("model.layers.3.mlp.experts.gate_up_proj", 5, "up")
    assert hf_names.packed_expert_slot("model.layers.3.mlp.experts.6.down_proj.weight") == \
        ("model.layers.3.mlp.experts.down_proj", 6, "down")
    assert hf_names.packed_expert_slot("model.layers.3.mlp.gate.weight") is None


@pytest.mark.parametrize("name", [
    "layers.0.attn.wq_c.weight", "embed", "layers.x.attn_norm.weight", "layers.0.e_proj.weight",
    "mtp.0.ffn.experts.1.w4.weight", "layers.0.attn.compressor.wkv.scale", "model.embed_tokens.weight",
    "layers.0.ffn.gate.weight.extra",
])
def test_unknown_official_name_raises(name):
    with pytest.raises(KeyError, match=name.replace(".", r"\.")):
        hf_names.official_to_hf(name)


@pytest.mark.parametrize("name", [
    "model.layers.0.self_attn.bogus.weight", "embed.weight", "model.layers.0.mlp.experts.gate_up_proj",
    "mtp.0.e_proj.bias", "model.layers.0.e_proj.weight", "model.layers.0.mlp.experts.1.gate_proj.scale",
])
def test_unknown_hf_name_raises(name):
    with pytest.raises(KeyError, match=name.replace(".", r"\.")):
        hf_names.hf_to_official(name)


@needs_ref
def test_names_and_shapes_match_port_state_dict():
    cfg = tiny.tiny_config()
    port = harness.port_shapes(cfg)
    shapes = tiny.official_shapes(cfg, include_mtp=False)
    expected: dict[str, tuple] = {}
    for name, shape in shapes.items():
        hf = hf_names.official_to_hf(name)
        slot = hf_names.packed_expert_slot(hf)
        if slot is None:
            expected[hf] = shape
        else:
            E, I, d = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"]
            expected[slot[0]] = (E, 2 * I, d) if slot[2] != "down" else (E, d, I)
    assert set(expected) == set(port), (sorted(set(expected) - set(port)), sorted(set(port) - set(expected)))
    for k, shape in expected.items():
        assert tuple(port[k][0]) == tuple(shape), k
    for k, v in port.items():  # every port name maps back (packed experts excepted)
        if not k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert hf_names.official_to_hf(hf_names.hf_to_official(k)) == k


@needs_ref
def test_names_match_port_conversion_rules():
    cfg = tiny.tiny_config()
    names = [n for n in _official_names(cfg, include_mtp=False)
             if not (".experts." in n and n.endswith(".scale"))]  # per-expert scales: our spelling
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        with open(os.path.join(d, "names.json"), "w") as f:
            json.dump(names, f)
        subprocess.run([harness.ref_python(), harness.RUN_HF, "--mode", "rename", d,
                        os.path.join(d, "names.json"), os.path.join(d, "out.json")], check=True, timeout=300)
        with open(os.path.join(d, "out.json")) as f:
            port = json.load(f)
    for n in names:
        ours = hf_names.official_to_hf(n)
        slot = hf_names.packed_expert_slot(ours)
        if slot is not None:
            ours = slot[0]
        # scales keep no `model.` prefix here: the non-quantised port has no such parameter
        assert port[n] in (ours, ours.removeprefix("model.")), (n, port[n], ours)


@needs_ref
def test_port_from_pretrained_places_values_where_map_says():
    from safetensors.numpy import save_file

    cfg = tiny.tiny_config()
    rng = np.random.default_rng(SEED)
    w = tiny.random_weights(cfg, rng, include_mtp=True)
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        save_file(w, os.path.join(d, "model.safetensors"))
        out_path = os.path.join(d, "out.npz")
        r = subprocess.run([harness.ref_python(), harness.RUN_HF, "--mode", "load_official", d, "-", out_path],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        with np.load(out_path) as z:
            port = {k: z[k] for k in z.files}
    assert port.pop("__missing__").size == 0
    assert port.pop("__mismatched__").size == 0
    unexpected = port.pop("__unexpected__")
    assert all(u.startswith("mtp.") for u in unexpected), unexpected  # the port has no MTP
    I = cfg["moe_intermediate_size"]
    seen = set()
    for name, v in w.items():
        if name.startswith("mtp."):
            continue
        hf = hf_names.official_to_hf(name)
        slot = hf_names.packed_expert_slot(hf)
        if slot is None:
            got = port[hf]
        else:
            packed, e, part = slot
            hf = packed
            got = {"gate": lambda: port[packed][e, :I], "up": lambda: port[packed][e, I:],
                   "down": lambda: port[packed][e]}[part]()
        np.testing.assert_array_equal(got, v, err_msg=name)
        seen.add(hf)
    assert seen == set(port), sorted(set(port) - seen)
