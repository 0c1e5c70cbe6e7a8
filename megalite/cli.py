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
    "inspect": "examples:\n  megalite inspect runs/demo/checkpoints\n  megalite inspect runs/demo/checkpoints --tree",
    "plot": "example:\n  megalite plot runs/demo runs/resumed --out loss.png",
    "verify": "example:\n  megalite verify runs/demo/checkpoints/step_00000060",
    "convert": "examples:\n  megalite convert runs/demo/checkpoints --out model.safetensors\n"
               "  megalite convert runs/demo/checkpoints --format hf-gpt2 --out gpt2-demo/",
    "split": "example:\n  megalite split model.safetensors --tp 2 --pp 2 --dp 1 --out ckpt-222/",
    "reshard": "example:\n  megalite reshard runs/demo/checkpoints --tp 1 --pp 4 --dp 2 --out ckpt-142/",
    "bench": "examples:\n  megalite bench ckpt --size-mb 1024 --world 4\n  megalite bench train --steps 10 --nproc 4\n"
             "  megalite bench plan --tp 8 --pp 16 --dp 8,32,128 --reshard-to 8,8,256   (GPT-3 175B shape)",
    "stress": "example:\n  megalite stress ckpt --trials 10",
    "generate": "example:\n  megalite generate --model model.safetensors --prompt 'def ' --max-new-tokens 100",
}

def _user_errors() -> tuple:
    """The errors a user can fix (one line, exit 2); anything else is a bug and keeps its traceback."""
    from .checkpoint import CheckpointError
    from .config import ConfigError
    from .data import DataError
    return (ConfigError, DataError, CheckpointError, FileNotFoundError, FileExistsError, PermissionError)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _cmd_train(args, rest) -> int:
    from .config import load_config
    from .train import train
    cfg = load_config(args.config, rest)
    train(cfg)  # on an error, exit at once: a barrier could wait the whole timeout on a peer that is gone
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
    from .checkpoint.verify import inspect, tree
    print(tree(args.ckpt) if args.tree else inspect(args.ckpt))
    return 0


def _cmd_plot(args, rest) -> int:
    from .plot import plot
    print(f"plot: wrote {plot(args.runs, args.out)}")
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


def _cmd_convert(args, rest) -> int:
    from .convert import convert
    out = convert(args.ckpt, args.out, dtype=args.dtype, fmt=args.format, force=args.force, quiet=args.quiet)
    if not args.quiet:
        print(f"convert: wrote {out}")
    return 0


def _cmd_split(args, rest) -> int:
    from .convert import split
    out = split(args.model, args.out, args.tp, args.pp, args.dp, zero1=args.zero1 == "on", step=args.step,
                force=args.force, quiet=args.quiet)
    if not args.quiet:
        print(f"split: wrote {out}")
    return 0


def _cmd_reshard(args, rest) -> int:
    from .convert import reshard
    zero1 = None if args.zero1 is None else args.zero1 == "on"
    out = reshard(args.ckpt, args.out, args.tp, args.pp, args.dp, zero1=zero1, force=args.force, quiet=args.quiet)
    if not args.quiet:
        print(f"reshard: wrote {out}")
    return 0


def _cmd_generate(args, rest) -> int:
    from .generate import sample_text
    print(sample_text(args.model, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      top_k=args.top_k, seed=args.seed))
    return 0


def _cmd_stress(args, rest) -> int:
    from .faults import stress_ckpt
    r = stress_ckpt(trials=args.trials, steps=args.steps, width=args.width, workdir=args.workdir, seed=args.seed)
    return 0 if r["valid_latest"] == r["trials"] == r["resumed_exactly"] else 1


