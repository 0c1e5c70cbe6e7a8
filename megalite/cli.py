"""`megalite <command>`: thin argument parsing over importable functions.

The error contract: a user error (bad input, a checkpoint or data problem, an OS error such as a read-only
or full disk) exits with code 2 and one line on stderr (`megalite <cmd>: error: ...`), never a traceback.
Under torchrun every rank exits 2 and only rank 0 prints an error that all ranks share (the others print
only an error of their own). MEGALITE_DEBUG=1 prints the traceback as well; a training run that got as
far as its first step also appends it to <train.out_dir>/errors.log. Anything else is a bug and keeps its
traceback.
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import traceback

from . import __version__, models
from .base.errors import USER_ERRORS, is_shared, one_line

EPILOGS = {
    "train": "example:\n  torchrun --nproc-per-node 8 -m megalite train --config configs/tiny-cpu.toml "
             "--parallel.tp=2 --parallel.pp=2    # dp = 8 / (tp * pp) = 2",
    "config": "examples:\n  megalite config show --config configs/tiny-cpu.toml --parallel.tp=2\n"
              "  megalite config show > my.toml   # every field with its default, ready to edit",
    "prepare": "examples:\n  megalite prepare ~/books/ notes.txt --out data/mine.bin                # byte tokens\n"
               "  megalite prepare ~/books/ --tokenizer data/bpe-4k --out data/mine-bpe.bin   # a BPE folder\n"
               "  megalite prepare ~/books/ --tokenizer gpt2/ --out data/gpt2.bin   # GPT-2's vocab.json + merges.txt\n"
               "  megalite prepare fineweb/sample/ --tokenizer gpt2/ --out data/fw.bin   # its *.parquet, column text\n"
               "  megalite prepare dump.jsonl --text-field content --out data/dump.bin   # one document per line",
    "tokenizer": "examples:\n  megalite tokenizer train ~/books/ notes.txt --vocab-size 8192 --out data/bpe-8k\n"
                 "  megalite tokenizer train --vocab-size 4096 --out data/bpe-4k   # on the default corpus",
    "inspect": "examples:\n  megalite inspect runs/demo/checkpoints\n  megalite inspect runs/demo/checkpoints --tree\n"
               "  megalite inspect my-llama/ > my.toml   # a transformers folder's [model] section, to paste",
    "plot": "example:\n  megalite plot runs/demo runs/resumed --out loss.png",
    "verify": "examples:\n  megalite verify runs/demo/checkpoints                  # the step `latest` names\n"
              "  megalite verify runs/demo/checkpoints/step_00000150",
    "convert": "examples:\n  megalite convert runs/demo/checkpoints --out runs/demo/model.safetensors\n"
               "  megalite convert runs/demo/checkpoints --format hf-gpt2 --out runs/demo/hf/\n"
               "  megalite convert megatron/ckpts --vocab-size 50257 --format hf-gpt2 --out hf/   (Megatron-LM)\n"
               "  megalite convert dcp_ckpt/step-100 --out step-100.safetensors   (PyTorch DCP, e.g. torchtitan)\n"
               "  megalite convert step-100 --from dcp --arch llama --config config.json --out llama.safetensors"
               "   (torchtitan's Llama 3)\n"
               "  megalite convert runs/demo/checkpoints --format dcp --out runs/demo/dcp/",
    "split": "example:\n  megalite split runs/demo/model.safetensors --tp 2 --pp 2 --dp 1 --out runs/split-221/",
    "reshard": "example:\n  megalite reshard runs/demo/checkpoints --tp 1 --pp 4 --dp 2 --out runs/reshard-142/",
    "bench": "examples:\n  megalite bench ckpt --size-mb 1024 --world 4\n  megalite bench ckpt --sizes 128,512,1024\n"
             "  megalite bench train --steps 10 --nproc 4\n"
             "  megalite bench plan --tp 8 --pp 16 --dp 8,32,128 --reshard-to 8,8,256   (GPT-3 175B shape)\n"
             "  megalite bench dcp --size-mb 300\n"
             "  megalite bench prepare --size-mb 64 --rounds 3\n  megalite bench blend --block-size 1024\n"
             "  megalite bench documents --steps 5 --rounds 3   (document masks vs windows, same tokens a step)\n"
             "  megalite bench generate --new-tokens 64 --rounds 3   (a 135M-class Llama on this CPU)",
    "torchrun": "example:\n  megalite torchrun --standalone --nproc-per-node 8 -m megalite train --config configs/tiny-cpu.toml "
                "--parallel.tp=2 --parallel.pp=2 --parallel.dp=2",
    "generate": "examples:\n"
                "  megalite generate --model runs/demo/model.safetensors --prompt 'def ' --max-new-tokens 60\n"
                "  megalite generate --model runs/demo/checkpoints --prompt 'def ' --temperature 0   # greedy\n"
                "  megalite generate --model runs/demo/hf/ --prompt 'The ' --ignore-eot\n"
                "  megalite generate --model SmolLM2-135M-Instruct/ --chat --system 'Be brief.' --prompt 'Hi!' "
                "--top-p 0.9",
    "eval": "examples:\n  megalite eval --model runs/demo/model.safetensors --data held-out.jsonl\n"
            "  megalite eval --model gpt2/ --data wiki.txt --per-document --out per-doc.jsonl\n"
            "  megalite torchrun --nproc-per-node 2 -m megalite eval --model runs/demo/checkpoints --data val.bin "
            "--split val --parallel.tp=2",
}

def _report(command: str, e: BaseException) -> None:
    """One line on stderr (rank 0 only for an error every rank shares); the traceback too with MEGALITE_DEBUG=1."""
    if int(os.environ.get("RANK", "0")) != 0 and is_shared(e):
        return
    if os.environ.get("MEGALITE_DEBUG", "") not in ("", "0"):
        traceback.print_exception(e)
    print(f"megalite {command}: error: {one_line(e)}", file=sys.stderr, flush=True)


class _Parser(argparse.ArgumentParser):
    more_help = None  # a callable giving text to add after the epilog, run only when the help is printed

    def error(self, message):  # argparse's own errors: one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")

    def format_help(self) -> str:
        text = super().format_help()
        return text if self.more_help is None else f"{text}\n{self.more_help()}\n"


def _cmd_train(args, rest) -> int:
    from .config import ConfigError, load_config
    from .parallel.process_group import world_size_from_env
    from .run.train import refuse_start, train
    try:
        cfg = load_config(args.config, rest)
    except ConfigError as e:
        if world_size_from_env() == 1:
            raise
        refuse_start(e)  # this rank's config file may not be the others': said once every rank has joined
    train(cfg, log=functools.partial(print, flush=True), force=args.force)  # joins and leaves the job itself
    return 0


def _cmd_config(args, rest) -> int:
    from .config import load_config, resolve, to_toml, validate
    from .run.init_from import adopt
    world = int(os.environ.get("WORLD_SIZE", "0")) or None
    cfg = load_config(args.config, rest)
    adopt(cfg)  # train.init_from: the model's [model] section, as train would take it
    cfg = validate(resolve(cfg, world), world)
    print(to_toml(cfg), end="")
    return 0


def _cmd_prepare(args, rest) -> int:
    from pathlib import Path
    from .data import check_out, default_corpus_files, prepare
    from .tokenizer import progress_on
    check_out(Path(args.out), args.force)  # before the default corpus is even looked for
    if args.chat:
        from .base.errors import DataError
        from .data.chat import prepare_chat
        if not args.sources:
            raise DataError("prepare --chat: name the .jsonl files of conversations to render")
        prepare_chat(args.sources, args.out, args.tokenizer, val_fraction=args.val_fraction, force=args.force,
                     log=(lambda *a: None) if args.quiet else print)
        return 0
    sources = args.sources or default_corpus_files()
    prepare(sources, args.out, val_fraction=args.val_fraction, log=(lambda *a: None) if args.quiet else print,
            tokenizer=args.tokenizer, progress=progress_on(args.quiet), force=args.force, val_split=args.val_split,
            text_field=args.text_field)
    return 0


def _cmd_tokenizer(args, rest) -> int:
    from .data import default_corpus_files, expand_sources
    from .tokenizer import train_folder
    files = expand_sources(args.sources) if args.sources else default_corpus_files()
    out = train_folder(files, args.vocab_size, args.out, force=args.force, quiet=args.quiet,
                       min_frequency=args.min_frequency, pre_tokenizer=args.pre_tokenizer, text_field=args.text_field)
    if not args.quiet:
        print(f"tokenizer: wrote {out}")
    return 0


def _cmd_inspect(args, rest) -> int:
    from .checkpoint.verify import inspect, tree
    from pathlib import Path
    from .convert.sources import detect, model_section
    p = Path(args.ckpt)  # a model file or a transformers folder: its [model]; anything else is read as a checkpoint
    if args.model or not args.tree and (p.is_file() and p.suffix == ".safetensors" or detect(p) == "hf"):
        print(model_section(args.ckpt), end="")
    else:
        print(tree(args.ckpt) if args.tree else inspect(args.ckpt))
    return 0


def _cmd_plot(args, rest) -> int:
    from .run.plot import plot
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
    from .convert.single import parse_size
    told = dict(num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, rope_theta=args.rope_theta,
                norm=args.norm, mlp=args.mlp, norm_eps=args.norm_eps)
    hints = None
    if args.config is not None or any(v is not None for v in told.values()):  # what a foreign checkpoint cannot tell
        from .convert.hints import Hints, merge_config
        hints = Hints(**told) if args.config is None else merge_config(Hints(**told), args.config)
    out = convert(args.ckpt, args.out, dtype=args.dtype, fmt=args.format, force=args.force, quiet=args.quiet,
                  source=args.source, vocab_size=args.vocab_size, arch=args.arch, hints=hints, check=args.check,
                  max_shard_size=parse_size(args.max_shard_size, "--max-shard-size"))
    if not args.quiet:
        print(f"convert: wrote {out}")
    return 0


def _cmd_split(args, rest) -> int:
    from .convert import split
    out = split(args.model, args.out, args.tp, args.pp, args.dp, zero1=args.zero1 == "on", step=args.step,
                force=args.force, quiet=args.quiet, cp=args.cp, check=args.check)
    if not args.quiet:
        print(f"split: wrote {out}")
    return 0


def _cmd_reshard(args, rest) -> int:
    from .convert import reshard
    zero1 = None if args.zero1 is None else args.zero1 == "on"
    out = reshard(args.ckpt, args.out, args.tp, args.pp, args.dp, zero1=zero1, force=args.force, quiet=args.quiet,
                  cp=args.cp)
    if not args.quiet:
        print(f"reshard: wrote {out}")
    return 0


def _cmd_generate(args, rest) -> int:
    from .config import ConfigError
    from .generate import check_sampling, sample_text
    # before the model is read
    check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.seed, args.top_p)
    if args.system is not None and not args.chat:
        raise ConfigError("--system: only with --chat (the system turn of the model's chat template)")
    for flag, text in (("--prompt", args.prompt), ("--system", args.system), *(("--stop", t) for t in args.stop)):
        try:
            (text or "").encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(f"{flag}: not valid UTF-8 text (every tokenizer here reads UTF-8 bytes)") from None
    if "" in args.stop:
        raise ConfigError("--stop '': expected a non-empty text (it would end the sample at once)")
    sample_text(args.model, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, seed=args.seed, as_ids=args.ids, stream=sys.stdout,
                stop_at_eot=not args.ignore_eot, stops=args.stop, chat=args.chat, system=args.system,
                check=args.check)
    print()
    return 0


def _cmd_eval(args, rest) -> int:
    from .config import ConfigError, load_config
    from .run.evaluate import evaluate
    bad = [r for r in rest if not r.startswith("--parallel.")]
    if bad:
        raise ConfigError(f"eval: {bad[0]}: only --parallel.* overrides apply (the model brings its [model] section)")
    if args.out is not None and not args.per_document:
        raise ConfigError("eval: --out holds the per-document lines: pass --per-document with it")
    scores = evaluate(args.model, args.data, load_config(None, rest), split=args.split, text_field=args.text_field,
                      batch_rows=args.batch_rows, out=args.out if args.per_document else None, force=args.force)
    if int(os.environ.get("RANK", "0")) == 0:
        if args.per_document and args.out is None:
            print("\n".join(scores.lines()))
        print(scores.summary() + (f"; per document: {args.out}" if args.per_document and args.out else ""))
    return 0


def _sizes(text: str) -> list[float]:
    from .config import ConfigError
    try:
        out = [float(x) for x in text.split(",")]
    except ValueError:
        out = []
    if not out or any(x <= 0 for x in out):
        raise ConfigError(f"bench: --sizes {text!r}: expected sizes in MiB separated by commas, e.g. 128,512,1024")
    return out


def _cmd_bench(args, rest) -> int:
    if args.what in ("ckpt", "dcp"):
        from .bench.scaling import scaling_lines
        if args.what == "ckpt":
            from .bench.ckpt import SCALING_PAIRS, bench_ckpt
            run = lambda mb: bench_ckpt(size_mb=mb, world=args.world, repeats=args.repeats, dir=args.dir)  # noqa: E731
            pairs, fit, default = SCALING_PAIRS, ["megalite save", "megalite load"], 1024
        else:
            from .bench.dcp import TOOLS, bench_dcp
            run = lambda mb: bench_dcp(size_mb=mb, repeats=args.repeats, dir=args.dir)  # noqa: E731
            pairs, fit, default = [TOOLS], [TOOLS[0]], 300
        sizes = _sizes(args.sizes) if args.sizes else [default if args.size_mb is None else args.size_mb]
        runs = {mb: run(mb) for mb in sizes}
        if len(sizes) > 1:
            print("\n" + "\n".join(scaling_lines(runs, pairs, fit)), flush=True)
    elif args.what == "plan" and args.memory:  # each rank's bytes instead of the write plan
        from .bench.memory import bench_memory_cli
        bench_memory_cli(args)
    elif args.what == "plan":
        from .bench.plan import bench_plan_cli
        args.vocab_size = 50304 if args.vocab_size is None else args.vocab_size
        bench_plan_cli(args)
    elif args.what == "blend":
        from .bench.blend import bench_blend
        bench_blend(block_size=_given(args.block_size, 1024))
    elif args.what == "generate":
        from .bench.generate import bench_generate
        bench_generate(n_layer=args.n_layer or 30, n_embd=args.n_embd or 576, vocab_size=args.vocab_size or 49152,
                       new_tokens=args.new_tokens, rounds=args.rounds or 3, dir=args.dir)
    elif args.what == "documents":
        from .bench.documents import bench_documents
        bench_documents(size_mb=_given(args.size_mb, 2.0), vocab_size=_given(args.vocab_size, 4096),
                        n_layer=args.n_layer or 4, n_embd=args.n_embd or 128, block_size=_given(args.block_size, 512),
                        steps=args.steps, rounds=_given(args.rounds, 3), dir=args.dir)
    elif args.what == "prepare":
        from .bench.prepare import bench_prepare
        bench_prepare(size_mb=_given(args.size_mb, 32), vocab_size=_given(args.vocab_size, 4096),
                      tokenizer=args.tokenizer, rounds=_given(args.rounds, 3), dir=args.dir)
    else:
        from .bench.train import bench_train
        bench_train(steps=args.steps, nproc=args.nproc, n_embd=_given(args.n_embd, 128),
                    n_layer=_given(args.n_layer, 4), block_size=_given(args.block_size, 128),
                    rounds=_given(args.rounds, 2), wait_ms=args.bubble_wait_ms,
                    cp_seq=args.cp_seq, pairs=args.pairs, llama_only=args.llama_only,
                    families=args.families)
    return 0


def _given(v, default):
    return default if v is None else v


def _config_fields() -> str:
    from .config import help_text
    return f"config fields (TOML [section] key, or --section.key=value):\n{help_text()}"


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
    p.more_help = _config_fields  # every config field, listed only for `train --help`, not on every command line
    p.add_argument("--config", help="TOML config file (configs/tiny-cpu.toml)")
    p.add_argument("--force", action="store_true",
                   help="with --checkpoint.resume=none: move an earlier run's checkpoints aside (never deleted)")
    p.set_defaults(allow_rest=True)

    add("torchrun", "torchrun itself, with the same arguments (`megalite torchrun --nproc-per-node 2 -m megalite "
                    "train ...`), except that Ctrl-C or SIGTERM ends with megalite's stop line (exit 128 + signal) "
                    "instead of torchrun's SignalException traceback; its options: `torchrun --help`",
        None)

    p = add("config", "`config show`: print the resolved config (file + overrides, validated) as TOML",
            _cmd_config)
    p.add_argument("what", choices=["show"])
    p.add_argument("--config", help="TOML config file (default: the built-in defaults)")
    p.set_defaults(allow_rest=True)

    p = add("prepare", "turn text files or folders into a token file (.bin, uint16 or uint32 ids, + .json) with a "
                       "val split; each text file is a document, and so is each record of a .jsonl or .parquet "
                       "file, separated by the tokenizer's end-of-text token",
            _cmd_prepare)
    p.add_argument("sources", nargs="*", help="files or folders (default: the Python standard library's sources)")
    p.add_argument("--out", required=True, help="output .bin path")
    p.add_argument("--tokenizer", default="byte",
                   help="byte (the default: UTF-8 bytes, vocab 256) | a tokenizer.json | an HF tokenizer folder "
                        "(tokenizer.json, or GPT-2's vocab.json + merges.txt)")
    p.add_argument("--val-fraction", type=float, default=0.1, help="share held out for validation (default: "
                                                                   "%(default)s)")
    p.add_argument("--val-split", choices=["documents", "tail"], default="documents",
                   help="documents: whole documents drawn across the corpus by a fixed hash of their index; "
                        "tail: the last tokens (default: %(default)s)")
    p.add_argument("--text-field", default="text",
                   help="the field of a .jsonl record or the column of a .parquet file that holds each "
                        "document's text (default: %(default)s)")
    p.add_argument("--force", action="store_true",
                   help="replace --out if it is a token file `megalite prepare` wrote (never any other file)")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no summary line")
    p.add_argument("--chat", action="store_true",
                   help="jsonl conversations ({\"messages\": [{\"role\", \"content\"}, ...]} a line) rendered with "
                        "--tokenizer's chat template (a transformers folder); only the assistant's turns count in the "
                        "loss (a loss mask beside --out); a template without {%% generation %%} markers is refused")

    p = add("tokenizer", "`tokenizer train`: a GPT-2-style byte-level BPE (GPT-2's regex, every byte encodable, "
                         "<|endoftext|>) trained on text files, written as an HF tokenizer folder", _cmd_tokenizer)
    p.add_argument("what", choices=["train"])
    p.add_argument("sources", nargs="*", help="files or folders (default: the Python standard library's sources)")
    p.add_argument("--vocab-size", type=int, required=True, help="ids in all (>= 257: 256 bytes + <|endoftext|>)")
    p.add_argument("--out", required=True, help="the folder to write (tokenizer.json, tokenizer_config.json, "
                                                "special_tokens_map.json)")
    p.add_argument("--min-frequency", type=int, default=2, help="a pair merges only if seen this often")
    p.add_argument("--pre-tokenizer", default="gpt2", choices=["gpt2", "llama3"],
                   help="how text is cut before merging: GPT-2's regex, or Llama 3's split (tiktoken-style: "
                        "digits in groups of 3, a letter run with one leading non-letter)")
    p.add_argument("--text-field", default="text",
                   help="the field of a .jsonl record or the column of a .parquet file that holds each "
                        "document's text (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--quiet", action="store_true")

    p = add("inspect", "describe a checkpoint (step, layout, tensors and bytes per coordinate) or a model (a model "
                       "file, a transformers folder: its [model] section as TOML)", _cmd_inspect)
    p.add_argument("ckpt", help="a step folder, a checkpoint root (the step `latest` names), a megalite model "
                                "file or a transformers folder")
    p.add_argument("--model", action="store_true", help="print only the [model] section, as TOML to paste into a "
                                                        "config (the default for a model file or folder)")
    p.add_argument("--tree", action="store_true", help="draw the rank-coded tree as the (tp, cp, pp, dp) grid")

    p = add("plot", "train/val loss curves of one or more runs on one chart (needs matplotlib)", _cmd_plot)
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="runs' out_dir folders (with metrics.jsonl)")
    p.add_argument("--out", default="loss.png")

    p = add("convert", "reassemble a checkpoint of any layout into one safetensors file (or the family's "
                       "transformers folder with --format hf, a DCP folder with --format dcp), one tensor at a "
                       "time; also from a transformers folder, a Megatron-LM (torch_dist) or PyTorch DCP "
                       "checkpoint, no pickle of theirs run", _cmd_convert)
    p.add_argument("ckpt", help="a step folder, or a checkpoint root (the step `latest` names); a `megalite "
                                "convert` file; a transformers, Megatron-LM or DCP checkpoint folder")
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (default: the dtype the source recorded, a transformers folder's carried through checkpoints and files; else fp32; from DCP: as stored)")
    p.add_argument("--format", default="megalite", help="megalite (one .safetensors) | hf (the family's "
                   "transformers folder; hf-gpt2: GPT-2's) | dcp (a DCP folder, Hugging Face storage format)")
    p.add_argument("--from", dest="source", default=None, metavar="KIND",
                   help="megalite | hf | dcp | megatron (default: recognised from the folder)")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                   help="run the source and the result on fixed prompts and refuse the output above the "
                        "tolerance (default: on where transformers is installed, for exports to transformers "
                        "and imports from other trainers)")
    p.add_argument("--max-shard-size", default="5GB", help="--format hf: shard the weights above this (bytes, "
                   "or with KB/MB/GB; transformers' default 5GB)")
    p.add_argument("--vocab-size", type=int, default=None, help="megatron: cut the padded vocabulary to this")
    titan = ", ".join(f"{s.name}: torchtitan's {s.torchtitan.what}" for s in models.FAMILIES.values()
                      if "torchtitan" in s.readers)
    p.add_argument("--arch", default=None, help=f"what model a DCP folder holds ({titan}); for a Megatron folder, "
                                                f"checked against it")
    hint = p.add_argument_group("what the tensors cannot tell (a Megatron checkpoint without args, a DCP folder)")
    hint.add_argument("--num-heads", type=int, default=None)
    hint.add_argument("--num-kv-heads", type=int, default=None, help="(default: read from the key width)")
    hint.add_argument("--rope-theta", type=float, default=None, help="(default 10000)")
    hint.add_argument("--norm", default=None, help="rms | layer (default: read from the norms' biases)")
    hint.add_argument("--mlp", default=None, help="swiglu | gelu | gelu_tanh (default: read from the MLP's rows)")
    hint.add_argument("--norm-eps", type=float, default=None, help="(default 1e-5)")
    hint.add_argument("--config", default=None, help="a transformers config.json giving all of the above")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--quiet", action="store_true")

    p = add("split", "cut one model (a megalite file, a transformers folder of any family, a Megatron-LM "
                     "checkpoint) into a checkpoint at a layout (fresh optimizer state)", _cmd_split)
    p.add_argument("model")
    _layout_flags(p)
    p.add_argument("--zero1", choices=["on", "off"], default="off")
    p.add_argument("--step", type=int, default=0, help="the step the checkpoint says it is at")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                   help="from another trainer or transformers: megalite's model on the source's tensors against "
                        "the source's own forward on fixed prompts, before anything is written (default: on "
                        "where transformers is installed)")

    p = add("reshard", "move a full training checkpoint (model, optimizer, step, data position) to a new "
                       "layout", _cmd_reshard)
    p.add_argument("ckpt")
    _layout_flags(p)
    p.add_argument("--zero1", choices=["on", "off"], default=None, help="default: as in the source")

    p = add("generate", "sample text from a model in one plain process, with the tokenizer the model carries",
            _cmd_generate)
    p.add_argument("--model", required=True, help="a megalite checkpoint (root or step folder), a megalite model "
                                                  "file (`megalite convert`), or a transformers folder (GPT-2, "
                                                  "Llama, Qwen2, Qwen3, Mistral: config.json, safetensors "
                                                  "weights, its tokenizer)")
    p.add_argument("--prompt", default="\n", help="the text to continue (default: a newline)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens to sample (default: 200, or fewer so that prompt + sample fit the model's "
                        "block_size)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="softmax temperature; 0: greedy, the likeliest token each time (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample among the k likeliest tokens only; 0: all of them (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: among the fewest likeliest tokens whose probabilities sum to at least p "
                        "(after --top-k, as transformers orders them); 1: all of them (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default: %(default)s)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the sample where TEXT appears (the text ends before it); repeatable")
    p.add_argument("--chat", action="store_true",
                   help="the prompt is a user's turn in the model's chat template (chat_template.jinja or "
                        "tokenizer_config.json's chat_template); prints the reply")
    p.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system turn before the prompt")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                   help="a transformers folder or another trainer's checkpoint: megalite's model on its tensors "
                        "against its own forward first, as convert does (default: on where transformers is "
                        "installed)")
    p.add_argument("--ids", action="store_true", help="print the token ids (prompt + new), not the text")
    p.add_argument("--ignore-eot", action="store_true",
                   help="sample on past the model's end ids (generation_config.json's eos_token_id, a list or "
                        "one; config.json's; the tokenizer's eos and <|endoftext|>), which by default end the "
                        "text, as in transformers")

    p = add("eval", "a model's loss, perplexity and bits per byte over a corpus or token file, each document "
                    "scored alone from position 0 (packed with document masks), in one process or under torchrun "
                    "at any layout (--parallel.tp=2 ...)", _cmd_eval)
    p.add_argument("--model", required=True, help="a transformers folder, a megalite model file or a megalite "
                                                  "checkpoint (root or step folder)")
    p.add_argument("--data", required=True,
                   help="text files or a folder (each file a document), a .jsonl/.parquet corpus (each record a "
                        "document), encoded with the model's tokenizer; or a token file `megalite prepare "
                        "--tokenizer MODEL` wrote (documents cut at its end-of-text ids)")
    p.add_argument("--per-document", action="store_true",
                   help="one JSON line per document: its summed log-likelihood, scored tokens, mean loss")
    p.add_argument("--out", default=None, help="with --per-document: write the lines to this file (jsonl) "
                                               "instead of stdout")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--split", choices=["all", "train", "val"], default="all",
                   help="a token file: which of its splits to score (default: %(default)s)")
    p.add_argument("--text-field", default="text", help="the text field of a .jsonl record or .parquet column "
                                                        "(default: %(default)s)")
    p.add_argument("--batch-rows", type=_positive(int), default=8,
                   help="rows of block_size + 1 tokens a batch, over all dp ranks (rounded up to a multiple of dp x "
                        "pp: each rank's rows are pp micro-batches; default: %(default)s)")
    p.set_defaults(allow_rest=True)

    p = add("bench", "benchmarks: `bench ckpt` (saves/loads vs DCP, torch.save and the disk), `bench train` "
                     "(vs plain PyTorch, pipeline bubbles, layouts), `bench plan` (checkpoint write plan and "
                     "manifest at thousands of ranks, no tensors), `bench dcp` (a DCP checkpoint to one file: "
                     "megalite convert vs dcp_to_torch_save), `bench prepare` (prepare vs the tokenizers "
                     "library's encode_batch), `bench generate` (tokens/s vs transformers' generate with its KV "
                     "cache), `bench blend` (data.mixture's blend vs megatron-core's helper), `bench documents` (a "
                     "training step with document-masked attention vs random windows)", _cmd_bench)
    p.add_argument("what", choices=["ckpt", "train", "plan", "dcp", "prepare", "generate", "blend", "documents"])
    p.add_argument("--size-mb", type=_positive(float), default=None,
                   help="ckpt: model + optimizer bytes over all ranks (1024); dcp: the DCP checkpoint's size "
                        "(300); prepare: corpus size (32); documents: the corpus's stdlib sources (2)")
    p.add_argument("--sizes", default=None,
                   help="ckpt, dcp: several sizes in MiB (e.g. 128,512,1024), one whole run each, then a scaling "
                        "table: s/GiB per operation and size, megalite / peer, a fixed + per-GiB fit")
    p.add_argument("--world", type=_positive(int), default=4, help="ckpt: gloo processes")
    p.add_argument("--repeats", type=_positive(int), default=3, help="ckpt: repetitions of each measurement")
    p.add_argument("--dir", default=None,
                   help="ckpt, prepare, generate, documents: folder to write in (default: the temp folder)")
    p.add_argument("--steps", type=_positive(int), default=10, help="train, documents: timed steps per measurement")
    p.add_argument("--new-tokens", type=_positive(int), default=64,
                   help="generate: tokens each run draws (default: 64)")
    p.add_argument("--nproc", type=_positive(int), default=4, help="train: processes for the layout table")
    p.add_argument("--n-embd", type=_positive(int), default=None,
                   help="model width (train: 128, documents: 128, plan: 12288, generate: 576)")
    p.add_argument("--n-layer", type=_positive(int), default=None,
                   help="model depth (train: 4, documents: 4, plan: 96, generate: 30)")
    p.add_argument("--block-size", type=_positive(int), default=None,
                   help="sequence length (train: 128, plan: 2048, blend: 1024 tokens a sample, documents: 512)")
    p.add_argument("--n-head", type=_positive(int), default=96, help="plan: attention heads")
    p.add_argument("--vocab-size", type=_positive(int), default=None,
                   help="plan: vocabulary (50304); prepare, documents: the BPE trained for it (4096); generate: 49152")
    p.add_argument("--tokenizer", default=None, help="prepare: a tokenizer to use instead of training one")
    p.add_argument("--tp", type=_positive(int), default=8, help="plan: tensor-parallel size")
    p.add_argument("--pp", type=_positive(int), default=16, help="plan: pipeline stages")
    p.add_argument("--dp", default="8,32,128", help="plan: data-parallel sizes, comma-separated (one line each)")
    p.add_argument("--cp", type=_positive(int), default=1,
                   help="plan: context-parallel size (ranks = tp x cp x pp x dp)")
    p.add_argument("--vpp", type=_positive(int), default=1, help="plan: virtual (interleaved) stages per pipeline rank")
    p.add_argument("--zero1", action="store_true", help="plan: ZeRO-1 optimizer-state shards")
    p.add_argument("--memory", action="store_true",
                   help="plan: each rank's bytes of weights, gradients, AdamW moments, the largest gathered block, "
                        "activations and what its collectives send per step, instead of the write plan")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0, help="plan --memory: the ZeRO level")
    p.add_argument("--dp-shard", type=int, default=0, help="plan --memory: hybrid sharding group (0: all dp)")
    p.add_argument("--micro-batch", type=int, default=1, help="plan --memory: sequences per micro-batch")
    p.add_argument("--microbatches", type=int, default=0, help="plan --memory: micro-batches per step (4 x pp)")
    p.add_argument("--arch", choices=sorted(models.FAMILIES), default=models.DEFAULT,
                   help="plan --memory: the model family")
    p.add_argument("--n-kv-head", type=int, default=0, help="plan --memory: key/value heads (0: n_head)")
    p.add_argument("--intermediate-size", type=int, default=0, help="plan --memory: gated MLP width (0: the "
                                                                       "family's default)")
    p.add_argument("--reshard-to", default=None, metavar="TP,PP,DP[,CP]",
                   help="plan: what each rank of this layout reads to resume the last layout's checkpoint")
    p.add_argument("--rounds", type=_positive(int), default=None,
                   help="train: alternating runs of each feature table's settings (2); prepare, generate, documents: "
                        "of each (3)")
    p.add_argument("--pairs", type=_positive(int), default=5,
                   help="train: table 1's megalite/plain pairs of fresh processes")
    p.add_argument("--cp-seq", type=_positive(int), default=None,
                   help="train: sequence length of the context-parallel table (default: 8 x --block-size)")
    p.add_argument("--llama-only", action="store_true",
                   help="train: only the Llama tables (9: vs transformers' LlamaForCausalLM, 10: a block's "
                        "saved bytes per rank)")
    p.add_argument("--families", action="store_true",
                   help="train: table 9 also for every other SwiGLU family (qwen2, qwen3, mistral) against its "
                        "own transformers class")
    p.add_argument("--bubble-wait-ms", type=_positive(float), default=None,
                   help="train: t_f of the bubble table's wait rows (default: the model's, at least 40 ms)")

    p = add("verify", "check every file's size and checksum, every coordinate, and that slices tile each "
                      "tensor; one line per problem, exit 1 if any", _cmd_verify)
    p.add_argument("ckpt", help="a step folder, or a checkpoint root (the step `latest` names)")
    return ap


def _positive(kind):
    """argparse's type for a number that must be > 0 (0 is a value, refused like -1; never read as "not given")."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            v = None
        if v is None or not math.isfinite(v) or v <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive {'integer' if kind is int else 'number'}, "
                                             f"got {text!r}")
        return v
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def _layout_flags(p) -> None:
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--dp", type=int, required=True)
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (default: 1)")
    p.add_argument("--out", required=True)
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--quiet", action="store_true")


def main(argv=None) -> int:
    """`megalite ...`; the exit code. A reader that closes stdout early (`megalite inspect CKPT | head -1`)
    ends the command quietly with exit code 1, Python's own recipe (docs: "Note on SIGPIPE"), not a
    BrokenPipeError traceback; a broken pipe anywhere else (a socket) is not hidden."""
    try:
        rc = _main(argv)
        sys.stdout.flush()  # a reader that went away is found here, not at interpreter exit
        return rc
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush then has nowhere to fail
        return 1


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end is closed (poll reports POLLERR on the writing end)."""
    import select
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, 0)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["torchrun"] and argv[1:] not in (["-h"], ["--help"]):  # torchrun's own arguments follow
        from .parallel.launch import torchrun
        return torchrun(argv[1:])
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
    except USER_ERRORS as e:
        if isinstance(e, BrokenPipeError):
            raise  # main() decides: a reader that went away, or a real error
        _report(args.command, e)
        return 2
