"""What every converter job shares: the Source interface (what each input answers), the safetensors metadata
keys megalite writes, progress lines, output safety, the model's partition tags, and opening input files
(JSON, safetensors) with one-line errors.

The Source interface. Every input (a megalite step folder, one megalite file, a transformers folder, a DCP
folder, a Megatron folder) is a `Source` answering the same questions:

    src.model         the megalite [model] dict (family and sizes), or None: a plain DCP folder names no model
    src.specs         {megalite global name: Spec(shape, dtype)} in the model's order (a plain DCP folder:
                      its stored names)
    src.read(name, region=None)   one tensor, or a region of it ((start, stop) per dim), in its stored dtype
    src.pieces(name)  the tensor as consecutive row pieces (a DCP folder yields its Shard(0) chunks unassembled)
    src.tokenizer()   the Tokenizer it carries, or None
    src.origin()      what its source said that the tensors do not (base/origin.py: the tokenizer's and
                      generation's files byte for byte, the stored dtype, the special ids), or None
    src.reference()   a forward of the source's own for `convert --check` (token ids (B, T) -> logits (B, T, V)),
                      or None: check.py then runs megalite's model on the source's tensors
    src.guards        the paths an --out must stay clear of; src.skipped: entries not converted

Each output (sink.py: one file, DCP, transformers; resharding.py: a megalite layout) consumes that answer.
"""
from __future__ import annotations

import functools
import json
import os
import re
import stat
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

import torch
from safetensors import safe_open

from ..base.fs import by_descriptor, kind_of, output_refusal, read_all, what_is
from ..base.lock import held
from ..base.origin import Origin
from ..checkpoint.manifest import FORMAT as MANIFEST_FORMAT, Manifest, entry_for
from ..checkpoint.stream import read_metadata
from ..checkpoint.tree import LATEST, LATEST_TMP, LOCK, MANIFEST, TMP_PREFIX, parse_step_dir
from ..config import ModelConfig
from ..base.errors import CheckpointError, ConvertError, LayoutError
from ..base.jsonio import loads
from ..model import GPTStage
from ..tokenizer import TOKENIZER_KEY
from ..parallel.grid import Layout, ParallelGrid
from ..parallel.partition import Partition

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# ---------------------------------------------------------------- safetensors metadata megalite writes
KIND = "megalite.kind"  # what the file is: MODEL_KIND, "dcp" (a plain DCP source's tensors), HF_KIND
MODEL_CONFIG = "megalite.model_config"  # the [model] dict, JSON
PARTITIONS = "megalite.partitions"  # {name: partition tag}, JSON
TOKENIZER = TOKENIZER_KEY  # the run's tokenizer.json text (tokenizer.py owns "which tokenizer an artifact carries")
ORIGIN = "megalite.origin"  # base/origin.py's JSON: the source's tokenizer files, dtype and ids
SKIPPED = "megalite.skipped"  # a DCP source's non-tensor entries, JSON list
DCP_OUT = "megalite.output"  # the file of a `convert --format dcp` folder: "dcp"


@dataclass(frozen=True)
class Spec:
    """One tensor of a source: its global shape and stored dtype."""
    shape: tuple
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


Runner = Callable[[torch.Tensor], torch.Tensor]  # token ids (B, T) -> logits (B, T, V)


