"""The manifest: the global description of one checkpoint, typed, with one owner (this module).

    {
      "format": "megalite-checkpoint", "format_version": 2,
      "manifest_crc32c": "<CRC32C of the canonical JSON of everything else>",
      "megalite_version": "...", "torch_version": "...", "created": "<ISO time>",
      "step": 200, "tokens_seen": 204800,
      "layout": {"tp": 2, "pp": 2, "dp": 2, "zero1": true},
      "config": { the full run config }, "data": {"batch_index": 200}, "client_state": {}, "scheduler": null,
      "optimizer": {"type": "adamw", "step": 200, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
      "checksum": {"algorithm": "crc32c", "block_bytes": 1048576},
      "model":     { "<global name>": TENSOR, ... },        e.g. "blocks.7.attn.qkv.weight"
      "optimizer_state": { "<global name>.exp_avg": TENSOR, "<global name>.exp_avg_sq": TENSOR, ... },
        a torch.optim optimizer's instead (torch_optim.py): "optimizer": {"type": "torch.optim",
          "class": "torch.optim.adamw.AdamW", "step": 200, "param_groups": [{"params": [<global names>], "lr": ...}],
          "scalars": {"<global name>": {"step": {"dtype": "float32", "value": 200.0}}}},
          "optimizer_state": {"<global name>.optim.<key>": TENSOR, ...}   (key: exp_avg, momentum_buffer, ...)
      "files": { "tp00-pp00-dp00/model.safetensors": {"bytes": 123, "header_crc32c": "89abcdef"},
                 "tp00-pp00-dp00/state.json": {"bytes": 456, "crc32c": "01234567"},
                 "tp00-pp00-dp00/tokenizer.json": {"bytes": 789, "crc32c": ...}  the run's tokenizer, if any, ... }
    }
    TENSOR = {"dtype": "float32" | "bfloat16" | "float16", "shape": [global shape],
              "partition": {"dim": split dim over tp or null, "tied_to": null,
                            "placement": "first" | "last" | "layer.<i>"  (which pipeline stage owns it)},
              "slices": [{"file": "...", "key": "<key in that file>",
                          "box": [[start, end] per dim of the global tensor],
                          "flat": [a, b]    only for ZeRO-1 pieces: elements [a, b) of the box, row-major,
                          "crc32c": ["<CRC32C of stored bytes [0, B)>", "<of [B, 2B)>", ...]}]}   B = block_bytes

`Manifest.from_json` checks everything a loader relies on and raises one-line CheckpointErrors naming the
field; nothing else in megalite reads the JSON. Validation is linear in the number of slices (tiling is
checked on the sorted grid of each tensor's cut points, not by comparing slices pairwise).
"""
from __future__ import annotations

import bisect
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..errors import LayoutError
from ..parallel.grid import Layout
from ..parallel.partition import Partition
from .tree import MANIFEST, MODEL_FILE, OPTIM_FILE, STATE_FILE, TOKENIZER_FILE, Box, CheckpointError, coord_dir
from .stream import crc32c

FORMAT = "megalite-checkpoint"
FORMAT_VERSION = 2
BLOCK_BYTES = 1 << 20  # checksum granularity: a reader verifies exactly the blocks it touches
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MOMENTS = ("exp_avg", "exp_avg_sq")
# A torch.optim optimizer (optimizer.type = TORCH_OPTIM; see torch_optim.py): its per-parameter state tensors are
# "<name>.optim.<key>" (kind "optim.<key>"), its scalar state and param groups live in the optimizer section.
TORCH_OPTIM = "torch.optim"
STATE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")  # a torch.optim state or hyperparameter key
SCALAR_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16, "int64": torch.int64, "int32": torch.int32}
_CLASS = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*){0,15}$")
_FILE_RE = re.compile(r"^(tp\d{2,}-pp\d{2,}-dp\d{2,})/(" + "|".join(
    re.escape(n) for n in (MODEL_FILE, OPTIM_FILE, STATE_FILE, TOKENIZER_FILE)) + r")$")
_HEX8 = re.compile(r"^[0-9a-f]{8}$")
_PLACEMENT = re.compile(r"^(first|last|layer\.(\d+))$")


def crc32c_file(path: Path, chunk: int = 16 << 20) -> str:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = crc32c(block, crc)
    return f"{crc:08x}"


