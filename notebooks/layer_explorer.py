# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Layer explorer: inside one DeepSeek-V4 forward pass
#
# One whole-sequence forward pass of the `tiny` preset (5 layers: SWA, CSA, HCA, CSA, HCA,
# the first 2 with hash-routed MoE) with debug capture, and a plot for each mechanism:
#
# 1. attention of one head over the sliding window and the compressed entries,
# 2. where the attention mass goes (window, compressed entries, sink),
# 3. which compressed blocks the lightning indexer selects (CSA layers),
# 4. the compressor's softmax gates,
# 5. MoE router load per expert and layer,
# 6. the mHC mixing matrices,
# 7. a logit lens: what each layer's residual would predict.
#
# The weights are **random** (`init_params(cfg, seed=0)`), so the patterns show the
# mechanics (masks, shapes, selection, mixing), not learned behaviour. The same code runs on
# a real checkpoint's params and config.
#
# The sequence has T = 300 tokens so that everything shows: the 128-token window, CSA
# (one entry per 4 tokens: 75 entries, of which the indexer keeps the top 16 per query) and
# HCA (one entry per 128 tokens: 2 entries). Each figure is also written as a PNG under
# `_out/layer_explorer/` in the working directory (next to the notebook in Jupyter).

# %%
import functools
import sys
import time
from pathlib import Path

try:
    import dsv4_jax  # noqa: F401
except ImportError:  # running from a clone without `pip install -e .`
    sys.path.insert(0, str(Path.cwd().parent))

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap, LogNorm

import dsv4_jax.chat
import dsv4_jax.config
import dsv4_jax.model
import dsv4_jax.params
import dsv4_jax.tokenizer
from dsv4_jax.quant import Numerics

OUT = Path("_out") / "layer_explorer"  # under the working directory
OUT.mkdir(parents=True, exist_ok=True)
plt.rcParams.update({"figure.dpi": 90, "font.size": 9})


def save(fig, name):
    """Write the figure to OUT/<name>.png and show it."""
    fig.savefig(OUT / f"{name}.png", dpi=110, bbox_inches="tight")
    plt.show()


# %% [markdown]
# ## Model, tokenizer and a 300-token chat prompt

# %%
cfg = dsv4_jax.config.tiny()
params = dsv4_jax.params.init_params(cfg, seed=0)
tok = dsv4_jax.tokenizer.load_tokenizer(None, cfg.vocab_size)  # byte-level: 1 token per byte
nm = Numerics(act_quant=True)
L = cfg.num_hidden_layers
kinds = [cfg.layer_kind(i) for i in range(L)]
print(cfg.name, "layers:", [f"{i}:{k}{' (hash)' if cfg.is_hash_layer(i) else ''}"
                            for i, k in enumerate(kinds)])
print("window", cfg.sliding_window, "| index_topk", cfg.index_topk,
      "| experts", cfg.n_routed_experts, "top", cfg.num_experts_per_tok,
      "| hc streams", cfg.hc_mult)

T = 300
story = ("Compressed sparse attention keeps a sliding window of recent tokens exactly, and "
         "summarises older text in blocks: every four tokens become one entry that a small "
         "indexer may pick, and every 128 tokens become one heavily compressed entry that "
         "every query can see. ")
prompt = dsv4_jax.chat.encode_messages(
    [{"role": "user", "content": story * 4 + "Summarise this in one line."}],
    thinking_mode="chat")
ids = tok.encode(prompt)
assert len(ids) >= T, len(ids)
tokens = jnp.asarray([ids[:T]], jnp.int32)  # [B=1, T]
print(len(ids), "prompt tokens, using the first", T)
print(repr(tok.decode(ids[:80])), "...")

# %% [markdown]
# ## One forward pass with debug capture
#
# `forward(..., debug=dbg)` fills `dbg[i]` for each layer `i` with that layer's
# intermediates. We jit a small wrapper that returns `dbg` as an output (a dict of arrays is
# a pytree), so the pass compiles once (~10-30 s on CPU) and then runs fast.
# `EXACT_COMPILER_OPTIONS` keeps the reference's FP8 / bf16 roundings on a GPU (XLA-GPU
# drops such round trips by default; the CPU keeps them either way).

