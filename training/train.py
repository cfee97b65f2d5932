"""Training on the pure-JAX forward (dsv4_jax.model), with optax.

Loss per batch of windows w [B, T + 2]:
  ce       next-token cross-entropy of the main model on w[:, :T] -> w[:, 1:T+1]
  mtp      cross-entropy of the MTP block (model.mtp_forward: main residual at t + token
           t+1 -> token t+2), weight TrainConfig.mtp_weight
  indexer  on each CSA layer, KL(p || softmax(I)) over the entries the indexer selected,
           p = the main attention's probability mass per entry summed over heads and
           normalised (no gradient through p), as DeepSeek-V3.2's sparse stage; the
           selection itself (top-k) has no gradient. Weight TrainConfig.indexer_weight.
Score-routed gate biases get no gradient: they follow DeepSeek-V3's auxiliary-loss-free
balancing (each step bias += rate * sign(mean load - expert load)). The hash layers'
tid2eid table is fixed at its (seeded) init.

Numerics: activations bf16 as the reference, without the FP8/FP4 activation simulation
(its rounding has no useful gradient: the FP4 codes are integers, the FP8 cast would
round the cotangents too), and `gpu=False` (the mHC Pallas kernel has no gradient).
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax import layers as L
from dsv4_jax import model as M
from dsv4_jax import param_specs as P
from dsv4_jax import params as PI
from dsv4_jax.config import Config
from dsv4_jax.quant import EXACT_COMPILER_OPTIONS, Numerics

from . import data as D
from .config import TrainConfig, training_form
from .quantize import forward_params, is_frozen

NM = Numerics(act_quant=False, dtype="bfloat16", gpu=False, sinkhorn_loop=True)
CHECKPOINT = "master.npz"
STATE = "state.json"
LOG = "log.jsonl"


# ---------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------
def init_master(cfg: Config, seed: int) -> tuple[dict, dict]:
    """-> (master {name: f32}, frozen {name: tid2eid int32 | gate bias f32}). Values from
    params.init_dense (seeded per name) with norms at 1 and gate biases at 0."""
    master, frozen = {}, {}
    for k, spec in P.describe(training_form(cfg)).items():
        v = PI.init_dense(k, spec, cfg, seed)
        if spec.init == "norm":
            v = np.ones_like(v)
        if k.endswith("gate.bias"):
            v = np.zeros_like(v)
        (frozen if is_frozen(k) else master)[k] = jnp.asarray(v)
    return master, frozen


# ---------------------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------------------
def mtp_forward(params, X_main, next_tokens, cfg: Config, nm: Numerics, debug: dict, j=0):
    """model.mtp_forward with its block's debug dict (the router's choices, for the bias
    balancing); tests/test_training.py checks it against model.mtp_forward."""
    p = f"mtp.{j}."
    e = L.rms_norm(params["embed.weight"][next_tokens], params[p + "enorm.weight"],
                   cfg.rms_norm_eps, nm.jdtype)
    h = L.rms_norm(X_main, params[p + "hnorm.weight"], cfg.rms_norm_eps, nm.jdtype)
    X = (M.linear(e, params[p + "e_proj"], nm)[..., None, :].astype(jnp.float32)
         + M.linear(h, params[p + "h_proj"], nm).astype(jnp.float32)).astype(nm.jdtype)
    layer = cfg.num_hidden_layers + j
    ratio = cfg.layer_ratio(layer)
    attn = lambda ap, x, xq=None: (L.attention_prefill(ap, x, cfg, nm, ratio, xq=xq), None)
    X, _ = M.block(L.block_params(params, p), X, next_tokens, layer, cfg, nm, attn, debug)
    return M.head(params, X, cfg, nm, prefix=p)


def cross_entropy(logits, labels):
    lse = jax.nn.logsumexp(logits, -1)
    return jnp.mean(lse - jnp.take_along_axis(logits, labels[..., None], -1)[..., 0])


def indexer_kl(ld: dict, T: int):
    """KL(attention mass || indexer distribution) over the selected entries of one CSA
    layer's debug dict, averaged over the query rows that selected any entry."""
    sel = ld["attn_mask"][..., T:]                                     # [B, T, n]
    mass = jax.lax.stop_gradient(ld["attn_probs"][..., T:].sum(2))     # [B, T, n]
    mass = jnp.where(sel, mass, 0.0)
    tot = mass.sum(-1, keepdims=True)
    valid = sel.any(-1) & (tot[..., 0] > 0)
    p = mass / jnp.where(tot > 0, tot, 1.0)
    logq = jax.nn.log_softmax(jnp.where(sel, ld["indexer_scores"], -1e9), -1)
    logp = jnp.log(jnp.where(p > 0, p, 1.0))
    kl = jnp.sum(jnp.where(sel & (p > 0), p * (logp - logq), 0.0), -1)
    return jnp.sum(jnp.where(valid, kl, 0.0)) / jnp.maximum(valid.sum(), 1)


