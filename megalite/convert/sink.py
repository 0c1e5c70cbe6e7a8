"""The outputs of `megalite convert`, each consuming a Source (common.py): one megalite model file, a DCP folder
(DCP's pickle-free Hugging Face storage format) or a transformers folder (hf.py). A megalite layout is
resharding.py's `split`.

Every output is written into a temporary path beside --out, proved by `convert --check` where asked (check.py:
the source's forward and the result's on the same tokens), and only then moved into place (`deliver`); on any
failure nothing is left behind and an existing --out is untouched.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from .. import models
from ..base.fs import remove_tree, replace_output
from ..checkpoint.stream import WRITABLE, StreamingWriter, raw_bytes
from .common import KIND, MODEL_CONFIG, MODEL_KIND, SKIPPED, ConvertError, Progress, Source
from .dcp import write_dcp
from .hf import MAX_SHARD, write_hf

FORMATS = ("megalite", "hf", "hf-gpt2", "dcp")  # hf-gpt2: the name GPT-2's export had first (GPT-2 only)
TMP_SUFFIX = ".tmp-megalite"


class PieceWriter(StreamingWriter):
    """A StreamingWriter that takes a tensor as consecutive pieces of its row-major bytes (rows of dim 0),
    so that a tensor stored in row chunks is written chunk by chunk, never assembled."""

    def write_pieces(self, name: str, pieces: Iterable[torch.Tensor]) -> None:
        want, shape, dtype = self.specs[self.next]
        rows = 0
        for p in pieces:
            if name != want or p.dtype != dtype or list(p.shape[1:]) != list(shape[1:]) or (not shape and p.dim()):
                raise ValueError(f"writer expected {want} {shape} {dtype}, got a piece {name} {list(p.shape)} "
                                 f"{p.dtype}")
            self._put(raw_bytes(p.detach().cpu()))
            rows += p.shape[0] if shape else 1
        if rows != (shape[0] if shape else 1):
            raise ValueError(f"writer expected {want} {shape}, got {rows} rows")
        self.next += 1


def write_file(path: Path, specs: list, tensors: Iterable[tuple[str, Iterable[torch.Tensor]]], meta: dict) -> None:
    """One safetensors file at `path` from (name, pieces) in the order of specs [(name, shape, dtype)]."""
    w = PieceWriter(path, specs, meta, checksum=False, direct=True)
    try:
        for name, pieces in tensors:
            w.write_pieces(name, pieces)
        w.close()
    except BaseException:
        w.abort()
        raise


def deliver(out: Path, build: Callable[[Path], None], check: Optional[Callable[[Path], None]] = None) -> Path:
    """build(tmp) writes the output at a temporary path beside `out`; check(tmp) may refuse it (a
    ConvertError); only then is it moved into place. On any failure the temporary output is removed."""
    tmp = out.with_name(out.name + TMP_SUFFIX)
    remove_tree(tmp)  # a stale temp output, or a symlink planted there: unlinked, never followed
    try:
        build(tmp)
        if check is not None:
            check(tmp)
    except BaseException:
        remove_tree(tmp)
        raise
    replace_output(tmp, out)
    return out


def _dtype_for(src: Source, name: str, dtype: Optional[torch.dtype]) -> torch.dtype:
    stored = src.specs[name].dtype
    return dtype if dtype is not None and stored.is_floating_point else stored


def write(src: Source, out: Path, fmt: str, dtype: Optional[torch.dtype], progress: Progress,
          check: Optional[Callable[[Path], None]] = None, max_shard: int = MAX_SHARD) -> Path:
    """The source as `fmt` at `out` (see the module docstring). dtype None: as stored."""
    specs = [(n, list(s.shape), _dtype_for(src, n, dtype)) for n, s in src.specs.items()]
    for n, _, dt in specs:
        if dt not in WRITABLE:
            raise ConvertError(f"{src.where}: tensor '{n}' is {dt}, which a safetensors file here cannot hold "
                               f"(expected one of {', '.join(map(str, WRITABLE))})")
    if fmt in ("hf", "hf-gpt2"):
        if src.model is None:
            raise ConvertError(f"--format {fmt}: {src.where} is a plain DCP checkpoint, which does not say what "
                               f"model its tensors make (a Megatron-LM checkpoint converts with --from megatron)")
        if fmt == "hf-gpt2" and models.spec_of(src.model) is not models.spec(models.DEFAULT):
            raise ConvertError(f"--format hf-gpt2: {src.where} is a model.arch = '{src.model['arch']}' model; "
                               f"--format hf writes each family's own transformers folder")
        return deliver(out, lambda tmp: write_hf(tmp, src, dtype or torch.float32, progress, max_shard), check)
    if src.model is None:  # a plain tensor store: every tensor under its stored name
        meta = {KIND: "dcp", SKIPPED: json.dumps(src.skipped)}
    else:
        meta = {MODEL_CONFIG: json.dumps(src.model, sort_keys=True)}
    if fmt == "dcp":
        return deliver(out, lambda tmp: write_dcp(tmp, specs, src.stream(dtype, progress), meta, write_file), check)
    if src.model is not None:
        meta = src.model_metadata(MODEL_KIND)
    return deliver(out, lambda tmp: write_file(tmp, specs, src.stream(dtype, progress), {"format": "pt", **meta}),
                   check)
