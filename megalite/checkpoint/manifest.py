"""The manifest: the global description of one checkpoint, typed, with one owner (this module).

    {
      "format": "megalite-checkpoint", "format_version": 2,
      "manifest_crc32c": "<CRC32C of the canonical JSON of everything else>",
      "megalite_version": "...", "torch_version": "...", "created": "<ISO time>",
      "step": 200, "tokens_seen": 204800,
      "layout": {"tp": 2, "pp": 2, "dp": 2, "zero1": true},    and "cp": N when the run had cp = N > 1
      "config": { the full run config }, "data": {"batch_index": 200}, "client_state": {}, "scheduler": null,
      "optimizer": {"type": "adamw", "step": 200, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
      "checksum": {"algorithm": "crc32c", "block_bytes": 1048576},
      "model":     { "<global name>": TENSOR, ... },        e.g. "blocks.7.attn.qkv.weight"
      "optimizer_state": { "<global name>.exp_avg": TENSOR, "<global name>.exp_avg_sq": TENSOR, ... },
        a torch.optim optimizer's instead (optimizer.py): "optimizer": {"type": "torch.optim",
          "class": "torch.optim.adamw.AdamW", "step": 200, "param_groups": [{"params": [<global names>], "lr": ...}],
          "scalars": {"<global name>": {"step": {"dtype": "float32", "value": 200.0}}}},
          "optimizer_state": {"<global name>.optim.<key>": TENSOR, ...}   (key: exp_avg, momentum_buffer, ...)
      "files": { "tp00-pp00-dp00/model.safetensors": {"bytes": 123, "header_crc32c": "89abcdef"},  (cp > 1:
                 "tp00-cp00-pp00-dp00/..."; cp ranks write disjoint shares, never the same tensor twice)
                 "tp00-pp00-dp00/state.json": {"bytes": 456, "crc32c": "01234567"},
                 "tp00-pp00-dp00/tokenizer.json": {"bytes": 789, "crc32c": ...}  the run's tokenizer, if any, ... }
    }
    TENSOR = {"dtype": "float32" | "bfloat16" | "float16", "shape": [global shape],
              "partition": {"dim": split dim over tp or null, "tied_to": null,
                            "placement": "first" | "last" | "layer.<i>"  (which pipeline stage owns it),
                            "units": n  only where the split dim is n blocks tp never cuts (GQA's kv heads)},
              "slices": [{"file": "...", "key": "<key in that file>",
                          "box": [[start, end] per dim of the global tensor],
                          "flat": [a, b]    only for ZeRO-1 pieces: elements [a, b) of the box, row-major,
                          "crc32c": ["<CRC32C of stored bytes [0, B)>", "<of [B, 2B)>", ...]}]}   B = block_bytes

`Manifest.from_json` checks everything a loader relies on and raises one-line CheckpointErrors naming the
field; nothing else in megalite reads the JSON. Validation is linear in the number of slices (tiling is
checked on the sorted grid of each tensor's cut points, not by comparing slices pairwise: tiling.py).
The meta of a step (everything but files and slices) is made in one place, `step_meta`.
"""
from __future__ import annotations

import json
import math
import os
import re
import stat
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

import torch

from .. import __version__
from ..config import MAX_COUNT, model_from
from ..base.errors import CheckpointError, ConfigError, LayoutError, UnsafeFileError
from ..base.jsonio import decode, loads
from ..parallel.grid import Layout
from ..parallel.partition import Box, Partition
from ..base.fs import kind_of, linked, open_read, read_all, write_new
from .stream import crc32c
from .tiling import tiling_problems
from .tree import COORD_PATTERN, MANIFEST, MODEL_FILE, OPTIM_FILE, ORIGIN_FILE, STATE_FILE, TOKENIZER_FILE, \
    coord_dir

FORMAT = "megalite-checkpoint"
FORMAT_VERSION = 2
BLOCK_BYTES = 1 << 20  # checksum granularity: a reader verifies exactly the blocks it touches
# What a checkpoint stores: floats for parameters and optimizer state; integers and booleans for buffers
# (BatchNorm's num_batches_tracked is a 0-dim int64) and any state_dict tensor of those dtypes.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64,
          "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
          "bool": torch.bool}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MOMENTS = ("exp_avg", "exp_avg_sq")