def routed_layers(cfg: Config) -> list[int]:
    """Blocks with score routing (their gate bias is balanced); MTP = num_hidden_layers."""
    return [i for i in range(cfg.num_blocks_total) if not cfg.is_hash_layer(i)]


def bias_key(cfg: Config, layer: int) -> str:
    if layer < cfg.num_hidden_layers:
        return f"layers.{layer}.ffn.gate.bias"
    return f"mtp.{layer - cfg.num_hidden_layers}.ffn.gate.bias"


def losses(fparams, windows, cfg: Config, tcfg: TrainConfig, nm: Numerics = NM):
    """-> (total loss, aux {ce, mtp_ce, indexer_kl, mtp_top1, top1, loads {layer: [E]}})."""
    T = windows.shape[1] - 2
    inp, nxt, nxt2 = windows[:, :T], windows[:, 1:T + 1], windows[:, 2:T + 2]
    dbg = {}
    X = M.forward_hidden(fparams, inp, cfg, nm, debug=dbg)
    logits = M.head(fparams, X, cfg, nm)
    mdbg = {}
    mlogits = mtp_forward(fparams, X, nxt, cfg, nm, mdbg)
    ce, mtp_ce = cross_entropy(logits, nxt), cross_entropy(mlogits, nxt2)
    csa = [i for i in range(cfg.num_hidden_layers) if cfg.layer_ratio(i) == 4]
    kl = sum((indexer_kl(dbg[i], T) for i in csa), jnp.float32(0.0)) / max(len(csa), 1)
    total = ce + tcfg.mtp_weight * mtp_ce + tcfg.indexer_weight * kl
    loads = {}
    for i in routed_layers(cfg):
        idx = (dbg[i] if i < cfg.num_hidden_layers else mdbg)["router_idx"]
        loads[i] = jnp.zeros(cfg.n_routed_experts, jnp.float32).at[idx.reshape(-1)].add(1.0)
    aux = {"ce": ce, "mtp_ce": mtp_ce, "indexer_kl": kl,
           "top1": jnp.mean(jnp.argmax(logits, -1) == nxt),
           "mtp_top1": jnp.mean(jnp.argmax(mlogits, -1) == nxt2), "loads": loads}
    return total, aux


# ---------------------------------------------------------------------------------------
# Optimiser and steps
# ---------------------------------------------------------------------------------------
def make_optimizer(tcfg: TrainConfig):
    import optax
    sched = optax.warmup_cosine_decay_schedule(
        0.0, tcfg.lr, max(tcfg.warmup_steps, 1), max(tcfg.steps, tcfg.warmup_steps + 1),
        tcfg.lr * tcfg.min_lr_ratio)
    decay = lambda tree: jax.tree.map(lambda a: a.ndim >= 2, tree)
    return optax.chain(optax.clip_by_global_norm(tcfg.grad_clip),
                       optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=tcfg.weight_decay,
                                   mask=decay)), sched


def balance_biases(frozen: dict, loads: dict, cfg: Config, rate: float) -> dict:
    out = dict(frozen)
    for i, n in loads.items():
        k = bias_key(cfg, i)
        out[k] = frozen[k] + rate * jnp.sign(jnp.mean(n) - n)
    return out


