"""The DSpark drafter (dsv4_jax/dspark.py) against an independent plain-numpy reference
(float64, from the numpy-dequantised weights: rings rebuilt from the whole history), and
its config fields.

Shapes are tiny (the `test` preset: hidden 128, 2 heads, 4 experts) with a window of 8 so
that one request's ring wraps around; seconds on CPU."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import formats as CF
from dsv4_jax import dspark as D
from dsv4_jax import params as P
from dsv4_jax import quant as Q
from dsv4_jax.config import Config, flash, get_preset
from dsv4_jax.quant import Numerics

# f32, no activation rounding; the Sinkhorn iterations as a loop (the same arithmetic,
# compiled in a quarter of the time)
F32 = Numerics(act_quant=False, dtype="float32", sinkhorn_loop=True)
SEED = 3


def dspark_cfg() -> Config:
    return D.with_dspark(get_preset("test"), markov_rank=32).replace(sliding_window=8)


# ---------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------
def release_dict() -> dict:
    """The V4-Flash-0731 config.json as released: 46 compress_ratios for 43 layers (the
    tail is the drafter's), num_nextn_predict_layers 1, the dspark_* fields."""
    d = flash().to_hf_dict()
    d.update(compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0, 0, 0], num_nextn_predict_layers=1,
             dspark_block_size=5, dspark_markov_rank=256, dspark_noise_token_id=128799,
             dspark_target_layer_ids=[40, 41, 42])
    return d


def test_release_config_parses_and_round_trips():
    cfg = Config.from_hf_dict(release_dict(), name="flash")
    assert cfg.dspark and cfg.dspark_num_stages == 3
    assert cfg.dspark_target_layer_ids == (40, 41, 42) and cfg.dspark_block_size == 5
    assert cfg.num_nextn_predict_layers == 0 and len(cfg.compress_ratios) == 43
    assert cfg.compress_ratios == flash().compress_ratios[:43]
    assert Config.from_hf_dict(cfg.to_hf_dict(), name="flash") == cfg
    assert cfg == D.with_dspark(flash())
    hash(cfg)
    base = flash().to_hf_dict()  # a base config.json stays as it was: no dspark keys
    assert not any(k.startswith("dspark") for k in base)
    assert not Config.from_hf_dict(base, name="flash").dspark


@pytest.mark.parametrize("field,value,msg", [
    ("dspark_target_layer_ids", [40, 43], "outside"),
    ("dspark_noise_token_id", 129280, "dspark_noise_token_id"),
    ("dspark_block_size", 0, "dspark_block_size"),
    ("dspark_markov_rank", -1, "dspark_markov_rank"),
    ("dspark_target_layer_ids", 40, "dspark_target_layer_ids"),
])
def test_release_config_refuses_bad_dspark_fields(field, value, msg):
    d = release_dict()
    d[field] = value
    with pytest.raises(ValueError, match=msg):
        Config.from_hf_dict(d)


def test_dspark_fields_without_target_layers_are_refused():
    with pytest.raises(ValueError, match="without dspark_target_layer_ids"):
        get_preset("test").replace(dspark_block_size=5)


# ---------------------------------------------------------------------------------------
# The numpy reference
# ---------------------------------------------------------------------------------------
def np_params(params: dict) -> dict:
    """Every leaf as a float64 numpy array (quantised ones dequantised by numpy)."""
    out = {}
    for k, v in params.items():
        if Q.is_quantized(v):
            fmt = {Q.Fp8Weight: "fp8", Q.Fp4Weight: "fp4"}[type(v)]
            fields = {f.name: np.asarray(getattr(v, f.name)) for f in dataclasses.fields(v)}
            out[k] = CF.dequant(fmt, fields).astype(np.float64)
        else:
            out[k] = np.asarray(v).astype(np.float64)
    return out


