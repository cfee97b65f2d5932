"""The embedded model (dsv4_jax/models/dsv4-small-stdlib, docs/TRAINING.md): it loads through
the release-format path a real checkpoint takes, generates deterministically, and has learned
its text: on held-out standard-library source its loss is far below a random model's."""
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import load, model as M, param_specs as PS, params as P
from dsv4_jax.cache import CacheSpec
from dsv4_jax.embedded import embedded_checkpoint
from dsv4_jax.generate import Engine, Greedy
from dsv4_jax.quant import Numerics
from dsv4_jax.tokenizer import load_tokenizer

pytest.importorskip("tokenizers")
from training import config as TC, data as D  # noqa: E402

NM = Numerics(act_quant=True, dtype="bfloat16")


@pytest.fixture(scope="module")
def embedded():
    cfg, params = load(embedded_checkpoint())
    return cfg, params, load_tokenizer(str(embedded_checkpoint()), cfg.vocab_size)


def test_loads_as_a_release_checkpoint(embedded):
    cfg, params, tok = embedded
    ck = embedded_checkpoint()
    assert sum(f.stat().st_size for f in ck.iterdir()) <= 8 * 2**20
    assert {"config.json", "tokenizer.json", "model.safetensors.index.json"} <= \
        {f.name for f in ck.iterdir()}
    # the layout of training.config.small(), stored as the release stores it
    small = TC.small()
    for f in ("hidden_size", "num_hidden_layers", "compress_ratios", "n_routed_experts",
              "num_hash_layers", "vocab_size", "expert_dtype"):
        assert getattr(cfg, f) == getattr(small, f), f
    assert {cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)} == {"swa", "csa", "hca"}
    specs = PS.describe(cfg)
    assert specs.keys() == params.keys()
    fmts = {s.fmt for s in specs.values()}
    assert {"fp8", "fp4"} <= fmts, fmts
    assert tok.vocab_size == cfg.vocab_size and tok.decode(tok.encode("def f(x):")) == "def f(x):"


def test_greedy_generation_is_deterministic_and_readable(embedded):
    cfg, params, tok = embedded
    prompt = [tok.bos_id] + tok.encode("import os\n\n\ndef ")
    outs = []
    for _ in range(2):   # a fresh engine each time: nothing carries over
        eng = Engine(cfg, params, numerics=NM, progress=False, cache_spec=CacheSpec.for_numerics(
            NM, max_requests=1, num_blocks=4, max_blocks=4))
        outs.append(eng.generate([prompt], max_new_tokens=24, sampler=Greedy())[0])
    assert outs[0] == outs[1]
    text = tok.decode(outs[0])
    assert "<|id=" not in text and "\ufffd" not in text   # every id a known, whole piece
    # readable: the completion is mostly ASCII letters, spaces and code punctuation
    assert sum(c.isalnum() or c in " \n_.,:()'\"=" for c in text) / len(text) > 0.9


def _heldout_tokens(tok, n_files=4, T=512):
    """The first T tokens of n_files standard-library files in the held-out split (the split
    rule of training/data.py: by a hash of the path, so no file here was trained on)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rows = []
    for rel in D.list_files(root, include_tests=False):
        if D.split_of(rel) != "heldout":
            continue
        ids = [tok.bos_id] + tok.encode((root / rel).read_text(encoding="utf-8",
                                                                errors="replace"))
        if len(ids) >= T + 1:
            rows.append(ids[:T + 1])
        if len(rows) == n_files:
            break
    assert len(rows) == n_files
    return np.asarray(rows, np.int32)


def _ce(params, cfg, tokens):
    """Mean next-token cross-entropy of the whole-sequence forward (nats/token)."""
    def ce(p, t):
        logp = jax.nn.log_softmax(M.forward(p, t[:, :-1], cfg, NM).astype(jnp.float32), -1)
        return -jnp.take_along_axis(logp, t[:, 1:, None], -1).mean()
    return float(jax.jit(ce)(params, jnp.asarray(tokens)))


@pytest.mark.slow  # ~35 s
def test_heldout_loss_is_far_below_a_random_models(embedded):
    """Measured on this test's tokens (the first 512 of 4 held-out files of CPython 3.12.1's
    stdlib; file openings, licence headers and module docstrings, are the hardest part of a
    file): the embedded model 3.33 nats/token, a random model of the same config (seed 0)
    8.84, a margin of 5.5. Asserted: a margin of at least 4 nats (room for another 3.12
    patch release's files) and under half the random model's loss."""
    cfg, params, tok = embedded
    tokens = _heldout_tokens(tok)
    trained = _ce(params, cfg, tokens)
    random = _ce(P.init_params(cfg, 0), cfg, tokens)
    print(f"held-out CE: embedded {trained:.3f}, random {random:.3f}")
    assert random > 7.0   # ~ln(4096) = 8.3: the random model knows nothing
    assert random - trained > 4.0 and trained < 0.5 * random