# %%
@functools.partial(jax.jit, compiler_options=dsv4_jax.EXACT_COMPILER_OPTIONS)
def forward_debug(params, tokens):
    dbg = {}
    logits = dsv4_jax.model.forward(params, tokens, cfg, nm, debug=dbg)
    return logits, dbg


t0 = time.perf_counter()
logits, dbg = jax.block_until_ready(forward_debug(params, tokens))
print(f"compile + run: {time.perf_counter() - t0:.1f} s")
dbg = jax.tree.map(np.asarray, dbg)  # everything below is numpy
logits = np.asarray(logits)
for i in range(L):
    shapes = {k: (tuple(v.shape) if hasattr(v, "shape") else [tuple(x.shape) for x in v])
              for k, v in sorted(dbg[i].items())}
    print(f"layer {i} ({kinds[i]}):", shapes)

# %% [markdown]
# ## 1. Attention of one head: window keys, then compressed entries
#
# `attn_probs[b, t, h, :]` has `T + n` keys: the `T` sequence positions first (only the
# last 128 up to `t` are unmasked: the sliding window), then the `n` compressed entries. In a
# CSA layer a query sees only the entries the indexer picked among the complete blocks; in
# an HCA layer it sees every complete 128-token block. Grey = masked. The sink takes the
# rest of each row's probability mass.

# %%
HEAD = 0
show_layers = [kinds.index("swa"), kinds.index("csa"), kinds.index("hca")]
norm = LogNorm(vmin=1e-4, vmax=1.0)
cmap = plt.get_cmap("viridis").copy()
cmap.set_bad("0.85")
fig, axes = plt.subplots(len(show_layers), 2, figsize=(11, 3.4 * len(show_layers)),
                         gridspec_kw={"width_ratios": [3, 1]}, layout="constrained")
for row, i in enumerate(show_layers):
    p = dbg[i]["attn_probs"][0, :, HEAD, :]  # [T, T + n]
    m = dbg[i]["attn_mask"][0]
    pm = np.ma.masked_where(~m, p)
    n = p.shape[1] - T
    aw, ae = axes[row]
    im = aw.imshow(pm[:, :T], aspect="auto", norm=norm, cmap=cmap, interpolation="nearest")
    aw.set_title(f"layer {i} ({kinds[i]}), head {HEAD}: window keys")
    aw.set_xlabel("key position")
    aw.set_ylabel("query position t")
    if n:
        ae.imshow(pm[:, T:], aspect="auto", norm=norm, cmap=cmap, interpolation="nearest",
                  extent=(-0.5, n - 0.5, T - 0.5, -0.5))
        ratio = cfg.layer_ratio(i)
        ae.set_title(f"{n} compressed entries (1 per {ratio} tok.)")
        ae.set_xlabel("entry index")
        if n <= 8:
            ae.set_xticks(range(n))
    else:
        ae.text(0.5, 0.5, "SWA layer:\nno compressed entries", ha="center", va="center",
                transform=ae.transAxes)
        ae.set_xticks([])
    ae.set_yticks([])
    for s in ("left",):  # the boundary between the two key sets
        ae.spines[s].set_color("red")
        ae.spines[s].set_linewidth(3)
fig.colorbar(im, ax=axes, shrink=0.6, label="attention probability (log)")
fig.suptitle("Attention weights over [window | compressed entries]  (red edge = boundary)")
save(fig, "attention_head")

# %% [markdown]
# ## 2. Where the attention mass goes
#
# Per query position, averaged over heads: the share of probability on window keys, on
# compressed entries, and on the attention sink (`1 - sum(probs)`). Compressed entries only
# exist once a block is complete (t >= 3 for CSA, t >= 127 for HCA).

# %%
fig, axes = plt.subplots(1, 3, figsize=(13, 3.2), sharey=True)
for i in range(L):
    p = dbg[i]["attn_probs"][0]  # [T, H, T + n]
    win = p[..., :T].sum(-1).mean(-1)
    ent = p[..., T:].sum(-1).mean(-1)
    sink = 1 - p.sum(-1).mean(-1)
    label = f"L{i} {kinds[i]}"
    axes[0].plot(win, label=label)
    axes[1].plot(ent, label=label)
    axes[2].plot(sink, label=label)
