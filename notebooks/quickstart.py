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
# Everything here runs on a CPU with the embedded `tiny` preset: a 5-layer DeepSeek-V4 with
# every architectural feature (sliding window, CSA and HCA compressed attention, hash and
# learned MoE routing, mHC, FP8/FP4 numerics) but **random weights**, so the generated text
# is noise. With a real checkpoint only the first cell changes (config and params from the
# checkpoint, the tokenizer from its `tokenizer.json`).
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
import dsv4_jax.config
import dsv4_jax.generate
import dsv4_jax.model
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
# `config.tiny()` is a frozen dataclass (hashable, so it can be a static jit argument);
# `init_params` builds the parameter dict from the same parameter description a checkpoint
# loader uses, with weights in their checkpoint formats (FP8 linears, FP4 experts).

# %%
cfg = dsv4_jax.config.tiny()
params = dsv4_jax.params.init_params(cfg, seed=0)
print(f"{cfg.name}: {cfg.num_hidden_layers} layers "
      f"({', '.join(cfg.layer_kind(i) for i in range(cfg.num_hidden_layers))}) + MTP, "
      f"d={cfg.hidden_size}, {cfg.num_attention_heads} heads x {cfg.head_dim}, "
      f"{cfg.n_routed_experts} experts (top {cfg.num_experts_per_tok}), vocab {cfg.vocab_size}")
print(f"{dsv4_jax.params.count_params(cfg) / 1e6:.1f} M parameters, "
      f"{dsv4_jax.params.nbytes(cfg) / 2**20:.1f} MiB in checkpoint formats")
print("a few entries:", {k: type(v).__name__ for k, v in list(params.items())[:6]})

# %% [markdown]
# ## 2. Tokenizer and chat prompt
#
# `load_tokenizer(None, vocab)` is the byte-level fallback for synthetic checkpoints: the
# chat special tokens are single ids (BOS = 0, EOS = 1, ...), and every byte is one id
# (16 + byte). `encode_messages` renders OpenAI-style messages in the DeepSeek-V4 chat
# format; in chat mode the prompt ends with `<｜Assistant｜></think>`.

# %%
tok = dsv4_jax.tokenizer.load_tokenizer(None, cfg.vocab_size)
prompt_text = dsv4_jax.chat.encode_messages(
    [{"role": "user", "content": "What is the capital of France?"}],
    thinking_mode="chat")
prompt = tok.encode(prompt_text)
assert tok.decode(prompt) == prompt_text  # the byte tokenizer round-trips exactly
print(repr(prompt_text))
print(len(prompt), "tokens:", prompt)
print("stop ids:", tok.stop_ids, [tok.decode([i]) for i in tok.stop_ids])

# %% [markdown]
# ## 3. The engine
#
# `Engine` owns a paged KV cache (FP8 entries, FP4 indexer keys when `act_quant=True`), a
# block manager and the compiled step. On CPU every distinct step shape costs a compile of
# several seconds, so this notebook uses one request slot and `prefill_chunk=1`: prefill and
# decode then share one compiled program. On a GPU keep the defaults (4 slots, prefill in
# chunks of 128); the API is the same.

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
# text can be shown as it is produced. The first step includes the prefill (and, the first
# time, the compilation).

# %%
MAX_NEW = 24
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
ax.bar(range(len(step_s)), np.asarray(step_s) * 1e3, color=["tab:red"] + ["tab:blue"] * (len(step_s) - 1))
ax.set_yscale("log")
ax.set_xlabel("stream step (0 = prefill of the prompt + first token)")
ax.set_ylabel("wall time [ms] (log)")
ax.set_title(f"eng.stream on CPU: {len(prompt)}-token prompt, greedy, tiny preset\n"
             "step 0 includes prefill and the one-time compilation")
save(fig, "stream_latency")

