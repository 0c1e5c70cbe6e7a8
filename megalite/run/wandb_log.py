"""train.wandb: the step records of metrics.jsonl, also as a Weights & Biases run (rank 0 only).

The same scalars as TensorBoard (`train/loss`, `train/lr`, `train/grad_norm`, `train/tokens_per_s`,
`train/ms_per_step`, `val/loss`, `val/bits_per_byte`) at the step, and the resolved config as the run's
config. Each launch is one W&B run named after `train.out_dir` and grouped by it, so a resumed run's launches
sit together; its files go to `<out_dir>/wandb/`, and so do W&B's cache (its debug logs), data and artifact
folders (PLACES, unless you set them): nothing is written outside the run's folder. The project is
`train.wandb_project`; W&B's own variables apply (WANDB_MODE=offline keeps the run on disk for `wandb sync`,
WANDB_ENTITY, WANDB_API_KEY). `wandb` is an
optional extra (`pip install megalite[wandb]`): when the key is on and it is missing, or W&B cannot start a
run (no login), the run stops at start-up in one line, before anything is written; W&B never prompts.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..base.errors import ConfigError
from .tensorboard_log import SCALARS


def require(cfg) -> None:
    """Raise ConfigError (one line) unless the wandb package imports and, outside offline mode, W&B has a
    login (checked without a prompt and without writing anything)."""
    try:
        import wandb
    except ImportError as e:
        raise ConfigError(f"train.wandb = true needs the `wandb` package, which is not importable ({e}): "
                          f"`pip install wandb` (or megalite[wandb]), or set --train.wandb=false") from None
    if os.environ.get("WANDB_MODE", "") in ("offline", "disabled", "dryrun"):
        return
    try:
        ok = wandb.login(prompt=False, verify=False)
    except wandb.errors.Error:
        ok = False
    if not ok:
        raise ConfigError(f"train.wandb = true but W&B has no login: run `wandb login`, or set WANDB_MODE=offline "
                          f"to keep the run in {Path(cfg.train.out_dir) / 'wandb'} and `wandb sync` it later")


class WandbRun:
    """Logs each step record's numbers at its step; `close` finishes the run."""

    def __init__(self, cfg, resumed_step: int):
        require(cfg)
        import wandb
        out = Path(cfg.train.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.saved_env = inside(out / "wandb")
        try:
            self.run = wandb.init(project=cfg.train.wandb_project, name=out.name, group=out.name, dir=str(out),
                                  config={**cfg.to_dict(), "resumed_from_step": resumed_step},
                                  settings=wandb.Settings(console="off", quiet=True, silent=True))
        except (wandb.errors.Error, OSError) as e:
            restore(self.saved_env)
            msg = " ".join(str(e).split()) or type(e).__name__
            raise ConfigError(f"train.wandb: W&B could not start a run ({msg}): run `wandb login`, or set "
                              f"WANDB_MODE=offline to keep it in {out / 'wandb'} and `wandb sync` it later") from None

    def write(self, rec: dict) -> None:
        self.run.log({tag: rec[key] for key, tag in SCALARS.items() if key in rec}, step=rec["step"])

    def close(self) -> None:
        import wandb
        self.run.finish()
        wandb.teardown()  # stops W&B's service process, which writes the run's file: complete once this returns
        restore(self.saved_env)


# W&B's folders outside its run folder (wandb/env.py): the cache (where wandb-core and its system monitor write
# their debug logs, ~/.cache/wandb/logs), the data staging area (~/.local/share/wandb) and artifact downloads
# (./artifacts). Each is put inside the run's folder for the run's life, unless the user set it; the config
# folder (the login, ~/.config/wandb) is only read, and stays the user's.
PLACES = {"WANDB_CACHE_DIR": "cache", "WANDB_DATA_DIR": "data", "WANDB_ARTIFACT_DIR": "artifacts"}


def inside(folder: Path) -> dict:
    """Point W&B's folders into `folder` (those the user left unset); the environment as it was, for restore."""
    saved = {k: os.environ.get(k) for k in PLACES}
    for k, sub in PLACES.items():
        if not os.environ.get(k):
            os.environ[k] = str(folder / sub)
    return saved


def restore(saved: dict) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