def make_steps(cfg: Config, tcfg: TrainConfig, opt):
    """-> (train_step(master, frozen, opt_state, windows) -> (master, frozen, opt_state,
    metrics), eval_step(master, frozen, windows) -> metrics), both jitted."""
    def loss_fn(master, frozen, windows):
        return losses(forward_params(master, frozen, cfg, tcfg.qat), windows, cfg, tcfg)

    def train_step(master, frozen, opt_state, windows):
        import optax
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(master, frozen, windows)
        updates, opt_state = opt.update(grads, opt_state, master)
        master = optax.apply_updates(master, updates)
        frozen = balance_biases(frozen, aux["loads"], cfg, tcfg.bias_update_rate)
        metrics = {k: v for k, v in aux.items() if k != "loads"}
        metrics["loss"] = loss
        metrics["grad_norm"] = optax.tree.norm(grads) if hasattr(optax, "tree") else \
            optax.global_norm(grads)  # optax < 0.2.5
        # the busiest expert's load over the mean load, worst layer (1 = balanced)
        metrics["max_load"] = jnp.max(jnp.stack(
            [jnp.max(n) / jnp.mean(n) for n in aux["loads"].values()] or [jnp.float32(1.0)]))
        return master, frozen, opt_state, metrics

    def eval_step(master, frozen, windows):
        loss, aux = loss_fn(master, frozen, windows)
        return {"loss": loss, **{k: v for k, v in aux.items() if k != "loads"}}

    # EXACT_COMPILER_OPTIONS: XLA-GPU would otherwise delete the f32 -> e4m3 -> f32 casts of
    # the FP8 fake quantisation (and the bf16 rounding points), training other weights
    # than the export holds (see quant.EXACT_COMPILER_OPTIONS)
    opts = EXACT_COMPILER_OPTIONS
    return (jax.jit(train_step, donate_argnums=(0, 1, 2), compiler_options=opts),
            jax.jit(eval_step, compiler_options=opts))


def evaluate(eval_step, master, frozen, batches) -> dict:
    """Mean of the held-out metrics; ppl = exp(mean next-token CE)."""
    ms = [jax.device_get(eval_step(master, frozen, jnp.asarray(b))) for b in batches]
    out = {k: float(np.mean([m[k] for m in ms])) for k in ms[0]}
    out["ppl"] = float(np.exp(out["ce"]))
    return out


# ---------------------------------------------------------------------------------------
# Checkpoints of the master weights
# ---------------------------------------------------------------------------------------
def save_checkpoint(run: Path, master: dict, frozen: dict, cfg: Config, tcfg: TrainConfig,
                    step: int, extra: dict | None = None):
    """run/master.npz (every parameter's logical value, f32 / int32) + run/state.json;
    written to temporary names and renamed, so an interrupt keeps the previous one."""
    vals = {k: np.asarray(jax.device_get(v)) for k, v in {**master, **frozen}.items()}
    tmp = run / (CHECKPOINT + ".tmp.npz")
    np.savez(tmp, **vals)
    tmp.replace(run / CHECKPOINT)
    state = {"step": step, "model": cfg.to_hf_dict(), "model_name": cfg.name,
             "train": dataclasses.asdict(tcfg), **(extra or {})}
    (run / (STATE + ".tmp")).write_text(json.dumps(state, indent=1))
    (run / (STATE + ".tmp")).replace(run / STATE)


def load_checkpoint(run: Path) -> tuple[Config, dict, dict]:
    """-> (export config, master {name: f32 numpy}, frozen {name: numpy})."""
    run = Path(run)
    if not (run / CHECKPOINT).exists() or not (run / STATE).exists():
        raise FileNotFoundError(f"{run}: no {CHECKPOINT} + {STATE} (not a training run "
                                "directory, or no checkpoint written yet)")
    state = json.loads((run / STATE).read_text())
    cfg = Config.from_hf_dict(state["model"], name=state.get("model_name", "custom"))
    with np.load(run / CHECKPOINT) as z:
        vals = {k: z[k] for k in z.files}
    master = {k: v for k, v in vals.items() if not is_frozen(k)}
    frozen = {k: v for k, v in vals.items() if is_frozen(k)}
    return cfg, master, frozen


