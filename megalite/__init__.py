"""megalite: a small, readable, Megatron-style 3D-parallel GPT trainer with rank-coded sharded checkpoints.

The Python API for your own model and optimizer (README, "Bring your own model"), importable from here:

    init_distributed()                     join the torchrun job (or make a world of one)
    leave_distributed(error=None)          leave it before exit: every process group destroyed, threads joined
    Layout(tp, pp, dp, cp), ParallelGrid   the layout and this rank's place in it: ParallelGrid.create(layout)
    shard(param, dim, grid.tp)             split one parameter over tp (untagged parameters are replicated)
    save_checkpoint(...), load_checkpoint(...), CheckpointError

Each name lives in its own module (listed in _EXPORTS) and is imported on first use, so `import megalite`
stays cheap and import order never matters.
"""
__version__ = "0.1.0"

_EXPORTS = {
    "init_distributed": "megalite.parallel.process_group",
    "leave_distributed": "megalite.parallel.process_group",
    "Layout": "megalite.parallel.grid",
    "ParallelGrid": "megalite.parallel.grid",
    "shard": "megalite.parallel.partition",
    "save_checkpoint": "megalite.checkpoint",
    "load_checkpoint": "megalite.checkpoint",
    "CheckpointError": "megalite.checkpoint",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'megalite' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
