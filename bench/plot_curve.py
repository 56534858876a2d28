"""Plot loss and val_loss from one or more WORKDIR/metrics.jsonl files into a PNG.

    python bench/plot_curve.py --out docs/shakespeare_curve.png runs/shakespeare [runs/other ...]
"""
import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    last = {}
    for r in rows:  # a resumed run may log a step twice: keep the latest
        last[r["step"]] = r
    return [last[k] for k in sorted(last)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("workdirs", nargs="+")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    fig, ax = plt.subplots(figsize=(7, 4))
    acc = None  # a classifier's (ViT's) val_accuracy, on a second axis
    for wd in a.workdirs:
        rows = read(wd)
        name = os.path.basename(os.path.normpath(wd))
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=1, alpha=0.6, label=f"{name} train")
        val = [r for r in rows if r.get("val_loss") is not None]
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label=f"{name} val")
        if any("val_accuracy" in r for r in val):
            acc = acc or ax.twinx()
            acc.plot([r["step"] for r in val], [r["val_accuracy"] for r in val], "s--", color="tab:green",
                     label=f"{name} val top-1")
            acc.set_ylabel("val top-1 accuracy")
            acc.legend(loc="center right")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token; a classifier's: per image)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(a.out)


if __name__ == "__main__":
    main()
