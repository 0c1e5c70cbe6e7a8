"""`megalite <command>`: thin argument parsing over importable functions.

Bad input exits with code 2 and one line on stderr (`megalite <cmd>: error: ...`), never a traceback.
"""
from __future__ import annotations

import argparse
import os
import sys

from . import __version__

EPILOGS = {
    "train": "example:\n  torchrun --nproc-per-node 8 -m megalite train --config configs/tiny-cpu.toml "
             "--parallel.tp=2 --parallel.pp=2 --parallel.dp=2",
    "prepare": "example:\n  megalite prepare ~/books/ notes.txt --out data/mine.bin",
    "inspect": "example:\n  megalite inspect runs/demo/checkpoints",
    "verify": "example:\n  megalite verify runs/demo/checkpoints/step_00000060",
}

# The errors a user can fix; anything else is a bug and keeps its traceback.
USER_ERRORS: tuple = ()


def _user_errors() -> tuple:
    global USER_ERRORS
    if not USER_ERRORS:
        from .config import ConfigError
        from .data import DataError
        USER_ERRORS = (ConfigError, DataError, FileNotFoundError, FileExistsError, PermissionError)
        try:
            from .checkpoint import CheckpointError
            USER_ERRORS += (CheckpointError,)
        except ImportError:
            pass
    return USER_ERRORS


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _cmd_train(args, rest) -> int:
    from .config import load_config
    from .train import train
    cfg = load_config(args.config, rest)
    try:
        train(cfg)
    finally:
        _shutdown_distributed()
    return 0


def _shutdown_distributed() -> None:
    """Leave the job together: a rank that exits while peers still talk to it can abort them."""
    import torch.distributed as dist
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def _cmd_prepare(args, rest) -> int:
    from .data import default_corpus_files, prepare
    sources = args.sources or default_corpus_files()
    prepare(sources, args.out, val_fraction=args.val_fraction, log=(lambda *a: None) if args.quiet else print)
    return 0


def _cmd_inspect(args, rest) -> int:
    from .checkpoint.verify import inspect
    print(inspect(args.ckpt))
    return 0


def _cmd_verify(args, rest) -> int:
    from .checkpoint.verify import verify
    step, problems = verify(args.ckpt)
    for p in problems:
        print(p)
    if problems:
        print(f"verify: {len(problems)} problem(s) in {step}", file=sys.stderr)
        return 1
    print(f"verify: {step} is complete and intact")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="megalite", description="A small Megatron-style 3D-parallel GPT trainer.")
    ap.add_argument("--version", action="version", version=f"megalite {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def add(name, help_, fn):
        p = sub.add_parser(name, help=help_, description=help_, epilog=EPILOGS.get(name),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(fn=fn)
        return p

    p = add("train", "train a GPT (under torchrun, or alone for one process); any config field can be "
                     "overridden as --section.key=value", _cmd_train)
    p.add_argument("--config", help="TOML config file (configs/tiny-cpu.toml)")
    p.set_defaults(allow_rest=True)

    p = add("prepare", "turn text files or folders into a uint16 token file (+ .json) with a val split", _cmd_prepare)
    p.add_argument("sources", nargs="*", help="files or folders (default: the Python standard library's sources)")
    p.add_argument("--out", required=True, help="output .bin path")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--quiet", action="store_true")

    p = add("inspect", "describe a checkpoint: step, layout, tensors and bytes per coordinate", _cmd_inspect)
    p.add_argument("ckpt", help="a step folder, or a checkpoint root (the step `latest` names)")

    p = add("verify", "check every file's size and checksum, every coordinate, and that slices tile each "
                      "tensor; one line per problem, exit 1 if any", _cmd_verify)
    p.add_argument("ckpt", help="a step folder, or a checkpoint root (the step `latest` names)")
    return ap


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = build_parser()
    args, rest = ap.parse_known_args(argv)
    if args.command is None:
        ap.print_help()
        return 2
    if rest and not getattr(args, "allow_rest", False):
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if rest:  # only --section.key=value overrides may pass through
        bad = [r for r in rest if not (r.startswith("--") and "." in r.split("=")[0])]
        if bad:
            ap.error(f"{args.command}: unrecognized argument '{bad[0]}' (config overrides look like "
                     f"--section.key=value)")
    try:
        return args.fn(args, rest)
    except _user_errors() as e:
        rank = int(os.environ.get("RANK", "0"))
        if rank == 0 or not isinstance(e, _user_errors()[:1]):
            print(f"megalite {args.command}: error: {e}", file=sys.stderr)
        return 2
