"""train.tensorboard: the step records of metrics.jsonl, also as TensorBoard scalars (rank 0 only).

`<out_dir>/tensorboard/` gets one event file per launch (torch.utils.tensorboard's SummaryWriter, the
`tensorboard` package's format); `tensorboard --logdir runs/NAME` shows `train/loss`, `train/lr`,
`train/grad_norm`, `train/tokens_per_s`, `train/ms_per_step`, `val/loss` (and `val/bits_per_byte` where a
record has it) against the step. A launch that
resumes at step N tells TensorBoard to drop the earlier launches' events from step N + 1 on (`purge_step`),
as metrics.jsonl's readers keep the last record of a redone step. `tensorboard` is an optional extra
(`pip install megalite[tensorboard]`): when the key is on and it is missing, the run stops at start-up, in one
line, before anything is written.

`<out_dir>/tensorboard` is checked like metrics.jsonl (`check_path`, at start-up before anything is
written): a folder of the run folder, or nothing yet; a symlink there (events would be written wherever it
points), a file or a FIFO is refused in one line.
"""
from __future__ import annotations

from pathlib import Path

from ..base.fs import folder_or_absent
from ..base.errors import ConfigError

DIR = "tensorboard"
SCALARS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
           "tokens_per_s": "train/tokens_per_s", "ms_per_step": "train/ms_per_step", "val_loss": "val/loss",
           "val_bpb": "val/bits_per_byte"}


def scalars(rec: dict) -> list[tuple[str, float]]:
    """(tag, value) of a step record's scalars: SCALARS' keys, and each data.eval set's eval/NAME/loss and /bpb."""
    return [(tag, rec[key]) for key, tag in SCALARS.items() if key in rec] + \
        [(key, v) for key, v in rec.items() if key.startswith("eval/")]


def require() -> None:
    """Raise ConfigError (one line) unless the tensorboard package and torch's writer for it import."""
    import importlib
    try:
        importlib.import_module("tensorboard")  # the package itself, which torch.utils.tensorboard needs
        importlib.import_module("torch.utils.tensorboard")
    except ImportError as e:
        raise ConfigError(f"train.tensorboard = true needs the `tensorboard` package, which is not importable "
                          f"({e}): `pip install tensorboard` (or megalite[tensorboard]), or set "
                          f"--train.tensorboard=false") from None


def check_path(out_dir: Path, name: str = DIR, what: str = "TensorBoard") -> None:
    """An UnsafeFileError unless <out_dir>/<name> (tensorboard, or W&B's wandb) is a real folder of the run folder
    or absent (a symlink is never followed: SummaryWriter or W&B would write their files through it)."""
    folder_or_absent(Path(out_dir) / name, "train.out_dir", f"the run's own {what} folder (a real folder)")


class Board:
    """Writes each step record's numbers as scalars at its step."""

    def __init__(self, out_dir: Path, resumed_step: int):
        require()
        check_path(out_dir)
        from torch.utils.tensorboard import SummaryWriter
        self.path = Path(out_dir) / DIR
        self.writer = SummaryWriter(str(self.path), purge_step=resumed_step + 1 if resumed_step else None)

    def write(self, rec: dict) -> None:
        for tag, value in scalars(rec):
            self.writer.add_scalar(tag, value, rec["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