class Source:
    """What every converter input answers (see the module docstring). Subclasses set `where`, `guards`,
    `model`, `specs` (and `skipped`) in __init__ and define `read`."""
    where: str = ""
    guards: list = []
    model: Optional[dict] = None
    specs: dict = {}
    skipped: list = []

    def read(self, name: str, region: Optional[tuple] = None) -> torch.Tensor:
        raise NotImplementedError

    def pieces(self, name: str) -> Iterator[torch.Tensor]:
        yield self.read(name)

    def tokenizer(self):
        return None

    def origin(self) -> Optional[Origin]:
        return None

    def partitions(self) -> dict:
        """The partition tag of every tensor (asked of the model: a source's own layout is not megalite's)."""
        if self.model is None:
            raise ConvertError(f"{self.where}: names no model (it is a plain tensor store); it has no layout")
        return model_partitions(self.model)

    def reference(self) -> Optional[Runner]:
        """A forward of the source's own (transformers' for a transformers folder; megatron-core's or
        torchtitan's where installed), or None: `convert --check` then runs megalite's model on its tensors."""
        return None

    def stream(self, dtype: Optional[torch.dtype], progress: "Progress"):
        """(name, pieces) for every tensor in order, floating ones cast to `dtype` when given, one at a time:
        a reader thread fetches the next tensor while the caller writes this one (file reads, CRC32 and
        writes release the GIL), so at most two are in memory."""
        names = list(self.specs)

        def fetch(i):
            return list(self.pieces(names[i]))

        with ThreadPoolExecutor(max_workers=1) as pool:
            nxt = pool.submit(fetch, 0) if names else None
            for i, name in enumerate(names):
                pieces = nxt.result()
                nxt = pool.submit(fetch, i + 1) if i + 1 < len(names) else None
                if dtype is not None and self.specs[name].dtype.is_floating_point:
                    pieces = [cast(p, dtype, name) for p in pieces]
                yield name, pieces
                progress.step(sum(p.numel() * p.element_size() for p in pieces))

    def model_metadata(self, kind: str = "model") -> dict:
        """The safetensors metadata of a megalite model file written from this source."""
        meta = {"format": "pt", KIND: kind, MODEL_CONFIG: json.dumps(self.model, sort_keys=True),
                PARTITIONS: json.dumps({n: p.to_json() for n, p in self.partitions().items()}, sort_keys=True)}
        tok = self.tokenizer()
        if tok is not None:  # the run's tokenizer travels with the model (generate and split read it)
            meta[TOKENIZER] = tok.json
        origin = self.origin()
        if origin is not None:
            meta[ORIGIN] = origin.to_json()
        return meta


