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
# # Quickstart: build, tokenize, generate, stream
#
# Everything here runs on a CPU with the model that ships inside the package,
# `dsv4-small-stdlib` (`dsv4_jax.embedded_checkpoint()`): a 6M-parameter DeepSeek-V4 with
# every architectural feature (sliding window, CSA and HCA compressed attention, hash and
# learned MoE routing, mHC, the MTP block, FP8/FP4 weights), **trained on the Python
# standard library's source** (docs/TRAINING.md: held-out perplexity 8.0). It completes
# Python code; it was never trained on chat, so the prompts here are Python source text.
# A real release checkpoint loads the same way (`dsv4_jax.load(path)`, the tokenizer from
# its `tokenizer.json`); `config.tiny()` + `params.init_params` (`--preset tiny` on the
# command line) is the random-weight model the tests use.
#
# Figures are shown inline and written to `_out/quickstart/` in the working directory (next
# to the notebook in Jupyter).

# %%
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

import dsv4_jax.chat
import dsv4_jax.generate
import dsv4_jax.params
import dsv4_jax.tokenizer
from dsv4_jax.cache import CacheSpec
from dsv4_jax.generate import Greedy, MinP, Temperature, TopK, TopP
from dsv4_jax.quant import Numerics

OUT = Path("_out") / "quickstart"  # under the working directory
OUT.mkdir(parents=True, exist_ok=True)
plt.rcParams.update({"figure.dpi": 90, "font.size": 9})


def save(fig, name):
    """Write the figure to OUT/<name>.png and show it."""
    fig.savefig(OUT / f"{name}.png", dpi=110, bbox_inches="tight")
    plt.show()


# %% [markdown]
# ## 1. The model
#
# `dsv4_jax.load(path)` reads a checkpoint directory (here the embedded one, stored exactly
# as the official release stores a model: `config.json`, safetensors with FP8 block-scaled
# linears and FP4 experts) and returns `(cfg, params)`. `cfg` is a frozen dataclass
# (hashable, so it can be a static jit argument); `params` is a flat dict of arrays, the
# quantised weights kept in their checkpoint formats.

# %%
ckpt = dsv4_jax.embedded_checkpoint()
cfg, params = dsv4_jax.load(ckpt)
print(ckpt)
print(f"{cfg.name}: {cfg.num_hidden_layers} layers "
      f"({', '.join(cfg.layer_kind(i) for i in range(cfg.num_hidden_layers))}) + MTP, "
      f"d={cfg.hidden_size}, {cfg.num_attention_heads} heads x {cfg.head_dim}, "
      f"{cfg.n_routed_experts} experts (top {cfg.num_experts_per_tok}), vocab {cfg.vocab_size}")
print(f"{dsv4_jax.params.count_params(cfg) / 1e6:.1f} M parameters, "
      f"{dsv4_jax.params.nbytes(cfg) / 2**20:.1f} MiB in checkpoint formats")
print("a few entries:", {k: type(v).__name__ for k, v in list(params.items())[:6]})

# %% [markdown]
# ## 2. Tokenizer and prompt
#
# `load_tokenizer(dir, vocab)` reads the checkpoint's `tokenizer.json`: here a byte-level
# BPE of 4096 ids trained on the same standard-library text, whose first ids are the
# DeepSeek-V4 chat special tokens (BOS = 0, EOS = 1, `<｜User｜>` = 2, ...). The model saw
# every training file as BOS + the file's tokens + EOS, so a prompt is BOS followed by the
# start of a Python file (what `dsv4 generate --prompt` does for plain text).
#
# For a chat checkpoint, `dsv4_jax.chat.encode_messages` renders OpenAI-style messages in
# the DeepSeek-V4 chat format (ending with `<｜Assistant｜></think>` in chat mode); shown
# below only as text, since this model has never seen a conversation.

# %%
tok = dsv4_jax.tokenizer.load_tokenizer(str(ckpt), cfg.vocab_size)
prompt_text = "import os\n\n\ndef "
prompt = [tok.bos_id] + tok.encode(prompt_text)
assert tok.decode(prompt[1:]) == prompt_text  # the BPE round-trips exactly
print(repr(prompt_text))
print(len(prompt), "tokens:", prompt, [tok.decode([i]) for i in prompt])
print("stop ids:", tok.stop_ids, [tok.decode([i]) for i in tok.stop_ids])
print("chat format:", repr(dsv4_jax.chat.encode_messages(
    [{"role": "user", "content": "Hi"}], thinking_mode="chat")))

# %% [markdown]
# ## 3. The engine
#
# `Engine` owns a paged KV cache (FP8 entries, FP4 indexer keys when `act_quant=True`), a
# block manager and the compiled step. On CPU every distinct step shape costs a compile of
# several seconds, so this notebook uses one request slot and `prefill_chunk=1`: prefill and
# the plain decode step (which `teacher_forced_logits` uses) then share one compiled
# program, whatever the prompt length; `stream` and `generate` each compile their own
# decode program once. On a GPU keep the defaults (4 slots, prefill in chunks of 128); the
# API is the same.

