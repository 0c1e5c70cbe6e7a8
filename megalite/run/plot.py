"""`megalite plot RUN_DIR... --out loss.png`: train/val loss curves of one or more runs on one chart."""
from __future__ import annotations

from pathlib import Path

from . import metrics
from ..config import ConfigError


def read_metrics(run_dir) -> list[dict]:
    try:
        return metrics.read(run_dir)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"plot: {e}") from None
    except metrics.MetricsError as e:
        raise ConfigError(f"plot: {e}") from None


def plot(run_dirs, out, title: str = "megalite loss") -> Path:
    """Loss (train, and val where evaluated) over steps above, the learning rate below; a dotted vertical
    line where a launch resumed, labelled with its layout (a layout change shows as a new label)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("plot: needs matplotlib (pip install 'megalite[plot]')") from None
    runs = [(run, read_metrics(run), _events(run)) for run in run_dirs]
    fig, (ax, ax_lr) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for i, (run, rows, events) in enumerate(runs):
        color = f"C{i % 10}"
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], color=color, label=f"{run} train")
        val = [r for r in rows if "val_loss" in r]
        if val:
            ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o--", color=color,
                    label=f"{run} val")
        lr = [r for r in rows if "lr" in r]
        if lr:
            ax_lr.plot([r["step"] for r in lr], [r["lr"] for r in lr], color=color)
        for e in events:
            for a in (ax, ax_lr):
                a.axvline(e["step"], color=color, linestyle=":", alpha=0.8)
            ax.annotate(f"resumed\n{e.get('layout', '')}", (e["step"], 1), xycoords=("data", "axes fraction"),
                        xytext=(3, -3), textcoords="offset points", va="top", fontsize=8, color=color)
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    ax_lr.set_xlabel("step")
    ax_lr.set_ylabel("learning rate")
    ax_lr.grid(alpha=0.3)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return out


def _events(run_dir) -> list[dict]:
    try:
        return metrics.events(run_dir)
    except metrics.MetricsError as e:
        raise ConfigError(f"plot: {e}") from None