def cast(t: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """`t` as `dtype`; a finite value the dtype cannot hold (1e6 in fp16, whose largest is 65504) is refused
    naming the tensor, never written as inf."""
    out = t.to(dtype)
    if out.is_floating_point() and out.dtype != t.dtype and int(torch.isinf(out).sum()) > int(torch.isinf(t).sum()):
        big = t[torch.isinf(out) & torch.isfinite(t)].abs().max().item()
        raise ConvertError(f"--dtype: tensor '{name}' holds {big:.6g}, beyond {dtype}'s largest finite value "
                           f"{torch.finfo(dtype).max:.6g}; convert to bf16 or fp32")
    return out


class ForeignModel(Source):
    """Another trainer's model read tensor by tensor under megalite's names (megatron.py, torchtitan.py).
    Subclasses set `m` (the [model] dict), `shapes` ({megalite name: global shape}), `parts` (partition tags,
    None where megalite's model cannot hold it), `ck` (its DcpFolder) and define `get(name)` (one tensor,
    megalite's layout, stored dtype) and `stored(name)` (the name it is read from)."""
    m: dict = {}
    shapes: dict = {}
    parts: Optional[dict] = None
    refusal = ""  # why megalite's model cannot hold it ('' when it can)

    @property
    def model(self):
        return self.m

    @functools.cached_property
    def specs(self):
        """Built once, on first use (asked once per tensor by a convert: rebuilt each time it was quadratic)."""
        return {n: Spec(tuple(s), self.ck.tensors[self.stored(n)].dtype) for n, s in self.shapes.items()}

    def read(self, name, region=None):
        t = self.get(name)
        return t if region is None else t[tuple(slice(a, b) for a, b in region)]

    def partitions(self):
        if self.parts is None:
            raise ConvertError(self.refusal or f"{self.where}: megalite's model cannot hold this model")
        return self.parts


# ---------------------------------------------------------------- progress
class Progress:
    """`what: 12/52 tensors, 1.2/3.4 GiB` on stderr, at most about once a second; silent when quiet."""

    def __init__(self, what: str, total_items: int, total_bytes: int, quiet: bool = False, every_s: float = 1.0):
        self.what, self.n, self.total_b, self.quiet, self.every = what, total_items, total_bytes, quiet, every_s
        self.i = self.b = 0
        self.last = time.monotonic()  # the first line comes after a second: small jobs stay silent
        self.printed = False

    def step(self, nbytes: int) -> None:
        self.i += 1
        self.b += nbytes
        now = time.monotonic()
        if not self.quiet and (now - self.last >= self.every or (self.i == self.n and self.printed)):
            self.last, self.printed = now, True
            print(f"{self.what}: {self.i}/{self.n} tensors, {self.b / 2**30:.2f}/{self.total_b / 2**30:.2f} GiB",
                  file=sys.stderr, flush=True)


# ---------------------------------------------------------------- output safety
# What each kind of output is, and the marker by which megalite recognises one it wrote (what --force may replace).
MODEL_KIND = "model"  # KIND of a `megalite convert` model file
FILE_KINDS = (MODEL_KIND, "dcp")  # ... of any single file convert writes (a plain DCP source's file says "dcp")
HF_KIND = "hf-"  # ... of the safetensors files of a `convert --format hf` folder: "hf-" + the family ("hf-llama")
HF_FILES = {"config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
            "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"}  # what that folder holds (and model-NNNNN-of-NNNNN shards)
HF_FILE, HF_INDEX = "model-00001-of-00001.safetensors", "model.safetensors.index.json"  # that folder's two files
OUT_KINDS = {"megalite": "a model file written by `megalite convert`",
             "hf": "an HF GPT-2 folder (or a Llama one) written by `megalite convert --format hf`",
             "dcp": "a DCP folder written by `megalite convert --format dcp`",
             "checkpoint": "a checkpoint root written by megalite (`latest`, step folders, its lock)"}


def check_out(out: Path, force: bool, sources: Iterable[Path], kind: str) -> None:
    """Refuse an output that is, contains or lies inside a source; that is `/`, `.` or holds the current
    folder; that holds a live training run's lock; or that exists (without --force). With --force an existing
    output is replaced only if it is of the same `kind` (OUT_KINDS) and megalite wrote it (`not_ours`): never a
    file or folder of anything else."""
    refused = output_refusal(out, sources)
    if refused:
        raise ConvertError(refused)
    given, out = out, out.resolve()
    if not os.path.lexists(given):
        return
    if not force:
        raise ConvertError(f"--out {out} already exists (pass --force to replace it)")
    if given.is_dir() and not given.is_symlink():
        for lock in [given / LOCK, *given.glob(f"*/{LOCK}")]:
            if held(lock):
                raise ConvertError(f"--out {out}: a training run holds {lock}; refusing to replace a live run's "
                                   f"checkpoint folder")
    why = not_ours(given, kind)
    if why:
        raise ConvertError(f"--out {given} already exists and is not {OUT_KINDS[kind]} ({why}); --force replaces "
                           f"only such an output: remove it yourself or choose another --out")


SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")  # transformers' shard file names


def not_ours(out: Path, kind: str) -> str:
    """'' when `out` is an output of `kind` that megalite wrote, recognised by its marker; else what it is."""
    if out.is_symlink():
        return what_is(out)
    if kind == "megalite":
        return "" if _st_kind(out) in FILE_KINDS else _what(out, KIND)
    if not out.is_dir():
        return _what(out, None)
    names = {p.name for p in out.iterdir()}
    if kind in ("hf", "dcp"):
        allowed, main, marker, want = ((HF_FILES, "model.safetensors", KIND, HF_KIND) if kind == "hf"
                                       else ({HF_FILE, HF_INDEX}, HF_FILE, DCP_OUT, "dcp"))
        if kind == "hf" and "model.safetensors" not in names:
            main = min((n for n in names if SHARD_NAME.fullmatch(n)), default=main)
        other = sorted(n for n in names - allowed if not (kind == "hf" and SHARD_NAME.fullmatch(n)))
        if other:
            return f"it holds '{other[0]}'" + (f" and {len(other) - 1} more" if len(other) > 1 else "")
        got = _st_kind(out / main, marker)
        return "" if got == want or kind == "hf" and got.startswith(want) else f"its {main} has no megalite marker"
    for name in sorted(names):  # a checkpoint root: `latest`, its lock, step folders with manifests, temp names
        p = out / name
        if name in (LATEST, LOCK, LATEST_TMP) and not p.is_dir():
            continue
        if name.startswith(TMP_PREFIX):
            continue
        if parse_step_dir(name) is not None and p.is_dir() and not p.is_symlink() and _is_manifest(p / MANIFEST):
            continue
        return f"it holds '{name}', which is not part of a megalite checkpoint"
    return ""


def _st_kind(path: Path, key: str = KIND) -> str:
    """The `key` of a safetensors file's metadata ('' if it is no such file)."""
    try:
        return str(read_metadata(path).get(key, ""))
    except (OSError, ValueError):
        return ""


def _is_manifest(path: Path) -> bool:
    try:
        return json.loads(read_all(path)).get("format") == MANIFEST_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _what(out: Path, marker: Optional[str]) -> str:
    try:
        st = os.lstat(out)
    except OSError as e:
        return e.strerror or str(e)
    what = kind_of(st)
    if stat.S_ISREG(st.st_mode) and marker:
        return f"a file without the '{marker}' marker megalite writes"
    return what




def model_partitions(m: dict) -> dict[str, Partition]:
    """The partition tag of every parameter, asked of the model itself (built on the meta device)."""
    with torch.device("meta"):
        stage = GPTStage(ModelConfig(**m), ParallelGrid.single())
    return {name: p.partition for name, p in stage.global_parameters()}


def check_manifest_tensors(step: Path, man: Manifest) -> None:
    """Every tensor the model config implies is in the manifest, with its global shape."""
    if not man.model_config:
        raise ConvertError(f"{step}: manifest field 'config.model' is empty; the model cannot be described")
    for name, part in model_partitions(man.model_config).items():
        try:
            entry_for(man.model, name, part.global_shape, step)
        except CheckpointError as e:
            raise ConvertError(str(e)) from None


MAX_WORLD = 2**17  # ranks of a layout split/reshard writes: beyond today's largest runs (a folder per rank)


def check_layout(m: dict, tp: int, pp: int, dp: int, cp: int = 1) -> Layout:
    """The layout split/reshard write (--tp/--pp/--dp/--cp): valid for the model, and at most MAX_WORLD ranks
    (a layout of 10**20 once enumerated its coordinates until killed). A manifest's layout is bounded by the
    state.json files it lists (manifest.py)."""
    try:
        layout = Layout(tp, pp, dp, cp).validate(m, "--")
    except LayoutError as e:
        raise ConvertError(str(e)) from None
    if layout.world_size > MAX_WORLD:
        axes = "--tp x --pp x --dp" + (" x --cp" if cp != 1 else "")
        raise ConvertError(f"{axes} = {layout.world_size}: more ranks than the {MAX_WORLD} megalite "
                           f"supports (one checkpoint folder per rank)")
    return layout


# ---------------------------------------------------------------- input files
def parse_json(text: str, source: str):
    """`text` parsed as JSON within limits' budget for a small JSON file (its size, its nesting); a
    ConvertError naming `source` if it is not."""
    return loads(text, source, ConvertError, kind="json")


def open_safetensors(path: Path, follow: bool = False):
    """safetensors' own reader (memory-mapped) on `path`, opened the safe way first (base/fs.open_regular: a FIFO
    or device refused at open, never waited on; a symlink refused unless `follow`, for the path the user named)
    and read through that descriptor, so what is checked is what is read; a ConvertError if it is not a
    readable safetensors file."""
    with by_descriptor(path, follow=follow) as name:  # safe_open holds its own descriptor and map after
        try:
            return safe_open(name, framework="pt")
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a damaged file
            raise ConvertError(f"{path}: not a readable safetensors file ({e})") from None