def n_blocks(nbytes: int, block: int) -> int:
    return -(-nbytes // block)


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise CheckpointError(f"dtype {dtype} cannot be checkpointed (expected one of {', '.join(DTYPES)})")
    return DTYPE_NAMES[dtype]


def itemsize(dtype: str) -> int:
    return torch.empty((), dtype=DTYPES[dtype]).element_size()


# ---------------------------------------------------------------- the typed records
@dataclass(frozen=True)
class FileRecord:
    """A file of the step folder: its size, and the CRC32C of its header (safetensors: the 8-byte length
    and the JSON; the tensor bytes are covered by their slices' block checksums) or of all of it (JSON)."""
    bytes: int
    crc32c: str

    def to_json(self, rel: str) -> dict:
        return {"bytes": self.bytes, ("crc32c" if rel.endswith(".json") else "header_crc32c"): self.crc32c}


@dataclass(frozen=True)
class SliceRef:
    """One stored slice: which file and key hold it, which region of the global tensor it is, checksums."""
    file: str
    key: str
    box: Box
    flat: Optional[tuple] = None  # ZeRO-1 piece: elements [a, b) of the box, row-major
    crc32c: tuple = ()  # one per block of the stored bytes

    @property
    def shape(self) -> list:
        """The shape of the stored tensor."""
        return [self.flat[1] - self.flat[0]] if self.flat else list(self.box.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_json(self) -> dict:
        out = {"file": self.file, "key": self.key, "box": self.box.to_json()}
        if self.flat:
            out["flat"] = list(self.flat)
        out["crc32c"] = list(self.crc32c)
        return out


@dataclass(frozen=True)
class TensorEntry:
    """One global tensor: its name, kind ("model", an AdamW moment or "optim.<key>"), real dtype, shape,
    partition, slices."""
    name: str
    kind: str
    dtype: str
    shape: tuple
    partition: Partition
    slices: tuple = ()

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "partition": self.partition.to_json(),
                "slices": [s.to_json() for s in self.slices]}


INFO_KEYS = ("megalite_version", "torch_version", "created", "resharded_from")


@dataclass
class Manifest:
    step: int
    tokens_seen: int
    layout: Layout
    zero1: bool
    config: dict
    data: dict
    optimizer: Optional[dict]
    client_state: dict
    scheduler: Optional[dict]
    model: dict  # name -> TensorEntry
    optimizer_state: dict  # "<name>.<moment>" -> TensorEntry
    files: dict  # rel path -> FileRecord
    block_bytes: int = BLOCK_BYTES
    info: dict = field(default_factory=dict)  # megalite/torch version, created, resharded_from: not relied on

    @property
    def model_config(self) -> dict:
        return self.config.get("model") or {}

    def tensors(self):
        yield from self.model.values()
        yield from self.optimizer_state.values()

    def slices_of(self, rel: str) -> list:
        """(entry, slice) for every slice stored in file `rel`."""
        return [(e, s) for e in self.tensors() for s in e.slices if s.file == rel]

    # -------------------------------------------------------- JSON
    def to_json(self) -> dict:
        body = {**{k: v for k, v in self.info.items() if v is not None},
                "step": self.step, "tokens_seen": self.tokens_seen,
                "layout": {"tp": self.layout.tp, "pp": self.layout.pp, "dp": self.layout.dp, "zero1": self.zero1},
                "config": self.config, "data": self.data, "optimizer": self.optimizer,
                "client_state": self.client_state, "scheduler": self.scheduler,
                "checksum": {"algorithm": "crc32c", "block_bytes": self.block_bytes},
                "model": {n: e.to_json() for n, e in sorted(self.model.items())},
                "optimizer_state": {n: e.to_json() for n, e in sorted(self.optimizer_state.items())},
                "files": {r: f.to_json(r) for r, f in sorted(self.files.items())}}
        return sign({"format": FORMAT, "format_version": FORMAT_VERSION, **body})

    @classmethod
    def from_json(cls, d, where: str = MANIFEST) -> "Manifest":
        return _Parser(where).manifest(d)


def canonical_crc(d: dict) -> str:
    """CRC32C of the canonical JSON (sorted keys, no spaces) of `d` without its manifest_crc32c."""
    body = {k: v for k, v in d.items() if k != "manifest_crc32c"}
    return f"{crc32c(json.dumps(body, sort_keys=True, separators=(',', ':')).encode()):08x}"


def sign(d: dict) -> dict:
    """`d` with manifest_crc32c set (after format/format_version, for readers of the file)."""
    head = {k: d[k] for k in ("format", "format_version") if k in d}
    rest = {k: v for k, v in d.items() if k not in head and k != "manifest_crc32c"}
    return {**head, "manifest_crc32c": canonical_crc(d), **rest}


# ---------------------------------------------------------------- validation
def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


class _Parser:
    """Turns manifest JSON into typed records, refusing anything a loader could not rely on."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, fld: str, got, expected: str):
        raise CheckpointError(f"{self.where}: field '{fld}' is {_short(got)}, expected {expected}")

    def get(self, d: dict, key: str, fld: str):
        if key not in d:
            raise CheckpointError(f"{self.where}: field '{fld}' is missing")
        return d[key]

    def int_(self, v, fld: str, lo: int = 0) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            self.fail(fld, v, f"an integer >= {lo}")
        return v

    def dict_(self, v, fld: str, optional: bool = False) -> Optional[dict]:
        if v is None and optional:
            return None
        if not isinstance(v, dict):
            self.fail(fld, v, "an object" + (" or null" if optional else ""))
        return v

    def range_(self, v, fld: str, hi: int) -> tuple:
        if (not isinstance(v, list) or len(v) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in v)
                or not 0 <= v[0] < v[1] <= hi):
            self.fail(fld, v, f"[start, end] with 0 <= start < end <= {hi}")
        return v[0], v[1]

    def manifest(self, d) -> Manifest:
        if not isinstance(d, dict):
            raise CheckpointError(f"{self.where}: expected a JSON object, got {type(d).__name__}")
        if d.get("format") != FORMAT:
            self.fail("format", d.get("format"), f"'{FORMAT}'")
        version = d.get("format_version")
        if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
            raise CheckpointError(f"{self.where}: format_version {version} is newer than this megalite reads "
                                  f"(format_version {FORMAT_VERSION}); upgrade megalite")
        if version != FORMAT_VERSION:
            self.fail("format_version", version, f"{FORMAT_VERSION} (the only version this megalite reads)")
        crc = d.get("manifest_crc32c")
        if not isinstance(crc, str) or crc != canonical_crc(d):
            raise CheckpointError(f"{self.where}: field 'manifest_crc32c' is {_short(crc)} but the content's CRC32C "
                                  f"is {canonical_crc(d)} (the manifest was edited or damaged)")
        step = self.int_(self.get(d, "step", "step"), "step")
        tokens = self.int_(d.get("tokens_seen", 0), "tokens_seen")
        config = self.dict_(self.get(d, "config", "config"), "config")
        model_cfg = self.dict_(config.get("model", {}), "config.model")
        lay = self.dict_(self.get(d, "layout", "layout"), "layout")
        layout = Layout(*(self.get(lay, k, f"layout.{k}") for k in ("tp", "pp", "dp")))
        try:
            layout.validate(model_cfg, "layout.")
        except LayoutError as e:
            raise CheckpointError(f"{self.where}: {e}") from None
        zero1 = lay.get("zero1", False)
        if not isinstance(zero1, bool):
            self.fail("layout.zero1", zero1, "true or false")
        opt = self.dict_(d.get("optimizer"), "optimizer", optional=True)
        if opt is not None:
            self.int_(self.get(opt, "step", "optimizer.step"), "optimizer.step")
        chk = self.dict_(self.get(d, "checksum", "checksum"), "checksum")
        if chk.get("algorithm") != "crc32c":
            self.fail("checksum.algorithm", chk.get("algorithm"), "'crc32c'")
        block = self.int_(chk.get("block_bytes"), "checksum.block_bytes", 8)
        if block % 8:
            self.fail("checksum.block_bytes", block, "a multiple of 8")
        files = self.files(self.dict_(self.get(d, "files", "files"), "files"), layout)
        n_layer = model_cfg.get("n_layer") if isinstance(model_cfg.get("n_layer"), int) else None
        seen: set = set()
        model = {n: self.entry("model", n, e, files, block, n_layer, seen)
                 for n, e in self.dict_(self.get(d, "model", "model"), "model").items()}
        optim = {}
        torch_optim = opt is not None and opt.get("type") == TORCH_OPTIM
        if torch_optim:
            self.torch_optimizer(opt, model)
        for n, e in self.dict_(self.get(d, "optimizer_state", "optimizer_state"), "optimizer_state").items():
            base, kind = state_name(n, torch_optim)
            expected = "optim.<key>" if torch_optim else "|".join(MOMENTS)
            if kind is None:
                raise CheckpointError(f"{self.where}: optimizer_state entry {_short(n)} is not '<model tensor>."
                                      f"{expected}'" + (" (key: an identifier)" if torch_optim else ""))
            if base not in model:
                raise CheckpointError(f"{self.where}: optimizer_state entry {_short(n)} names no model tensor "
                                      f"{_short(base)} (missing from 'model'; expected '<model tensor>.{expected}')")
            entry = self.entry("optimizer_state", n, e, files, block, n_layer, seen, kind=kind)
            if entry.shape != model[base].shape:
                self.fail(f"optimizer_state.{n}.shape", list(entry.shape), f"{list(model[base].shape)} (as '{base}')")
            optim[n] = entry
        info = {k: d[k] for k in INFO_KEYS if k in d}
        return Manifest(step, tokens, layout, zero1, config, self.dict_(d.get("data", {}), "data"), opt,
                        self.dict_(d.get("client_state", {}), "client_state"),
                        self.dict_(d.get("scheduler"), "scheduler", optional=True),
                        model, optim, files, block, info)

    def torch_optimizer(self, opt: dict, model: dict) -> None:
        """The optimizer section of a torch.optim checkpoint (torch_optim.describe writes it):
        class, param_groups [{"params": [names], <hyperparameter>: JSON value}], scalars {name: {key: {dtype?, value}}}."""
        cls = opt.get("class")
        if not isinstance(cls, str) or not _CLASS.match(cls):
            self.fail("optimizer.class", cls, "a dotted Python class name")
        groups, grouped = opt.get("param_groups"), set()
        if not isinstance(groups, list) or not groups:
            self.fail("optimizer.param_groups", groups, "a non-empty list")
        for k, g in enumerate(groups):
            at = f"optimizer.param_groups[{k}]"
            self.dict_(g, at)
            names = g.get("params")
            for n in names if isinstance(names, list) else [None]:
                if not isinstance(n, str) or n not in model or n in grouped:
                    self.fail(f"{at}.params", names, "a list of model tensor names, each listed once")
                grouped.add(n)
            for key, v in g.items():
                if not isinstance(key, str) or not STATE_KEY.match(key):
                    self.fail(f"{at} key", key, "an identifier")
                if key != "params" and not _hyper_ok(v):
                    self.fail(f"{at}.{key}", v, "a number, string, boolean, null or a list of them")
        scalars = self.dict_(opt.get("scalars"), "optimizer.scalars")
        for name, state in scalars.items():
            if name not in grouped:
                self.fail("optimizer.scalars key", name, "a parameter of one of the param groups")
            for key, rec in self.dict_(state, f"optimizer.scalars.{name}").items():
                at = f"optimizer.scalars.{name}.{key}"
                if not isinstance(key, str) or not STATE_KEY.match(key):
                    self.fail(f"optimizer.scalars.{name} key", key, "an identifier")
                self.dict_(rec, at)
                v, dt = rec.get("value"), rec.get("dtype")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or set(rec) - {"value", "dtype"}:
                    self.fail(at, rec, "{\"value\": a number} or {\"dtype\": ..., \"value\": a number}")
                if dt is not None and (dt not in SCALAR_DTYPES or (isinstance(v, float) and "int" in dt)):
                    self.fail(f"{at}.dtype", dt, f"one of {', '.join(SCALAR_DTYPES)} (a float value: not int)")

    def files(self, d: dict, layout: Layout) -> dict:
        coords = {coord_dir(c) for c in layout.coords()}
        out = {}
        for rel, rec in d.items():
            m = _FILE_RE.match(rel) if isinstance(rel, str) else None
            if m is None:
                names = "|".join((MODEL_FILE, OPTIM_FILE, STATE_FILE, TOKENIZER_FILE))
                raise CheckpointError(f"{self.where}: file name {_short(rel)} in 'files' is not "
                                      f"'tpNN-ppNN-dpNN/<{names}>' (a plain name inside the step folder)")
            if m[1] not in coords:
                raise CheckpointError(f"{self.where}: file {rel} in 'files' belongs to no coordinate of layout "
                                      f"{layout}")
            self.dict_(rec, f"files.{rel}")
            size = self.int_(rec.get("bytes"), f"files.{rel}.bytes")
            key = "crc32c" if rel.endswith(".json") else "header_crc32c"
            crc = rec.get(key)
            if not isinstance(crc, str) or not _HEX8.match(crc):
                self.fail(f"files.{rel}.{key}", crc, "8 lowercase hex digits")
            out[rel] = FileRecord(size, crc)
        for c in sorted(coords):
            if f"{c}/{STATE_FILE}" not in out:
                raise CheckpointError(f"{self.where}: coordinate {c} has no {STATE_FILE} in 'files' "
                                      f"(layout {layout} expects {layout.world_size} coordinates)")
        return out

    def entry(self, section: str, name, e, files: dict, block: int, n_layer, seen: set,
              kind: str = "model") -> TensorEntry:
        if not isinstance(name, str) or not name:
            self.fail(f"{section} name", name, "a non-empty string")
        at = f"{section}.{name}"
        self.dict_(e, at)
        dtype = e.get("dtype")
        if dtype not in DTYPES:
            self.fail(f"{at}.dtype", dtype, f"one of {', '.join(DTYPES)}")
        shape = e.get("shape")
        if (not isinstance(shape, list) or not shape
                or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in shape)):
            self.fail(f"{at}.shape", shape, "a list of positive integers")
        part = self.dict_(e.get("partition"), f"{at}.partition")
        dim = part.get("dim")
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim < len(shape)):
            self.fail(f"{at}.partition.dim", dim, f"null or a dim in [0, {len(shape)})")
        if part.get("tied_to") is not None:
            self.fail(f"{at}.partition.tied_to", part.get("tied_to"), "null (tied copies are never stored)")
        placement = part.get("placement", "first")
        m = _PLACEMENT.match(placement) if isinstance(placement, str) else None
        if m is None or (m[2] is not None and n_layer is not None and int(m[2]) >= n_layer):
            self.fail(f"{at}.partition.placement", placement,
                      "'first', 'last' or 'layer.<i>'" + (f" with i < n_layer = {n_layer}" if n_layer else ""))
        want_file = MODEL_FILE if kind == "model" else OPTIM_FILE
        size = itemsize(dtype)
        slices = []
        raw = e.get("slices")
        if not isinstance(raw, list) or not raw:
            self.fail(f"{at}.slices", raw, "a non-empty list")
        for i, s in enumerate(raw):
            sat = f"{at}.slices[{i}]"
            self.dict_(s, sat)
            rel = s.get("file")
            if not isinstance(rel, str) or rel not in files or rel.rsplit("/", 1)[-1] != want_file:
                self.fail(f"{sat}.file", rel, f"a '{want_file}' listed in 'files'")
            key = s.get("key")
            if not isinstance(key, str) or not key:
                self.fail(f"{sat}.key", key, "a non-empty string")
            if (rel, key) in seen:
                raise CheckpointError(f"{self.where}: field '{sat}.key': {rel} key '{key}' is used by two slices")
            seen.add((rel, key))
            box = s.get("box")
            if not isinstance(box, list) or len(box) != len(shape):
                self.fail(f"{sat}.box", box, f"{len(shape)} [start, end] ranges (shape {shape})")
            box = Box(self.range_(r, f"{sat}.box[{j}]", shape[j]) for j, r in enumerate(box))
            flat = None
            if s.get("flat") is not None:
                flat = self.range_(s["flat"], f"{sat}.flat", box.numel)
            sl = SliceRef(rel, key, box, flat, ())
            crcs = s.get("crc32c")
            want = n_blocks(sl.numel * size, block)
            if (not isinstance(crcs, list) or len(crcs) != want
                    or not all(isinstance(c, str) and _HEX8.match(c) for c in crcs)):
                self.fail(f"{sat}.crc32c", crcs, f"a list of {want} CRC32Cs (8 hex digits, one per {block}-byte block)")
            slices.append(SliceRef(rel, key, box, flat, tuple(crcs)))
        problems = tiling_problems(name, (shape, slices))
        if problems:
            raise CheckpointError(f"{self.where}: {problems[0]}")
        partition = Partition.from_json(shape, part)
        return TensorEntry(name, kind, dtype, tuple(shape), partition, tuple(slices))


def state_name(n: str, torch_optim: bool) -> tuple:
    """(model tensor name, kind) of an optimizer_state entry name: '<name>.exp_avg' -> (name, 'exp_avg') for
    megalite's AdamW; '<name>.optim.<key>' -> (name, 'optim.<key>') for torch.optim; (name, None) if neither."""
    if not isinstance(n, str):
        return n, None
    if torch_optim:
        base, sep, key = n.rpartition(".optim.")
        return (base, f"optim.{key}") if sep and STATE_KEY.match(key) else (n, None)
    base, _, moment = n.rpartition(".")
    return (base, moment) if moment in MOMENTS else (base, None)


def _hyper_ok(v, depth: int = 0) -> bool:
    if v is None or isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) <= 200):
        return True
    return depth == 0 and isinstance(v, list) and len(v) <= 64 and all(_hyper_ok(x, 1) for x in v)


