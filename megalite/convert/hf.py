"""transformers folders both ways, for every family (family.py): read as a Source (config.json, one safetensors
file or an index of shards, the tokenizer files), and written from any Source with a model: config.json,
generation_config.json, the tokenizer's files and the weights, sharded with model.safetensors.index.json above
--max-shard-size (transformers' own default, 5 GB)."""
from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath

import torch
from einops import EinopsError

from ..base import limits
from ..base.fs import read_all, special_entries_refused, write_new
from ..base.origin import GENERATION, TOKENIZER_JSON, Origin
from ..checkpoint.stream import StreamingWriter, dtype_of
from ..config import model_from
from ..checkpoint.validate import carried_by
from ..tokenizer import byte_tokenizer, write_hf_folder
from .common import HF_KIND, KIND, ConvertError, Progress, Source, Spec, cast, model_partitions, \
    open_safetensors, parse_json
from .family import BY_MODEL_TYPE, Family, family_of

ST_FILE, ST_INDEX = "model.safetensors", "model.safetensors.index.json"
MAX_SHARD = 5 * 10**9  # transformers' save_pretrained default max_shard_size ("5GB")
TORCH_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class HFFolder(Source):
    """A transformers folder of a family megalite models: config.json read field by field, the weights from
    model.safetensors or the shards model.safetensors.index.json names; every tensor must be the one its
    config.json implies, at its shape (a folder that disagrees with itself is refused, nothing written)."""

    def __init__(self, path):
        p = self.folder = Path(path)
        self.where, self.guards = str(p), [p]
        cfg_file = p / "config.json"
        if not cfg_file.exists():  # a FIFO or a folder there is refused at open, naming what it is
            raise ConvertError(f"{p}: expected a transformers folder with config.json and model.safetensors "
                               f"(or {ST_INDEX})")
        raw = read_all(cfg_file, limits.FILE_BYTES["json"] + 1, follow=True)  # a link into the HF cache's blobs
        limits.within(len(raw), "json", str(cfg_file), ConvertError)
        hf = parse_json(raw.decode("utf-8", errors="replace"), str(cfg_file))
        got = hf.get("model_type") if isinstance(hf, dict) else hf
        self.family: Family = BY_MODEL_TYPE.get(got) if isinstance(got, str) else None
        if self.family is None:
            raise ConvertError(f"{cfg_file}: model_type is {limits.describe(got)}, expected one of "
                               f"{', '.join(repr(k) for k in BY_MODEL_TYPE)} (the families megalite models)")
        m, self.harmless = self.family.read_config(hf, str(cfg_file))
        self.hf = hf
        self.files = {}  # transformers name -> the open safetensors file that holds it
        for fname in self._weight_files():
            # a link to a regular file is followed: the Hugging Face cache's snapshot folders are links into its
            # blobs; a FIFO or device, linked or not, is still refused at open (base/fs.open_regular)
            f = open_safetensors(p / fname, follow=True)
            for k in f.keys():
                self.files[k] = f
        weights = p / (ST_FILE if (p / ST_FILE).is_file() else ST_INDEX)
        _sizes_stored(self.family, hf, {k: f.get_slice(k).get_shape() for k, f in self.files.items()}, cfg_file,
                      weights)
        self.model = model_from(self._tie_as_transformers(m, cfg_file), str(cfg_file))
        self._table(weights)

    def _tie_as_transformers(self, m: dict, cfg_file: Path) -> dict:
        """tie_word_embeddings true beside a stored lm_head that differs from the embedding: transformers (5.x)
        keeps the stored head untied, and so does megalite (a head equal to the embedding is the tied copy)."""
        if not m["tie_embeddings"] or "lm_head.weight" not in self.files:
            return m
        embed = next((k for k in self.files if (r := self.family.from_hf(k, torch.empty(0), True)) and
                      r[0] == "wte.weight"), None)
        if embed is None or torch.equal(self.files[embed].get_tensor(embed),
                                        self.files["lm_head.weight"].get_tensor("lm_head.weight")):
            return m
        self.harmless = [*self.harmless, "tie_word_embeddings (true, but the stored lm_head.weight differs from "
                                          "the embedding: kept untied, as transformers does)"]
        return {**m, "tie_embeddings": False}

    def _weight_files(self) -> list[str]:
        p = self.folder
        if (p / ST_FILE).is_file():
            return [ST_FILE]
        index = p / ST_INDEX
        if not index.is_file():
            raise ConvertError(f"{p}: has neither {ST_FILE} nor {ST_INDEX} (expected the weights as safetensors)")
        raw = read_all(index, limits.FILE_BYTES["json"] + 1, follow=True)  # the HF cache links it too; never a FIFO
        limits.within(len(raw), "json", str(index), ConvertError)
        d = parse_json(raw.decode("utf-8", errors="replace"), str(index))
        wm = d.get("weight_map") if isinstance(d, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise ConvertError(f"{index}: field 'weight_map' is missing or empty (expected tensor name -> file)")
        for f in wm.values():  # every value typed before it is hashed, sorted or joined to a path
            pp = PurePosixPath(f) if isinstance(f, str) else None
            if pp is None or pp.is_absolute() or len(pp.parts) != 1 or f in ("", ".", ".."):
                raise ConvertError(f"{index}: weight_map names file {limits.describe(f)}, expected a file name "
                                   f"inside the folder")
        return sorted(set(wm.values()))

    def _table(self, where: Path) -> None:
        """megalite name -> transformers name, and each megalite tensor's shape, checked against the model."""
        m, fam, tied = self.model, self.family, self.model["tie_embeddings"]
        self.table, self.specs = {}, {}
        for k, f in self.files.items():
            s = f.get_slice(k)
            shape, st = s.get_shape(), s.get_dtype()
            try:
                r = fam.from_hf(k, torch.empty(shape, device="meta"), tied)
            except (EinopsError, RuntimeError):
                raise ConvertError(f"{where}: tensor '{k}' has shape {list(shape)}, which is not a "
                                   f"{fam.architecture} layout") from None
            if r is not None:
                self.table[r[0]] = k
                self.specs[r[0]] = Spec(tuple(r[1].shape), dtype_of(st, f"{where}: tensor '{k}'", ConvertError))
        parts = model_partitions(m)
        extra = sorted(k for name, k in self.table.items() if name not in parts)
        if extra:
            raise ConvertError(f"{where}: tensor '{extra[0]}' is not part of a {fam.architecture} with this "
                               f"config.json ({len(extra)} such)")
        for name, part in parts.items():
            if name not in self.specs:
                raise ConvertError(f"{where}: tensor '{fam.to_hf(name, torch.empty(0))[0][0]}' is missing "
                                   f"(config.json implies it)")
            if list(self.specs[name].shape) != list(part.global_shape):
                hf_name = self.table[name]
                raise ConvertError(f"{where}: tensor '{hf_name}' has shape {list(self.files[hf_name].get_slice(hf_name).get_shape())}, "
                                   f"but config.json implies {list(fam.to_hf(name, torch.empty(part.global_shape, device='meta'))[0][1].shape)}; "
                                   f"the folder disagrees with itself")
        self.specs = {n: self.specs[n] for n in parts}  # the model's order

    def read(self, name, region=None):
        k = self.table[name]
        t = self.family.from_hf(k, self.files[k].get_tensor(k), False)[1]
        return t if region is None else t[tuple(slice(a, b) for a, b in region)]

    def tokenizer(self):
        return carried_by(self.folder)

    def origin(self):
        """Its tokenizer's and generation's files as they are, its weights' stored dtype and config.json's special
        ids (base/origin.py)."""
        tok = self.tokenizer()
        stored = next((TORCH_DTYPE.get(s.dtype) for s in self.specs.values() if s.dtype.is_floating_point), None)
        return Origin.of_folder(self.folder, self.hf, tok and tok.json, tok and tok.sha256, stored, ConvertError)

    def reference(self):
        """transformers' own model on the folder, fp32 (None where transformers is not installed)."""
        return transformers_runner(self.folder)


def _sizes_stored(fam: Family, hf: dict, shapes: dict, cfg_file: Path, weights: Path) -> None:
    """config.json's sizes are those of the tensors stored, checked before anything is built from them:
    n_layer = 10**6 over two stored blocks once ran for minutes, n_positions = 2**31 - 1 failed in the
    allocator."""
    for key, what, how, names in fam.stored:
        if how == "layers":
            blocks = {int(m.group(1)) for k in shapes if (m := re.match(names, k))}
            have = len(blocks) if blocks == set(range(len(blocks))) else None
        else:
            shape = next((shapes[n] for n in names if n in shapes), None)
            have = shape[how] if shape else None
        if hf[key] != have:
            got = "no such tensors" if have is None else f"{have}"
            raise ConvertError(f"{cfg_file}: {key} = {limits.describe(hf[key])}, but {weights.name} holds {got} "
                               f"({what} it); expected the sizes of the stored tensors")


def transformers_runner(folder: Path):
    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging
    except ImportError:
        return None
    logging.disable_progress_bar()  # its "Loading weights" bar would interleave with convert's own lines
    special_entries_refused(folder)  # it reads generation_config.json and the rest by name: never a FIFO
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()

    def run(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(ids).logits
    return run


# ---------------------------------------------------------------- writing
def hf_shards(specs: list, max_shard: int) -> list[list]:
    """specs [(name, shape, dtype)] cut into consecutive shards of at most `max_shard` bytes (a tensor larger
    than that is a shard of its own), as transformers' save_pretrained cuts them."""
    shards, size = [[]], 0
    for s in specs:
        n = torch.empty((), dtype=s[2]).element_size()
        for d in s[1]:
            n *= d
        if shards[-1] and size + n > max_shard:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += n
    return shards


def write_hf(tmp: Path, src: Source, dtype: torch.dtype, progress: Progress, max_shard: int = MAX_SHARD) -> None:
    """The source's model as a transformers folder at `tmp`, with the source's tokenizer (none: the byte
    tokenizer's files). Padding rows (model.vocab_size above the tokenizer's) are never predicted by megalite;
    they are left out, so transformers' softmax is over the tokenizer's ids only, as megalite's is."""
    m, fam = src.model, family_of(src.model)
    tok = src.tokenizer()
    rows = m["vocab_size"] if tok is None else min(tok.vocab_size, m["vocab_size"])

    def trim(name, t):
        return t[:rows] if name in fam.vocab_rows else t

    specs = []
    for name, spec in src.specs.items():  # shapes only: transforms applied to meta tensors
        for hf_name, t in fam.to_hf(name, trim(name, torch.empty(spec.shape, device="meta"))):
            specs.append((hf_name, list(t.shape), dtype))
    shards = hf_shards(specs, max_shard)
    names = ([ST_FILE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    tmp.mkdir(parents=True)
    writers = [StreamingWriter(tmp / n, sh, {"format": "pt", KIND: HF_KIND + fam.name}, checksum=False, direct=True)
               for n, sh in zip(names, shards)]
    where = {s[0]: w for w, sh in zip(writers, shards) for s in sh}
    try:
        for name, pieces in src.stream(None, progress):
            t = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            for hf_name, ht in fam.to_hf(name, trim(name, t)):
                w = where[hf_name]
                assert w.specs[w.next][0] == hf_name
                w.write(hf_name, cast(ht, dtype, hf_name))
        for w in writers:
            w.close()
    except BaseException:
        for w in writers:
            w.abort()
        raise
    if len(shards) > 1:
        total = sum((tmp / n).stat().st_size for n in names)  # as transformers: the files' bytes
        index = {"metadata": {"total_size": total},
                 "weight_map": {s[0]: n for n, sh in zip(names, shards) for s in sh}}
        write_new(tmp / ST_INDEX, (json.dumps(index, indent=2) + "\n").encode())
    eot = tok.eot_id if tok is not None and tok.eot_id is not None and tok.eot_id < rows else None
    tok = tok or byte_tokenizer()
    origin = (src.origin() or Origin()).beside(tok.sha256)  # the source's own files and ids, where they apply
    carried = dict(origin.files)
    cfg = fam.hf_config({**m, "vocab_size": rows}, eot)
    cfg.update(origin.ids)  # the source's bos/eos/pad (one small step after the family's table: issue 38)
    cfg["torch_dtype"] = TORCH_DTYPE[dtype]
    write_new(tmp / "config.json", (json.dumps(cfg, indent=2) + "\n").encode())
    if GENERATION not in carried:
        gen = {"_from_model_config": True, "bos_token_id": cfg.get("bos_token_id", eot),
               "eos_token_id": cfg.get("eos_token_id", eot), **({"pad_token_id": cfg["pad_token_id"]}
                                                                 if cfg.get("pad_token_id") is not None else {})}
        write_new(tmp / GENERATION, (json.dumps(gen, indent=2) + "\n").encode())
    if "tokenizer_config.json" in carried:  # the source's tokenizer, whole: its files as they came
        write_new(tmp / TOKENIZER_JSON, carried.pop(TOKENIZER_JSON, tok.json.encode("utf-8")))
    else:  # so AutoTokenizer / pipeline work on the folder as is
        write_hf_folder(tok, tmp, m["block_size"])
    origin.write(tmp, carried)
