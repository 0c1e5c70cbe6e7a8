"""Which files of megalite/ one operation walks through, measured as it runs (a sys.setprofile tracer):

    python -m benchmarks walk save --config configs/tiny-cpu.toml --train.steps=2 --checkpoint.interval=2 \
        --train.out_dir=/tmp/w --checkpoint.dir=/tmp/w/ckpt       # `megalite train ARGS`; its first save traced
    python -m benchmarks walk convert DCP_FOLDER --out /tmp/m.safetensors    # `megalite convert ARGS`, all of it

`save` traces the first `CheckpointManager.save` of the run (the training loop's save, to `latest`); `convert`
traces `cli.main` from start to end. Printed (stderr): the files entered and, per file, how many times control
entered it from another file. Not counted: module bodies (an import is not the walk) and a generator resumed
(only its first entry counts). With --order, every cross-file call in order: `caller -> callee:function`.
"""
from __future__ import annotations

import argparse
import collections
import inspect
import os
import sys
from dataclasses import dataclass, field

import megalite

PKG = os.path.dirname(megalite.__file__)
_GENERATORS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def _rel(filename: str):
    """The path under megalite/ of a code object's file, or None outside the package."""
    return os.path.relpath(filename, PKG) if filename.startswith(PKG + os.sep) else None


@dataclass
class Walk:
    """What one traced call entered: per file, the times control came in from another file; the calls in order."""
    entries: collections.Counter = field(default_factory=collections.Counter)
    calls: list = field(default_factory=list)  # (caller file or None, callee file, function)

    @property
    def files(self) -> list[str]:
        return sorted(self.entries)

    def report(self, label: str, order: bool = False) -> str:
        lines = [f"== {label}: {len(self.entries)} files, {sum(self.entries.values())} entries"]
        lines += [f"  {n:5d} {f}" for f, n in sorted(self.entries.items(), key=lambda kv: (-kv[1], kv[0]))]
        if order:
            lines += [f"     {src} -> {dst}:{fn}" for src, dst, fn in self.calls]
        return "\n".join(lines)


def traced(fn, *args, **kwargs):
    """(fn(*args, **kwargs), its Walk). The profile hook is this thread's only (a thread fn starts is not traced)."""
    walk, resumed = Walk(), {}

    def hook(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        dst = _rel(code.co_filename)
        if dst is None or code.co_name == "<module>":
            return
        if code.co_flags & _GENERATORS:  # a generator's frame is entered again at each next(): count it once
            if id(frame) in resumed:
                return
            resumed[id(frame)] = frame  # held, so that its id is not reused while tracing
        up = frame.f_back
        while up is not None and _rel(up.f_code.co_filename) is None:
            up = up.f_back
        src = _rel(up.f_code.co_filename) if up is not None else None
        if src != dst:
            walk.entries[dst] += 1
            walk.calls.append((src, dst, code.co_name))

    sys.setprofile(hook)
    try:
        result = fn(*args, **kwargs)
    finally:
        sys.setprofile(None)
    return result, walk


def walk_save(train_args: list[str]) -> Walk:
    """`megalite train TRAIN_ARGS` with its first checkpoint save traced; that save's Walk."""
    from megalite.cli import main
    from megalite.run.ckpt_policy import CheckpointManager
    real, got = CheckpointManager.save, []

    def save(self, *a, **k):
        if got:
            return real(self, *a, **k)
        result, walk = traced(real, self, *a, **k)
        got.append(walk)
        return result

    CheckpointManager.save = save
    try:
        rc = main(["train", *train_args])
    finally:
        CheckpointManager.save = real
    if rc or not got:
        raise SystemExit(f"walk save: `megalite train` returned {rc} after {len(got)} save(s)")
    return got[0]


def walk_cli(argv: list[str]) -> tuple[int, Walk]:
    """`megalite ARGV` traced from cli.main: (its exit code, its Walk)."""
    from megalite.cli import main
    return traced(main, argv)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks walk", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("what", choices=["save", "convert"], help="the training loop's first save, or one convert")
    ap.add_argument("--order", action="store_true", help="also print every cross-file call, in order")
    args, rest = ap.parse_known_args(argv)
    if args.what == "save":
        walk, rc = walk_save(rest), 0
        label = "save from the training loop (megalite train " + " ".join(rest) + ")"
    else:
        rc, walk = walk_cli(["convert", *rest])
        label = "megalite convert " + " ".join(rest) + " from cli.main"
    print(walk.report(label, args.order), file=sys.stderr)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