# %%
nm = Numerics(act_quant=True)
cache_spec = CacheSpec.for_numerics(nm, max_requests=1, num_blocks=4, max_blocks=1)
eng = dsv4_jax.generate.Engine(cfg, params, numerics=nm, cache_spec=cache_spec,
                               prefill_chunk=1)
print(cache_spec, "-> capacity", cache_spec.capacity, "tokens per request")

# %% [markdown]
# ## 4. Streaming
#
# `eng.stream(prompts, ...)` yields one list of `(request_index, token)` per decode step, so
# text can be shown as it is produced. The first step includes the prefill; the first time,
# step 0 also compiles the prefill step and step 1 the decode program (about 10 s each on
# CPU), after which a token takes a few milliseconds. The continuation is greedy: the model
# names the function, writes a docstring and a body in the standard library's style (6M
# parameters: it starts repeating itself after a few lines).

# %%
MAX_NEW = 40
streamed, step_s = [], []
t0 = time.perf_counter()
for step in eng.stream([prompt], max_new_tokens=MAX_NEW, sampler=Greedy(),
                       stop_ids=tok.stop_ids):
    for i, t in step:
        before = tok.decode(streamed)
        streamed.append(t)
        print(tok.decode(streamed)[len(before):], end="", flush=True)
    step_s.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
print()
print(f"{len(streamed)} tokens; first step {step_s[0]:.2f} s, then "
      f"{np.median(step_s[1:]) * 1e3:.0f} ms per token (median)")

# %%
fig, ax = plt.subplots(figsize=(6.5, 3))
ax.bar(range(len(step_s)), np.asarray(step_s) * 1e3,
       color=["tab:red"] * 2 + ["tab:blue"] * (len(step_s) - 2))
ax.set_yscale("log")
ax.set_xlabel("stream step (0 = prefill of the prompt + first token)")
ax.set_ylabel("wall time [ms] (log)")
ax.set_title(f"eng.stream on CPU: {len(prompt)}-token prompt, greedy, {cfg.name}\n"
             "red: step 0 (prefill) and step 1 (first decode step) include compilation")
save(fig, "stream_latency")

# %% [markdown]
# ## 5. `generate`: a whole decode loop in one jitted program
#
# `eng.generate(prompts, ...)` runs all decode steps inside one `lax.while_loop` and returns
# the generated ids per prompt (including the stop token that ended a request, if any).
# Prompts beyond the request slots run in waves, so a list of several prompts works with
# our single slot. Greedy decoding here must give the tokens the streaming run gave. The
# second prompt opens a class; the model fills in `__init__` with an attribute named after
# the class, then loops on that line: small models trained on little text repeat.

# %%
prompt2 = [tok.bos_id] + tok.encode(
    'class Stack:\n    """A last-in, first-out stack of items."""\n\n    def __init__(self):')
t0 = time.perf_counter()
outs = eng.generate([prompt, prompt2], max_new_tokens=MAX_NEW, sampler=Greedy(), seed=0,
                    stop_ids=tok.stop_ids)
print(f"generate: {time.perf_counter() - t0:.1f} s (includes compiling the loop)")
for p, o in zip([prompt, prompt2], outs):
    print(f"--- prompt {tok.decode(p[1:])!r}\n{o}\n{tok.decode(p[1:]) + tok.decode(o)}")
print("same tokens as the stream:", outs[0] == streamed)
print(eng.timing)

# %% [markdown]
# ## 6. Samplers
#
# Samplers are small frozen dataclasses with `get_next_tokens(logits [B, V], key) -> [B]`:
# `Greedy()`, `Temperature(t)`, `TopK(k, t)`, `TopP(p, t)`, `MinP(p, t)`. To see what each one
# does, take the model's next-token logits after the prompt (the engine's teacher-forced
# logits) and draw 4000 tokens from each sampler: grey bars are the model's probabilities
# (top 40 tokens, sorted), blue bars the sampler's empirical frequencies.
#
# After `import os\n\n\ndef ` the model expects a function name with a long tail: `join`
# gets about a quarter of the probability, then a slowly decaying list of other names. So
# `Temperature(1.0)` draws a couple of hundred distinct tokens in 4000 draws, `Temperature(0.5)`
# sharpens the top (about 0.7 on `join`), `TopK(10)` and `TopP(0.5)` renormalise over the
# first 10 and first few tokens, and `MinP(0.5)` keeps only tokens with at least half the top
# token's probability: here `join` alone, like `Greedy()`.

# %%
logits = eng.teacher_forced_logits(np.asarray([prompt]), len(prompt))[0, 0]  # [V]
probs = np.asarray(jax.nn.softmax(logits))
order = np.argsort(-probs)[:40]
print("most likely next tokens:", [(tok.decode([int(i)]), round(float(probs[i]), 3))
                                   for i in order[:8]])
samplers = [Greedy(), Temperature(1.0), Temperature(0.5), TopK(10, 1.0), TopP(0.5, 1.0),
            MinP(0.5, 1.0)]
