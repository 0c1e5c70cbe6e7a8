"""Rank-coded sharded checkpoints: every (tp, pp, dp[, cp]) coordinate saves its own slice; one manifest describes all.

    api.py         save_checkpoint / load_checkpoint (the public calls)

  what a shard is (the format)
    tree.py        the folder tree: coordinate <-> folder, step folders, `latest` (and `publish`: latest, then prune)
    manifest.py    the global description (names, shapes, partitions, slices, checksums) and a step's meta
    tiling.py      the check that a tensor's slices cover it exactly
    plan.py        the write plan (who writes which slice) and a rank's payload
    state.py       state.json (StepState) and the RNG states it carries
    optimizer.py   the optimizer section: megalite's AdamW and any torch.optim optimizer behind one interface

  how bytes move (the save)
    stream.py      safetensors streamed from and into tensor memory, with block CRC32Cs
    commit.py      the commit protocol (a coordinate's folder written, gather, commit_step, recover)
    async_save.py  AsyncSaver: the snapshot in the loop, the writes and the commit in a thread

  reading back, every byte checked
    validate.py    the validation home: every check of a step's file (sizes, checksums, headers, keys, no links)
    read.py        reads any region of a global tensor from whichever slices hold it, every block checked
    load.py        checks and loads into a model/optimizer at any layout
    verify.py      the `verify` command (every check of validate.py, without loading; `recover`'s `complete`),
                   `inspect` and `inspect --tree`

This package imports nothing of the training loop (megalite/run/); its policy is megalite/run/ckpt_policy.py.
Its files go through megalite/base/fs.py, the house's one file-safety owner. The names below are imported on
first use (_EXPORTS), so importing one light module does not load torch.
"""
_EXPORTS = {
    "CheckpointError": "megalite.base.errors",
    "save_checkpoint": "megalite.checkpoint.api",
    "load_checkpoint": "megalite.checkpoint.api",
    "global_named": "megalite.checkpoint.api",
    "AsyncSaver": "megalite.checkpoint.async_save",
    "Loaded": "megalite.checkpoint.load",
    "resolve": "megalite.checkpoint.tree",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'megalite.checkpoint' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
