"""What the bench scripts share: writing their results (`python bench/X.py` puts bench/ first on sys.path)."""
import json
import os


def write_results(out_dir: str, stem: str, rows: list, table: str, plot=None) -> None:
    """`rows` to OUT_DIR/STEM.json, the markdown `table` to STEM.md and, given `plot(rows, path)`, STEM.png; nothing
    when `out_dir` is empty."""
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(table + "\n")
    if plot is not None:
        plot(rows, os.path.join(out_dir, f"{stem}.png"))


def m_axis(ax, ms) -> None:
    """A matplotlib x axis over microbatch counts `ms` (powers of two): log scale, one labelled tick each, a grid."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.minorticks_off()
    ax.grid(alpha=0.3)
