"""Every converter input as one `Source` (common.py): megalite's own two here (a checkpoint step folder, one model
file), the others in their format's module (hf.py, dcp.py, megatron.py), and `open_source`, which tells them
apart (or takes --from's word for it)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from .. import models
from ..checkpoint import manifest as mf
from ..base.origin import Origin
from ..checkpoint.read import SliceReader
from ..checkpoint.stream import dtype_of
from ..checkpoint.tree import LATEST, MANIFEST, resolve
from ..base.fs import path_kind
from ..config import model_from, model_toml
from ..parallel.partition import Box
from ..checkpoint.validate import carried_by, read_origin
from .common import MODEL_CONFIG, ORIGIN, ConvertError, Source, Spec, check_manifest_tensors, \
    open_safetensors, parse_json
from .dcp import METADATA, DcpFolder
from .hf import HFFolder
from .hints import Hints
from .megatron import LATEST as MEGATRON_LATEST, META_JSON, MegatronGPT

SOURCES = ("megalite", "dcp", "megatron", "hf")


class StepSource(Source):
    """A megalite checkpoint (root or step folder): its manifest says everything; every byte read is checked
    against its block checksums."""

    def __init__(self, path):
        self.step = resolve(path)
        self.man = mf.read(self.step)
        check_manifest_tensors(self.step, self.man)
        self.where, self.guards = str(self.step), [self.step.parent, self.step]
        self.model = model_from(self.man.model_config, f"{self.step / MANIFEST}: config.model")
        self.specs = {n: Spec(tuple(e.shape), e.torch_dtype) for n, e in self.man.model.items()}
        self._reader = SliceReader(self.step, self.man)

    def read(self, name, region=None):
        e = self.man.model[name]
        box = Box.whole(e.shape) if region is None else Box(region)
        return self._reader.read(e, box).view(box.shape)

    def partitions(self):
        return {n: e.partition for n, e in self.man.model.items()}

    def tokenizer(self):
        return carried_by(self.step)

    def origin(self):
        return read_origin(self.step, self.man)


class FileSource(Source):
    """One safetensors file written by `megalite convert` (its metadata holds the [model] dict and tokenizer)."""

    def __init__(self, path):
        p = Path(path)
        self.where, self.guards = str(p), [p]
        self.f = open_safetensors(p, follow=True)  # the file the user named
        self.meta = self.f.metadata() or {}
        if MODEL_CONFIG not in self.meta:
            raise ConvertError(f"{p}: safetensors metadata has no '{MODEL_CONFIG}' (expected a file written by "
                               f"`megalite convert`)")
        self.model = model_from(parse_json(self.meta[MODEL_CONFIG], f"{p}: metadata '{MODEL_CONFIG}'"),
                                f"{p}: metadata '{MODEL_CONFIG}'")
        self.specs = {}
        for k in sorted(self.f.keys()):
            s = self.f.get_slice(k)
            self.specs[k] = Spec(tuple(s.get_shape()), dtype_of(s.get_dtype(), f"{p}: tensor '{k}'", ConvertError))

    def read(self, name, region=None):
        if region is None:
            return self.f.get_tensor(name)
        return self.f.get_slice(name)[tuple(slice(a, b) for a, b in region)]

    def tokenizer(self):
        return carried_by(self.where)

    def origin(self):
        text = self.meta.get(ORIGIN)
        return None if text is None else Origin.from_json(text, f"{self.where}: metadata '{ORIGIN}'", ConvertError)


def is_megatron(path: Path) -> bool:
    """A Megatron torch_dist iteration folder (metadata.json) or a root naming one."""
    return path.is_dir() and ((path / META_JSON).is_file() or (path / MEGATRON_LATEST).is_file())


def is_checkpoint(p: Path) -> bool:
    """A step folder (manifest.json) or a checkpoint root (`latest`), as opposed to any other folder."""
    return p.is_dir() and ((p / MANIFEST).exists() or (p / LATEST).exists())


def detect(path: Path) -> str:
    """'megatron', 'dcp', 'hf' (a folder with config.json) or 'megalite' (a step folder, a root, one file; also
    anything else: its reader says what is wrong)."""
    if is_megatron(path):
        return "megatron"
    if path.is_dir() and (path / METADATA).is_file():
        return "dcp"
    if path.is_dir() and not is_checkpoint(path) and (path / "config.json").is_file():
        return "hf"
    return "megalite"


def open_source(path, forced: Optional[str] = None, vocab_size: Optional[int] = None, arch: Optional[str] = None,
                hints: Optional[Hints] = None) -> Source:
    """The Source at `path`: found from what the folder holds, or `forced` (--from). arch and hints (--arch,
    --num-heads, --config, ...): what another trainer's checkpoint cannot tell (hints.py)."""
    p = Path(path)
    if forced is not None and forced not in SOURCES:
        raise ConvertError(f"--from '{forced}': expected one of {', '.join(SOURCES)}")
    if forced == "megatron" and not is_megatron(p):
        raise ConvertError(f"--from megatron: {p} has no metadata.json or latest_checkpointed_iteration.txt "
                           f"(expected a Megatron-LM torch_dist checkpoint)")
    if forced == "dcp" and not (p / METADATA).is_file():
        raise ConvertError(f"--from dcp: {p} has no {METADATA} (expected a torch.distributed.checkpoint folder)")
    kind = forced or detect(p)
    told = hints is not None and hints.given()
    if kind in ("megalite", "hf") and (arch is not None or told):
        raise ConvertError(f"--arch, --num-heads, --config, ...: only for a Megatron or DCP checkpoint (a "
                           f"{'megalite checkpoint' if kind == 'megalite' else 'transformers folder'} says what "
                           f"model it holds)")
    if vocab_size is not None and kind != "megatron":
        raise ConvertError(f"--vocab-size: only for a Megatron checkpoint (this source is "
                           f"{'a megalite checkpoint' if kind == 'megalite' else kind})")
    readers = {r: [n for n, s in models.FAMILIES.items() if r in s.readers] for r in ("megatron", "torchtitan")}
    if kind == "megatron":
        if arch not in (None, *readers["megatron"]):
            raise ConvertError(f"--arch '{arch}': expected {' or '.join(readers['megatron'])}")
        g = MegatronGPT(p, vocab_size, hints)
        made = models.spec_of(g.m).name
        if arch is not None and made != arch:
            raise ConvertError(f"--arch {arch} contradicts {p}: its arguments and tensors make a {made}")
        if hints is not None and hints.family is not None and hints.family != made:
            raise ConvertError(f"--config {hints.config}: its model_type is a {hints.family}, but the arguments and "
                               f"tensors of {p} make a {made}")
        return g
    if kind == "dcp":
        tt = " or ".join(readers["torchtitan"])
        if arch is None:
            if told:
                raise ConvertError(f"--num-heads, --config, ...: a DCP folder is read as a model only with --arch {tt}")
            return DcpFolder(p)
        if arch not in readers["torchtitan"]:
            raise ConvertError(f"--arch '{arch}': a DCP folder is read as a model only for --arch {tt} (torchtitan's "
                               f"{', '.join(models.spec(n).torchtitan.what for n in readers['torchtitan'])})")
        from .torchtitan import TorchtitanModel
        return TorchtitanModel(p, hints or Hints(), arch=arch)
    if kind == "hf":
        return HFFolder(p)
    if is_checkpoint(p) or p.is_dir():
        return StepSource(p)
    if not p.exists() and not p.is_symlink():
        raise ConvertError(f"model '{p}' does not exist")
    if not p.is_file():
        raise ConvertError(f"model '{p}' is {path_kind(p)}, expected a safetensors file or a transformers folder")
    return FileSource(p)


def model_section(path) -> str:
    """`megalite inspect PATH --model` (and `inspect` of a model file or a transformers folder): the model's
    [model] section as TOML a user can paste into a config, after one comment line saying what holds it."""
    src = open_source(path)
    if src.model is None:
        raise ConvertError(f"{src.where}: a plain DCP folder names no model (it has no [model] section)")
    origin, tok = src.origin(), src.tokenizer()
    dtypes = sorted({str(s.dtype).replace("torch.", "") for s in src.specs.values() if s.dtype.is_floating_point})
    said = (f"tokenizer {tok.kind}, {tok.vocab_size:,} ids" if tok is not None else "no tokenizer") + (
        ", with a chat template" if origin is not None and origin.chat_template() else "")
    recorded = f", recorded dtype {origin.dtype}" if origin is not None and origin.dtype else ""
    return (f"# {src.where}: {models.spec_of(src.model).name}, {len(src.specs)} tensors stored as "
            f"{'/'.join(dtypes) or 'nothing'}{recorded}; {said}\n" + model_toml(src.model))