# ---------------------------------------------------------------- tiling
def _pieces(entry):
    """(shape, [(Box, flat or None, file)]) from a TensorEntry, a (shape, slices) pair or a JSON entry."""
    if isinstance(entry, TensorEntry):
        return list(entry.shape), [(s.box, s.flat, s.file) for s in entry.slices]
    if isinstance(entry, tuple):
        shape, slices = entry
        return list(shape), [(s.box, s.flat, s.file) for s in slices]
    return list(entry["shape"]), [(tuple(tuple(r) for r in s["box"]), tuple(s["flat"]) if s.get("flat") else None,
                                   s.get("file")) for s in entry["slices"]]


def tiling_problems(name: str, entry) -> list[str]:
    """The slices of one tensor must cover its global shape exactly: no hole, no overlap, nothing outside.

    Linear in the number of slices (plus the grid): the boxes' start/end points cut every dim into
    intervals; each box must cover whole cells of that grid, and every cell must be covered exactly once.
    """
    shape, pieces = _pieces(entry)
    boxes: dict = {}
    for box, flat, file in pieces:
        if len(box) != len(shape) or any(not (0 <= a < b <= n) for (a, b), n in zip(box, shape)):
            return [f"tensor '{name}': slice {[list(r) for r in box]} in {file} lies outside shape {shape}"]
        boxes.setdefault(Box(box), []).append(flat)
    if not boxes:
        return [f"tensor '{name}': no slices are stored"]
    problems = []
    for box, flats in boxes.items():
        if None in flats:
            if len(flats) > 1:
                problems.append(f"tensor '{name}': box {box.to_json()} is stored more than once (overlap)")
            continue
        pos = 0
        for a, b in sorted(flats):
            if a != pos:
                problems.append(f"tensor '{name}': pieces of box {box.to_json()} "
                                f"{'overlap' if a < pos else 'leave a hole'} at element {min(a, pos)}")
                break
            pos = b
        else:
            if pos != box.numel:
                problems.append(f"tensor '{name}': pieces of box {box.to_json()} end at element {pos}, "
                                f"expected {box.numel} (a hole)")
    if problems:
        return problems
    cuts = [sorted({0, n} | {r[d][i] for r in boxes for i in (0, 1)}) for d, n in enumerate(shape)]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > 16 * len(boxes) + 64:  # a sane layout cuts each dim a few times; refuse a hostile grid
        return [f"tensor '{name}': its {len(boxes)} slices cut it into {cells} cells, not a grid of tp slices"]
    count = np.zeros([len(c) - 1 for c in cuts], dtype=np.int64)
    for box in boxes:
        count[tuple(slice(bisect.bisect_left(c, a), bisect.bisect_left(c, b)) for c, (a, b) in zip(cuts, box))] += 1
    if (count > 1).any():
        at = [c[i] for c, i in zip(cuts, np.argwhere(count > 1)[0])]
        problems.append(f"tensor '{name}': slices overlap at element {at}")
    if (count == 0).any():
        at = [c[i] for c, i in zip(cuts, np.argwhere(count == 0)[0])]
        problems.append(f"tensor '{name}': slices leave a hole at element {at}")
    return problems


