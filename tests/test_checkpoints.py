"""Synthetic checkpoint writer, safetensors -> orbax converter, loader, inspect, CLI.

Every synthetic checkpoint is compared with `params.init_params` (an independent in-memory
construction of the same random parameters); conversions are compared with numpy
dequantisation of the source tensors; the forward pass from loaded params with the one
from in-memory params.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from checkpoints import convert as C
from checkpoints import formats as F
from checkpoints import layout as L
from checkpoints import synthetic as S
from checkpoints.cli import main as cli_main
from checkpoints.errors import (CorruptHeaderError, DtypeMismatchError, ForeignCheckpointError,
                                IncompleteCheckpointError, IndexMismatchError, MemoryBudgetError,
                                MissingKeyError, ShapeMismatchError, TruncatedShardError,
                                UnknownKeyError)
from checkpoints.inspection import inspect, summarize
from checkpoints.safetensors_io import SafetensorsFile, ShardWriter, dtype_name
from dsv4_jax import sharding as SH
from dsv4_jax import loading, model
from dsv4_jax import params as P
from dsv4_jax.config import get_preset
from dsv4_jax.quant import Numerics

SEED = 7


def tiny3():
    """Tiny with its first 3 blocks: SWA, CSA (indexer), HCA; 2 hash layers; MTP."""
    return S.truncate_layers(get_preset("tiny"), 3)


def bits(x) -> np.ndarray:
    a = np.asarray(x)
    return a.reshape(-1).view(np.uint8) if a.dtype.itemsize else a


def assert_trees_bit_equal(a: dict, b: dict):
    assert set(a) == set(b)
    for k in a:
        assert jax.tree.structure(a[k]) == jax.tree.structure(b[k]), k
        for x, y in zip(jax.tree.leaves(a[k]), jax.tree.leaves(b[k])):
            assert x.dtype == y.dtype and x.shape == y.shape, (k, x.dtype, y.dtype, x.shape, y.shape)
            assert np.array_equal(bits(x), bits(y)), f"{k} differs"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Synthetic tiny3 checkpoints in both formats (small shards, row-blocked embedding)."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for fmt in S.FORMATS:
        out[fmt] = root / fmt
        S.make_checkpoint(out[fmt], tiny3(), fmt, SEED, shard_bytes=1 << 20, row_block_elems=3000)
    return out


@pytest.fixture(scope="module")
def converted(ckpts, tmp_path_factory):
    root = tmp_path_factory.mktemp("orbax")
    out = {}
    for fmt, src in ckpts.items():
        out[fmt] = root / fmt
        C.convert(src, out[fmt], progress=False, log=lambda *a: None)
    return out


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_shard(path: Path, edit):
    """Rewrite one shard file through `edit(dict name -> array) -> dict` and fix the index."""
    f = SafetensorsFile(path)
    tensors = edit({n: f.read(n) for n in f.keys()})
    with ShardWriter(path, [(n, dtype_name(a.dtype), a.shape) for n, a in tensors.items()]) as w:
        for n, a in tensors.items():
            w.write(n, a)
    idx_p = path.parent / S.INDEX_NAME
    idx = json.loads(idx_p.read_text())
    wm = {n: s for n, s in idx["weight_map"].items() if s != path.name}
    wm.update({n: path.name for n in tensors})
    total = sum(i.nbytes for p in path.parent.glob("*.safetensors")
                for i in SafetensorsFile(p).infos.values())
    idx_p.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": wm}))


def shard_of(ckpt: Path, name: str) -> Path:
    idx = json.loads((ckpt / S.INDEX_NAME).read_text())
    return ckpt / idx["weight_map"][name]


# ---------------------------------------------------------------------------------------
# raw safetensors IO
# ---------------------------------------------------------------------------------------
def test_safetensors_io_against_reference_library(tmp_path):
    from safetensors.numpy import load_file, save_file
    rng = np.random.default_rng(101)
    ref = {"a": rng.standard_normal((3, 5)).astype(np.float32), "b": rng.integers(-9, 9, (7,)),
           "c": rng.integers(0, 255, (2, 2, 3)).astype(np.uint8), "d": np.float32(rng.random()),
           "e": rng.integers(-128, 127, (4, 8)).astype(np.int8)}
    ref["d"] = np.asarray(ref["d"])
    save_file(ref, str(tmp_path / "lib.safetensors"))
    f = SafetensorsFile(tmp_path / "lib.safetensors")
    for n, a in ref.items():
        assert np.array_equal(f.read(n), a) and f.read(n).dtype == a.dtype
    with ShardWriter(tmp_path / "ours.safetensors",
                     [(n, dtype_name(a.dtype), a.shape) for n, a in ref.items()]) as w:
        for n, a in ref.items():
            w.write(n, a)
    back = load_file(str(tmp_path / "ours.safetensors"))
    for n, a in ref.items():
        assert np.array_equal(back[n], a) and back[n].dtype == a.dtype
    # the dtypes the library cannot hand to numpy: F8_E8M0, F8_E4M3, BF16
    fp = {"s": rng.integers(100, 140, (3, 4)).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu),
          "w": rng.standard_normal((5, 6)).astype(ml_dtypes.float8_e4m3fn),
          "h": rng.standard_normal((9,)).astype(ml_dtypes.bfloat16)}
    with ShardWriter(tmp_path / "fp8.safetensors", [(n, dtype_name(a.dtype), a.shape) for n, a in fp.items()]) as w:
        for n, a in fp.items():
            w.write(n, a)
    f = SafetensorsFile(tmp_path / "fp8.safetensors")
    assert [f.info(n).dtype for n in fp] == ["F8_E8M0", "F8_E4M3", "BF16"]
    for n, a in fp.items():
        assert np.array_equal(bits(f.read(n)), bits(a))
    assert np.array_equal(bits(f.read_rows("w", 1, 4)), bits(fp["w"][1:4]))


def test_safetensors_header_validation(tmp_path):
    a = np.arange(12, dtype=np.float32)
    with ShardWriter(tmp_path / "x.safetensors", [("a", "F32", a.shape), ("b", "F32", a.shape)]) as w:
        w.write("a", a)
        w.write("b", a)
    raw = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "t.safetensors").write_bytes(raw[:-5])
    with pytest.raises(TruncatedShardError, match="'b'"):
        SafetensorsFile(tmp_path / "t.safetensors")
    (tmp_path / "j.safetensors").write_bytes(raw[:8] + b"x" + raw[9:])
    with pytest.raises(CorruptHeaderError):
        SafetensorsFile(tmp_path / "j.safetensors")
    bad = raw.replace(b'"data_offsets":[48,96]', b'"data_offsets":[40,88]')
    assert bad != raw
    (tmp_path / "o.safetensors").write_bytes(bad)
    with pytest.raises(CorruptHeaderError, match="overlap or hole"):
        SafetensorsFile(tmp_path / "o.safetensors")
    with pytest.raises(ValueError):  # writer refuses a tensor that is not the declared one
        with ShardWriter(tmp_path / "w.safetensors", [("a", "F32", (2,))]) as w:
            w.write("a", np.zeros(3, np.float32))
    assert not (tmp_path / "w.safetensors").exists() and not (tmp_path / "w.safetensors.tmp").exists()


# ---------------------------------------------------------------------------------------
# synthetic checkpoints
# ---------------------------------------------------------------------------------------
def test_layout_counts_match_release():
    ex = L.expected_tensors(get_preset("flash"), "official")
    assert len(ex) == 69187  # the Flash release's tensor count (CHECKPOINT_FORMAT.md)
    t = ex["layers.5.ffn.experts.17.w2.scale"]
    assert (t.dtype, t.shape, t.key, t.expert) == ("F8_E8M0", (4096, 64), "layers.5.ffn.experts.w2", 17)
    assert ex["layers.0.ffn.gate.tid2eid"].dtype == "I64"
    hf = L.expected_tensors(get_preset("tiny").replace(linear_dtype="nvfp4", expert_dtype="nvfp4"), "hf")
    t = hf["model.layers.1.mlp.experts.3.down_proj.weight_scale"]
    assert (t.dtype, t.shape) == ("F8_E4M3", (256, 128 // 16))
    assert hf["model.layers.1.self_attn.q_a_proj.weight_scale_2"].shape == ()


@pytest.mark.parametrize("fmt", S.FORMATS)
def test_synthetic_reads_back_as_init_params(ckpts, fmt):
    cfg, params = loading.load(ckpts[fmt])  # direct safetensors read
    assert cfg == S.format_config(tiny3(), fmt).replace(name=cfg.name)
    assert_trees_bit_equal(P.init_params(cfg, SEED), params)
    idx = json.loads((ckpts[fmt] / S.INDEX_NAME).read_text())
    assert len(set(idx["weight_map"].values())) > 3  # really sharded
    assert idx["metadata"]["total_size"] == sum(
        i.nbytes for p in ckpts[fmt].glob("*.safetensors") for i in SafetensorsFile(p).infos.values())


# ---------------------------------------------------------------------------------------
# convert -> load
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", S.FORMATS)
def test_convert_load_bit_identical(ckpts, converted, fmt):
    cfg_src, src_params = loading.load(ckpts[fmt], numerics_check=False)
    cfg, params = loading.load(converted[fmt])
    assert cfg == cfg_src.replace(name=cfg.name)
    assert_trees_bit_equal(src_params, params)
    for k, v in params.items():  # arrays are on the device already, not numpy
        assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(v)), k
    man = json.loads((converted[fmt] / C.MANIFEST).read_text())
    assert man["complete"] and man["source"]["format"] == fmt
    assert (converted[fmt] / "generation_config.json").exists()


def test_forward_from_loaded_equals_in_memory(converted):
    cfg, loaded = loading.load(converted["official"])
    mem = P.init_params(cfg, SEED)
    nm = Numerics(act_quant=False, dtype="float32")  # weights still dequantised; cheaper compile
    tok = jnp.asarray(np.random.default_rng(102).integers(0, cfg.vocab_size, (1, 40)), jnp.int32)
    fwd = jax.jit(lambda p, t: model.forward(p, t, cfg, nm)).lower(loaded, tok).compile()
    a, b = np.asarray(fwd(loaded, tok)), np.asarray(fwd(mem, tok))
    assert np.isfinite(a).all() and np.abs(a).max() > 0
    assert np.array_equal(a, b)


def test_expert_dtype_fp8_is_lossless(ckpts, tmp_path):
    C.convert(ckpts["official"], tmp_path / "o", expert_dtype="fp8", progress=False, log=lambda *a: None)
    cfg, params = loading.load(tmp_path / "o")
    assert cfg.expert_dtype == "fp8" and cfg.linear_dtype == "fp8"
    src_cfg, src = loading.load(ckpts["official"], numerics_check=False)
    for k in params:
        if L.is_expert_key(k):
            assert type(params[k]).__name__ == "Fp8Weight" and type(src[k]).__name__ == "Fp4Weight"
            a = F.dequant_fp4(np.asarray(src[k].packed), np.asarray(src[k].scale))
            b = F.dequant_fp8(np.asarray(params[k].w), np.asarray(params[k].scale))
            assert np.array_equal(a, b), k
        else:
            assert_trees_bit_equal({k: src[k]}, {k: params[k]})


def test_fp4_to_fp8_wide_scale_range():
    rng = np.random.default_rng(103)
    W = (rng.standard_normal((256, 384)) * np.exp2(rng.integers(-5, 6, (256, 12)))
         .repeat(32, 1)).astype(np.float32)
    from dsv4_jax.quant import encode_fp4_np
    p, s = encode_fp4_np(W)
    w8, s8 = F.fp4_to_fp8(p, s)
    assert np.array_equal(F.dequant_fp4(p, s), F.dequant_fp8(w8, s8))
    s_bad = s.view(np.uint8).copy()
    s_bad[0, 0] = s_bad[0, 1] + 20  # a group 2^20 above its neighbour: not representable
    with pytest.raises(Exception, match="lossless"):
        F.fp4_to_fp8(p, s_bad.view(ml_dtypes.float8_e8m0fnu))


def test_dtype_bf16_dequantises_everything(ckpts, tmp_path):
    C.convert(ckpts["nvfp4"], tmp_path / "o", dtype="bf16", progress=False, log=lambda *a: None)
    cfg, params = loading.load(tmp_path / "o")
    assert (cfg.linear_dtype, cfg.expert_dtype) == ("bf16", "bf16")
    src_cfg, src = loading.load(ckpts["nvfp4"], numerics_check=False)
    src_specs = P.describe(src_cfg)
    for k, v in params.items():
        if src_specs[k].fmt == "nvfp4" and not k.startswith(("layers.1.", "mtp.0.e_proj")):
            assert v.dtype == jnp.bfloat16 and v.shape == src[k].shape, k
        elif src_specs[k].fmt == "nvfp4":  # against quant.py's dequantisation
            want = np.asarray(jax.jit(lambda w: w.dequant(jnp.float32))(src[k])).astype(ml_dtypes.bfloat16)
            assert np.array_equal(bits(v), bits(want)), k
        else:
            assert_trees_bit_equal({k: src[k]}, {k: v})


# ---------------------------------------------------------------------------------------
# resume, budget, bad input
# ---------------------------------------------------------------------------------------
def test_resume_after_interruption(ckpts, tmp_path, monkeypatch):
    dst = tmp_path / "o"
    saved = []
    real = C._save_chunk

    def flaky(path, tree):
        if len(saved) == 3:
            raise KeyboardInterrupt("simulated interruption")
        real(path, tree)
        saved.append(path.parent.name)

    monkeypatch.setattr(C, "_save_chunk", flaky)
    with pytest.raises(KeyboardInterrupt):
        C.convert(ckpts["official"], dst, progress=False, log=lambda *a: None)
    assert not (dst / C.MANIFEST).exists()
    with pytest.raises(IncompleteCheckpointError, match="resume"):
        loading.load(dst)
    done = sorted(p.parent.name for p in (dst / "parts").glob("*/part.json"))
    assert len(done) == 3 and set(done) == {s.removesuffix(".tmp") for s in saved}
    before = {p: (dst / "parts" / p / "part.json").stat().st_mtime_ns for p in done}
    saved.clear()
    monkeypatch.setattr(C, "_save_chunk", lambda path, tree: (real(path, tree), saved.append(path)))
    msgs = []
    C.convert(ckpts["official"], dst, progress=False, log=msgs.append)
    assert any("resuming" in m for m in msgs)
    assert {p: (dst / "parts" / p / "part.json").stat().st_mtime_ns for p in done} == before
    assert not any(p.parent.name.removesuffix(".tmp") in done for p in saved)  # not redone
    _, params = loading.load(dst)
    _, src = loading.load(ckpts["official"], numerics_check=False)
    assert_trees_bit_equal(src, params)
    with pytest.raises(Exception, match="different"):  # other options on the same output
        C.convert(ckpts["official"], dst, expert_dtype="fp8", progress=False, log=lambda *a: None)


def test_memory_budget_too_small(ckpts, tmp_path):
    with pytest.raises(MemoryBudgetError, match="too small"):
        C.convert(ckpts["official"], tmp_path / "o", memory_budget="64M",
                  progress=False)
    assert not (tmp_path / "o").exists()


def _convert_fails(src, tmp_path, err, match):
    with pytest.raises(err, match=match):
        C.convert(src, tmp_path / "out", progress=False, log=lambda *a: None)
    assert not (tmp_path / "out").exists()  # nothing a later run could mistake for output


def test_bad_inputs_distinct_errors(ckpts, tmp_path):
    src = ckpts["official"]
    # truncated shard
    c = copy_ckpt(src, tmp_path / "trunc")
    p = shard_of(c, "layers.1.attn.wq_b.weight")
    p.write_bytes(p.read_bytes()[:-100])
    _convert_fails(c, tmp_path, TruncatedShardError, "truncated")
    # wrong index: a tensor attributed to the wrong shard
    c = copy_ckpt(src, tmp_path / "index")
    idx = json.loads((c / S.INDEX_NAME).read_text())
    wm = idx["weight_map"]
    wm["layers.0.attn.wq_a.weight"] = next(s for s in sorted(set(wm.values()))
                                          if s != wm["layers.0.attn.wq_a.weight"])
    (c / S.INDEX_NAME).write_text(json.dumps(idx))
    _convert_fails(c, tmp_path, IndexMismatchError, "layers.0.attn.wq_a.weight")
    # foreign model
    c = copy_ckpt(src, tmp_path / "foreign")
    conf = json.loads((c / "config.json").read_text())
    conf.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (c / "config.json").write_text(json.dumps(conf))
    _convert_fails(c, tmp_path, ForeignCheckpointError, "llama")
    # unknown key
    c = copy_ckpt(src, tmp_path / "unknown")
    name = "layers.2.attn.wq_a.weight"
    rewrite_shard(shard_of(c, name), lambda t: {**t, "layers.2.attn.bogus.weight": t[name][:2]})
    _convert_fails(c, tmp_path, UnknownKeyError, "layers.2.attn.bogus.weight")
    # missing key
    c = copy_ckpt(src, tmp_path / "missing")
    name = "layers.1.ffn.experts.5.w3.scale"
    rewrite_shard(shard_of(c, name), lambda t: {k: v for k, v in t.items() if k != name})
    _convert_fails(c, tmp_path, MissingKeyError, name)
    # dtype mismatch: fp8 weight stored as bf16
    c = copy_ckpt(src, tmp_path / "dtype")
    name = "layers.0.attn.wkv.weight"
    rewrite_shard(shard_of(c, name), lambda t: {**t, name: t[name].astype(ml_dtypes.bfloat16)})
    _convert_fails(c, tmp_path, DtypeMismatchError, name)
    # shape mismatch: config and checkpoint disagree
    c = copy_ckpt(src, tmp_path / "shape")
    conf = json.loads((c / "config.json").read_text())
    conf["moe_intermediate_size"] = 256
    (c / "config.json").write_text(json.dumps(conf))
    _convert_fails(c, tmp_path, ShapeMismatchError, "moe_intermediate_size|shape")


def test_extra_mtp_blocks_reported_and_skipped(ckpts, tmp_path):
    c = copy_ckpt(ckpts["official"], tmp_path / "mtp")
    name = "mtp.0.attn_norm.weight"
    rewrite_shard(shard_of(c, name), lambda t: {**t, "mtp.1.attn_norm.weight": t[name],
                                                "mtp.2.ffn.experts.0.w1.weight": t[name].view(np.int8)})
    msgs = []
    C.convert(c, tmp_path / "o", progress=False, log=msgs.append)
    assert any("MTP block 1" in m for m in msgs) and any("MTP block 2" in m for m in msgs)
    man = json.loads((tmp_path / "o" / C.MANIFEST).read_text())
    assert sum(len(v) for v in man["skipped"].values()) == 2
    _, params = loading.load(tmp_path / "o")
    assert not any(k.startswith("mtp.1.") for k in params)


def test_orbax_config_mismatch_is_clear(converted, tmp_path):
    c = copy_ckpt(converted["official"], tmp_path / "o")
    conf = json.loads((c / "config.json").read_text())
    conf["q_lora_rank"] = 256
    (c / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ShapeMismatchError, match=r"layers\.0\.attn\..* has shape \[128\], config.json implies \[256\]"):
        loading.load(c)
    conf["q_lora_rank"], conf["num_hidden_layers"] = 128, 4
    conf["compress_ratios"] = [0, 4, 128, 4, 0]
    (c / "config.json").write_text(json.dumps(conf))
    with pytest.raises(MissingKeyError, match="layers.3"):
        loading.load(c)


def test_load_onto_mesh(converted):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), SH.AXES)
    cfg, params = loading.load(converted["official"], mesh=mesh)
    want = SH.param_shardings(cfg, mesh)
    for k, v in params.items():
        for x, sh in zip(jax.tree.leaves(v), jax.tree.leaves(want[k])):
            assert x.sharding == sh, k


# ---------------------------------------------------------------------------------------
# inspect and CLI
# ---------------------------------------------------------------------------------------
def test_inspect_both_kinds(ckpts, converted):
    st = inspect(ckpts["official"])
    s = summarize(st)
    assert s["count"] == len(L.expected_tensors(st["config"], "official"))
    assert s["total_bytes"] == json.loads((ckpts["official"] / S.INDEX_NAME).read_text())["metadata"]["total_size"]
    assert set(s["by_layer_kind"]) == {"globals", "swa", "csa", "hca", "mtp"}
    ob = inspect(converted["official"])
    cfg = ob["config"]
    assert summarize(ob)["total_bytes"] == P.nbytes(cfg)
    names = {t["name"]: t for t in ob["tensors"]}
    assert names["layers.1.ffn.experts.w1.packed"]["shape"] == [8, 128, 128]


def test_cli_end_to_end(tmp_path, capsys):
    src, dst = tmp_path / "src", tmp_path / "dst"
    assert cli_main(["make-checkpoint", "--preset", "tiny", "--layers", "2", "--format", "nvfp4",
                     "--seed", "3", "--shard-size", "2M", "--quiet", str(src)]) == 0
    assert cli_main(["convert", str(src), str(dst), "--memory-budget", "4G", "--quiet"]) == 0
    assert cli_main(["inspect", str(dst)]) == 0
    out = capsys.readouterr().out
    assert "routed experts" in out and "nvfp4" in out
    cfg, params = loading.load(dst)
    assert cfg.num_hidden_layers == 2
    assert_trees_bit_equal(P.init_params(cfg, 3), params)
    assert cli_main(["convert", str(tmp_path / "nope"), str(tmp_path / "d2"), "--quiet"]) == 2


@pytest.mark.gpu
def test_load_onto_gpu_and_forward(ckpts, converted):
    dev = jax.devices()[0]
    for path in (converted["official"], ckpts["nvfp4"]):  # orbax, and safetensors directly
        cfg, params = loading.load(path)
        for k, v in params.items():
            assert all(x.devices() == {dev} for x in jax.tree.leaves(v)), k
        mem = jax.device_put(P.init_params(cfg, SEED), dev)
        assert_trees_bit_equal(mem, params)
        nm = Numerics(act_quant=True, dtype="float32")
        tok = jnp.asarray(np.random.default_rng(104).integers(0, cfg.vocab_size, (2, 40)), jnp.int32)
        fwd = jax.jit(lambda p, t: model.forward(p, t, cfg, nm)).lower(params, tok).compile()
        a, b = np.asarray(fwd(params, tok)), np.asarray(fwd(mem, tok))
        assert np.isfinite(a).all() and np.array_equal(a, b)


_MESH_SCRIPT = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np
from dsv4_jax import loading, params as P, sharding as SH
mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(1, 2, 2), SH.AXES)
for path in sys.argv[2:]:
    cfg, p = loading.load(path, mesh=mesh)
    ref = P.init_params(cfg, int(sys.argv[1]))
    w = p["layers.1.ffn.experts.w1"].packed  # experts split over expert x model: E/4 each
    assert {s.data.shape[0] for s in w.addressable_shards} == {cfg.n_routed_experts // 4}
    assert len({s.device for s in w.addressable_shards}) == 4
    e = p["embed.weight"]
    assert {s.data.shape[0] for s in e.addressable_shards} == {cfg.vocab_size // 2}
    for k in ref:
        for x, y in zip(jax.tree.leaves(ref[k]), jax.tree.leaves(p[k])):
            a, b = np.asarray(x), np.asarray(y)
            assert a.dtype == b.dtype and np.array_equal(a.reshape(-1).view(np.uint8),
                                                         b.reshape(-1).view(np.uint8)), k
print("MESH OK")
"""


