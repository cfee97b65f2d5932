"""Bad input to make-checkpoint / convert / inspect / load: a clear one-line error (exit 2)
naming the flag or file before any heavy work; Ctrl-C exits 130 saying what was kept; and
nothing unfinished looks complete. Paths may be relative, `~` or symlinks everywhere.

One tiny 2-block checkpoint (and its conversion) is shared by the module; tests that
damage it work on copies.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import zlib
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest

import dsv4_jax
from checkpoints import convert as C
from checkpoints import formats as F
from checkpoints import synthetic as S
from checkpoints.errors import (CheckpointError, ForeignCheckpointError,
                                IncompleteCheckpointError, IndexMismatchError)
from checkpoints.safetensors_io import SafetensorsFile
from dsv4_jax import cli, loading
from dsv4_jax.config import get_preset

SEED = 31
SHARD = "1M"


def tiny2():
    return S.truncate_layers(get_preset("tiny"), 2)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    p = tmp_path_factory.mktemp("input") / "src"
    S.make_checkpoint(p, tiny2(), "official", SEED, shard_bytes=1 << 20)
    return p


@pytest.fixture(scope="module")
def orbax(src):
    p = src.parent / "orbax"
    C.convert(src, p, progress=False, log=lambda *a: None)
    return p


@pytest.fixture(scope="module")
def reference(src):
    """The params of the source, read directly (no numerics check)."""
    return loading.load(src, numerics_check=False)[1]


def dsv4(argv, capsys):
    """Run `dsv4 ARGV` -> (exit code, stdout, stderr); `main` returns the code (argparse's
    own errors exit)."""
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def usage_error(argv, capsys, *must_name):
    """`dsv4 ARGV` exits 2 with one stderr line `dsv4 CMD: error: ...` naming `must_name`."""
    code, _, err = dsv4(argv, capsys)
    line = err.strip()
    assert code == 2, err
    assert "\n" not in line and line.startswith(f"dsv4 {argv[0]}: error: "), err
    for s in must_name:
        assert str(s) in line, (s, line)
    return line


def bits_equal(a: dict, b: dict):
    assert set(a) == set(b)
    for k in a:
        for x, y in zip(jax.tree.leaves(a[k]), jax.tree.leaves(b[k])):
            x, y = np.asarray(x), np.asarray(y)
            assert x.dtype == y.dtype and x.shape == y.shape, k
            assert np.array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8)), k


def poke(ckpt: Path, name: str, value: bytes, rng) -> Path:
    """Overwrite one random element of tensor `name` in place with `value` (its bytes)."""
    idx = json.loads((ckpt / S.INDEX_NAME).read_text())
    shard = ckpt / idx["weight_map"][name]
    info = SafetensorsFile(shard).info(name)
    k = int(rng.integers(info.nbytes // len(value)))
    with open(shard, "r+b") as f:
        f.seek(info.start + k * len(value))
        f.write(value)
    return shard


# ---------------------------------------------------------------------------------------
# 1. paths: relative, ~, symlinks
# ---------------------------------------------------------------------------------------
def test_relative_home_and_symlink_paths(src, orbax, reference, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rel_src = os.path.relpath(src, tmp_path)
    code, _, err = dsv4(["convert", rel_src, "out/rel", "--quiet"], capsys)
    assert code == 0, err
    assert (tmp_path / "out/rel" / C.MANIFEST).exists()
    for p in ("out/rel", rel_src):  # orbax and safetensors, both relative
        assert dsv4(["inspect", p], capsys)[0] == 0
        bits_equal(dsv4_jax.load(p)[1], reference)

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "link").symlink_to(orbax)
    for p in ("~/out/rel", "~/link", tmp_path / "link"):
        code, out, err = dsv4(["inspect", p], capsys)
        assert code == 0 and "orbax" in out, err
        bits_equal(loading.load(p)[1], reference)
    # make-checkpoint to ~, and a symlinked source for convert
    code, _, err = dsv4(["make-checkpoint", "--layers", "2", "--seed", SEED, "--shard-size",
                         SHARD, "--quiet", "~/made"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "made").iterdir()) == sorted(p.name for p in src.iterdir())
    (tmp_path / "srclink").symlink_to(src)
    assert dsv4(["convert", "~/srclink", "~/out/home", "--quiet"], capsys)[0] == 0
    bits_equal(loading.load("~/out/home")[1], reference)


# ---------------------------------------------------------------------------------------
# 2. flags, checked before any work
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,names", [
    (["make-checkpoint", "OUT", "--shard-size", "0"], ["--shard-size", "'0'", "8G"]),
    (["make-checkpoint", "OUT", "--shard-size", "-1"], ["--shard-size", "'-1'"]),
    (["make-checkpoint", "OUT", "--shard-size", "lots"], ["--shard-size", "'lots'"]),
    (["make-checkpoint", "OUT", "--shard-size", "nanG"], ["--shard-size"]),
    (["make-checkpoint", "OUT", "--shard-size", "infG"], ["--shard-size"]),
    (["make-checkpoint", "OUT", "--layers", "0"], ["--layers", "must be in [1, ", "got 0"]),
    (["make-checkpoint", "OUT", "--layers", "-2"], ["--layers", "got -2"]),
    (["make-checkpoint", "OUT", "--layers", "99"], ["--layers", "got 99"]),
    (["make-checkpoint", "OUT", "--seed", "-1"], ["--seed", ">= 0"]),
    (["convert", "SRC", "OUT", "--memory-budget", "0"], ["--memory-budget", "'0'"]),
    (["convert", "SRC", "OUT", "--memory-budget", "-1"], ["--memory-budget", "'-1'"]),
    (["convert", "SRC", "OUT", "--memory-budget", "8X"], ["--memory-budget", "'8X'"]),
    (["convert", "SRC", "OUT", "--dtype", "bf16", "--expert-dtype", "fp8"], ["--dtype bf16", "fp8"]),
])
def test_bad_flags(argv, names, src, tmp_path, capsys):
    out = tmp_path / "out"
    usage_error([{"SRC": src, "OUT": out}.get(a, a) for a in argv], capsys, *names)
    assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_memory_budget_below_floor_names_the_minimum(src, tmp_path, capsys):
    usage_error(["convert", src, tmp_path / "o", "--memory-budget", "1M"], capsys,
                "too small", "use at least")
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------
# 3. sources and destinations
# ---------------------------------------------------------------------------------------
def test_bad_sources(src, tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    usage_error(["convert", tmp_path / "missing", tmp_path / "o"], capsys, tmp_path / "missing",
                "no such")
    usage_error(["convert", f, tmp_path / "o"], capsys, f, "is a file")
    (tmp_path / "empty").mkdir()
    usage_error(["convert", tmp_path / "empty", tmp_path / "o"], capsys, "no config.json")
    cfg_only = tmp_path / "cfg_only"
    cfg_only.mkdir()
    shutil.copy(src / "config.json", cfg_only)
    usage_error(["convert", cfg_only, tmp_path / "o"], capsys, cfg_only, S.INDEX_NAME,
                "model.safetensors")
    assert not (tmp_path / "o").exists()


def test_bad_destinations(src, orbax, tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("keep me")
    usage_error(["convert", src, f], capsys, f, "existing file")
    usage_error(["convert", src, f / "sub"], capsys, f, "is a file")
    usage_error(["convert", src, src / "inside"], capsys, "inside the source")
    usage_error(["convert", src, src], capsys, "inside the source")
    usage_error(["convert", src, src.parent], capsys, "contains the source")
    other = tmp_path / "other"
    other.mkdir()
    (other / "precious.txt").write_text("keep me")
    for extra in ([], ["--overwrite"]):
        usage_error(["convert", src, other, *extra], capsys, other, "holds no dsv4 conversion")
    assert (other / "precious.txt").read_text() == "keep me" and f.read_text() == "keep me"
    usage_error(["make-checkpoint", f], capsys, f, "existing file")
    usage_error(["make-checkpoint", other], capsys, other, "not empty")
    (tmp_path / "x.partial").mkdir()  # not ours: never deleted
    usage_error(["make-checkpoint", tmp_path / "x"], capsys, "x.partial", "not made by")
    assert not (tmp_path / "x").exists()
    # a conversion with other options in the way
    usage_error(["convert", src, orbax, "--expert-dtype", "bf16"], capsys, "different",
                "--overwrite")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_unwritable_destination(src, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        usage_error(["convert", src, ro / "o"], capsys, ro, "not writable")
        usage_error(["make-checkpoint", ro / "o"], capsys, ro, "not writable")
    finally:
        ro.chmod(0o755)


def test_inspect_and_load_bad_paths(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    usage_error(["inspect", f], capsys, f, "is a file")
    usage_error(["inspect", tmp_path / "missing"], capsys, "missing", "no such")
    (tmp_path / "empty").mkdir()
    usage_error(["inspect", tmp_path / "empty"], capsys, "neither")
    with pytest.raises(NotADirectoryError, match="is a file"):
        loading.load(f)
    with pytest.raises(CheckpointError, match="neither"):
        loading.load(tmp_path / "empty")


# ---------------------------------------------------------------------------------------
# 4. convert refuses NaN/inf data as it streams, and marks nothing complete
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,value,extra", [
    ("layers.1.ffn.experts.3.w2.scale", b"\xff", []),                  # e8m0 NaN, stored as is
    ("layers.1.ffn.experts.5.w1.scale", b"\xff", ["--expert-dtype", "bf16"]),  # while converting
    ("layers.0.attn.attn_sink", np.float32(np.inf).tobytes(), []),      # f32 inf
    ("layers.1.attn_norm.weight", np.array(np.nan, ml_dtypes.bfloat16).tobytes(), []),  # bf16 NaN
])
def test_convert_refuses_nonfinite(src, tmp_path, capsys, name, value, extra):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    shard = poke(bad, name, value, rng)
    dst = tmp_path / "o"
    usage_error(["convert", bad, dst, "--quiet", *extra], capsys, repr(name), shard.name,
                "NaN" if value == b"\xff" else "NaN/inf")
    assert not (dst / C.MANIFEST).exists()
    with pytest.raises(IncompleteCheckpointError, match="did not finish"):
        loading.load(dst)
    code, _, err = dsv4(["inspect", dst], capsys)
    assert code == 2 and "did not finish" in err


def test_nonfinite_count_in_slices(monkeypatch):
    """The host check sees a NaN in the last of many slices, for every float format."""
    monkeypatch.setattr(F, "CHECK_SLICE_BYTES", 64)
    rng = np.random.default_rng(32)
    x = rng.standard_normal(1000).astype(np.float32)
    for dt in (np.float32, ml_dtypes.bfloat16, np.float16, ml_dtypes.float8_e4m3fn):
        a = x.astype(dt)
        assert F.nonfinite_count(a) == 0
        a[-1 - int(rng.integers(3))] = np.nan
        assert F.nonfinite_count(a) == 1, dt
    s = rng.integers(100, 140, 777).astype(np.uint8)
    s[int(rng.integers(700, 777))] = 0xFF
    assert F.nonfinite_count(s.view(ml_dtypes.float8_e8m0fnu)) == 1
    assert F.nonfinite_count(s) == 0  # integers: no NaN


# ---------------------------------------------------------------------------------------
# 5. inspect reports corrupt / unfinished checkpoints (exit 2)
# ---------------------------------------------------------------------------------------
def test_inspect_corrupt_safetensors(src, tmp_path, capsys):
    rng = np.random.default_rng(33)
    idx = json.loads((src / S.INDEX_NAME).read_text())
    shards = sorted(set(idx["weight_map"].values()))
    c = tmp_path / "trunc"
    shutil.copytree(src, c)
    s = c / shards[int(rng.integers(len(shards)))]
    s.write_bytes(s.read_bytes()[:-int(rng.integers(1, 100))])
    usage_error(["inspect", c], capsys, s.name, "truncated")

    c = tmp_path / "header"
    shutil.copytree(src, c)
    s = c / shards[0]
    raw = bytearray(s.read_bytes())
    raw[8] = ord("x")  # the header's opening brace
    s.write_bytes(bytes(raw))
    usage_error(["inspect", c], capsys, s.name, "not valid JSON")

    c = tmp_path / "index"
    shutil.copytree(src, c)
    wm = idx["weight_map"]
    shared = [n for n in wm if list(wm.values()).count(wm[n]) > 1]  # its shard holds others
    del wm[shared[int(rng.integers(len(shared)))]]
    (c / S.INDEX_NAME).write_text(json.dumps(idx))
    usage_error(["inspect", c], capsys, S.INDEX_NAME, "does not list")


def test_inspect_and_load_damaged_orbax(orbax, tmp_path, capsys):
    c = tmp_path / "nochunk"
    shutil.copytree(orbax, c)
    shutil.rmtree(c / "parts" / "layers.1" / "c0")
    usage_error(["inspect", c], capsys, "layers.1/c0", "missing")
    with pytest.raises(IncompleteCheckpointError, match="layers.1/c0"):
        loading.load(c)

    c = tmp_path / "nomanifest"
    shutil.copytree(orbax, c)
    (c / C.MANIFEST).unlink()
    usage_error(["inspect", c], capsys, "did not finish", "resume")

    c = tmp_path / "badmanifest"
    shutil.copytree(orbax, c)
    m = json.loads((c / C.MANIFEST).read_text())
    m["parts"]["layers.0"]["chunks"] = "c0"
    (c / C.MANIFEST).write_text(json.dumps(m))
    usage_error(["inspect", c], capsys, C.MANIFEST, "malformed")
    with pytest.raises(IncompleteCheckpointError, match="malformed"):
        loading.load(c)


# ---------------------------------------------------------------------------------------
# 6. Ctrl-C: one line, exit 130, an honest output, resume works
# ---------------------------------------------------------------------------------------
def test_convert_interrupt_and_resume(src, orbax, reference, tmp_path, monkeypatch, capsys):
    real, saved = C._save_chunk, []

    def interrupted(path, tree):
        if len(saved) == 2:
            raise KeyboardInterrupt
        real(path, tree)
        saved.append(path)

    monkeypatch.setattr(C, "_save_chunk", interrupted)
    dst = tmp_path / "o"
    code, _, err = dsv4(["convert", src, dst, "--quiet", "--memory-budget", "16G"], capsys)
    line = err.strip()
    assert code == 130 and "\n" not in line, err
    assert line.startswith("dsv4 convert: interrupted: ") and "not marked complete" in line
    assert not (dst / C.MANIFEST).exists()
    with pytest.raises(IncompleteCheckpointError):
        loading.load(dst)
    monkeypatch.setattr(C, "_save_chunk", real)
    resume = line.split("to resume, run: ")[1]
    argv = shlex.split(resume)
    assert argv[:4] == ["dsv4", "convert", str(src), str(dst)] and "--overwrite" not in argv
    assert "--memory-budget" in argv
    code, _, err = dsv4(argv[1:] + ["--quiet"], capsys)
    assert code == 0, err
    bits_equal(loading.load(dst)[1], reference)
    ref_parts = json.loads((orbax / C.MANIFEST).read_text())["parts"]
    assert json.loads((dst / C.MANIFEST).read_text())["parts"] == ref_parts


def test_convert_overwrite_interrupted_then_rerun(src, tmp_path, monkeypatch, capsys):
    """--overwrite interrupted after discarding the old parts: the rerun (with or without
    --overwrite) finishes the conversion."""
    dst = tmp_path / "o"
    C.convert(src, dst, progress=False, log=lambda *a: None)
    real = shutil.rmtree

    def interrupted(p, *a, **k):
        if Path(p).name == C._DISCARD:
            raise KeyboardInterrupt
        real(p, *a, **k)

    monkeypatch.setattr(C.shutil, "rmtree", interrupted)
    code, _, err = dsv4(["convert", src, dst, "--overwrite", "--quiet"], capsys)
    assert code == 130 and not (dst / C.MANIFEST).exists()
    monkeypatch.setattr(C.shutil, "rmtree", real)
    code, _, err = dsv4(["convert", src, dst, "--quiet"], capsys)
    assert code == 0, err
    assert not (dst / C._DISCARD).exists() and (dst / C.MANIFEST).exists()


def test_make_checkpoint_interrupt_leaves_nothing(src, tmp_path, monkeypatch, capsys):
    real, n = S._write_tensor, []

    def interrupted(*a, **k):
        n.append(1)
        if len(n) == 40:
            raise KeyboardInterrupt
        real(*a, **k)

    monkeypatch.setattr(S, "_write_tensor", interrupted)
    out = tmp_path / "ck"
    argv = ["make-checkpoint", "--layers", "2", "--seed", SEED, "--shard-size", SHARD, "--quiet", out]
    code, _, err = dsv4(argv, capsys)
    line = err.strip()
    assert code == 130 and "\n" not in line and line.startswith("dsv4 make-checkpoint: interrupted: ")
    assert "nothing was kept" in line and str(out) in line
    assert not out.exists() and not (tmp_path / "ck.partial").exists()
    monkeypatch.setattr(S, "_write_tensor", real)
    # a run killed outright leaves its marked temporary directory: the next run replaces it
    (tmp_path / "ck.partial").mkdir()
    (tmp_path / "ck.partial" / S.PARTIAL_MARK).write_text("")
    code, _, err = dsv4(argv, capsys)
    assert code == 0, err
    for p in src.iterdir():  # byte for byte the module's checkpoint
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name
    assert not (tmp_path / "ck.partial").exists()


# ---------------------------------------------------------------------------------------
# 7. the numerics check in bounded memory still finds what it must
# ---------------------------------------------------------------------------------------
def test_numerics_check_slices_find_last_entry(orbax, monkeypatch):
    monkeypatch.setattr(F, "CHECK_SLICE_BYTES", 256)
    monkeypatch.setattr(loading, "NUMERICS_SLICE_BYTES", 256)
    cfg, params = loading.load(orbax, numerics_check=False)
    rng = np.random.default_rng(34)
    key = "embed.weight"
    e = np.array(params[key])
    e.reshape(-1)[-1 - int(rng.integers(100))] = np.inf
    with pytest.raises(CheckpointError, match=r"embed\.weight has 1 NaN"):
        loading.check_numerics({**params, key: jax.numpy.asarray(e)}, cfg)
    key = "layers.1.ffn.gate.tid2eid"
    t = np.array(params[key])
    t.reshape(-1)[-1 - int(rng.integers(100))] = cfg.n_routed_experts
    with pytest.raises(CheckpointError, match="tid2eid"):
        loading.check_numerics({**params, key: jax.numpy.asarray(t)}, cfg)


# ---------------------------------------------------------------------------------------
# 8. unreadable JSON files are named
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fname,content,err", [
    ("config.json", b"\xff\xfe{not utf-8", "not a UTF-8 config.json"),
    ("config.json", b'{"model_type": "deepseek_v4",', "not a valid config.json"),
    ("config.json", b'[1, 2]', "must hold a JSON object"),
    ("config.json", b'{"model_type": "deepseek_v4", "num_hidden_layers": "two"}', "config.json"),
    (S.INDEX_NAME, b"\x80\x81", "not a UTF-8 index"),
    (S.INDEX_NAME, b'{"weight_map": [', "not a valid index"),
    (S.INDEX_NAME, None, "total_size"),  # a valid weight map, a garbage total_size
])
def test_bad_json_names_the_file(src, tmp_path, capsys, fname, content, err):
    c = tmp_path / "c"
    shutil.copytree(src, c)
    if content is None:
        idx = json.loads((c / fname).read_text())
        idx["metadata"]["total_size"] = "lots"
        content = json.dumps(idx).encode()
    (c / fname).write_bytes(content)
    for cmd in (["convert", c, tmp_path / "o"], ["inspect", c]):
        usage_error(cmd, capsys, c / fname if "total_size" not in err else fname, err)
    with pytest.raises((ForeignCheckpointError, IndexMismatchError), match=err):
        loading.load(c)
    assert not (tmp_path / "o").exists()


def test_bad_orbax_json_names_the_file(src, orbax, tmp_path, capsys):
    for fname in ("config.json", C.MANIFEST):
        c = tmp_path / fname
        shutil.copytree(orbax, c)
        (c / fname).write_bytes(b"\xff" + (c / fname).read_bytes())
        usage_error(["inspect", c], capsys, c / fname, "UTF-8")
        with pytest.raises(CheckpointError, match="UTF-8"):
            loading.load(c)
    # a damaged resume guard in an unfinished conversion
    c = tmp_path / "state"
    shutil.copytree(orbax, c)
    (c / C.MANIFEST).unlink()
    (c / C.STATE).write_text("{")
    usage_error(["convert", src, c], capsys, c / C.STATE, "not a valid")