keys = jax.random.split(jax.random.key(0), 4000)
fig, axes = plt.subplots(2, 3, figsize=(12, 5.5), sharex=True)
for ax, s in zip(axes.ravel(), samplers):
    draw = jax.jit(jax.vmap(lambda k, s=s: s.get_next_tokens(jnp.asarray(logits)[None], k)[0]))
    samples = np.asarray(draw(keys))
    freq = np.bincount(samples, minlength=cfg.vocab_size) / len(samples)
    ax.bar(range(len(order)), probs[order], color="0.75", label="model p")
    ax.bar(range(len(order)), freq[order], width=0.5, color="tab:blue", label="sampled")
    ax.set_title(f"{s}\n{len(np.unique(samples))} distinct tokens", fontsize=8)
for ax in axes[1]:
    ax.set_xlabel("token rank under the model")
for ax in axes[:, 0]:
    ax.set_ylabel("probability / frequency")
axes[0, 0].legend()
fig.suptitle("Next-token distribution after the prompt, and what each sampler draws from it")
fig.tight_layout()
save(fig, "sampler_distributions")

# %% [markdown]
# Sampled generations (`TopP(0.9, 0.8)`): each seed writes another function (most start
# with the likely `join`); the seed fixes the draws (the same seed gives the same tokens).

# %%
for seed in (0, 1, 0):
    o = eng.generate([prompt], max_new_tokens=12, sampler=TopP(0.9, 0.8), seed=seed,
                     stop_ids=tok.stop_ids, jit_loop=False)[0]
    print(f"seed {seed}: {o}\n        {tok.decode(o)!r}")

# %% [markdown]
# ## 7. What the model predicted at each step
#
# `eng.teacher_forced_logits(tokens, prefill_len)` prefills the first `prefill_len` tokens
# and then feeds the rest one decode step at a time, returning the next-token logits after
# each step: the same numbers the engine sampled from. Feeding the prompt plus the greedy
# continuation shows, per generated token (labelled below the plot), the probabilities of
# the five most likely tokens (the greedy choice is the top one) and the entropy of the
# distribution. The trained model is far from the uniform `log V` = 8.3 nats (a random
# model stays close to it): it is almost certain (under 0.1 nats) of syntax that follows
# from what it already wrote (the `:` and the indented newline after `try`, the `.`s of
# `os.path.join`, the newline after a docstring's closing quotes), and unsure (4-5 nats)
# where code is free to choose: the argument's name, the words of the docstring, the
# statement after `try:`.
#
# (`dsv4_jax.model.forward(params, tokens, cfg, nm)` computes the same logits over the whole
# sequence without a cache; the layer explorer notebook uses it.)

# %%
seq = prompt + outs[0]
lg = eng.teacher_forced_logits(np.asarray([seq]), len(prompt))[0, :-1]  # [new tokens, V]
p = np.asarray(jax.nn.softmax(jnp.asarray(lg), -1))
top5 = np.sort(p, -1)[:, ::-1][:, :5]
entropy = -(p * np.log(np.clip(p, 1e-30, None))).sum(-1)
assert (p.argmax(-1) == np.asarray(outs[0])).all()  # greedy picked the top token each step

labels = [repr(tok.decode([t]))[1:-1] for t in outs[0]]
fig, (a1, a2) = plt.subplots(2, 1, figsize=(11, 5.8), sharex=True)
x = np.arange(len(top5))
bottom = np.zeros(len(top5))
for r in range(5):
    a1.bar(x, top5[:, r], bottom=bottom, label=f"rank {r + 1}" + (" (chosen)" if r == 0 else ""))
    bottom += top5[:, r]
a1.set_ylabel("probability (stacked)")
a1.set_title("top-5 next-token probabilities per step")
a1.set_ylim(0, 1.22)
a1.legend(fontsize=7, ncol=5, loc="upper center")
a2.plot(x, entropy, marker="o")
a2.axhline(np.log(cfg.vocab_size), color="k", ls=":", label=f"uniform: log {cfg.vocab_size}")
a2.set_ylim(0, np.log(cfg.vocab_size) * 1.1)
a2.set_xticks(x, labels, rotation=90, fontsize=7, family="monospace")
a2.set_xlabel("generated token (greedy)")
a2.set_ylabel("entropy [nats]")
a2.set_title("entropy of the next-token distribution")
a2.legend(fontsize=8)
fig.tight_layout()
save(fig, "step_probabilities")
print(f"entropy: mean {entropy.mean():.2f} nats (uniform {np.log(cfg.vocab_size):.2f}); "
      f"{np.mean(top5[:, 0] > 0.9):.0%} of the steps put > 0.9 on the chosen token")
for j in np.argsort(entropy)[:4].tolist() + np.argsort(entropy)[-4:].tolist():
    print(f"  step {j:2d} {labels[j]!r:14s} p(top) {top5[j, 0]:.2f}  entropy {entropy[j]:.2f}")

# %%
print("figures:", sorted(p.name for p in OUT.glob("*.png")))