def test_load_sharded_over_four_devices(ckpts, converted):
    """(data 1, expert 2, model 2) mesh on 4 host devices (a subprocess, since the
    device count is fixed when jax starts): each device gets only its experts / vocab rows,
    from orbax and straight from safetensors."""
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, str(SEED), str(converted["official"]),
                        str(ckpts["nvfp4"])], cwd=root, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)
    assert r.returncode == 0 and "MESH OK" in r.stdout, r.stderr[-3000:]


def test_numerics_check_names_bad_tensors():
    """load()'s numerics check: a NaN e8m0 scale (0xFF) is an error naming the tensor; FP4
    scales above 2^65 (the Pallas FP4 "place" program's range) are a warning naming the
    tensor and the way out (Numerics(exact_fp4=True)), silent when the model runs with it."""
    import dataclasses
    import warnings
    from checkpoints.errors import CheckpointError
    cfg = tiny3()
    rng = np.random.default_rng(105)
    params = P.init_params(cfg, int(rng.integers(1 << 30)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loading.check_numerics(params, cfg)                      # a clean model: silent

    key = "layers.2.ffn.experts.w2"
    w = params[key]
    bad = {**params, key: dataclasses.replace(w, scale=with_scale_byte_arr(w.scale, 255, rng))}
    with pytest.raises(CheckpointError, match=r"layers\.2\.ffn\.experts\.w2\.scale has 1 NaN"):
        loading.check_numerics(bad, cfg)
    big = {**params, key: dataclasses.replace(w, scale=with_scale_byte_arr(w.scale, 193, rng))}
    with pytest.warns(UserWarning, match=r"1 FP4 weight\(s\) .*layers\.2\.ffn\.experts\.w2 \(1\).*Numerics\(exact_fp4=True\)"):
        loading.check_numerics(big, cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loading.check_numerics(big, cfg, exact_fp4=True)


def with_scale_byte_arr(scale, byte, rng):
    """e8m0 array with one random entry set to `byte`."""
    sc = np.array(jax.lax.bitcast_convert_type(scale, jnp.uint8))
    sc[tuple(int(rng.integers(n)) for n in sc.shape)] = byte
    return jax.lax.bitcast_convert_type(jnp.asarray(sc), jnp.float8_e8m0fnu)


# ---------------------------------------------------------------------------------------
# V4-Flash-0731: the DSpark drafter layout
# ---------------------------------------------------------------------------------------
def tiny3_dspark():
    """tiny3 with the DSpark drafter in place of its MTP block (3 stages mtp.0-2)."""
    from dsv4_jax.dspark import with_dspark
    return with_dspark(tiny3())


@pytest.fixture(scope="module")
def dspark_ckpts(tmp_path_factory):
    """A synthetic 0731-format checkpoint of tiny3 and its conversion."""
    root = tmp_path_factory.mktemp("dspark")
    S.make_checkpoint(root / "st", tiny3_dspark(), "official", SEED, shard_bytes=1 << 20,
                      row_block_elems=3000)
    C.convert(root / "st", root / "ob", progress=False, log=lambda *a: None)
    return root / "st", root / "ob"


def test_dspark_layout_at_flash_shapes():
    from dsv4_jax.dspark import with_dspark
    cfg = with_dspark(get_preset("flash"))
    ex = L.expected_tensors(cfg, "official")
    want = {"mtp.0.main_proj.weight": ("F8_E4M3", (4096, 12288)),
            "mtp.0.main_proj.scale": ("F8_E8M0", (32, 96)),
            "mtp.0.main_norm.weight": ("BF16", (4096,)),
            "mtp.2.markov_head.markov_w1.weight": ("BF16", (129280, 256)),
            "mtp.2.markov_head.markov_w2.weight": ("F32", (129280, 256)),
            "mtp.2.confidence_head.proj.weight": ("F32", (1, 4352)),
            "mtp.2.hc_head_fn": ("F32", (4, 16384)), "mtp.2.norm.weight": ("BF16", (4096,)),
            "mtp.1.ffn.experts.255.w2.weight": ("I8", (4096, 1024)),
            "mtp.1.ffn.gate.bias": ("F32", (256,)), "mtp.2.attn.wkv.weight": ("F8_E4M3", (512, 4096))}
    for n, (dt, shp) in want.items():
        assert (ex[n].dtype, ex[n].shape) == (dt, shp), n
    mtp = [n for n in ex if n.startswith("mtp.")]
    assert not any(".compressor." in n or ".indexer." in n or "tid2eid" in n for n in mtp)
    assert not any(n.startswith(("mtp.3.", "mtp.0.e_proj", "mtp.0.enorm")) for n in mtp)
    assert "mtp.0.markov_head.markov_w1.weight" not in ex and "mtp.1.main_proj.weight" not in ex
    base = L.expected_tensors(get_preset("flash"), "official")
    # three blocks for one; beyond its blocks each drafter has 10 tensors (MTP: e/h_proj
    # weight + scale, enorm, hnorm, norm, hc_head x 3; DSpark: main_proj x 2, main_norm,
    # norm, hc_head x 3, markov_w1, markov_w2, confidence proj)
    assert len(ex) - len(base) == 2 * (len([n for n in base if n.startswith("mtp.0.")]) - 10)
    assert "DSpark drafter: 3 stages" in L.layout_name(cfg)
    assert L.layout_name(get_preset("flash")) == "base V4 (1 MTP block)"


def test_dspark_checkpoint_round_trip(dspark_ckpts):
    st, ob = dspark_ckpts
    conf = json.loads((st / "config.json").read_text())
    assert conf["dspark_target_layer_ids"] == [0, 1, 2] and conf["dspark_block_size"] == 5
    assert len(conf["compress_ratios"]) == 3 + 3 and conf["num_nextn_predict_layers"] == 1
    want = P.init_params(tiny3_dspark(), SEED)
    assert "mtp.2.markov_head.markov_w2.weight" in want and "mtp.0.e_proj" not in want
    for path in (st, ob):  # direct safetensors read, and the orbax conversion
        cfg, params = loading.load(path)
        assert cfg == tiny3_dspark().replace(name=cfg.name)
        assert_trees_bit_equal(want, params)
        info = inspect(path)
        assert "V4-Flash-0731 (DSpark drafter: 3 stages" in info["layout"]
        assert "dspark" in summarize(info)["by_layer_kind"]
    man = json.loads((ob / C.MANIFEST).read_text())
    assert "DSpark" in man["source"]["layout"]
    cfg, params = loading.load(ob, include_mtp=False)
    assert not any(k.startswith("mtp.") for k in params)


def base_config_json(cfg) -> str:
    return json.dumps(cfg.to_hf_dict())


def test_each_layout_refuses_the_others_drafter(ckpts, converted, dspark_ckpts, tmp_path):
    from checkpoints.errors import DrafterMismatchError
    from checkpoints.source import open_source
    st, ob = dspark_ckpts
    # 0731 tensors, base-V4 config.json: would read the drafter's stages as MTP blocks
    c = copy_ckpt(st, tmp_path / "a")
    (c / "config.json").write_text(base_config_json(tiny3()))
    for f in (open_source, loading.load, inspect):
        with pytest.raises(DrafterMismatchError, match=r"hold a DSpark drafter .*mtp\.0\.main_proj"):
            f(c)
    o = copy_ckpt(ob, tmp_path / "ao")
    (o / "config.json").write_text(base_config_json(tiny3()))
    for f in (loading.load, inspect):
        with pytest.raises(DrafterMismatchError, match="hold a DSpark drafter"):
            f(o)
    # base-V4 tensors, 0731 config.json: no drafter to run
    c = copy_ckpt(ckpts["official"], tmp_path / "b")
    (c / "config.json").write_text(base_config_json(tiny3_dspark()))
    with pytest.raises(DrafterMismatchError, match=r"declares a DSpark drafter .*mtp\.0\.e_proj"):
        loading.load(c)
    o = copy_ckpt(converted["official"], tmp_path / "bo")
    (o / "config.json").write_text(base_config_json(tiny3_dspark()))
    with pytest.raises(DrafterMismatchError, match="hold a base-V4 MTP block"):
        loading.load(o)
    # a stage the config does not declare is not skipped as an extra MTP block
    c = copy_ckpt(st, tmp_path / "c")
    name = "mtp.2.attn_norm.weight"
    rewrite_shard(shard_of(c, name), lambda t: {**t, "mtp.3.attn_norm.weight": t[name]})
    with pytest.raises(UnknownKeyError, match=r"mtp\.3\.attn_norm"):
        open_source(c)


def test_dspark_truncated_and_foreign_stay_clear(dspark_ckpts, tmp_path):
    st, _ = dspark_ckpts
    c = copy_ckpt(st, tmp_path / "t")
    p = shard_of(c, "mtp.2.markov_head.markov_w2.weight")
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(TruncatedShardError, match=p.name):
        loading.load(c)
    c = copy_ckpt(st, tmp_path / "f")
    conf = json.loads((c / "config.json").read_text())
    conf["model_type"], conf["architectures"] = "llama", ["LlamaForCausalLM"]
    (c / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ForeignCheckpointError, match="not a DeepSeek-V4"):
        loading.load(c)
    c = copy_ckpt(st, tmp_path / "s")  # a drafter head of the wrong rank
    conf = json.loads((c / "config.json").read_text())
    conf["dspark_markov_rank"] = 128
    (c / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ShapeMismatchError, match="markov_w1"):
        loading.load(c)


def test_cli_make_checkpoint_dspark(tmp_path, capsys):
    out = tmp_path / "d"
    assert cli_main(["make-checkpoint", "--preset", "tiny", "--layers", "2", "--dspark",
                     "--seed", "4", "--quiet", str(out)]) == 0
    assert "DSpark drafter" in capsys.readouterr().out
    assert cli_main(["inspect", str(out)]) == 0
    rep = capsys.readouterr().out
    assert "layout: V4-Flash-0731 (DSpark drafter: 3 stages mtp.0-2" in rep
    assert "dspark heads" in rep and "3 DSpark stages" in rep
    cfg, params = loading.load(out)
    assert cfg.dspark_target_layer_ids == (0, 0, 1) and cfg.num_hidden_layers == 2
    assert_trees_bit_equal(P.init_params(cfg, 4), params)