# A torch.optim optimizer (optimizer.type = TORCH_OPTIM; see optimizer.py): its per-parameter state tensors are
# "<name>.optim.<key>" (kind "optim.<key>"), its scalar state and param groups live in the optimizer section.
TORCH_OPTIM = "torch.optim"
STATE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")  # a torch.optim state or hyperparameter key
SCALAR_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16, "int64": torch.int64, "int32": torch.int32}
_CLASS = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*){0,15}$")
_FILE_RE = re.compile(r"^(" + COORD_PATTERN + r")/(" + "|".join(
    re.escape(n) for n in (MODEL_FILE, OPTIM_FILE, STATE_FILE, TOKENIZER_FILE, ORIGIN_FILE)) + r")$")
_HEX8 = re.compile(r"^[0-9a-f]{8}$")
_PLACEMENT = re.compile(r"^(first|last|layer\.(\d+))$")


def crc32c_file(path: Path, chunk: int = 16 << 20) -> str:
    crc = 0
    with open_read(path) as f:
        while block := f.read(chunk):
            crc = crc32c(block, crc)
    return f"{crc:08x}"


def checksum_block() -> int:
    """The checksum block size new checkpoints are written with (BLOCK_BYTES, read when called: the writer
    and `build` agree even where a test makes blocks small)."""
    return BLOCK_BYTES


