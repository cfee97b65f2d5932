"""training/: corpus manifest, tokenizer, fake quantisation, a short seeded training run
on the smoke config (its loss goes down), and export -> dsv4_jax.load() -> the logits of
the master weights."""
from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("optax")

from checkpoints import layout as CL  # noqa: E402
from checkpoints.formats import dequant_fp4, dequant_fp8  # noqa: E402
from dsv4_jax import chat, load  # noqa: E402
from dsv4_jax import model as M  # noqa: E402
from dsv4_jax import param_specs as P  # noqa: E402
from dsv4_jax.tokenizer import load_tokenizer  # noqa: E402
from pallas_kernels.formats import encode_fp4_np, encode_fp8_np  # noqa: E402
from training import cli, config as TC, data as D, export as X, quantize as Q  # noqa: E402
from training import tokenizer as TT, train as TR  # noqa: E402

# Small stdlib modules for a corpus of ~100 KB (present in every CPython 3.12+)
CORPUS_FILES = ("abc.py", "bisect.py", "colorsys.py", "contextvars.py", "copy.py",
                "fnmatch.py", "heapq.py", "keyword.py", "numbers.py", "opcode.py",
                "operator.py", "queue.py", "sched.py", "shlex.py", "string.py",
                "textwrap.py", "this.py", "token.py", "types.py", "weakref.py")
HELDOUT_PER_MILLE = 300
SMOKE = TC.TrainConfig(model="smoke", steps=30, batch_size=2, seq_len=128, lr=3e-3,
                       warmup_steps=5, eval_every=1000, eval_batches=2, checkpoint_every=1000,
                       seed=0)


def _fake_stdlib(root):
    src = D.stdlib_dir()
    root.mkdir()
    for f in CORPUS_FILES:
        shutil.copyfile(src / f, root / f)
    (root / "pkg").mkdir()
    (root / "pkg" / "__init__.py").write_text('"""A package."""\n')
    (root / "pkg" / "latin1.py").write_bytes(b"# caf\xe9\n")            # not UTF-8: skipped
    (root / "site-packages").mkdir()
    (root / "site-packages" / "foreign.py").write_text("x = 1\n")       # never read
    (root / "__pycache__").mkdir()
    (root / "LICENSE.txt").write_text("PSF LICENSE AGREEMENT (stand-in)\n")
    return root


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    base = tmp_path_factory.mktemp("training")
    root = _fake_stdlib(base / "stdlib")
    m = D.prepare(base / "data", TC.smoke().vocab_size, root,
                  heldout_per_mille=HELDOUT_PER_MILLE, log=lambda *_: None)
    return base, root, m


@pytest.fixture(scope="module")
def trained(prepared):
    base, _, _ = prepared
    summary = TR.train(base / "data", base / "run", SMOKE, progress=False, log=lambda *_: None)
    return base, summary


def test_manifest_is_deterministic(prepared, tmp_path):
    base, root, m = prepared
    m2, texts = D.read_corpus(root, heldout_per_mille=HELDOUT_PER_MILLE)
    assert m2["corpus_sha256"] == m["corpus_sha256"]
    assert m2["files"] == m["files"]
    paths = [f["path"] for f in m["files"]]
    assert paths == sorted(paths) and "pkg/__init__.py" in paths
    assert not any("site-packages" in p for p in paths)
    assert m["skipped"] == [{"path": "pkg/latin1.py", "reason": "not UTF-8"}]
    assert m["licence"].startswith("PSF-2.0") and (base / "data" / "LICENSE.txt").exists()
    import hashlib
    f0 = m["files"][0]
    assert f0["sha256"] == hashlib.sha256((root / f0["path"]).read_bytes()).hexdigest()
    assert {f["split"] for f in m["files"]} == {"train", "heldout"}
    # a file's split depends on its path only: adding a file moves no other
    (root / "zzz_new.py").write_text("pass\n")
    m3, _ = D.read_corpus(root, heldout_per_mille=HELDOUT_PER_MILLE)
    (root / "zzz_new.py").unlink()
    old = {f["path"]: f["split"] for f in m["files"]}
    assert all(old[f["path"]] == f["split"] for f in m3["files"] if f["path"] in old)
    assert m3["corpus_sha256"] != m["corpus_sha256"]
    # the real stdlib's list is sorted and stable
    real = D.list_files(D.stdlib_dir(), include_tests=False)
    assert real == sorted(real) == D.list_files(D.stdlib_dir(), include_tests=False)