for ax, title in zip(axes, ["window keys", "compressed entries", "sink"]):
    ax.set_title(f"attention mass on {title}")
    ax.set_xlabel("query position t")
    ax.axvline(cfg.sliding_window, color="k", ls=":", lw=1)
axes[0].set_ylabel("share of probability (mean over heads)")
axes[0].legend(fontsize=8)
axes[1].text(cfg.sliding_window + 3, 0.95, "t = window", fontsize=8, va="top",
             transform=axes[1].get_xaxis_transform())
save(fig, "attention_mass")

# %% [markdown]
# ## 3. Lightning indexer: which compressed blocks each query selects (CSA layers)
#
# Entry `e` of a CSA layer summarises tokens `4e .. 4e+3` (plus an overlapping look at
# block `e-1`). A query at position `t` may use only complete blocks (`e < (t+1)/4`); the
# indexer scores them and keeps the top `index_topk` (16 here). While there are at most 16
# complete blocks, all of them are kept. The dashed line marks the entry whose block starts
# where the sliding window starts: selections left of it are the query's only view of text
# beyond the window.

# %%
csa_layers = [i for i in range(L) if kinds[i] == "csa"]
state_cmap = ListedColormap(["white", "0.8", "tab:blue"])
fig, axes = plt.subplots(1, 2 * len(csa_layers), figsize=(4.2 * 2 * len(csa_layers), 4.2))
for j, i in enumerate(csa_layers):
    topk = dbg[i]["indexer_topk"][0]  # [T, k], -1 = none
    scores = dbg[i]["indexer_scores"][0]  # [T, n]
    n = scores.shape[1]
    t = np.arange(T)
    state = (np.arange(n)[None, :] < ((t + 1) // 4)[:, None]).astype(int)  # 1 = complete
    rows, cols = np.nonzero(topk >= 0)
    state[rows, topk[rows, cols]] = 2  # 2 = selected
    ax = axes[2 * j]
    ax.imshow(state, aspect="auto", cmap=state_cmap, vmin=0, vmax=2, interpolation="nearest")
    ax.plot((t - cfg.sliding_window + 1) / 4, t, "r--", lw=1, label="window start")
    ax.set_xlim(-0.5, n - 0.5)
    ax.set_title(f"layer {i}: selected (blue) / complete (grey)")
    ax.set_xlabel("compressed entry e (tokens 4e..4e+3)")
    ax.set_ylabel("query position t")
    ax.legend(loc="lower left", fontsize=8)
    ax = axes[2 * j + 1]
    vis = np.ma.masked_where(state == 0, scores)
    im = ax.imshow(vis, aspect="auto", cmap="magma", interpolation="nearest")
    fig.colorbar(im, ax=ax, shrink=0.8)
    ax.set_title(f"layer {i}: indexer score (complete blocks)")
    ax.set_xlabel("compressed entry e")
    print(f"layer {i}: selected per query: min {np.min((topk >= 0).sum(1))}, "
          f"max {np.max((topk >= 0).sum(1))}; fraction of picks outside the window: "
          f"{np.mean((4 * topk[rows, cols] + 3) < (rows - cfg.sliding_window + 1)):.2f}")
fig.tight_layout()
save(fig, "indexer_selection")

# %% [markdown]
# ## 4. Compressor gates
#
# Each compressed entry is a softmax-gated sum over the tokens of its block: per channel, a
# weight for each in-block position (`main_compressor_gates[b, e, pos, channel]`, a softmax
# over `pos`, so each column of the top-row images sums to 1). Top row: the gates of the
# last complete entry for its first 64 channels; every channel mixes the block's tokens in
# its own way. In CSA layers the `2c` channels come in two halves: `[c:]` pools the entry's
# own block (shown), `[:c]` is the overlap half that the next entry uses. Bottom row: the
# normalised entropy of every (entry, channel) gate distribution (1 = uniform average,
# 0 = copies one token).

# %%
cmp_layers = [i for i in range(L) if kinds[i] != "swa"]
fig, axes = plt.subplots(2, len(cmp_layers), figsize=(3.8 * len(cmp_layers), 6.4),
                         layout="constrained")
c = cfg.head_dim
for j, i in enumerate(cmp_layers):
    g = dbg[i]["main_compressor_gates"][0]  # [n, r, coff*c]
    n, r = g.shape[:2]
    halves = ({"own block [c:]": g[..., c:], "overlap [:c]": g[..., :c]} if kinds[i] == "csa"
              else {"all channels": g})
    ax = axes[0, j]
    first = next(iter(halves.values()))
    im = ax.imshow(first[-1, :, :64], aspect="auto", cmap="cividis", vmin=0,
                   interpolation="nearest")
    fig.colorbar(im, ax=ax, shrink=0.9)
    if r <= 8:
        ax.set_yticks(range(r))
    ax.set_title(f"layer {i} ({kinds[i]}), entry {n - 1} of {n}\n"
                 f"tokens {(n - 1) * r}..{n * r - 1}, r = {r}", fontsize=9)
    ax.set_xlabel("channel" + (" (own-block half)" if kinds[i] == "csa" else ""))
    ax = axes[1, j]
    for name, h in halves.items():
        ent = -(h * np.log(np.clip(h, 1e-30, None))).sum(1) / np.log(r)  # [n, channels]
        ax.hist(ent.ravel(), bins=40, range=(0, 1), alpha=0.6, label=name)
    ax.set_xlabel("gate entropy / log r")
    ax.legend(fontsize=7, loc="upper left")
axes[0, 0].set_ylabel("position in block")
axes[1, 0].set_ylabel("count (entry, channel)")
fig.suptitle("Compressor softmax gates: how each channel pools the tokens of a block")
save(fig, "compressor_gates")

# %% [markdown]
# ## 5. MoE router load
#
# Tokens routed to each expert (each token picks `num_experts_per_tok` = 2 of 8), per layer.
# The first `num_hash_layers` layers route by a fixed token-id hash table (`tid2eid`), so
# their load depends only on which tokens occur; the others route by the learned gate
# (`sqrt(softplus)` scores plus a bias, top-k). Colour: load relative to a uniform split.

# %%
E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
load = np.stack([np.bincount(dbg[i]["router_idx"].ravel(), minlength=E) for i in range(L)])
rel = load / (T * k / E)
fig, ax = plt.subplots(figsize=(7, 3.6))
im = ax.imshow(rel, cmap="coolwarm", vmin=0, vmax=2, aspect="auto")
for (li, e), v in np.ndenumerate(load):
    ax.text(e, li, str(v), ha="center", va="center", fontsize=8)
ax.set_xticks(range(E))
ax.set_xlabel("expert")
ax.set_yticks(range(L), [f"L{i} {kinds[i]}" + ("  [hash]" if cfg.is_hash_layer(i) else "")
                         for i in range(L)])
ax.axhline(cfg.num_hash_layers - 0.5, color="k", lw=2)
fig.colorbar(im, ax=ax, label="load / uniform (T*k/E)")
ax.set_title(f"tokens per expert ({T} tokens x top-{k})\n"
             "[hash]: routed by token id (above the line); below: learned gate")
save(fig, "router_load")

# %% [markdown]
# ## 6. mHC: the hyper-connection mixing matrices
#
# The residual is `N = 4` parallel streams `X [B, T, 4, D]`. Before each sub-block (attention,
# FFN) the input is `sum_i pre[i] X[i]`; after it, `X_new[j] = post[j] f + sum_i comb[i, j]
# X[i]`, with `comb` made doubly stochastic by Sinkhorn iterations. Below: `comb` averaged
# over tokens for each layer and sub-block, then `pre` and `post`.

# %%
N = cfg.hc_mult
fig, axes = plt.subplots(2, L, figsize=(2.6 * L, 5.4))
for row, which in enumerate(["hc_attn", "hc_ffn"]):
    for i in range(L):
        C = dbg[i][which][2][0].mean(0)  # [N, N]
        ax = axes[row, i]
        im = ax.imshow(C, cmap="Blues", vmin=0, vmax=1)
        for (a, b), v in np.ndenumerate(C):
            ax.text(b, a, f"{v:.2f}", ha="center", va="center", fontsize=7,
                    color="white" if v > 0.6 else "black")
        ax.set_xticks(range(N))
        ax.set_yticks(range(N))
        ax.set_title(f"L{i} {kinds[i]} {which[3:]}", fontsize=9)
        if i == 0:
            ax.set_ylabel("from stream i")
        if row == 1:
            ax.set_xlabel("to stream j")
fig.colorbar(im, ax=axes, shrink=0.7, label="comb[i, j] (token mean)")
fig.suptitle("mHC residual mixing comb[i, j] (rows and columns sum to 1)")
save(fig, "mhc_comb")

# %%
labels = [f"L{i} {kinds[i]} {w[3:]}" for i in range(L) for w in ("hc_attn", "hc_ffn")]
pre = np.stack([dbg[i][w][0][0].mean(0) for i in range(L) for w in ("hc_attn", "hc_ffn")])
post = np.stack([dbg[i][w][1][0].mean(0) for i in range(L) for w in ("hc_attn", "hc_ffn")])
fig, axes = plt.subplots(1, 2, figsize=(8, 4.6), sharey=True)
for ax, M, name, vmax in [(axes[0], pre, "pre (sigmoid, input collapse)", 1),
                          (axes[1], post, "post (2 sigmoid, output spread)", 2)]:
    im = ax.imshow(M, cmap="Greens", vmin=0, vmax=vmax, aspect="auto")
    for (a, b), v in np.ndenumerate(M):
        ax.text(b, a, f"{v:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(N))
    ax.set_xlabel("stream")
    ax.set_title(name)
    fig.colorbar(im, ax=ax, shrink=0.8)
axes[0].set_yticks(range(len(labels)), labels)
fig.suptitle("mHC pre / post weights (mean over tokens)")
fig.tight_layout()
save(fig, "mhc_pre_post")

# %% [markdown]
# ## 7. Logit lens
#
# Apply the final head (hc collapse, RMSNorm, unembedding) to the residual after every layer
# (and to the embedding) and compare with the model's output: the share of positions whose
# top-1 token equals the final top-1, and the KL divergence from the final distribution. The
# last layer's lens is the model output itself (checked below).

# %%
head = jax.jit(lambda X: dsv4_jax.model.head(params, X, cfg, nm),
              compiler_options=dsv4_jax.EXACT_COMPILER_OPTIONS)
X0 = dsv4_jax.model.embed(params, tokens, cfg, nm)
lens = [np.asarray(head(X0))] + [np.asarray(head(jnp.asarray(dbg[i]["X"]))) for i in range(L)]
np.testing.assert_allclose(lens[-1], logits, rtol=1e-5, atol=1e-5)


def log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


final_top1 = logits.argmax(-1)
lp_final = log_softmax(logits)
agree = [float(np.mean(z.argmax(-1) == final_top1)) for z in lens]
kl = [float(np.mean((np.exp(lp_final) * (lp_final - log_softmax(z))).sum(-1))) for z in lens]
names = ["embed"] + [f"L{i} {kinds[i]}" for i in range(L)]
fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.4))
a1.plot(names, agree, marker="o")
a1.set_ylim(-0.03, 1.03)
a1.set_ylabel("top-1 agreement with final")
a1.set_title("logit lens: top-1 token agreement")
a2.plot(names, kl, marker="o", color="tab:red")
a2.set_ylabel("mean KL(final || layer) [nats]")
a2.set_title("logit lens: distance to the final distribution")
for ax in (a1, a2):
    ax.set_xlabel("residual after")
    ax.tick_params(axis="x", rotation=30)
fig.tight_layout()
save(fig, "logit_lens")
for name, a, d in zip(names, agree, kl):
    print(f"{name:10s} agreement {a:.2f}  KL {d:.3f}")

# %%
print("figures:", sorted(p.name for p in OUT.glob("*.png")))
