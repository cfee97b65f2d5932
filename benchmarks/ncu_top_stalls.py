"""The SASS instructions with the most warp-state samples in an Nsight Compute source page
(`ncu -i R --page source --csv --print-source sass > F.csv`), with each one's non-zero
stall-reason columns: where a kernel's warps wait.

  python3 benchmarks/ncu_top_stalls.py F.csv [N]"""
import csv
import sys


def top_stalls(path, n=40):
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f)]
    head_i = next(i for i, r in enumerate(rows) if any("Sampl" in c for c in r))
    head, body = rows[head_i], [r for r in rows[head_i + 1:] if len(r) == len(rows[head_i])]
    col = next(i for i, c in enumerate(head) if "Warp Stall Sampling (All" in c)
    num = lambda x: float(x.replace(",", "") or 0) if x.replace(",", "").replace(".", "").isdigit() else 0.0
    total = sum(num(r[col]) for r in body) or 1.0
    src = next((i for i, c in enumerate(head) if c.strip() == "Source"), 1)
    reasons = [i for i, c in enumerate(head) if c.startswith("stall_") or "Stall" in c and i != col]
    out = [f"{len(body)} instructions, {total:.0f} samples; columns: {head}"]
    for r in sorted(body, key=lambda r: -num(r[col]))[:n]:
        why = ", ".join(f"{head[i]}={r[i]}" for i in reasons if num(r[i]) > 0)
        out.append(f"{100 * num(r[col]) / total:5.1f}%  {r[0]:>6}  {r[src][:60]:60s}  {why}")
    return "\n".join(out)


if __name__ == "__main__":
    print(top_stalls(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40))
