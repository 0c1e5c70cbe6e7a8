"""What every converter job shares: the error type, progress lines, output safety, the model's partition
tags, reading a checkpoint's model one full tensor at a time, and opening input files (JSON, safetensors)
with one-line errors."""
from __future__ import annotations

import json
import os
import stat
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Optional

import torch
from safetensors import safe_open

from ..base.fs import kind_of, output_refusal, read_all
from ..base.lock import held
from ..checkpoint.manifest import FORMAT as MANIFEST_FORMAT, Manifest, entry_for
from ..checkpoint.read import SliceReader
from ..checkpoint.stream import read_metadata
from ..checkpoint.tree import LATEST, LATEST_TMP, LOCK, MANIFEST, TMP_PREFIX, parse_step_dir
from ..config import ModelConfig
from ..base.errors import CheckpointError, ConvertError, LayoutError
from ..base.jsonio import loads
from ..model import GPTStage
from ..parallel.grid import Layout, ParallelGrid
from ..parallel.partition import Box, Partition

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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
MODEL_KIND = "model"  # safetensors metadata "megalite.kind" of a `megalite convert` model file
FILE_KINDS = (MODEL_KIND, "dcp")  # ... of any single file convert writes (a plain DCP source's file says "dcp")
HF_KIND = "hf-gpt2"  # ... of the model.safetensors of a `convert --format hf-gpt2` folder
HF_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}  # what that folder holds
DCP_OUT = "megalite.output"  # safetensors metadata of a `convert --format dcp` folder's file: "dcp"
HF_FILE, HF_INDEX = "model-00001-of-00001.safetensors", "model.safetensors.index.json"  # that folder's two files
OUT_KINDS = {"megalite": "a model file written by `megalite convert`",
             "hf-gpt2": "an HF GPT-2 folder written by `megalite convert --format hf-gpt2`",
             "dcp": "a DCP folder written by `megalite convert --format dcp`",
             "checkpoint": "a checkpoint root written by megalite (`latest`, step folders, its lock)"}


def _check_out(out: Path, force: bool, sources: Iterable[Path], kind: str) -> None:
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


def not_ours(out: Path, kind: str) -> str:
    """'' when `out` is an output of `kind` that megalite wrote, recognised by its marker; else what it is."""
    if out.is_symlink():
        return f"a symbolic link to '{os.readlink(out)}'"
    if kind == "megalite":
        return "" if _st_kind(out) in FILE_KINDS else _what(out, "megalite.kind")
    if not out.is_dir():
        return _what(out, None)
    names = {p.name for p in out.iterdir()}
    if kind in ("hf-gpt2", "dcp"):
        allowed, main, marker, want = ((HF_FILES, "model.safetensors", "megalite.kind", HF_KIND) if kind == "hf-gpt2"
                                       else ({HF_FILE, HF_INDEX}, HF_FILE, DCP_OUT, "dcp"))
        other = sorted(names - allowed)
        if other:
            return f"it holds '{other[0]}'" + (f" and {len(other) - 1} more" if len(other) > 1 else "")
        return "" if _st_kind(out / main, marker) == want else f"its {main} has no megalite marker"
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


def _st_kind(path: Path, key: str = "megalite.kind") -> str:
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


def _full_tensors(step: Path, man: Manifest, progress: Progress):
    """Yield (name, full tensor) for every model tensor, assembled from the slices, one at a time.

    A reader thread fetches the next tensor while the caller writes this one (file reads, CRC32 and
    writes all release the GIL), so at most two tensors are in memory.
    """
    reader = SliceReader(step, man)
    items = list(man.model.items())

    def fetch(i):
        return reader.read(items[i][1], Box.whole(items[i][1].shape))

    with ThreadPoolExecutor(max_workers=1) as pool:
        nxt = pool.submit(fetch, 0) if items else None
        for i, (name, _) in enumerate(items):
            t = nxt.result()
            nxt = pool.submit(fetch, i + 1) if i + 1 < len(items) else None
            yield name, t
            progress.step(t.numel() * t.element_size())


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


def open_safetensors(path: Path):
    """safetensors' own reader (memory-mapped) on `path`; a ConvertError if it is not a readable file."""
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a damaged file
        raise ConvertError(f"{path}: not a readable safetensors file ({e})") from None
