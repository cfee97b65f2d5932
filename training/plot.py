"""Loss curves of a training run (log.jsonl) as one PNG: the training losses (next-token
CE and the MTP block's CE, smoothed) and the held-out CE, with the MTP head's top-1
agreement with the next-next token on a second axis."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def read_log(run) -> tuple[list[dict], list[dict]]:
    p = Path(run) / "log.jsonl"
    if not p.exists():
        raise FileNotFoundError(f"{run}: no log.jsonl")
    recs = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return ([r for r in recs if r["split"] == "train"],
            [r for r in recs if r["split"] == "heldout"])


def _smooth(y, n):
    if len(y) < n or n < 2:
        return np.asarray(y)
    k = np.ones(n) / n
    return np.convolve(y, k, mode="valid")


def plot(run, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr, ho = read_log(run)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    n = max(1, len(tr) // 100)
    if tr:
        steps = np.asarray([r["step"] for r in tr])
        for key, label in (("ce", "train next-token CE"), ("mtp_ce", "train MTP CE (t+2)")):
            y = _smooth([r[key] for r in tr], n)
            ax.plot(steps[len(steps) - len(y):], y, label=label, lw=1)
    if ho:
        ax.plot([r["step"] for r in ho], [r["ce"] for r in ho], "o-", ms=3,
                label="held-out next-token CE")
        ax.plot([r["step"] for r in ho], [r["mtp_ce"] for r in ho], "s--", ms=3,
                label="held-out MTP CE")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    if ho:
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in ho], [r["mtp_top1"] for r in ho], "^:", color="k", ms=3,
                 label="held-out MTP top-1 (next-next token)")
        ax2.set_ylabel("MTP top-1 agreement")
        ax2.set_ylim(0, 1)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, loc="upper right", fontsize=8)
        last = ho[-1]
        ax.set_title(f"held-out ppl {last['ppl']:.2f}, MTP top-1 {last['mtp_top1']:.3f} "
                     f"at step {last['step']}", fontsize=10)
    else:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
