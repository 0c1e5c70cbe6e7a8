"""`megalite plot RUN_DIR... --out loss.png`: train/val loss curves of one or more runs on one chart."""
from __future__ import annotations

from pathlib import Path

from . import metrics
from .config import ConfigError


def read_metrics(run_dir) -> list[dict]:
    try:
        return metrics.read(run_dir)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"plot: {e}") from None
    except metrics.MetricsError as e:
        raise ConfigError(f"plot: {e}") from None


def plot(run_dirs, out, title: str = "megalite loss") -> Path:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("plot: needs matplotlib (pip install 'megalite[plot]')") from None
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, run in enumerate(run_dirs):
        rows = read_metrics(run)
        color = f"C{i % 10}"
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], color=color, label=f"{run} train")
        val = [r for r in rows if "val_loss" in r]
        if val:
            ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o--", color=color,
                    label=f"{run} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return out
