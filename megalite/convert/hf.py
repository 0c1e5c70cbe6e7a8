"""Hugging Face GPT-2: names and layouts of its tensors, its config.json, export and import."""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Optional

import torch
from einops import EinopsError, rearrange

from ..base import limits
from ..base.fs import remove_tree, write_new, replace_output
from ..checkpoint.stream import StreamingWriter
from ..config import ACTIVATIONS, ModelConfig, model_from
from .common import (HF_KIND, ConvertError, Progress, _full_tensors, model_partitions, open_safetensors,
                     parse_json)
from ..tokenizer import Tokenizer, byte_tokenizer, write_hf_folder


def _to_hf(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """megalite name/tensor -> HF GPT-2 name/tensor (HF's Conv1D stores weights as (in, out))."""
    if name == "lm_head.weight":  # an untied head: nn.Linear (vocab, C) in both
        return [("lm_head.weight", t)]
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


def _from_hf(name: str, t: torch.Tensor, tied: bool = True) -> Optional[tuple[str, torch.Tensor]]:
    if name == "lm_head.weight":
        return None if tied else (name, t)  # a tied head is wte (older exports still store the copy)
    if name.endswith(".attn.bias") or name.endswith(".attn.masked_bias"):
        return None  # causal-mask buffers of old exports
    name = name.removeprefix("transformer.")
    if "." not in name or (name.startswith("h.") and name.count(".") < 2):
        return name, t  # not a GPT-2 tensor: the caller names it
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


# ---------------------------------------------------------------- GPT2Config, field by field
# Each field Hugging Face's GPT2Config can carry is honoured (mapped to a megalite model key), accepted only
# at the value that means plain GPT-2, or ignored because it changes neither the weights nor the logits.
# Any other field is refused: a config megalite cannot reproduce is never imported silently.
HONOURED = {"vocab_size": "vocab_size", "n_positions": "block_size", "n_embd": "n_embd", "n_layer": "n_layer",
            "n_head": "n_head", "layer_norm_epsilon": "layer_norm_eps", "activation_function": "activation",
            "tie_word_embeddings": "tie_embeddings"}
ONLY_AT = {"scale_attn_weights": (True,), "scale_attn_by_inverse_layer_idx": (False,),
           "reorder_and_upcast_attn": (False,), "add_cross_attention": (False,), "is_encoder_decoder": (False,),
           "n_special": (0,), "model_type": ("gpt2",)}  # n_inner: None or 4 * n_embd (checked below)
IGNORED = {  # training, generation and bookkeeping settings: no effect on the imported weights or logits
    "resid_pdrop", "embd_pdrop", "attn_pdrop",  # dropout is a megalite training setting (model.dropout)
    "initializer_range",  # only used to initialise a fresh model
    "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
    # ^ GPT2DoubleHeadsModel's classification head, which the LM model does not have
    "bos_token_id", "eos_token_id", "pad_token_id",  # generation settings; the tokenizer's own are its files'
    "use_cache", "output_past", "n_ctx", "predict_special_tokens", "task_specific_params", "chunk_size_feed_forward",
    "architectures", "dtype", "torch_dtype", "transformers_version", "_name_or_path", "output_hidden_states",
    "output_attentions", "return_dict", "id2label", "label2id", "problem_type", "_num_labels",
    "gradient_checkpointing", "tokenizer_class"}
ARCHITECTURES = ("GPT2LMHeadModel", "GPT2Model")


def model_from_hf_config(hf: dict, where: str) -> dict:
    """A megalite [model] dict from a GPT2Config dict; a field megalite cannot honour is a one-line error."""
    for key, value in hf.items():
        if key in HONOURED or key in IGNORED or key == "n_inner":
            continue
        if key not in ONLY_AT:
            raise ConvertError(f"{where}: field '{key}' is not a GPT2Config field megalite knows; refusing to "
                               f"import a model it may not reproduce")
        if value not in ONLY_AT[key]:
            raise ConvertError(f"{where}: {key} = {json.dumps(value)} is not supported (megalite reproduces "
                               f"only {key} = {json.dumps(ONLY_AT[key][0])})")
    for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
        if not isinstance(hf.get(key), int) or isinstance(hf.get(key), bool) or hf[key] < 1:
            raise ConvertError(f"{where}: field '{key}' = {hf.get(key)!r}, expected a positive integer")
    if hf.get("n_inner") not in (None, 4 * hf["n_embd"]):
        raise ConvertError(f"{where}: n_inner = {hf['n_inner']} is not supported (megalite's MLP width is "
                           f"4 * n_embd = {4 * hf['n_embd']}; expected null or that)")
    arch = hf.get("architectures") or ["GPT2LMHeadModel"]
    if not isinstance(arch, list) or any(a not in ARCHITECTURES for a in arch):
        raise ConvertError(f"{where}: architectures = {json.dumps(arch)}, expected one of "
                           f"{', '.join(ARCHITECTURES)}")
    m = {ours: hf[theirs] for theirs, ours in HONOURED.items() if theirs in hf}
    m["dropout"] = 0.0
    cfg = ModelConfig(**m)  # defaults for what the folder leaves out are GPT2Config's defaults too
    if cfg.activation not in ACTIVATIONS:
        raise ConvertError(f"{where}: activation_function = {json.dumps(cfg.activation)} is not supported "
                           f"(expected one of {', '.join(ACTIVATIONS)})")
    if not isinstance(cfg.tie_embeddings, bool):
        raise ConvertError(f"{where}: tie_word_embeddings = {cfg.tie_embeddings!r}, expected true or false")
    if not isinstance(cfg.layer_norm_eps, (int, float)) or isinstance(cfg.layer_norm_eps, bool) \
            or not cfg.layer_norm_eps > 0:
        raise ConvertError(f"{where}: layer_norm_epsilon = {cfg.layer_norm_eps!r}, expected a positive number")
    cfg.layer_norm_eps = float(cfg.layer_norm_eps)
    return dataclasses.asdict(cfg)


def hf_config(m: dict, eot_id: Optional[int] = None) -> dict:
    """config.json for a megalite [model] dict: plain GPT-2 plus the options megalite has; bos/eos are the
    tokenizer's end-of-text id (as GPT-2's 50256), null for the byte tokenizer (it has none)."""
    m = {**dataclasses.asdict(ModelConfig()), **m}
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m["vocab_size"],
            "n_positions": m["block_size"], "n_embd": m["n_embd"],
            "n_layer": m["n_layer"], "n_head": m["n_head"], "n_inner": None,
            "activation_function": m["activation"], "layer_norm_epsilon": m["layer_norm_eps"],
            "resid_pdrop": m["dropout"], "embd_pdrop": m["dropout"], "attn_pdrop": m["dropout"],
            "initializer_range": 0.02, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "tie_word_embeddings": m["tie_embeddings"],
            "bos_token_id": eot_id, "eos_token_id": eot_id, "pad_token_id": None,
            "torch_dtype": "float32", "use_cache": True}