# ---------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------
def train(data: str | Path, run: str | Path, tcfg: TrainConfig, cfg: Config | None = None,
          progress: bool = True, log=print) -> dict:
    """Train on `data` (training.data.prepare's directory) into `run`: log.jsonl (one line
    per step: losses, lr, tokens/s; and held-out evals), master.npz + state.json
    (checkpoints every tcfg.checkpoint_every steps and at the end), summary.json.
    -> the summary (first and final held-out metrics, wall time, tokens/s)."""
    from tqdm import tqdm
    import optax  # noqa: F401  (fail early when the `train` extra is missing)

    cfg = cfg or tcfg.model_config()
    data_dir = str(Path(data).resolve())
    train_ids, held_ids = D.load_split(data, "train"), D.load_split(data, "heldout")
    run = Path(run)
    if run.exists() and not run.is_dir():
        raise FileExistsError(f"--run {run} is a file; give a directory")
    run.mkdir(parents=True, exist_ok=True)
    vmax = int(max(train_ids.max(), held_ids.max()))
    if vmax >= cfg.vocab_size:
        raise ValueError(f"--data {data}: token id {vmax} >= the model's vocab_size "
                         f"{cfg.vocab_size} (prepare with --vocab-size <= {cfg.vocab_size})")
    batches = D.Batches(train_ids, tcfg.batch_size, tcfg.seq_len, tcfg.seed)
    held = D.eval_windows(held_ids, tcfg.batch_size, tcfg.seq_len, tcfg.eval_batches)
    master, frozen = init_master(cfg, tcfg.seed)
    opt, sched = make_optimizer(tcfg)
    opt_state = opt.init(master)
    train_step, eval_step = make_steps(cfg, tcfg, opt)
    n_params = P.count_params(cfg)
    log(f"model {cfg.name}: {n_params / 1e6:.2f}M parameters, {cfg.num_hidden_layers} layers "
        f"{[cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)]} + MTP; "
        f"{tcfg.steps} steps of {tcfg.batch_size} x {tcfg.seq_len} tokens on "
        f"{jax.devices()[0].platform}")
    logf = open(run / LOG, "w")

    def write(rec):
        logf.write(json.dumps(rec) + "\n")
        logf.flush()

    t0 = time.perf_counter()
    first = evaluate(eval_step, master, frozen, held)
    write({"step": 0, "split": "heldout", **first})
    log(f"step 0: held-out loss {first['ce']:.3f} (ppl {first['ppl']:.1f})")
    pending, last_eval, stopped = [], first, None
    tokens_per_step = tcfg.batch_size * tcfg.seq_len
    bar = tqdm(range(1, tcfg.steps + 1), disable=not progress, desc="train", unit="step")
    t_train = time.perf_counter()
    for step in bar:
        w = jnp.asarray(next(batches))
        master, frozen, opt_state, m = train_step(master, frozen, opt_state, w)
        pending.append((step, m))
        if step % 10 == 0 or step == tcfg.steps or (
                time.perf_counter() - t_train > 60 * tcfg.max_minutes):  # fetch in groups
            el = time.perf_counter() - t_train
            for s, mm in jax.device_get(pending):
                write({"step": s, "split": "train", "lr": float(sched(s - 1)),
                       "tokens": s * tokens_per_step, "elapsed_s": round(el, 2),
                       **{k: float(v) for k, v in mm.items()}})
            bar.set_postfix(loss=f"{float(pending[-1][1]['loss']):.3f}",
                            tok_s=f"{step * tokens_per_step / el:.0f}")
            pending = []
        if step % tcfg.eval_every == 0 or step == tcfg.steps:
            last_eval = evaluate(eval_step, master, frozen, held)
            write({"step": step, "split": "heldout", **last_eval})
            bar.write(f"step {step}: held-out loss {last_eval['ce']:.3f} (ppl "
                      f"{last_eval['ppl']:.1f}), MTP top-1 {last_eval['mtp_top1']:.3f}")
        over = time.perf_counter() - t_train > 60 * tcfg.max_minutes
        if over and step < tcfg.steps:
            stopped = step
            last_eval = evaluate(eval_step, master, frozen, held)
            write({"step": step, "split": "heldout", **last_eval})
            bar.write(f"step {step}: stopping, over --max-minutes {tcfg.max_minutes}")
            break
        if step % tcfg.checkpoint_every == 0 and step != tcfg.steps:
            save_checkpoint(run, master, frozen, cfg, tcfg, step, {"data": data_dir})
    bar.close()
    train_s = time.perf_counter() - t_train
    done = stopped or tcfg.steps
    summary = {"steps": done, "stopped_early": stopped is not None,
               "tokens": done * tokens_per_step, "train_seconds": round(train_s, 1),
               "tokens_per_second": round(done * tokens_per_step / train_s, 1),
               "wall_seconds": round(time.perf_counter() - t0, 1),
               "device": str(jax.devices()[0].device_kind), "parameters": n_params,
               "heldout_initial": first, "heldout_final": last_eval}
    save_checkpoint(run, master, frozen, cfg, tcfg, done,
                    {"data": data_dir, "summary": summary})
    (run / "summary.json").write_text(json.dumps(summary, indent=1))
    logf.close()
    return summary
