"""The benchmarks page's chart, drawn from a run's JSON: ``python benchmarks/chart.py RUN.json OUT.png``.

``RUN.json`` is what ``python benchmarks/run.py --json RUN.json`` writes. The chart shows, for
W1, W1h and W2 on the CPU, each step as a fraction of **L** (the same bytes moved by one
in-place multiply of one buffer, measured in the same run): ampscale's rows beside the anchors.
Higher is faster; 1.0 is the machine's memory limit for the bytes a step moves. Rows the run
did not measure (a backend not installed, ``torch.amp.GradScaler`` on float16) are left out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

#: the bars, in order: (backend, row name in run.py, label, ampscale's own row)
BARS = (
    ("numpy", "ampscale numpy", "ampscale, NumPy", True),
    ("torch", "ampscale torch (unscale + update)", "ampscale, torch", True),
    ("torch", "ampscale.torch.GradScaler", "ampscale.torch.GradScaler", True),
    ("jax", "ampscale jax (jit, donated)", "ampscale, JAX (jit)", True),
    ("torch", "torch fused kernel only", "torch's fused kernel alone", False),
    ("torch", "torch.amp.GradScaler", "torch.amp.GradScaler", False),
    ("jax", "jmp (jit, donated)", "jmp (jit)", False),
    ("numpy", "naive numpy", "naive NumPy", False),
)
WORKLOADS = ("W1", "W1h", "W2")
WORKLOAD_LABELS = {"W1": "W1: GPT-2 small, fp32", "W1h": "W1h: the same in fp16", "W2": "W2: 2000 x 4096, fp32"}
OURS = ("#1b7837", "#5aae61", "#a6dba0", "#2166ac")
THEIRS = ("#4d4d4d", "#878787", "#bababa", "#e0e0e0")


def fractions_of_l(rows: list[dict[str, Any]]) -> dict[tuple[str, str, str], float]:
    """``(backend, row name, workload) -> L's time / the row's time``, for a run's CPU rows."""
    limits = {r["workload"]: r["seconds"] for r in rows if r.get("limit") and r.get("device", "cpu") == "cpu"}
    return {
        (r["backend"], r["name"], r["workload"]): limits[r["workload"]] / r["seconds"]
        for r in rows
        if r.get("device", "cpu") == "cpu" and not r.get("limit") and r["workload"] in limits
    }


def draw(rows: list[dict[str, Any]], out: pathlib.Path) -> list[str]:
    """Draw the chart of ``rows`` into ``out``; returns the labels of the bars drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = fractions_of_l(rows)
    bars = [bar for bar in BARS if any((bar[0], bar[1], w) in ratios for w in WORKLOADS)]
    if not bars:
        raise ValueError("the run has no CPU rows of W1, W1h or W2 with an L to compare with")
    fig, ax = plt.subplots(figsize=(9.0, 5.0), dpi=110)
    width = 0.8 / len(bars)
    ours, theirs = iter(OURS), iter(THEIRS)
    for index, (backend, name, label, own) in enumerate(bars):
        color = next(ours) if own else next(theirs)
        xs = [w for w, workload in enumerate(WORKLOADS) if (backend, name, workload) in ratios]
        values = [ratios[(backend, name, WORKLOADS[w])] for w in xs]
        positions = [x - 0.4 + width * (index + 0.5) for x in xs]
        ax.bar(positions, values, width * 0.92, label=label, color=color, edgecolor="#333333", linewidth=0.4)
    ax.axhline(1.0, color="#b2182b", linewidth=1.0, linestyle="--")
    ax.text(len(WORKLOADS) - 0.45, 1.02, "L: the memory limit", color="#b2182b", ha="right", va="bottom", fontsize=8)
    ax.set_xticks(range(len(WORKLOADS)), [WORKLOAD_LABELS[w] for w in WORKLOADS])
    ax.set_ylabel("step speed, as a fraction of L")
    ax.set_title("Check + unscale + update of one step on the CPU (higher is faster)", fontsize=11)
    drawn = [ratios[(b[0], b[1], w)] for b in bars for w in WORKLOADS if (b[0], b[1], w) in ratios]
    ax.set_ylim(0, max(1.15, max(drawn) * 1.1))
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.1), frameon=False)
    fig.tight_layout()
    fig.savefig(out, metadata={"Software": None})
    plt.close(fig)
    return [bar[2] for bar in bars]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=pathlib.Path, help="the JSON a run of benchmarks/run.py --json wrote")
    parser.add_argument("out", type=pathlib.Path, help="the PNG to write (docs/img/benchmarks.png for the page)")
    args = parser.parse_args(argv)
    try:
        rows = json.loads(args.run.read_text())
    except (OSError, ValueError) as exc:
        parser.error(f"cannot read the run {str(args.run)!r}: {exc}")
    try:
        drawn = draw(rows, args.out)
    except ValueError as exc:
        print(f"chart.py: {exc}", file=sys.stderr)
        return 1
    print(f"{args.out}: {len(drawn)} bars per workload at most ({', '.join(drawn)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
