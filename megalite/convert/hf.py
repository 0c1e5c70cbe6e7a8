"""Hugging Face GPT-2: names and layouts of its tensors, its config.json, export and import."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import torch
from einops import rearrange

from ..checkpoint.stream import StreamingWriter
from .common import ConvertError, Progress, _full_tensors, _replace


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


def export_hf(step: Path, man: dict, out: Path, dtype: torch.dtype, progress: Progress) -> Path:
    tmp = out.with_name(out.name + ".tmp-megalite")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    specs = []
    for name, e in man.model.items():  # shapes only: transforms applied to meta tensors
        for hf_name, t in _to_hf(name, torch.empty(e.shape, device="meta")):
            specs.append((hf_name, list(t.shape), dtype))
    order = {n: i for i, (n, _, _) in enumerate(specs)}
    w = StreamingWriter(tmp / "model.safetensors", specs, {"format": "pt"}, checksum=False)
    try:
        for name, t in _full_tensors(step, man, progress):
            for hf_name, ht in _to_hf(name, t):
                assert order[hf_name] == w.next
                w.write(hf_name, ht.to(dtype))
        w.close()
        cfg = hf_config(man.model_config)
        cfg["torch_dtype"] = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    except BaseException:
        w.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _replace(tmp, out)
    return out



def read_hf_folder(p: Path):
    """(model config dict, get(name) -> full fp32 tensor, names) for an HF GPT-2 folder."""
    from .single import _open_st
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
