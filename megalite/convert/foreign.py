"""`megalite convert` from other trainers' checkpoints, and `--format dcp` out.

Sources, recognised from the folder (or forced with --from): a megalite checkpoint (a manifest, or a root
whose `latest` names one), a Megatron-LM torch_dist checkpoint (`metadata.json`, or a root with
`latest_checkpointed_iteration.txt`), a DCP folder (`.metadata`). Outputs:

    source     --format megalite                   hf-gpt2        dcp
    megatron   megalite names, one file            HF GPT-2       megalite names, DCP (HF storage format)
    dcp        every tensor, stored name + dtype   (refused)      the same tensors, DCP (HF storage format)
    megalite   (single.py)                         (single.py)    megalite names, DCP (HF storage format)

Everything streams one tensor at a time into a temporary output that is moved into place when complete.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Optional

import torch

from ..checkpoint.stream import WRITABLE
from ..base.errors import ConvertError
from .common import DTYPES, Progress, _check_out
from .dcp import METADATA, DcpFolder, stream, write_dcp, write_file
from .hints import Hints
from .megatron import MegatronGPT, is_megatron

SOURCES = ("megalite", "dcp", "megatron")


def detect_source(path: Path) -> str:
    """'megatron', 'dcp' or 'megalite' (the last also for anything else: its reader says what is wrong)."""
    if is_megatron(path):
        return "megatron"
    if path.is_dir() and (path / METADATA).is_file():
        return "dcp"
    return "megalite"


def source_kind(path: Path, forced: Optional[str]) -> str:
    if forced is None:
        return detect_source(path)
    if forced not in SOURCES:
        raise ConvertError(f"--from '{forced}': expected one of {', '.join(SOURCES)}")
    if forced == "megatron" and not is_megatron(path):
        raise ConvertError(f"--from megatron: {path} has no metadata.json or latest_checkpointed_iteration.txt "
                           f"(expected a Megatron-LM torch_dist checkpoint)")
    if forced == "dcp" and not (path / METADATA).is_file():
        raise ConvertError(f"--from dcp: {path} has no {METADATA} (expected a torch.distributed.checkpoint folder)")
    return forced


def read_megatron_model(path: Path):
    """(model config, get(name) -> fp32 tensor, names) of a Megatron checkpoint folder, else None: what
    `split` and `generate` read a model through (read_model_file)."""
    if not is_megatron(path):
        return None
    g = MegatronGPT(path)
    _needs_megalite_model(g, "split / generate")
    return g.m, (lambda name: g.get(name).float()), g.names


def _needs_megalite_model(g, what: str) -> None:
    if getattr(g, "parts", None) is None:
        raise ConvertError(f"{g.step / 'common.pt'}: args: add_qkv_bias = True: megalite's Llama has no q/k/v biases "
                           f"(Qwen-style), so {what} cannot hold this model")


def foreign_model(src: Path, kind: str, arch: Optional[str], vocab_size: Optional[int], hints: Optional[Hints]):
    """The model source for a Megatron folder or (with --arch llama) a torchtitan DCP folder: `m`, `names`,
    `shape(name)`, `get(name)`."""
    if kind == "megatron":
        if arch not in (None, "gpt2", "llama"):
            raise ConvertError(f"--arch '{arch}': expected gpt2 or llama")
        g = MegatronGPT(src, vocab_size, hints)
        if arch is not None and g.m.get("arch", "gpt2") != arch:
            raise ConvertError(f"--arch {arch} contradicts {src}: its arguments and tensors make a "
                               f"{g.m.get('arch', 'gpt2')}")
        return g
    if arch != "llama":
        raise ConvertError(f"--arch '{arch}': a DCP folder is read as a model only for --arch llama (torchtitan's "
                           f"Llama 3)")
    if vocab_size is not None:
        raise ConvertError("--vocab-size: only for a Megatron checkpoint (a torchtitan Llama's vocabulary is not padded)")
    from .torchtitan import TorchtitanLlama
    return TorchtitanLlama(src, hints or Hints())


def convert_foreign(src: Path, kind: str, out: Path, fmt: str, dtype: Optional[str], vocab_size: Optional[int],
                    force: bool, quiet: bool, arch: Optional[str] = None, hints: Optional[Hints] = None,
                    check: Optional[bool] = None) -> Path:
    """A Megatron or DCP checkpoint -> one file, an HF GPT-2 folder, or a DCP folder (see the table above)."""
    if vocab_size is not None and kind != "megatron":
        raise ConvertError(f"--vocab-size: only for a Megatron checkpoint (this source is {kind})")
    torch_dtype = None if dtype is None else DTYPES[dtype]
    if kind == "dcp" and arch is None and hints is not None and hints.given():
        raise ConvertError("--num-heads, --config, ...: a DCP folder is read as a model only with --arch llama")
    if kind == "dcp" and arch is None:
        if fmt == "hf-gpt2":
            raise ConvertError(f"--format hf-gpt2: {src} is a plain DCP checkpoint, which does not say what model "
                               f"its tensors make (a Megatron-LM checkpoint converts with --from megatron)")
        ck = DcpFolder(src)
        _check_out(out, force, [src], fmt)
        names = list(ck.tensors)
        for n in names:
            if ck.tensors[n].dtype not in WRITABLE:
                raise ConvertError(f"{src / METADATA}: tensor '{n}' is {ck.tensors[n].dtype}, which a safetensors "
                                   f"file here cannot hold (expected one of {', '.join(map(str, WRITABLE))})")
        specs = [(n, list(ck.tensors[n].shape), _cast(ck.tensors[n].dtype, torch_dtype)) for n in names]
        progress = Progress("convert", len(names), sum(ck.tensors[n].nbytes for n in names), quiet)
        meta = {"megalite.kind": "dcp", "megalite.skipped": json.dumps(ck.others)}
        tensors = stream(ck, names, torch_dtype, progress)
        if fmt == "dcp":
            done = write_dcp(out, specs, tensors, meta)
        else:
            done = write_file(out, specs, tensors, {"format": "pt", **meta})
        if ck.others and not quiet:  # after the work: a failed convert prints its one error line only
            shown = ", ".join(ck.others[:8]) + (f", ... ({len(ck.others)} in all)" if len(ck.others) > 8 else "")
            print(f"convert: skipped {len(ck.others)} non-tensor entr{'y' if len(ck.others) == 1 else 'ies'} "
                  f"(bytes, never unpickled): {shown}", file=sys.stderr, flush=True)
        return done
    g = foreign_model(src, kind, arch, vocab_size, hints)
    if fmt == "hf-gpt2" and g.m.get("arch", "gpt2") != "gpt2":
        raise ConvertError(f"--format hf-gpt2: {src} is a {g.m['arch']} (hf-gpt2 writes GPT-2 only)")
    if fmt != "hf-gpt2":
        _needs_megalite_model(g, f"--format {fmt}")
    _check_out(out, force, [src, getattr(g, "step", src)], fmt)
    if g.m.get("arch") == "llama" and check is not False and getattr(g, "parts", None) is not None:
        from . import native  # before anything is written: a failed check leaves no output
        diff, kl = native.check(g, native.prompt(g.m), str(src))
        if not quiet:
            print(f"convert: --check: max |logit difference| {diff:.2e}, KL {kl:.2e} against {src.name}'s own-layout "
                  f"forward", file=sys.stderr, flush=True)
    skipped = getattr(g, "skipped", [])
    torch_dtype = torch_dtype or torch.float32
    progress = Progress("convert", len(g.names), sum(math.prod(g.shape(n)) * torch_dtype.itemsize for n in g.names),
                        quiet)

    def tensors():
        for name in g.names:
            t = g.get(name).to(torch_dtype)
            yield name, t
            progress.step(t.numel() * t.element_size())

    specs = [(n, list(g.shape(n)), torch_dtype) for n in g.names]
    if fmt == "hf-gpt2":
        from .hf import write_hf
        return write_hf(out, g.m, {n: g.shape(n) for n in g.names}, tensors(), torch_dtype)
    pieces = ((n, [t]) for n, t in tensors())  # one piece: the whole tensor
    meta = {"megalite.model_config": json.dumps(g.m, sort_keys=True)}
    if fmt == "dcp":
        done = write_dcp(out, specs, pieces, meta)
    else:
        meta = {"format": "pt", "megalite.kind": "model", **meta,
                "megalite.partitions": json.dumps({n: g.parts[n].to_json() for n in g.names}, sort_keys=True)}
        done = write_file(out, specs, pieces, meta)
    if skipped and not quiet:
        print(f"convert: skipped {len(skipped)} training entries ({g.naming}): {_listed(skipped)}",
              file=sys.stderr, flush=True)
    return done


def _listed(names: list) -> str:
    return ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")


def _cast(stored: torch.dtype, to: Optional[torch.dtype]) -> torch.dtype:
    return to if to is not None and stored.is_floating_point else stored


def export_dcp(step: Path, man, out: Path, dtype: torch.dtype, progress: Progress) -> Path:
    """A megalite checkpoint's model -> a DCP folder (HF storage format) of megalite-named full tensors."""
    from .common import _full_tensors
    specs = [(n, list(e.shape), dtype) for n, e in man.model.items()]
    tensors = ((n, [t.to(dtype)]) for n, t in _full_tensors(step, man, progress))
    return write_dcp(out, specs, tensors, {"megalite.model_config": json.dumps(man.model_config, sort_keys=True)})
