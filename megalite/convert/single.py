"""Any layout -> one safetensors file, and reading one model file back (megalite's or an HF GPT-2 folder)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import torch

from ..checkpoint import manifest as mf
from ..checkpoint.check import read_tokenizer
from ..checkpoint.read import SliceReader
from ..checkpoint.tree import LATEST, MANIFEST, resolve
from ..base.fs import path_kind
from ..config import model_from
from ..parallel.partition import Box
from ..tokenizer import TOKENIZER_KEY, carried_by
from .common import (DTYPES, MODEL_KIND, ConvertError, Progress, _check_out, _full_tensors, check_manifest_tensors,
                     open_safetensors, parse_json)
from .dcp import write_file
from .foreign import convert_foreign, export_dcp, read_megatron_model, source_kind
from .hf import export_hf, read_hf_folder

FORMATS = ("megalite", "hf-gpt2", "dcp")


def convert(ckpt, out, dtype: Optional[str] = None, fmt: str = "megalite", force: bool = False,
            quiet: bool = False, source: Optional[str] = None, vocab_size: Optional[int] = None,
            arch: Optional[str] = None, hints=None) -> Path:
    """Reassemble the model of any layout into one safetensors file (or an HF GPT-2 / a DCP folder); a
    Megatron-LM or DCP checkpoint too (foreign.py). dtype: fp32 unless given (a DCP source: as stored)."""
    if fmt not in FORMATS:
        raise ConvertError(f"--format '{fmt}': expected one of {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise ConvertError(f"--dtype '{dtype}': expected one of {', '.join(DTYPES)}")
    kind = source_kind(Path(ckpt), source)
    if kind != "megalite":
        return convert_foreign(Path(ckpt), kind, Path(out), fmt, dtype, vocab_size, force, quiet, arch, hints)
    if arch is not None or (hints is not None and hints.given()):
        raise ConvertError("--arch, --num-heads, --config, ...: only for a Megatron or DCP checkpoint (a megalite "
                           "checkpoint says what model it holds)")
    if vocab_size is not None:
        raise ConvertError("--vocab-size: only for a Megatron checkpoint (this source is a megalite checkpoint)")
    dtype = dtype or "fp32"
    step = resolve(ckpt)
    man = mf.read(step)
    check_manifest_tensors(step, man)
    out = Path(out)
    _check_out(out, force, [step.parent, step], fmt)
    total = sum(e.nbytes for e in man.model.values())
    progress = Progress("convert", len(man.model), total, quiet)
    tokenizer = read_tokenizer(step, man)
    if fmt == "hf-gpt2":
        return export_hf(step, man, out, DTYPES[dtype], progress, carried_by(step))
    if fmt == "dcp":
        return export_dcp(step, man, out, DTYPES[dtype], progress)
    torch_dtype = DTYPES[dtype]
    specs = [(n, list(e.shape), torch_dtype) for n, e in man.model.items()]
    meta = {"format": "pt", "megalite.kind": MODEL_KIND, "megalite.model_config": json.dumps(man.model_config, sort_keys=True),
            "megalite.partitions": json.dumps({n: e.partition.to_json() for n, e in man.model.items()},
                                              sort_keys=True)}
    if tokenizer is not None:  # the run's tokenizer travels with the model (generate and split read it)
        meta[TOKENIZER_KEY] = tokenizer.decode("utf-8")
    tensors = ((n, [t.to(torch_dtype)]) for n, t in _full_tensors(step, man, progress))
    return write_file(out, specs, tensors, meta)  # a temp file (never through a symlink) moved into place


def is_checkpoint(p: Path) -> bool:
    """A step folder (manifest.json) or a checkpoint root (`latest`), as opposed to an HF folder."""
    return p.is_dir() and ((p / MANIFEST).exists() or (p / LATEST).exists())


def read_model_file(path) -> tuple[dict, Callable[[str], torch.Tensor], list[str]]:
    """(model config dict, get(name) -> full fp32 tensor, names) for a megalite file, an HF GPT-2 folder, a
    Megatron checkpoint or a megalite checkpoint (root or step folder; every byte read checked against its
    block checksums)."""
    p = Path(path)
    if is_checkpoint(p):
        step = resolve(p)
        man = mf.read(step)
        check_manifest_tensors(step, man)
        reader = SliceReader(step, man)
        m = model_from(man.model_config, f"{step / MANIFEST}: config.model")
        return m, (lambda name: reader.read(man.model[name], Box.whole(man.model[name].shape)).float()), \
            sorted(man.model)
    if p.is_dir():
        found = read_megatron_model(p)  # a Megatron-LM torch_dist checkpoint
        if found is not None:
            return found
        return read_hf_folder(p)
    if not p.exists() and not p.is_symlink():
        raise ConvertError(f"model '{p}' does not exist")
    if not p.is_file():
        raise ConvertError(f"model '{p}' is {path_kind(p)}, expected a safetensors file or an HF GPT-2 folder")
    f = open_safetensors(p)
    meta = f.metadata() or {}
    if "megalite.model_config" not in meta:
        raise ConvertError(f"{p}: safetensors metadata has no 'megalite.model_config' "
                           f"(expected a file written by `megalite convert`)")
    m = model_from(parse_json(meta["megalite.model_config"], f"{p}: metadata 'megalite.model_config'"),
                   f"{p}: metadata 'megalite.model_config'")
    return m, (lambda name: f.get_tensor(name).float()), sorted(f.keys())