class Ref:
    """DSpark's forward, written from its description (dsv4_jax/dspark.py docstring and
    the public implementations) for one request at a time, float64."""

    def __init__(self, w: dict, cfg: Config):
        self.w, self.c = w, cfg

    def rms(self, x, w=None):
        y = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + self.c.rms_norm_eps)
        return y if w is None else y * w

    def rope(self, x, pos, inverse=False):
        R = self.c.qk_rope_head_dim
        f = 1.0 / self.c.rope_theta ** (np.arange(0, R, 2) / R)
        ang = np.asarray(pos, np.float64)[:, None] * f                       # [T, R/2]
        while ang.ndim < x.ndim:
            ang = ang[:, None]
        cos, sin = np.cos(ang), np.sin(ang) * (-1 if inverse else 1)
        re, im = x[..., -R:][..., 0::2], x[..., -R:][..., 1::2]
        out = np.empty_like(x[..., -R:])
        out[..., 0::2], out[..., 1::2] = re * cos - im * sin, re * sin + im * cos
        return np.concatenate([x[..., :-R], out], -1)

    def hc_site(self, X, p):
        """X [T, N, D] -> (x [T, D] before the norm, post [T, N], comb [T, N, N])."""
        c, N = self.c, self.c.hc_mult
        flat = X.reshape(X.shape[0], -1)
        m = flat @ self.w[p + "_fn"].T / np.sqrt(np.mean(flat ** 2, -1, keepdims=True) + c.rms_norm_eps)
        sc, b = self.w[p + "_scale"], self.w[p + "_base"]
        sig = lambda z: 1 / (1 + np.exp(-z))
        pre = sig(m[:, :N] * sc[0] + b[:N]) + c.hc_eps
        post = 2 * sig(m[:, N:2 * N] * sc[1] + b[N:2 * N])
        C = (m[:, 2 * N:] * sc[2] + b[2 * N:]).reshape(-1, N, N)
        C = np.exp(C - C.max(-1, keepdims=True))
        C = C / C.sum(-1, keepdims=True) + c.hc_eps
        C = C / (C.sum(-2, keepdims=True) + c.hc_eps)
        for _ in range(c.hc_sinkhorn_iters - 1):
            C = C / (C.sum(-1, keepdims=True) + c.hc_eps)
            C = C / (C.sum(-2, keepdims=True) + c.hc_eps)
        return np.einsum("tn,tnd->td", pre, X), post, C

    def hc_post(self, f, X, post, C):
        return post[..., None] * f[:, None, :] + np.einsum("tij,tid->tjd", C, X)

    def window_row(self, s, main_x, pos):
        a = f"mtp.{s}.attn."
        kv = self.rms(main_x @ self.w[a + "wkv"].T, self.w[a + "kv_norm.weight"])
        return self.rope(kv, pos)

    def attention(self, s, x, ring, pos):
        c, a = self.c, f"mtp.{s}.attn."
        H, K, G = c.num_attention_heads, c.head_dim, c.o_groups
        q = self.rms(x @ self.w[a + "wq_a"].T, self.w[a + "q_norm.weight"]) @ self.w[a + "wq_b"].T
        q = self.rope(self.rms(q.reshape(len(x), H, K)), pos)
        kv = self.rope(self.rms(x @ self.w[a + "wkv"].T, self.w[a + "kv_norm.weight"]), pos)
        keys = np.concatenate([ring, kv])                    # the window, the whole block
        sc = np.einsum("thk,sk->ths", q, keys) / np.sqrt(K)
        sink = self.w[a + "attn_sink"][None, :, None]
        mx = np.maximum(sc.max(-1, keepdims=True), sink)
        p = np.exp(sc - mx) / (np.exp(sc - mx).sum(-1, keepdims=True) + np.exp(sink - mx))
        o = self.rope(np.einsum("ths,sk->thk", p, keys), pos, inverse=True)
        og = o.reshape(len(x), G, H // G * K)
        wo_a = self.w[a + "wo_a"].reshape(G, c.o_lora_rank, H // G * K)
        z = np.einsum("tgk,gok->tgo", og, wo_a).reshape(len(x), -1)
        return z @ self.w[a + "wo_b"].T

    def expert(self, x, w1, w2, w3):
        lim = self.c.swiglu_limit
        g, u = np.minimum(x @ w1.T, lim), np.clip(x @ w3.T, -lim, lim)
        return (g / (1 + np.exp(-g)) * u) @ w2.T

    def moe(self, s, x):
        c, f = self.c, f"mtp.{s}.ffn."
        sc = np.sqrt(np.logaddexp(0, x @ self.w[f + "gate.weight"].T))
        idx = np.argsort(-(sc + self.w[f + "gate.bias"]), -1)[:, :c.num_experts_per_tok]
        wt = np.take_along_axis(sc, idx, -1)
        wt = wt / wt.sum(-1, keepdims=True) * c.routed_scaling_factor
        y = self.expert(x, *(self.w[f + f"shared_experts.w{i}"] for i in (1, 2, 3)))
        for t in range(len(x)):
            for e, we in zip(idx[t], wt[t]):
                y[t] += we * self.expert(x[t], *(self.w[f + f"experts.w{i}"][e] for i in (1, 2, 3)))
        return y

    def draft(self, hid, anchor, draw=np.argmax):
        """hid [P, S*D] the target hidden of positions 0..P-1, anchor the token at P ->
        (base logits [G, V], tokens [G], corrected logits [G, V], confidence [G])."""
        c, w = self.c, self.w
        P_, Gs, W = len(hid), c.dspark_block_size, c.sliding_window
        main_x = self.rms(hid @ w["mtp.0.main_proj"].T, w["mtp.0.main_norm.weight"])
        win = np.arange(max(0, P_ - W), P_)                   # the last W committed positions
        pos = P_ + np.arange(Gs)
        toks = np.array([anchor] + [c.dspark_noise_token_id] * (Gs - 1))
        X = np.repeat(w["embed.weight"][toks][:, None], c.hc_mult, 1)
        for s in range(c.dspark_num_stages):
            p = f"mtp.{s}."
            ring = self.window_row(s, main_x[win], win)
            x, post, C = self.hc_site(X, p + "hc_attn")
            X = self.hc_post(self.attention(s, self.rms(x, w[p + "attn_norm.weight"]), ring, pos),
                             X, post, C)
            x, post, C = self.hc_site(X, p + "hc_ffn")
            X = self.hc_post(self.moe(s, self.rms(x, w[p + "ffn_norm.weight"])), X, post, C)
        last = f"mtp.{c.dspark_num_stages - 1}."
        flat = X.reshape(Gs, -1)
        m = flat @ w[last + "hc_head_fn"].T / np.sqrt(np.mean(flat ** 2, -1, keepdims=True)
                                                      + c.rms_norm_eps)
        pre = 1 / (1 + np.exp(-(m * w[last + "hc_head_scale"][0] + w[last + "hc_head_base"])))
        y = np.einsum("tn,tnd->td", pre + c.hc_eps, X)
        base = self.rms(y, w[last + "norm.weight"]) @ w["head.weight"].T
        w1, w2 = w[last + "markov_head.markov_w1.weight"], w[last + "markov_head.markov_w2.weight"]
        prev, out, lg = anchor, [], []
        for i in range(Gs):
            lg.append(base[i] + w2 @ w1[prev])
            prev = int(draw(lg[-1]))
            out.append(prev)
        prevs = np.array([anchor] + out[:-1])
        raw = np.concatenate([y, w1[prevs]], -1) @ w[last + "confidence_head.proj.weight"][0]
        return base, np.array(out), np.stack(lg), 1 / (1 + np.exp(-raw))


# ---------------------------------------------------------------------------------------
# The drafter against the reference
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup():
    cfg = dspark_cfg()
    params = P.init_params(cfg, SEED)
    g = np.random.default_rng(SEED)
    lens = np.array([5, 13])        # request 1 wraps the 8-slot ring
    T = int(lens.max())
    hid = g.standard_normal((2, T, cfg.dspark_num_stages * cfg.hidden_size)).astype(np.float32)
    anchor = np.array([17, 200], np.int32)
    return cfg, params, hid, lens, anchor


def committed_state(cfg, params, hid, lens, chunk=7):
    """The rings after committing each request's positions 0..len-1 in chunks of `chunk`
    rows (rows past a request's length are invalid)."""
    commit = jax.jit(functools.partial(D.commit, cfg=cfg, nm=F32))
    st = D.init_state(cfg, hid.shape[0], jnp.float32)
    for t0 in range(0, hid.shape[1], chunk):
        t = np.arange(t0, min(t0 + chunk, hid.shape[1]))
        pos = np.ascontiguousarray(np.broadcast_to(t, (hid.shape[0], len(t))))
        st = commit(params, st, jnp.asarray(hid[:, t0:t0 + chunk]), jnp.asarray(pos),
                    jnp.asarray(pos < lens[:, None]))
    return st


def test_draft_matches_numpy_reference(setup):
    cfg, params, hid, lens, anchor = setup
    st = committed_state(cfg, params, hid, lens)
    assert (np.asarray(st["pos"]) >= 0).sum(1).tolist() == [5, 8]
    f = jax.jit(functools.partial(D.draft, cfg=cfg, nm=F32))
    out = f(params, st, jnp.asarray(anchor), jnp.asarray(lens, jnp.int32))
    ref = Ref(np_params(params), cfg)
    for b in range(2):
        base, toks, lg, conf = ref.draft(hid[b, :lens[b]].astype(np.float64), int(anchor[b]))
        scale = np.abs(lg).max()
        np.testing.assert_allclose(np.asarray(out["logits"][b]), lg, rtol=1e-4, atol=1e-4 * scale)
        assert np.asarray(out["tokens"][b]).tolist() == toks.tolist()
        np.testing.assert_allclose(np.asarray(out["confidence"][b]), conf, rtol=1e-4, atol=1e-5)
        assert np.ptp(base, 0).max() > 1e-2  # the block's positions see different inputs
    assert out["q"] is None and out["tokens"].dtype == jnp.int32


def test_markov_chain_feeds_each_position_the_token_drawn_before(setup):
    cfg, params, hid, lens, anchor = setup
    ref = Ref(np_params(params), cfg)
    base = np.stack([ref.draft(hid[b, :lens[b]].astype(np.float64), int(anchor[b]))[0]
                     for b in range(2)])
    argmin = lambda lg, key: (jnp.argmin(lg, -1).astype(jnp.int32), jax.nn.softmax(lg, -1))
    f = jax.jit(functools.partial(D.markov_sample, cfg=cfg, draw=argmin))
    tok, lg, q, prev = f(params, jnp.asarray(base, jnp.float32), jnp.asarray(anchor))
    w1 = ref.w["mtp.2.markov_head.markov_w1.weight"]
    w2 = ref.w["mtp.2.markov_head.markov_w2.weight"]
    for b in range(2):
        p, toks = int(anchor[b]), []
        for i in range(cfg.dspark_block_size):
            p = int(np.argmin(base[b, i] + w2 @ w1[p]))
            toks.append(p)
        assert np.asarray(tok[b]).tolist() == toks
        assert np.asarray(prev[b]).tolist() == [int(anchor[b])] + toks[:-1]
        np.testing.assert_allclose(np.asarray(q[b]).sum(-1), 1.0, rtol=1e-5)
    # a sampling draw with a key: one key per position, the same keys the same tokens
    sample = lambda lg, key: (jax.random.categorical(key, lg).astype(jnp.int32), None)
    g = jax.jit(functools.partial(D.markov_sample, cfg=cfg, draw=sample))
    t1 = g(params, jnp.asarray(base, jnp.float32), jnp.asarray(anchor), key=jax.random.key(0))[0]
    t2 = g(params, jnp.asarray(base, jnp.float32), jnp.asarray(anchor), key=jax.random.key(0))[0]
    assert np.array_equal(np.asarray(t1), np.asarray(t2)) and t1.shape == (2, 5)


def test_ring_keeps_the_last_window_and_ignores_invalid_rows(setup):
    cfg, params, hid, lens, anchor = setup
    one = committed_state(cfg, params, hid, lens, chunk=hid.shape[1])  # one prefill chunk
    many = committed_state(cfg, params, hid, lens, chunk=3)
    for st in (one, many):
        pos = np.asarray(st["pos"])
        assert sorted(pos[0][pos[0] >= 0].tolist()) == [0, 1, 2, 3, 4]
        assert sorted(pos[1].tolist()) == list(range(5, 13))
    # the same rows (chunked matmuls may round the last bit differently)
    np.testing.assert_allclose(np.asarray(one["kv"]), np.asarray(many["kv"]), rtol=1e-5,
                               atol=1e-6)
    cleared = D.clear(one, jnp.array([True, False]))
    assert (np.asarray(cleared["pos"][0]) == -1).all()
    assert (np.asarray(cleared["pos"][1]) == np.asarray(one["pos"][1])).all()


def test_decode_form_params_give_the_same_draft(setup):
    cfg, params, hid, lens, anchor = setup
    st = committed_state(cfg, params, hid, lens)
    merged = P.merge_x_proj(params, cfg)
    assert "mtp.2.attn.wqkv_a" in merged and "mtp.2.attn.wq_a" not in merged
    f = jax.jit(functools.partial(D.draft, cfg=cfg, nm=F32))
    a = f(params, st, jnp.asarray(anchor), jnp.asarray(lens, jnp.int32))
    b = f(merged, st, jnp.asarray(anchor), jnp.asarray(lens, jnp.int32))
    np.testing.assert_allclose(np.asarray(a["logits"]), np.asarray(b["logits"]), rtol=1e-6,
                               atol=1e-6)
    assert np.array_equal(np.asarray(a["tokens"]), np.asarray(b["tokens"]))


def test_capture_hidden_reads_the_target_layers(setup):
    cfg, params, *_ = setup
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 6)), jnp.int32)
    X, hid = jax.jit(functools.partial(D.capture_hidden, cfg=cfg, nm=F32))(params, tokens)
    d = cfg.hidden_size
    assert hid.shape == (2, 6, cfg.dspark_num_stages * d)
    assert cfg.dspark_target_layer_ids[-1] == cfg.num_hidden_layers - 1  # the last layer's
    np.testing.assert_allclose(np.asarray(hid[..., -d:]), np.asarray(X).mean(-2), rtol=1e-6,
                               atol=1e-6)
    h = [np.asarray(hid[..., i * d:(i + 1) * d]) for i in range(3)]  # three layers' outputs
    assert not np.allclose(h[0], h[1]) and not np.allclose(h[1], h[2])
    E = np.asarray(params["embed.weight"])[np.asarray(tokens)]  # the residual before layer 0
    assert not np.allclose(h[0], E)


def test_check_dspark_refuses_a_base_config():
    with pytest.raises(ValueError, match="no DSpark drafter"):
        D.check_dspark(get_preset("test"))
    D.check_dspark(dspark_cfg())