# %% [markdown]
# ## 5. `generate`: a whole decode loop in one jitted program
#
# `eng.generate(prompts, ...)` runs all decode steps inside one `lax.while_loop` and returns
# the generated ids per prompt (including the stop token that ended a request, if any).
# Prompts beyond the request slots run in waves, so a list of several prompts works with
# our single slot. Greedy decoding here must give the tokens the streaming run gave.

# %%
prompt2 = tok.encode(dsv4_jax.chat.encode_messages(
    [{"role": "user", "content": "Write a haiku about JAX."}], thinking_mode="chat"))
t0 = time.perf_counter()
outs = eng.generate([prompt, prompt2], max_new_tokens=MAX_NEW, sampler=Greedy(), seed=0,
                    stop_ids=tok.stop_ids)
print(f"generate: {time.perf_counter() - t0:.1f} s (includes compiling the loop)")
for p, o in zip([prompt, prompt2], outs):
    print(f"--- {tok.decode(p)[-40:]!r}\n{o}\n{tok.decode(o)!r}")
print("same tokens as the stream:", outs[0] == streamed)
print(eng.timing)

# %% [markdown]
# ## 6. Samplers
#
# Samplers are small frozen dataclasses with `get_next_tokens(logits [B, V], key) -> [B]`:
# `Greedy()`, `Temperature(t)`, `TopK(k, t)`, `TopP(p, t)`, `MinP(p, t)`. To see what each one
# does, take the model's next-token logits after the prompt (the engine's teacher-forced
# logits) and draw 4000 tokens from each sampler: grey bars are the model's probabilities
# (top 40 tokens, sorted), blue bars the sampler's empirical frequencies. The random model is
# nearly uniform over its 1024 ids, so the truncating samplers show up in how many distinct
# tokens they ever draw.

# %%
logits = eng.teacher_forced_logits(np.asarray([prompt]), len(prompt))[0, 0]  # [V]
probs = np.asarray(jax.nn.softmax(logits))
order = np.argsort(-probs)[:40]
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
# Sampled generations: the seed fixes the draws (the same seed gives the same tokens).

# %%
for seed in (0, 1, 0):
    o = eng.generate([prompt], max_new_tokens=12, sampler=TopP(0.9, 0.8), seed=seed,
                     stop_ids=tok.stop_ids, jit_loop=False)[0]
    print(f"seed {seed}: {o}")

# %% [markdown]
# ## 7. What the model predicted at each step
#
# `eng.teacher_forced_logits(tokens, prefill_len)` prefills the first `prefill_len` tokens
# and then feeds the rest one decode step at a time, returning the next-token logits after
# each step: the same numbers the engine sampled from. Feeding the prompt plus the greedy
# continuation shows, per generated position, the probabilities of the five most likely
# tokens (the greedy choice is the top one) and the entropy of the distribution. A random
# model is unsure everywhere: its entropy stays close to the uniform `log V`.
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

fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.2))
x = np.arange(len(top5))
bottom = np.zeros(len(top5))
for r in range(5):
    a1.bar(x, top5[:, r], bottom=bottom, label=f"rank {r + 1}" + (" (chosen)" if r == 0 else ""))
    bottom += top5[:, r]
a1.set_xlabel("generated token index")
a1.set_ylabel("probability (stacked)")
a1.set_title("top-5 next-token probabilities per step")
a1.legend(fontsize=7, ncol=2)
a2.plot(x, entropy, marker="o")
a2.axhline(np.log(cfg.vocab_size), color="k", ls=":", label=f"uniform: log {cfg.vocab_size}")
a2.set_ylim(0, np.log(cfg.vocab_size) * 1.1)
a2.set_xlabel("generated token index")
a2.set_ylabel("entropy [nats]")
a2.set_title("entropy of the next-token distribution")
a2.legend(fontsize=8)
fig.tight_layout()
save(fig, "step_probabilities")

# %%
print("figures:", sorted(p.name for p in OUT.glob("*.png")))