VOCAB_ROWS = ("wte.weight", "lm_head.weight")  # the tensors with one row per token id


def export_hf(step: Path, man: dict, out: Path, dtype: torch.dtype, progress: Progress,
              tok: Optional[Tokenizer] = None) -> Path:
    return write_hf(out, man.model_config, {n: e.shape for n, e in man.model.items()},
                    _full_tensors(step, man, progress), dtype, tok)


def write_hf(out: Path, model_config: dict, shapes: dict, tensors, dtype: torch.dtype,
             tok: Optional[Tokenizer] = None) -> Path:
    """megalite-named tensors (in the order of `shapes`) -> an HF GPT-2 folder at `out`, with the run's
    tokenizer `tok` (None: a run that carried none; the byte tokenizer's files are written, as before).
    Padding rows (model.vocab_size above `tok`'s) are never predicted by megalite; they are left out, so
    transformers' softmax is over the tokenizer's ids only, as megalite's is."""
    rows = model_config["vocab_size"] if tok is None else min(tok.vocab_size, model_config["vocab_size"])

    def trim(name, t):
        return t[:rows] if name in VOCAB_ROWS else t

    tmp = out.with_name(out.name + ".tmp-megalite")
    remove_tree(tmp)  # a stale folder, or a symlink planted there: unlinked, never followed
    tmp.mkdir(parents=True)
    specs = []
    for name, shape in shapes.items():  # shapes only: transforms applied to meta tensors
        for hf_name, t in _to_hf(name, trim(name, torch.empty(shape, device="meta"))):
            specs.append((hf_name, list(t.shape), dtype))
    order = {n: i for i, (n, _, _) in enumerate(specs)}
    w = StreamingWriter(tmp / "model.safetensors", specs, {"format": "pt", "megalite.kind": HF_KIND}, checksum=False,
                        direct=True)
    try:
        for name, t in tensors:
            for hf_name, ht in _to_hf(name, trim(name, t)):
                assert order[hf_name] == w.next
                w.write(hf_name, ht.to(dtype))
        w.close()
        eot = tok.eot_id if tok is not None and tok.eot_id is not None and tok.eot_id < rows else None
        cfg = hf_config({**model_config, "vocab_size": rows}, eot)
        cfg["torch_dtype"] = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
        write_new(tmp / "config.json", (json.dumps(cfg, indent=2) + "\n").encode())
        # so AutoTokenizer / pipeline work on the folder as is
        write_hf_folder(tok or byte_tokenizer(), tmp, cfg["n_positions"])
    except BaseException:
        w.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_output(tmp, out)
    return out