def test_tokenizer_round_trip_with_special_tokens(prepared):
    base, root, _ = prepared
    tok = load_tokenizer(base / "data", TC.smoke().vocab_size)  # the engine's own loader
    n = len(chat.SPECIAL_TOKENS)
    assert [tok.special_ids[s] for s in chat.SPECIAL_TOKENS] == list(range(n))
    assert tok.bos_id == TC.smoke().bos_token_id and tok.eos_id == TC.smoke().eos_token_id
    text = (chat.BOS + "def f(x):\n    return x ** 2  # caf\u00e9 \u2192 \U0001F600\n"
            + chat.USER + "hi" + chat.ASSISTANT + chat.THINK_END + "ok" + chat.EOS)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids[0] == 0 and ids[-1] == 1 and 2 in ids and 3 in ids
    # the same text trains the same tokenizer
    texts = [(root / f).read_text() for f in CORPUS_FILES[:6]]
    assert TT.train_tokenizer(texts, 400).to_str() == TT.train_tokenizer(texts, 400).to_str()
    with pytest.raises(ValueError, match="vocab-size"):
        TT.train_tokenizer(texts, 100)


def test_fake_quant_is_the_export_encoding():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((256, 384)) * rng.choice([1e-4, 0.02, 5.0], (256, 1))
    w = w.astype(np.float32)
    w[:, :32] = np.round(w[:, :32] * 4) / 4  # ties of e2m1 / e4m3 rounding
    w[0] = 0.0                                # all-zero blocks (floored scale)
    assert np.array_equal(np.asarray(Q.fake_fp8(jnp.asarray(w))), dequant_fp8(*encode_fp8_np(w)))
    assert np.array_equal(np.asarray(Q.fake_fp4(jnp.asarray(w))), dequant_fp4(*encode_fp4_np(w)))
    # straight-through: exact forward value, gradient 1
    g = jax.grad(lambda v: jnp.sum(Q.straight_through(v, "fp4") * 3.0))(jnp.asarray(w))
    assert np.all(np.asarray(g) == 3.0)


def test_mtp_forward_with_debug_matches_model():
    cfg = TC.smoke()
    master, frozen = TR.init_master(cfg, 1)
    fp = Q.forward_params(master, frozen, cfg, qat=True)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 16)))
    X = jnp.asarray(rng.standard_normal((1, 16, cfg.hc_mult, cfg.hidden_size)), jnp.bfloat16)

    @jax.jit
    def both(fp, X, tokens):
        dbg = {}
        got = TR.mtp_forward(fp, X, tokens, cfg, TR.NM, dbg)
        return M.mtp_forward(fp, X, tokens, cfg, TR.NM), got, dbg["router_idx"]

    want, got, idx = both(fp, X, tokens)
    assert np.array_equal(np.asarray(want), np.asarray(got))
    assert idx.shape == (1, 16, cfg.num_experts_per_tok)


@pytest.mark.slow  # ~100 s with the training fixture
def test_training_reduces_loss(trained):
    base, s = trained
    first, last = s["heldout_initial"], s["heldout_final"]
    assert np.isfinite(last["loss"])
    # a random model sits near ln(vocab); 30 steps on ~100 KB of code must move well below
    assert first["ce"] > 0.9 * np.log(TC.smoke().vocab_size)
    assert last["ce"] < first["ce"] - 1.0, (first, last)
    assert last["mtp_ce"] < first["mtp_ce"] - 0.5, (first, last)
    log = [json.loads(line) for line in (base / "run" / "log.jsonl").read_text().splitlines()]
    tr = [r for r in log if r["split"] == "train"]
    assert [r["step"] for r in tr] == list(range(1, SMOKE.steps + 1))
    assert np.mean([r["loss"] for r in tr[-5:]]) < np.mean([r["loss"] for r in tr[:5]]) - 0.5
    assert all(np.isfinite(r["indexer_kl"]) and r["max_load"] >= 1.0 for r in tr)


