"""`megalite convert`: any Source (sources.py) -> one Sink (sink.py), proved by `--check` (check.py) where asked.

    source                     --format megalite         hf (hf-gpt2)            dcp
    megalite step / one file   one file                  the family's folder     megalite names, DCP
    transformers folder        one file, megalite names  the family's folder     megalite names, DCP
    megatron                   one file, megalite names  the family's folder     megalite names, DCP
    plain dcp                  stored names and dtypes   (refused: no model)     the same tensors, DCP

"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Optional

import torch

from . import check as checking
from .common import DTYPES, ConvertError, Progress, check_out
from .hf import MAX_SHARD, TORCH_DTYPE, transformers_runner
from .sink import FORMATS, write
from .sources import FileSource, StepSource, open_source


def convert(ckpt, out, dtype: Optional[str] = None, fmt: str = "megalite", force: bool = False,
            quiet: bool = False, source: Optional[str] = None, vocab_size: Optional[int] = None,
            check: Optional[bool] = None, max_shard_size: int = MAX_SHARD, arch: Optional[str] = None,
            hints=None) -> Path:
    """Any source as one safetensors file, a transformers folder or a DCP folder. dtype: unless given, the
    dtype its origin records (a transformers folder's, carried through checkpoints and files), else fp32 (a
    plain DCP source: as stored). check: None = on where transformers is installed, for every export to
    transformers and every import from another trainer. arch, hints: what another trainer's checkpoint cannot
    tell (--arch, --num-heads, --config, ...: hints.py)."""
    if fmt not in FORMATS:
        raise ConvertError(f"--format '{fmt}': expected one of {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise ConvertError(f"--dtype '{dtype}': expected one of {', '.join(DTYPES)}")
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int) or max_shard_size < 1:
        raise ConvertError(f"--max-shard-size {max_shard_size!r}: expected a positive number of bytes")
    src = open_source(Path(ckpt), source, vocab_size, arch, hints)
    if src.model is not None and fmt != "hf-gpt2":
        src.partitions()  # a model megalite's cannot hold (q/k/v biases) is refused before anything is written
    out = Path(out)
    check_out(out, force, src.guards, "hf" if fmt.startswith("hf") else fmt)
    torch_dtype = DTYPES[dtype] if dtype else (None if src.model is None else default_dtype(src))
    foreign = not isinstance(src, (StepSource, FileSource))
    if check is None:
        check = src.model is not None and (fmt.startswith("hf") or foreign) and fmt != "dcp" \
            and checking.available()
    elif check and (src.model is None or fmt == "dcp"):
        raise ConvertError(f"--check: {src.where} -> --format {fmt} has no model forward to compare "
                           f"(a plain DCP source, or a DCP output)")
    elif check and not checking.available():  # asked for: its reference forward is transformers'
        raise ConvertError("--check needs the `transformers` package, which is not importable: `pip install "
                           "transformers` (or megalite[hf]), or --no-check; nothing was written")
    progress = Progress("convert", len(src.specs), sum(s.nbytes for s in src.specs.values()), quiet)
    proof = _proof(src, fmt, torch_dtype or torch.float32, quiet) if check else None
    done = write(src, out, fmt, torch_dtype, progress, proof, max_shard_size)
    if getattr(src, "harmless", None) and not quiet:  # one informational line (models/hf.py's rule), after
        print(f"convert: {src.where}/config.json: {len(src.harmless)} harmless fields ignored (they change "  # the work
              f"neither the weights nor the logits): {', '.join(src.harmless)}", file=sys.stderr, flush=True)
    if src.skipped and not quiet:  # after the work: a failed convert prints its one error line only
        n = len(src.skipped)
        shown = ", ".join(src.skipped[:8]) + (f", ... ({n} in all)" if n > 8 else "")
        what = (f"training entries ({src.naming})" if hasattr(src, "naming") else
                f"non-tensor entr{'y' if n == 1 else 'ies'} (bytes, never unpickled)")
        print(f"convert: skipped {n} {what}: {shown}", file=sys.stderr, flush=True)
    return done


def default_dtype(src) -> torch.dtype:
    """What an output is written in unless --dtype says: the source's recorded dtype (base/origin.py), else fp32."""
    origin = src.origin()
    return NAMED_DTYPES.get(origin.dtype if origin is not None else None, torch.float32)


def _proof(src, fmt: str, dtype: torch.dtype, quiet: bool) -> Callable[[Path], None]:
    """The check step of the sink: the written output at `tmp` against the source."""
    def run(tmp: Path) -> None:
        if fmt.startswith("hf"):
            tok = src.tokenizer()
            vocab = src.model["vocab_size"] if tok is None else min(tok.vocab_size, src.model["vocab_size"])
            checking.check(src, lambda: transformers_runner(tmp), dtype, "transformers' forward of the export",
                           quiet, vocab)
            return
        result = FileSource(tmp)
        if src.reference() is None:  # both sides would be megalite's model: transformers on the result
            checking.check(src, lambda: checking.transformers_on(result), dtype,
                           "transformers on the converted tensors", quiet)
        else:
            checking.check(src, lambda: checking.megalite_runner(result), dtype, "megalite's model on the "
                           "converted file", quiet)
    return run


NAMED_DTYPES = {v: k for k, v in TORCH_DTYPE.items()}  # "bfloat16" -> torch.bfloat16
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str, flag: str) -> int:
    """'5GB', '500MB', '123' -> bytes (transformers' units: KB/MB/GB are powers of ten, KiB/MiB/GiB of two)."""
    t = str(text).strip().upper()
    num = t.rstrip("KMGIB")
    unit = t[len(num):]
    try:
        value = float(num) * UNITS[unit]
    except (ValueError, KeyError):
        raise ConvertError(f"{flag} '{text}': expected a size such as 5GB, 500MB or a number of bytes") from None
    if not value >= 1 or value > 2**62:
        raise ConvertError(f"{flag} '{text}': expected a size of at least 1 byte")
    return int(value)