def _sizes_stored(hf: dict, shapes: dict, cfg_file: Path, st: Path) -> None:
    """config.json's sizes are those of the tensors model.safetensors stores, checked before anything is built
    from them: n_layer = 10**6 over two stored blocks once ran for minutes, n_positions = 2**31 - 1 failed in
    the allocator. n_layer: the blocks h.0 ... h.(n-1); n_embd, vocab_size, n_positions: wte's and wpe's sizes."""
    names = {k.removeprefix("transformer."): s for k, s in shapes.items()}
    blocks = {int(m.group(1)) for k in names if (m := re.match(r"h\.([0-9]{1,9})\.", k))}
    stored = {"n_layer": (len(blocks) if blocks == set(range(len(blocks))) else None, "blocks h.0, h.1, ... of"),
              "vocab_size": ((names.get("wte.weight") or [None])[0], "rows of wte.weight in"),
              "n_embd": ((names.get("wte.weight") or [None, None])[-1], "columns of wte.weight in"),
              "n_positions": ((names.get("wpe.weight") or [None])[0], "rows of wpe.weight in")}
    for key, (have, what) in stored.items():
        if hf[key] != have:
            got = "no such tensors" if have is None else f"{have}"
            raise ConvertError(f"{cfg_file}: {key} = {limits.describe(hf[key])}, but {st.name} holds {got} ({what} "
                               f"it); expected the sizes of the stored tensors")


def read_hf_folder(p: Path):
    """(model config dict, get(name) -> full fp32 tensor, names) for an HF GPT-2 folder."""
    cfg_file, st = p / "config.json", p / "model.safetensors"
    if not cfg_file.is_file() or not st.is_file():
        raise ConvertError(f"{p}: expected an HF GPT-2 folder with config.json and model.safetensors")
    limits.within(cfg_file.stat().st_size, "json", str(cfg_file), ConvertError)
    hf = parse_json(cfg_file.read_bytes().decode("utf-8", errors="replace"), str(cfg_file))
    if not isinstance(hf, dict) or hf.get("model_type") != "gpt2":
        got = hf.get("model_type") if isinstance(hf, dict) else hf
        raise ConvertError(f"{cfg_file}: model_type is {limits.describe(got)}, expected 'gpt2'")
    for theirs in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size"):
        if theirs not in hf:
            raise ConvertError(f"{cfg_file}: field '{theirs}' is missing (expected an HF GPT-2 config)")
    f = open_safetensors(st)
    shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    _sizes_stored(hf, shapes, cfg_file, st)
    m = model_from(model_from_hf_config(hf, str(cfg_file)), str(cfg_file))
    table = {}
    for k, shape in shapes.items():
        try:
            r = _from_hf(k, torch.empty(shape, device="meta"), m["tie_embeddings"])
        except (EinopsError, RuntimeError):
            raise ConvertError(f"{st}: tensor '{k}' has shape {list(shape)}, which is not a GPT-2 layout") from None
        if r is not None:
            table[r[0]] = k
    known = model_partitions(m)
    extra = sorted(k for name, k in table.items() if name not in known)
    if extra:
        raise ConvertError(f"{st}: tensor '{extra[0]}' is not part of a GPT-2 with this config.json "
                           f"({len(extra)} such)")

    def get(name):
        return _from_hf(table[name], f.get_tensor(table[name]).float(), m["tie_embeddings"])[1]
    return m, get, sorted(table)