@pytest.mark.slow  # needs the training fixture (~80 s)
def test_export_loads_as_a_release_checkpoint(trained):
    base, _ = trained
    out = base / "model"
    r = X.export_run(base / "run", out)
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    rcfg = X.release_config(TC.smoke())
    assert set(names) == set(CL.expected_tensors(rcfg, "official"))
    cfg, params = load(out)  # the path a downloaded checkpoint takes
    assert (cfg.linear_dtype, cfg.expert_dtype) == ("fp8", "fp4")
    assert type(params["layers.0.attn.wq_a"]).__name__ == "Fp8Weight"
    assert type(params["layers.1.ffn.experts.w1"]).__name__ == "Fp4Weight"
    assert json.loads((out / "training.json").read_text())["data"]["licence"].startswith("PSF")
    tok = load_tokenizer(out, cfg.vocab_size)
    assert tok.decode(tok.encode("import os\n")) == "import os\n"

    _, master, frozen = TR.load_checkpoint(base / "run")
    tokens = jnp.asarray(np.load(base / "data" / "heldout.npy")[:128].astype(np.int32))[None]
    # no activation simulation: the exported values against the trained ones
    fwd = jax.jit(lambda p: M.forward(p, tokens, cfg, TR.NM))
    got = np.asarray(fwd(params))
    fq = np.asarray(fwd(Q.forward_params(master, frozen, rcfg, True)))
    raw = np.asarray(fwd(Q.forward_params(master, frozen, rcfg, False)))
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
    assert rel(got, fq) < 1e-3, rel(got, fq)      # the QAT forward is the exported model
    assert rel(got, raw) < 0.2, rel(got, raw)     # unrounded masters: quantisation error
    want = CL.expected_tensors(rcfg, "official").values()
    assert r["tensor_bytes"] == sum(t.nbytes for t in want)


def test_intended_model_fits_8_mb():
    cfg = X.release_config(TC.small())
    tensor_bytes = sum(t.nbytes for t in CL.expected_tensors(cfg, "official").values())
    assert tensor_bytes < 7.5e6  # + tokenizer.json (~0.3 MB at 4096 tokens) < 8 MB
    kinds = {cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)}
    assert kinds == {"swa", "csa", "hca"} and 0 < cfg.num_hash_layers < cfg.num_hidden_layers
    assert P.count_params(cfg) > 5e6


def test_cli_bad_flags_exit_2(tmp_path, capsys):
    assert cli.main(["train", "--data", str(tmp_path), "--run", str(tmp_path / "r"),
                     "--steps", "0"]) == 2
    assert "steps" in capsys.readouterr().err
    assert cli.main(["train", "--data", str(tmp_path / "none"), "--run", str(tmp_path / "r"),
                     "--steps", "1"]) == 2
    assert cli.main(["export", str(tmp_path / "norun"), str(tmp_path / "out")]) == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--model", "huge", "--data", "d", "--run", "r"])
    assert e.value.code == 2


def test_cli_prepare_exits_0_and_names_what_it_wrote(tmp_path, capsys, monkeypatch):
    root = _fake_stdlib(tmp_path / "stdlib")
    prepare = D.prepare
    monkeypatch.setattr(D, "prepare", lambda *a, **kw: prepare(
        *a, heldout_per_mille=HELDOUT_PER_MILLE, log=lambda *_: None, **kw))
    assert cli.main(["prepare", "--model", "smoke", "--data", str(tmp_path / "data"),
                     "--stdlib", str(root)]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "data") in out and "corpus sha256" in out
    assert (tmp_path / "data" / "train.npy").exists()
    # a file for --stdlib: one line naming it, exit 2
    assert cli.main(["prepare", "--data", str(tmp_path / "d2"), "--stdlib",
                     str(root / "abc.py")]) == 2
    assert "not a directory" in capsys.readouterr().err