def n_blocks(nbytes: int, block: int) -> int:
    return -(-nbytes // block)


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise CheckpointError(f"dtype {dtype} cannot be checkpointed (expected one of {', '.join(DTYPES)})")
    return DTYPE_NAMES[dtype]


def itemsize(dtype: str) -> int:
    return DTYPES[dtype].itemsize


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
# What every manifest holds (`Manifest.to_json` writes them all; the parser refuses a manifest without one).
REQUIRED = ("step", "tokens_seen", "layout", "config", "data", "optimizer", "client_state", "scheduler", "checksum",
            "model", "optimizer_state", "files")


@dataclass
class StepMeta:
    """Everything in a manifest that is not about files and slices: what a step says about itself.
    Made by `step_meta` only (live saves, `split` and `reshard` alike)."""
    step: int
    tokens_seen: int
    layout: Layout
    zero1: bool
    config: dict
    data: dict  # the sampler's position
    optimizer: Optional[dict]  # the optimizer section (optimizer.py: one owner per kind), None: weights only
    client_state: dict
    scheduler: Optional[dict]
    info: dict = field(default_factory=dict)  # megalite/torch version, created, resharded_from: not relied on


@dataclass
class Manifest(StepMeta):
    """A step's meta, and its tensors (name -> TensorEntry with its slices) and files (rel path -> FileRecord)."""
    model: dict = field(default_factory=dict)
    optimizer_state: dict = field(default_factory=dict)  # "<name>.<moment>" or "<name>.optim.<key>"
    files: dict = field(default_factory=dict)
    block_bytes: int = BLOCK_BYTES

    @property
    def model_config(self) -> dict:
        return self.config.get("model") or {}

    def tensors(self):
        yield from self.model.values()
        yield from self.optimizer_state.values()

    # -------------------------------------------------------- JSON
    def to_json(self) -> dict:
        body = {**{k: v for k, v in self.info.items() if v is not None},
                "step": self.step, "tokens_seen": self.tokens_seen,
                "layout": {"tp": self.layout.tp, "pp": self.layout.pp, "dp": self.layout.dp, "zero1": self.zero1,
                           **({"cp": self.layout.cp} if self.layout.cp != 1 else {})},
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
def short(v) -> str:
    """A value for a one-line error: its repr, cut at 60 characters."""
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


class _Parser:
    """Turns manifest JSON into typed records, refusing anything a loader could not rely on."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, fld: str, got, expected: str):
        raise CheckpointError(f"{self.where}: field '{fld}' is {short(got)}, expected {expected}")

    def get(self, d: dict, key: str, fld: str):
        if key not in d:
            raise CheckpointError(f"{self.where}: field '{fld}' is missing")
        return d[key]

    def int_(self, v, fld: str, lo: int = 0) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= MAX_COUNT:
            self.fail(fld, v, f"an integer >= {lo} and <= {MAX_COUNT}")
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
            raise CheckpointError(f"{self.where}: field 'manifest_crc32c' is {short(crc)} but the content's CRC32C "
                                  f"is {canonical_crc(d)} (the manifest was edited or damaged)")
        # Every field the writer writes is required: a missing one is an edited manifest, never a default
        # (a manifest without `step` must not load as step 0).
        missing = [k for k in REQUIRED if k not in d]
        if missing:
            raise CheckpointError(f"{self.where}: field '{missing[0]}' is missing"
                                  + (f" (and {', '.join(missing[1:])})" if len(missing) > 1 else ""))
        step = self.int_(d["step"], "step")
        tokens = self.int_(d["tokens_seen"], "tokens_seen")
        config = self.dict_(d["config"], "config")
        lay = self.dict_(d["layout"], "layout")
        layout = Layout(*(self.get(lay, k, f"layout.{k}") for k in ("tp", "pp", "dp")), lay.get("cp", 1))
        zero1 = self.get(lay, "zero1", "layout.zero1")
        if not isinstance(zero1, bool):
            self.fail("layout.zero1", zero1, "true or false")
        model_cfg = self.step_config(config, layout)
        opt = self.dict_(d["optimizer"], "optimizer", optional=True)
        if opt is not None:
            if opt.get("type") not in ("adamw", TORCH_OPTIM):
                self.fail("optimizer.type", opt.get("type"), f"'adamw' or '{TORCH_OPTIM}'")
            self.int_(self.get(opt, "step", "optimizer.step"), "optimizer.step")
        chk = self.dict_(d["checksum"], "checksum")
        if self.get(chk, "algorithm", "checksum.algorithm") != "crc32c":
            self.fail("checksum.algorithm", chk["algorithm"], "'crc32c'")
        block = self.int_(self.get(chk, "block_bytes", "checksum.block_bytes"), "checksum.block_bytes", 8)
        if block % 8:
            self.fail("checksum.block_bytes", block, "a multiple of 8")
        files = self.files(self.dict_(d["files"], "files"), layout)
        n_layer = model_cfg.get("n_layer")
        seen: set = set()
        model = {n: self.entry("model", n, e, files, block, n_layer, seen)
                 for n, e in self.dict_(d["model"], "model").items()}
        optim = {}
        torch_optim = opt is not None and opt["type"] == TORCH_OPTIM
        if torch_optim:
            self.torch_optimizer(opt, model)
        for n, e in self.dict_(d["optimizer_state"], "optimizer_state").items():
            base, kind = state_name(n, torch_optim)
            expected = "optim.<key>" if torch_optim else "|".join(MOMENTS)
            if kind is None:
                raise CheckpointError(f"{self.where}: optimizer_state entry {short(n)} is not '<model tensor>."
                                      f"{expected}'" + (" (key: an identifier)" if torch_optim else ""))
            if base not in model:
                raise CheckpointError(f"{self.where}: optimizer_state entry {short(n)} names no model tensor "
                                      f"{short(base)} (missing from 'model'; expected '<model tensor>.{expected}')")
            entry = self.entry("optimizer_state", n, e, files, block, n_layer, seen, kind=kind)
            # torch.optim state of another shape (Adafactor's factored moments) is stored whole (dim null)
            if entry.shape != model[base].shape and not (torch_optim and entry.partition.dim is None):
                self.fail(f"optimizer_state.{n}.shape", list(entry.shape),
                          f"{list(model[base].shape)} (as '{base}')" + (", or partition.dim null for a state "
                                                                        "tensor of another shape" if torch_optim else ""))
            optim[n] = entry
        scheduler = self.dict_(d["scheduler"], "scheduler", optional=True)
        decode(scheduler, "scheduler", self.error)  # the exact codec's tags must be well-formed
        info = {k: d[k] for k in INFO_KEYS if k in d}
        return Manifest(step, tokens, layout, zero1, config, self.dict_(d["data"], "data"), opt,
                        self.dict_(d["client_state"], "client_state"), scheduler, info,
                        model=model, optimizer_state=optim, files=files, block_bytes=block)

    def error(self, msg: str) -> CheckpointError:
        return CheckpointError(f"{self.where}: {msg}")

    def step_config(self, config: dict, layout: Layout) -> dict:
        """The step's config where readers use it, checked against its layout; returns config.model parsed.
        config.model: {} (a model megalite does not describe: your own module), or megalite's [model] section
        checked as a config file's is (every key known, types, ranges, activation), so inspect, convert and
        reshard can build the model from it; the layout must fit it. config.parallel: an object whose vpp
        (inspect's stage map) is a positive integer that fits the layers of the stored layout."""
        m = self.dict_(config.get("model", {}), "config.model")
        vpp = self.dict_(config.get("parallel", {}), "config.parallel").get("vpp", 1)
        if isinstance(vpp, bool) or not isinstance(vpp, int) or vpp < 1:
            self.fail("config.parallel.vpp", vpp, "a positive integer")
        try:
            model_cfg = model_from(m, "config") if m else {}
            layout.validate(model_cfg, "layout.")
        except (ConfigError, LayoutError) as e:
            raise CheckpointError(f"{self.where}: {e}") from None
        n_layer = model_cfg.get("n_layer")
        hi = max(1, n_layer // layout.pp) if n_layer else 1 << 16
        if vpp > hi:
            raise CheckpointError(f"{self.where}: field 'config.parallel.vpp' is {vpp}, expected an integer in "
                                  f"[1, {hi}] (model.n_layer / layout.pp)")
        return model_cfg

    def torch_optimizer(self, opt: dict, model: dict) -> None:
        """The optimizer section of a torch.optim checkpoint (optimizer.py's TorchOptimState writes it):
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
                if key != "params" and not hyper_ok(v):
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
        # Bound the layout by what is listed before enumerating its coordinates: every coordinate has a
        # state.json, so a layout of more coordinates than listed files (dp = 10**9) is refused in O(files).
        states = sum(1 for rel in d if isinstance(rel, str) and rel.endswith("/" + STATE_FILE))
        if layout.world_size > states:
            raise CheckpointError(f"{self.where}: field 'layout' ({layout}) has {layout.world_size} coordinates but "
                                  f"'files' lists {states} {STATE_FILE} (one per coordinate expected)")
        coords = {coord_dir(c, layout.cp) for c in layout.coords()}
        out = {}
        for rel, rec in d.items():
            m = _FILE_RE.match(rel) if isinstance(rel, str) else None
            if m is None:
                names = "|".join((MODEL_FILE, OPTIM_FILE, STATE_FILE, TOKENIZER_FILE, ORIGIN_FILE))
                raise CheckpointError(f"{self.where}: file name {short(rel)} in 'files' is not "
                                      f"'tpNN-ppNN-dpNN/<{names}>' (tpNN-cpNN-ppNN-dpNN with cp > 1; a plain "
                                      f"name inside the step folder)")
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
        if (not isinstance(shape, list) or len(shape) > 64
                or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in shape)):
            self.fail(f"{at}.shape", shape, "a list of at most 64 positive integers ([] for a 0-dim tensor)")
        part = self.dict_(e.get("partition"), f"{at}.partition")
        dim = part.get("dim")
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim < len(shape)):
            self.fail(f"{at}.partition.dim", dim, f"null or a dim in [0, {len(shape)})")
        if part.get("tied_to") is not None:
            self.fail(f"{at}.partition.tied_to", part.get("tied_to"), "null (tied copies are never stored)")
        units = part.get("units", 0)
        if (isinstance(units, bool) or not isinstance(units, int) or units < 0
                or (units and (dim is None or shape[dim] % units))):
            self.fail(f"{at}.partition.units", units, "0, or a count of equal blocks of the split dim (kv heads)")
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


def hyper_ok(v, depth: int = 0) -> bool:
    if v is None or isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) <= 200):
        return True
    return depth == 0 and isinstance(v, list) and len(v) <= 64 and all(hyper_ok(x, 1) for x in v)


# ---------------------------------------------------------------- building, reading, writing
def step_meta(step: int, layout, config: dict, *, tokens_seen: int = 0, data: Optional[dict] = None,
              zero1: bool = False, optimizer: Optional[dict] = None, client_state: Optional[dict] = None,
              scheduler: Optional[dict] = None, info: Optional[dict] = None) -> StepMeta:
    """The one place a step's meta is made. `info` defaults to this megalite, this torch and now; `reshard`
    passes the source's, with `resharded_from` added."""
    if info is None:
        info = {"megalite_version": __version__, "torch_version": torch.__version__,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    return StepMeta(step, tokens_seen, Layout(*layout), bool(zero1), config or {},
                    data or {}, optimizer, client_state or {}, scheduler,
                    {k: info[k] for k in INFO_KEYS if info.get(k) is not None})


def check_meta(meta: StepMeta, where: str = "save_checkpoint") -> None:
    """The parser's checks of what a step says about itself (config, layout, scheduler), run by a save
    before anything is written: a save never starts what its commit would refuse."""
    p = _Parser(where)
    p.step_config(meta.config, meta.layout)
    decode(meta.scheduler, "scheduler", p.error)


@dataclass
class RankReport:
    """What a rank wrote in a save (or a stage's ranks, merged by its leader): the files, each with its size and
    checksum, the slices they hold as (entry prototype, SliceRef), and one line per rank that failed."""
    files: dict = field(default_factory=dict)    # rel -> FileRecord
    tensors: list = field(default_factory=list)  # [(TensorEntry, SliceRef)]
    errors: list = field(default_factory=list)   # [str]

    @classmethod
    def failed(cls, error: str) -> "RankReport":
        return cls(errors=[error])

    @classmethod
    def merged(cls, reports: list) -> "RankReport":
        """One report holding several ranks' (a stage leader's part): their files, slices and errors."""
        out = cls()
        for r in reports:
            out.files.update(r.files)
            out.tensors += r.tensors
            out.errors += r.errors
        return out


def build(meta: StepMeta, reports: list) -> Manifest:
    """Merge every rank's RankReport (the files it wrote, the slices they hold) into one manifest."""
    files, sections = {}, {"model": {}, "optimizer_state": {}}
    for rep in reports:
        files.update(rep.files)
        for proto, sl in rep.tensors:
            section = sections["model" if proto.kind == "model" else "optimizer_state"]
            section.setdefault(proto.name, []).append((proto, sl))
    out = {}
    for sname, section in sections.items():
        out[sname] = {}
        for name, items in sorted(section.items()):
            slices = sorted((sl for _, sl in items), key=lambda s: (s.box, s.flat or (0, 0)))
            out[sname][name] = TensorEntry(name, items[0][0].kind, items[0][0].dtype, tuple(items[0][0].shape),
                                           items[0][0].partition, tuple(slices))
    return Manifest(**{f.name: getattr(meta, f.name) for f in fields(StepMeta)}, model=out["model"],
                    optimizer_state=out["optimizer_state"], files=dict(sorted(files.items())), block_bytes=BLOCK_BYTES)


def entry_for(section: dict, name: str, shape, step: Path) -> TensorEntry:
    """The entry of a tensor the caller needs (in `section`: Manifest.model or .optimizer_state), with the
    global shape it expects."""
    entry = section.get(name)
    if entry is None:
        raise CheckpointError(f"{step}: tensor '{name}' is missing from the manifest")
    if list(entry.shape) != list(shape):
        raise CheckpointError(f"{step}: tensor '{name}' has global shape {list(entry.shape)} in the manifest, "
                              f"the model expects {list(shape)}")
    return entry


def read_json(step_dir: Path) -> dict:
    """The raw JSON of manifest.json (for tools and tests that craft manifests; loaders use `read`)."""
    path = Path(step_dir) / MANIFEST
    if linked(path):
        raise CheckpointError(f"{path}: manifest is a symbolic link (refused: files must live in the step folder)")
    try:
        data = read_all(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: manifest is missing") from None
    except UnsafeFileError as e:  # a FIFO, a device: refused at open, reported like any damaged manifest
        raise CheckpointError(str(e)) from None
    return loads(data, f"{path}: manifest", CheckpointError)


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
    write_new(Path(step_dir) / MANIFEST, (dumps(d) if text is None else text).encode())


def write(step_dir: Path, meta: StepMeta, reports: list) -> Manifest:
    """The commit's manifest: `build` from every rank's report, its text parsed back (a writer never commits what
    its readers would refuse), every file it names found in place at its reported size (`reported_problems`),
    then written as manifest.json; returns it. Refused with one CheckpointError before anything is written."""
    man = build(meta, reports)
    text = dumps(man.to_json())
    path = Path(step_dir) / MANIFEST
    Manifest.from_json(loads(text, f"{path} (being written)", CheckpointError), f"{path} (being written)")
    problems = reported_problems(Path(step_dir), man)
    if problems:
        raise CheckpointError(f"{problems[0]}" + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "")
                              + "; do all ranks write to the same checkpoint.dir on one shared file system?")
    write_new(path, text.encode())
    return man


def reported_problems(tmp: Path, man: Manifest) -> list[str]:
    """What every rank reported writing, checked where the commit is about to rename it, from the reports alone
    (no file is re-read): each file of the manifest (its parsing asked for every coordinate's state.json) is a
    regular file of its coordinate's folder under `tmp`, no link on the way, of the size its rank reported. A
    rank that wrote into another folder or onto another file system leaves its files missing here."""
    problems = []
    for rel, rec in man.files.items():
        path = tmp / rel
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            problems.append(f"{tmp.name}: {rel} is missing (its rank reported writing {rec.bytes} bytes)")
            continue
        except OSError as e:
            problems.append(f"{tmp.name}: {rel} cannot be examined ({e.strerror or e})")
            continue
        if not stat.S_ISREG(st.st_mode) or linked(path, parents=1):
            what = "reached through a symbolic link" if stat.S_ISREG(st.st_mode) else kind_of(st)
            problems.append(f"{tmp.name}: {rel} is {what}, expected a regular file of its coordinate's folder")
        elif st.st_size != rec.bytes:
            problems.append(f"{tmp.name}: {rel} is {st.st_size} bytes, its rank reported {rec.bytes}")
    return problems
