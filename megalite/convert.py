"""The converter: any layout -> one file, -> Hugging Face GPT-2, one file -> any layout, and layout -> layout.

Everything that reads a checkpoint is driven by its manifest: the global shapes, the partition tags and
the slices. Only `split` (whose input has no manifest) asks the model code for the partition tags.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
from einops import rearrange
from safetensors import safe_open

from .checkpoint import manifest as mf
from .checkpoint.layout import (CheckpointError, coord_dir, fsync_dir, plan_writes, resolve, step_dir, tmp_dir,
                                write_latest)
from .checkpoint.reshard import SliceReader
from .checkpoint.save import Payload, add, manifest_meta, write_rank
from .checkpoint.stream import StreamingWriter
from .config import Config, ModelConfig
from .parallel.grid import Layout
from .parallel.pipeline import stage_of
from .parallel.tensor import Partition

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FORMATS = ("megalite", "hf-gpt2")


class ConvertError(CheckpointError):
    """Bad converter input: one line naming the path or flag and what was expected."""


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
def _check_out(out: Path, force: bool, sources: Iterable[Path]) -> None:
    out = out.resolve()
    for src in sources:
        src = src.resolve()
        if out == src or src in out.parents:
            raise ConvertError(f"--out {out}: refusing to write into the source checkpoint {src}")
    if out.exists() and not force:
        raise ConvertError(f"--out {out} already exists (pass --force to replace it)")


def _replace(tmp: Path, out: Path) -> None:
    """Move a finished temporary output into place; the old output is removed only after it is done."""
    if out.exists():
        old = out.with_name(out.name + ".old-megalite")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    else:
        os.replace(tmp, out)


# ---------------------------------------------------------------- checkpoint -> one file
def _model_cfg(man: dict) -> dict:
    return man["config"].get("model", {})


def _full_tensors(step: Path, man: dict, progress: Progress):
    """Yield (name, full tensor) for every model tensor, assembled from the slices, one at a time.

    A reader thread fetches the next tensor while the caller writes this one (file reads, CRC32 and
    writes all release the GIL), so at most two tensors are in memory.
    """
    reader = SliceReader(step, man)
    items = list(man["model"].items())

    def fetch(i):
        name, entry = items[i]
        return reader.read(name, entry, [[0, n] for n in entry["shape"]])

    with ThreadPoolExecutor(max_workers=1) as pool:
        nxt = pool.submit(fetch, 0) if items else None
        for i, (name, _) in enumerate(items):
            t = nxt.result()
            nxt = pool.submit(fetch, i + 1) if i + 1 < len(items) else None
            yield name, t
            progress.step(t.numel() * t.element_size())


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
    total = sum(math.prod(e["shape"]) * 4 for e in man["model"].values())
    progress = Progress("convert", len(man["model"]), total, quiet)
    if fmt == "hf-gpt2":
        return _export_hf(step, man, out, DTYPES[dtype], progress)
    tmp = out.with_name(out.name + ".tmp-megalite")
    torch_dtype = DTYPES[dtype]
    specs = [(n, e["shape"], torch_dtype) for n, e in man["model"].items()]
    meta = {"format": "pt", "megalite.kind": "model", "megalite.model_config": json.dumps(_model_cfg(man), sort_keys=True),
            "megalite.partitions": json.dumps({n: e["partition"] for n, e in man["model"].items()}, sort_keys=True)}
    w = StreamingWriter(tmp, specs, meta, checksum=False)
    try:
        for name, t in _full_tensors(step, man, progress):
            w.write(name, t.to(torch_dtype))
        w.close()
    except BaseException:
        w.abort()
        raise
    _replace(tmp, out)
    return out


# ---------------------------------------------------------------- Hugging Face GPT-2
def _to_hf(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """megalite name/tensor -> HF GPT-2 name/tensor (HF's Conv1D stores weights as (in, out))."""
    if name == "wte.weight":
        return [("transformer.wte.weight", t)]
    if name == "wpe":
        return [("transformer.wpe.weight", t)]
    if name.startswith("ln_f."):
        return [("transformer." + name, t)]
    _, i, rest = name.split(".", 2)
    base = f"transformer.h.{i}."
    if rest == "attn.qkv.weight":  # (3, C, C) -> (C, 3C): [q | k | v] along the output columns
        return [(base + "attn.c_attn.weight", rearrange(t, "three o i -> i (three o)"))]
    if rest == "attn.qkv.bias":
        return [(base + "attn.c_attn.bias", rearrange(t, "three o -> (three o)"))]
    mapping = {"attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
    for ours, theirs in mapping.items():
        if rest.startswith(ours + "."):
            kind = rest.rsplit(".", 1)[1]
            return [(base + theirs + "." + kind, t.t().contiguous() if kind == "weight" else t)]
    return [(base + rest, t)]  # ln_1, ln_2


def _from_hf(name: str, t: torch.Tensor) -> Optional[tuple[str, torch.Tensor]]:
    if name in ("lm_head.weight",) or name.endswith(".attn.bias") or name.endswith(".attn.masked_bias"):
        return None  # tied to wte / causal-mask buffers of old exports
    name = name.removeprefix("transformer.")
    if name == "wte.weight":
        return "wte.weight", t
    if name == "wpe.weight":
        return "wpe", t
    if name.startswith("ln_f."):
        return name, t
    _, i, rest = name.split(".", 2)
    base = f"blocks.{i}."
    if rest == "attn.c_attn.weight":
        return base + "attn.qkv.weight", rearrange(t, "i (three o) -> three o i", three=3).contiguous()
    if rest == "attn.c_attn.bias":
        return base + "attn.qkv.bias", rearrange(t, "(three o) -> three o", three=3).contiguous()
    for theirs, ours in {"attn.c_proj": "attn.proj", "mlp.c_fc": "mlp.fc", "mlp.c_proj": "mlp.proj"}.items():
        if rest.startswith(theirs + "."):
            kind = rest.rsplit(".", 1)[1]
            return base + ours + "." + kind, (t.t().contiguous() if kind == "weight" else t)
    return base + rest, t


def hf_config(m: dict) -> dict:
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m["vocab_size"],
            "n_positions": m["block_size"], "n_ctx": m["block_size"], "n_embd": m["n_embd"],
            "n_layer": m["n_layer"], "n_head": m["n_head"], "n_inner": None,
            "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "resid_pdrop": m["dropout"],
            "embd_pdrop": m["dropout"], "attn_pdrop": m["dropout"], "initializer_range": 0.02,
            "scale_attn_weights": True, "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0,
            "torch_dtype": "float32", "use_cache": True}


def _export_hf(step: Path, man: dict, out: Path, dtype: torch.dtype, progress: Progress) -> Path:
    tmp = out.with_name(out.name + ".tmp-megalite")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    specs = []
    for name, e in man["model"].items():  # shapes only: transforms applied to meta tensors
        for hf_name, t in _to_hf(name, torch.empty(e["shape"], device="meta")):
            specs.append((hf_name, list(t.shape), dtype))
    order = {n: i for i, (n, _, _) in enumerate(specs)}
    w = StreamingWriter(tmp / "model.safetensors", specs, {"format": "pt"}, checksum=False)
    try:
        for name, t in _full_tensors(step, man, progress):
            for hf_name, ht in _to_hf(name, t):
                assert order[hf_name] == w.next
                w.write(hf_name, ht.to(dtype))
        w.close()
        cfg = hf_config(_model_cfg(man))
        cfg["torch_dtype"] = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    except BaseException:
        w.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _replace(tmp, out)
    return out


# ---------------------------------------------------------------- reading a single model (megalite or HF)
def read_model_file(path) -> tuple[dict, Callable[[str], torch.Tensor], list[str]]:
    """(model config dict, get(name) -> full fp32 tensor, names) for a megalite file or an HF GPT-2 folder."""
    p = Path(path)
    if p.is_dir():
        cfg_file, st = p / "config.json", p / "model.safetensors"
        if not cfg_file.is_file() or not st.is_file():
            raise ConvertError(f"{p}: expected an HF GPT-2 folder with config.json and model.safetensors")
        hf = json.loads(cfg_file.read_text())
        if hf.get("model_type") != "gpt2":
            raise ConvertError(f"{cfg_file}: model_type is {hf.get('model_type')!r}, expected 'gpt2'")
        m = {"n_layer": hf["n_layer"], "n_head": hf["n_head"], "n_embd": hf["n_embd"],
             "block_size": hf["n_positions"], "vocab_size": hf["vocab_size"], "dropout": 0.0}
        f = _open_st(st)
        table = {}
        for k in f.keys():
            r = _from_hf(k, torch.empty(f.get_slice(k).get_shape(), device="meta"))
            if r is not None:
                table[r[0]] = k

        def get(name):
            return _from_hf(table[name], f.get_tensor(table[name]).float())[1]
        return m, get, sorted(table)
    if not p.is_file():
        raise ConvertError(f"model '{p}' does not exist")
    f = _open_st(p)
    meta = f.metadata() or {}
    if "megalite.model_config" not in meta:
        raise ConvertError(f"{p}: safetensors metadata has no 'megalite.model_config' "
                           f"(expected a file written by `megalite convert`)")
    m = json.loads(meta["megalite.model_config"])
    return m, (lambda name: f.get_tensor(name).float()), sorted(f.keys())


def _open_st(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # noqa: BLE001
        raise ConvertError(f"{path}: not a readable safetensors file ({e})") from None


def model_partitions(m: dict) -> dict[str, Partition]:
    """The partition tag of every parameter, asked of the model itself (built on the meta device)."""
    from .model import GPTStage
    from .parallel.grid import ParallelGrid
    with torch.device("meta"):
        stage = GPTStage(ModelConfig(**m), ParallelGrid.single())
    return {name: p.partition for name, p in stage.global_parameters()}


def check_manifest_tensors(step: Path, man: dict) -> None:
    """Every tensor the model config implies is in the manifest, with its global shape."""
    for name, part in model_partitions(_model_cfg(man)).items():
        entry = man["model"].get(name)
        if entry is None:
            raise ConvertError(f"{step}: tensor '{name}' is missing from the manifest")
        if list(entry["shape"]) != list(part.global_shape):
            raise ConvertError(f"{step}: tensor '{name}' has global shape {entry['shape']} in the manifest, "
                               f"the model expects {list(part.global_shape)}")


def check_layout(m: dict, tp: int, pp: int, dp: int) -> None:
    for flag, v in (("--tp", tp), ("--pp", pp), ("--dp", dp)):
        if v < 1:
            raise ConvertError(f"{flag} {v}: must be a positive integer")
    if m["n_head"] % tp:
        raise ConvertError(f"--tp {tp} does not divide model.n_head = {m['n_head']}")
    if pp > m["n_layer"]:
        raise ConvertError(f"--pp {pp} is larger than model.n_layer = {m['n_layer']}")


# ---------------------------------------------------------------- writing a whole checkpoint offline
def _nbytes(it) -> int:
    n = it.flat[1] - it.flat[0] if it.flat else math.prod(b - a for a, b in it.box)
    return n * 4


def _write_checkpoint(out: Path, step: int, layout: Layout, zero1: bool, tensors: dict[str, Partition],
                      n_layer: int, read: Callable, meta: dict, with_optimizer: bool, what: str, quiet: bool,
                      coord_state: Callable) -> Path:
    """Write every coordinate of `layout` in this one process into a temporary root next to `out`, commit it
    like a live save, then move it into place; on any failure nothing is left behind."""
    root = out.with_name(out.name + ".tmp-megalite")
    shutil.rmtree(root, ignore_errors=True)
    tmp = root / tmp_dir(step)
    tmp.mkdir(parents=True)
    plans = []
    for c in layout.coords():
        stage = [(n, p) for n, p in tensors.items() if stage_of(p.placement, n_layer, layout.pp) == c.pp]
        plans.append((c, plan_writes(stage, c, layout, zero1, optimizer=with_optimizer)))
    items = [it for _, plan in plans for it in plan]
    progress = Progress(what, len(items), sum(_nbytes(it) for it in items), quiet)
    reports = []
    try:
        for c, plan in plans:
            pay = Payload(files={}, state=coord_state(c))
            for it in plan:
                add(pay, it, tensors[it.name], read(it))
                progress.step(_nbytes(it))
            reports.append(write_rank(tmp / coord_dir(c), pay, coord_dir(c)))
        mf.write(tmp, mf.build(meta, reports))
        fsync_dir(tmp)
        os.replace(tmp, root / step_dir(step))
        write_latest(root, step_dir(step))
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    _replace(root, out)
    return out / step_dir(step)


def split(model, out, tp: int, pp: int, dp: int, zero1: bool = False, step: int = 0, force: bool = False,
          quiet: bool = False) -> Path:
    """One model file (megalite or HF GPT-2) -> a committed checkpoint at (tp, pp, dp), fresh optimizer."""
    m, get, names = read_model_file(model)
    check_layout(m, tp, pp, dp)
    out = Path(out)
    _check_out(out, force, [Path(model)])
    parts = model_partitions(m)
    missing = sorted(set(parts) - set(names))
    if missing:
        raise ConvertError(f"{model}: tensor '{missing[0]}' is missing ({len(missing)} of {len(parts)} missing)")
    cache: dict = {}

    def read(it):
        if it.name not in cache:
            cache.clear()
            full = get(it.name)
            if list(full.shape) != list(parts[it.name].global_shape):
                raise ConvertError(f"{model}: tensor '{it.name}' has shape {list(full.shape)}, "
                                   f"expected {list(parts[it.name].global_shape)}")
            cache[it.name] = full
        return cache[it.name][tuple(slice(a, b) for a, b in it.box)].clone()

    cfg = Config.from_dict({"model": m, "parallel": {"tp": tp, "pp": pp, "dp": dp, "zero1": zero1}}).to_dict()
    meta = manifest_meta(cfg, Layout(tp, pp, dp), zero1, step, 0, None, {"batch_index": step}, None)
    return _write_checkpoint(out, step, Layout(tp, pp, dp), zero1, parts, m["n_layer"], read, meta, False,
                             "split", quiet,
                             lambda c: {"step": step, "tokens_seen": 0, "rng": None, "data": {"batch_index": step}})


def reshard(ckpt, out, tp: int, pp: int, dp: int, zero1: Optional[bool] = None, force: bool = False,
            quiet: bool = False) -> Path:
    """The full training state of a checkpoint (model, moments, step, data position) at a new layout.

    Per-rank RNG states are not carried over: a coordinate of the new layout has no counterpart in the
    old one, so resuming re-seeds every rank from (seed, step), as resuming at another layout does.
    """
    src = resolve(ckpt)
    man = mf.read(src)
    m = _model_cfg(man)
    check_layout(m, tp, pp, dp)
    check_manifest_tensors(src, man)
    zero1 = man["layout"].get("zero1", False) if zero1 is None else zero1
    out = Path(out)
    _check_out(out, force, [src.parent, src])
    parts = {n: Partition.from_json(e["shape"], e["partition"]) for n, e in man["model"].items()}
    reader = SliceReader(src, man)
    with_opt = bool(man["optimizer_state"])

    def read(it):
        if it.kind == "model":
            return reader.read(it.name, man["model"][it.name], it.box)
        entry = man["optimizer_state"].get(it.key)
        if entry is None:
            raise CheckpointError(f"{src.name}: tensor '{it.key}' is missing from the manifest")
        t = reader.read(it.key, entry, it.box, flat=it.flat)
        return t if it.flat else t.view([b - a for a, b in it.box])

    cfg = json.loads(json.dumps(man["config"]))
    cfg.setdefault("parallel", {}).update({"tp": tp, "pp": pp, "dp": dp, "zero1": zero1})
    meta = {k: v for k, v in man.items() if k not in ("model", "optimizer_state", "files", "format",
                                                       "format_version")}
    meta.update(config=cfg, layout={"tp": tp, "pp": pp, "dp": dp, "zero1": zero1},
                resharded_from={"layout": man["layout"], "path": str(src)})
    return _write_checkpoint(out, man["step"], Layout(tp, pp, dp), zero1, parts, m["n_layer"], read, meta,
                             with_opt, "reshard", quiet,
                             lambda c: {"step": man["step"], "tokens_seen": man.get("tokens_seen", 0), "rng": None,
                                        "data": man.get("data") or {}})
