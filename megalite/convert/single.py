"""Any layout -> one safetensors file, and reading one model file back (megalite's or an HF GPT-2 folder)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors import safe_open

from ..checkpoint import manifest as mf
from ..checkpoint.load import read_tokenizer
from ..checkpoint.read import SliceReader
from ..checkpoint.tree import LATEST, MANIFEST, TOKENIZER_REL, Box, remove_tree, resolve
from ..checkpoint.stream import StreamingWriter
from ..config import model_from, path_kind
from ..tokenizer import Tokenizer, from_json
from .common import (DTYPES, ConvertError, Progress, _check_out, _full_tensors, _replace,
                     check_manifest_tensors)

FORMATS = ("megalite", "hf-gpt2")
TOKENIZER_KEY = "megalite.tokenizer"  # safetensors metadata: the run's tokenizer.json text


def convert(ckpt, out, dtype: str = "fp32", fmt: str = "megalite", force: bool = False,
            quiet: bool = False) -> Path:
    """Reassemble the model of any layout into one safetensors file (or an HF GPT-2 folder)."""
    if fmt not in FORMATS:
        raise ConvertError(f"--format '{fmt}': expected one of {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise ConvertError(f"--dtype '{dtype}': expected one of {', '.join(DTYPES)}")
    step = resolve(ckpt)
    man = mf.read(step)
    check_manifest_tensors(step, man)
    out = Path(out)
    _check_out(out, force, [step.parent, step])
    total = sum(e.nbytes for e in man.model.values())
    progress = Progress("convert", len(man.model), total, quiet)
    tokenizer = read_tokenizer(step, man)
    if fmt == "hf-gpt2":
        from .hf import export_hf
        tok = from_json(tokenizer.decode("utf-8"), f"{step / TOKENIZER_REL}") if tokenizer is not None else None
        return export_hf(step, man, out, DTYPES[dtype], progress, tok)
    tmp = out.with_name(out.name + ".tmp-megalite")
    remove_tree(tmp)  # a stale temp file, or a symlink planted there: unlinked, never followed (O_NOFOLLOW below)
    torch_dtype = DTYPES[dtype]
    specs = [(n, list(e.shape), torch_dtype) for n, e in man.model.items()]
    meta = {"format": "pt", "megalite.kind": "model", "megalite.model_config": json.dumps(man.model_config, sort_keys=True),
            "megalite.partitions": json.dumps({n: e.partition.to_json() for n, e in man.model.items()},
                                              sort_keys=True)}
    if tokenizer is not None:  # the run's tokenizer travels with the model (generate and split read it)
        meta[TOKENIZER_KEY] = tokenizer.decode("utf-8")
    w = StreamingWriter(tmp, specs, meta, checksum=False, direct=True)
    try:
        for name, t in _full_tensors(step, man, progress):
            w.write(name, t.to(torch_dtype))
        w.close()
    except BaseException:
        w.abort()
        raise
    _replace(tmp, out)
    return out


def is_checkpoint(p: Path) -> bool:
    """A step folder (manifest.json) or a checkpoint root (`latest`), as opposed to an HF folder."""
    return p.is_dir() and ((p / MANIFEST).exists() or (p / LATEST).exists())


def read_model_file(path) -> tuple[dict, Callable[[str], torch.Tensor], list[str]]:
    """(model config dict, get(name) -> full fp32 tensor, names) for a megalite file, an HF GPT-2 folder or a
    checkpoint (root or step folder; every byte read checked against its block checksums)."""
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
        from .hf import read_hf_folder
        return read_hf_folder(p)
    if not p.exists() and not p.is_symlink():
        raise ConvertError(f"model '{p}' does not exist")
    if not p.is_file():
        raise ConvertError(f"model '{p}' is {path_kind(p)}, expected a safetensors file or an HF GPT-2 folder")
    f = _open_st(p)
    meta = f.metadata() or {}
    if "megalite.model_config" not in meta:
        raise ConvertError(f"{p}: safetensors metadata has no 'megalite.model_config' "
                           f"(expected a file written by `megalite convert`)")
    m = model_from(_json(meta["megalite.model_config"], f"{p}: metadata 'megalite.model_config'"),
                   f"{p}: metadata 'megalite.model_config'")
    return m, (lambda name: f.get_tensor(name).float()), sorted(f.keys())


def model_tokenizer(path) -> Optional[Tokenizer]:
    """The tokenizer a model carries, or None: a checkpoint's tokenizer.json, a converted file's metadata
    'megalite.tokenizer', an HF folder's tokenizer.json or vocab.json + merges.txt."""
    p = Path(path)
    if is_checkpoint(p):
        step = resolve(p)
        text = read_tokenizer(step, mf.read(step))
        where = f"{step / TOKENIZER_REL}"
    elif p.is_dir():
        from .hf import folder_tokenizer
        return folder_tokenizer(p)
    else:
        text = (_open_st(p).metadata() or {}).get(TOKENIZER_KEY)
        where = f"{p}: metadata '{TOKENIZER_KEY}'"
    if text is None:
        return None
    return from_json(text if isinstance(text, str) else text.decode("utf-8", errors="replace"), where)


def _json(text: str, source: str):
    try:
        return json.loads(text)
    except ValueError as e:
        raise ConvertError(f"{source} is not valid JSON ({e})") from None


def _open_st(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # noqa: BLE001
        raise ConvertError(f"{path}: not a readable safetensors file ({e})") from None