def _cmd_bench(args, rest) -> int:
    if args.what == "ckpt":
        from .bench.ckpt import bench_ckpt
        bench_ckpt(size_mb=args.size_mb, world=args.world, repeats=args.repeats, dir=args.dir)
    elif args.what == "plan":
        from .bench.plan import bench_plan_cli
        bench_plan_cli(args)
    else:
        from .bench.train import bench_train
        bench_train(steps=args.steps, nproc=args.nproc, n_embd=args.n_embd or 128, n_layer=args.n_layer or 4,
                    block_size=args.block_size or 128, rounds=args.rounds)
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
    p.add_argument("--tree", action="store_true", help="draw the rank-coded tree as the (tp, pp, dp) grid")

    p = add("plot", "train/val loss curves of one or more runs on one chart (needs matplotlib)", _cmd_plot)
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="runs' out_dir folders (with metrics.jsonl)")
    p.add_argument("--out", default="loss.png")

    p = add("convert", "reassemble a checkpoint of any layout into one safetensors file (or an HF GPT-2 "
                       "folder with --format hf-gpt2), one tensor at a time", _cmd_convert)
    p.add_argument("ckpt", help="a step folder, or a checkpoint root (the step `latest` names)")
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="fp32", help="fp32 | bf16 | fp16")
    p.add_argument("--format", default="megalite", help="megalite (one .safetensors) | hf-gpt2 (a folder)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--quiet", action="store_true")

    p = add("split", "cut one model file (megalite or HF GPT-2 folder) into a checkpoint at a layout "
                     "(fresh optimizer state)", _cmd_split)
    p.add_argument("model")
    _layout_flags(p)
    p.add_argument("--zero1", choices=["on", "off"], default="off")
    p.add_argument("--step", type=int, default=0, help="the step the checkpoint says it is at")

    p = add("reshard", "move a full training checkpoint (model, optimizer, step, data position) to a new "
                       "layout", _cmd_reshard)
    p.add_argument("ckpt")
    _layout_flags(p)
    p.add_argument("--zero1", choices=["on", "off"], default=None, help="default: as in the source")

    p = add("generate", "sample text from a single-file model in one plain process", _cmd_generate)
    p.add_argument("--model", required=True, help="a `megalite convert` file or an HF GPT-2 folder")
    p.add_argument("--prompt", default="\n")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)

    p = add("stress", "fault injection: `stress ckpt` kills a random rank mid-save, N times, and checks that "
                      "latest stays valid and resumes exactly", _cmd_stress)
    p.add_argument("what", choices=["ckpt"])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--width", type=int, default=64, help="model n_embd (bigger: longer saves)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--seed", type=int, default=0)

    p = add("bench", "benchmarks: `bench ckpt` (saves/loads vs DCP, torch.save and the disk), `bench train` "
                     "(vs plain PyTorch, pipeline bubbles, layouts), `bench plan` (checkpoint write plan and "
                     "manifest at thousands of ranks, no tensors)", _cmd_bench)
    p.add_argument("what", choices=["ckpt", "train", "plan"])
    p.add_argument("--size-mb", type=float, default=1024, help="ckpt: model + optimizer bytes over all ranks")
    p.add_argument("--world", type=int, default=4, help="ckpt: gloo processes")
    p.add_argument("--repeats", type=int, default=3, help="ckpt: repetitions of each measurement")
    p.add_argument("--dir", default=None, help="ckpt: folder to write in (default: the temp folder)")
    p.add_argument("--steps", type=int, default=10, help="train: timed steps per measurement")
    p.add_argument("--nproc", type=int, default=4, help="train: processes for the layout table")
    p.add_argument("--n-embd", type=int, default=None, help="model width (train: 128, plan: 12288)")
    p.add_argument("--n-layer", type=int, default=None, help="model depth (train: 4, plan: 96)")
    p.add_argument("--block-size", type=int, default=None, help="sequence length (train: 128, plan: 2048)")
    p.add_argument("--n-head", type=int, default=96, help="plan: attention heads")
    p.add_argument("--vocab-size", type=int, default=50304, help="plan: vocabulary")
    p.add_argument("--tp", type=int, default=8, help="plan: tensor-parallel size")
    p.add_argument("--pp", type=int, default=16, help="plan: pipeline stages")
    p.add_argument("--dp", default="8,32,128", help="plan: data-parallel sizes, comma-separated (one line each)")
    p.add_argument("--vpp", type=int, default=1, help="plan: virtual (interleaved) stages per pipeline rank")
    p.add_argument("--zero1", action="store_true", help="plan: ZeRO-1 optimizer-state shards")
    p.add_argument("--reshard-to", default=None, metavar="TP,PP,DP",
                   help="plan: what each rank of this layout reads to resume the last layout's checkpoint")
    p.add_argument("--rounds", type=int, default=2, help="train: alternating runs of megalite and plain PyTorch")

    p = add("verify", "check every file's size and checksum, every coordinate, and that slices tile each "
                      "tensor; one line per problem, exit 1 if any", _cmd_verify)
    p.add_argument("ckpt", help="a step folder, or a checkpoint root (the step `latest` names)")
    return ap


def _layout_flags(p) -> None:
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--dp", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--quiet", action="store_true")


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
        from .config import ConfigError
        # A config error is the same on every rank: say it once. Others may differ per rank (a shard).
        if int(os.environ.get("RANK", "0")) == 0 or not isinstance(e, ConfigError):
            print(f"megalite {args.command}: error: {e}", file=sys.stderr)
        return 2