# ---------------------------------------------------------------- building, reading, writing
def build(meta: dict, reports: list[dict]) -> Manifest:
    """Merge every rank's report (the files it wrote, the slices they hold) into one manifest.

    meta: step, tokens_seen, layout (Layout), zero1, config, data, optimizer, client_state, scheduler and
    the informational keys; a report: {"files": {rel: FileRecord}, "tensors": [(TensorEntry, SliceRef)]}.
    """
    files, sections = {}, {"model": {}, "optimizer_state": {}}
    for rep in reports:
        files.update(rep["files"])
        for proto, sl in rep["tensors"]:
            section = sections["model" if proto.kind == "model" else "optimizer_state"]
            section.setdefault(proto.name, []).append((proto, sl))
    out = {}
    for sname, section in sections.items():
        out[sname] = {}
        for name, items in sorted(section.items()):
            slices = sorted((sl for _, sl in items), key=lambda s: (s.box, s.flat or (0, 0)))
            out[sname][name] = TensorEntry(name, items[0][0].kind, items[0][0].dtype, tuple(items[0][0].shape),
                                           items[0][0].partition, tuple(slices))
    info = {k: meta[k] for k in INFO_KEYS if meta.get(k) is not None}
    return Manifest(meta["step"], meta.get("tokens_seen", 0), Layout(*meta["layout"]), bool(meta.get("zero1")),
                    meta.get("config") or {}, meta.get("data") or {}, meta.get("optimizer"),
                    meta.get("client_state") or {}, meta.get("scheduler"), out["model"], out["optimizer_state"],
                    dict(sorted(files.items())), BLOCK_BYTES, info)


def read_json(step_dir: Path) -> dict:
    """The raw JSON of manifest.json (for tools and tests that craft manifests; loaders use `read`)."""
    path = Path(step_dir) / MANIFEST
    if path.is_symlink():
        raise CheckpointError(f"{path}: manifest is a symbolic link (refused: files must live in the step folder)")
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: manifest is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: manifest is not valid JSON ({e})") from None


def read(step_dir: Path) -> Manifest:
    """Load manifest.json and validate all of it (see Manifest.from_json)."""
    return Manifest.from_json(read_json(step_dir), str(Path(step_dir) / MANIFEST))


def dumps(d: dict) -> str:
    """The manifest's text: compact JSON from the C encoder (an indented dump goes through json's pure-Python
    encoder, the largest cost of a 16,384-rank manifest), still one line per top-level field and one line
    per entry of a section (a file, a tensor) so that it reads and greps well."""
    def one(v) -> str:
        return json.dumps(v, separators=(",", ":"))

    lines = []
    for k, v in d.items():
        if isinstance(v, dict) and v:
            inner = ",\n".join(f"  {one(k2)}: {one(v2)}" for k2, v2 in v.items())
            lines.append(f" {one(k)}: {{\n{inner}\n }}")
        else:
            lines.append(f" {one(k)}: {one(v)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def write_json(step_dir: Path, d: dict, text: Optional[str] = None) -> None:
    """Write `d` (or its text, already made by `dumps`) as manifest.json, fsynced (`d` must already be signed;
    see `sign`)."""
    path = Path(step_dir) / MANIFEST
    with open(path, "w") as f:
        f.write(dumps(d) if text is None else text)
        f.flush()
        os.fsync(f.fileno())


def write(step_dir: Path, man: Manifest) -> None:
    """Write the manifest after parsing its text back: a writer never commits what its readers would refuse."""
    d = man.to_json()
    text = dumps(d)
    Manifest.from_json(json.loads(text), f"{Path(step_dir) / MANIFEST} (being written)")
    write_json(step_dir, d, text)


def model_config_diff(saved: dict, current: dict) -> list[str]:
    """Differences in the [model] section, one 'field: checkpoint X, run Y' per field."""
    keys = sorted(set(saved) | set(current))
    return [f"model.{k}: checkpoint has {saved.get(k)!r}, this run has {current.get(k)!r}"
            for k in keys if saved.get(k) != current.get(k)]
