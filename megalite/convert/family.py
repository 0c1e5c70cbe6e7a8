"""Model families as transformers names them: a name table (megalite <-> transformers) plus the few tensors that
reshape, and config.json both ways, field by field.

    family  transformers class   reshapes
    gpt2    GPT2LMHeadModel      Conv1D weights are (in, out): transposed; q/k/v fused as c_attn [q | k | v]
    llama   LlamaForCausalLM     none: megalite stores q/k in transformers' rotate-half layout (families.md)

Each config.json field is honoured (mapped to a megalite [model] key), accepted only at the value megalite
reproduces, or ignored because it changes neither the weights nor the logits. Any other field is refused in
one line naming it: a model megalite cannot reproduce is never imported silently.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Optional

import torch
from einops import rearrange

from ..config import ACTIVATIONS, ModelConfig
from ..base.errors import ConvertError

# fields of every transformers config that change neither the weights nor the logits
COMMON_IGNORED = {
    "bos_token_id", "eos_token_id", "pad_token_id",  # generation settings; the tokenizer's own are its files'
    "use_cache", "output_past", "task_specific_params", "chunk_size_feed_forward", "architectures", "dtype",
    "torch_dtype", "transformers_version", "_name_or_path", "output_hidden_states", "output_attentions",
    "return_dict", "id2label", "label2id", "problem_type", "_num_labels", "gradient_checkpointing",
    "tokenizer_class", "initializer_range", "is_decoder", "add_cross_attention_", "_from_model_config"}


def _positive_int(hf: dict, key: str, where: str) -> int:
    if key not in hf:
        raise ConvertError(f"{where}: field '{key}' is missing (expected it in a transformers config.json)")
    v = hf.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConvertError(f"{where}: field '{key}' = {v!r}, expected a positive integer")
    return v


def _positive_float(hf: dict, key: str, where: str, default: float) -> float:
    v = hf.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
        raise ConvertError(f"{where}: {key} = {v!r}, expected a positive number")
    return float(v)


def _check_fields(hf: dict, where: str, honoured, only_at: dict, ignored, cls: str) -> None:
    for key, value in hf.items():
        if key in honoured or key in ignored or key in COMMON_IGNORED:
            continue
        if key not in only_at:
            raise ConvertError(f"{where}: field '{key}' is not a {cls} field megalite knows; refusing to import "
                               f"a model it may not reproduce")
        if value not in only_at[key]:
            raise ConvertError(f"{where}: {key} = {json.dumps(value)} is not supported (megalite reproduces only "
                               f"{key} = {json.dumps(only_at[key][0])})")


def _architectures(hf: dict, where: str, allowed: tuple) -> None:
    arch = hf.get("architectures") or [allowed[0]]
    if not isinstance(arch, list) or any(a not in allowed for a in arch):
        raise ConvertError(f"{where}: architectures = {json.dumps(arch)}, expected one of {', '.join(allowed)}")


class Family:
    """One model family as transformers writes it."""
    name = ""  # megalite's model.arch
    model_type = ""  # config.json's model_type
    architecture = ""  # config.json's architectures[0]
    vocab_rows = ("wte.weight", "lm_head.weight")  # megalite tensors with one row per token id

    def to_hf(self, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        raise NotImplementedError

    def from_hf(self, name: str, t: torch.Tensor, tied: bool) -> Optional[tuple[str, torch.Tensor]]:
        """(megalite name, tensor), or None for a tensor megalite does not keep (a tied head's copy)."""
        raise NotImplementedError

    def hf_config(self, m: dict, eot_id: Optional[int]) -> dict:
        raise NotImplementedError

    def model_from_hf(self, hf: dict, where: str) -> dict:
        raise NotImplementedError


# ---------------------------------------------------------------- GPT-2
class GPT2(Family):
    name, model_type, architecture = "gpt2", "gpt2", "GPT2LMHeadModel"
    LINEAR = {"attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}  # Conv1D: (in, out)
    HONOURED = {"vocab_size": "vocab_size", "n_positions": "block_size", "n_embd": "n_embd", "n_layer": "n_layer",
                "n_head": "n_head", "layer_norm_epsilon": "layer_norm_eps", "activation_function": "activation",
                "tie_word_embeddings": "tie_embeddings"}
    ONLY_AT = {"scale_attn_weights": (True,), "scale_attn_by_inverse_layer_idx": (False,),
               "reorder_and_upcast_attn": (False,), "add_cross_attention": (False,), "is_encoder_decoder": (False,),
               "n_special": (0,), "model_type": ("gpt2",)}  # n_inner: None or 4 * n_embd (checked below)
    IGNORED = {"resid_pdrop", "embd_pdrop", "attn_pdrop",  # dropout is a megalite training setting
               "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
               "summary_first_dropout",  # GPT2DoubleHeadsModel's classification head, which the LM lacks
               "n_ctx", "predict_special_tokens", "n_inner"}

    def to_hf(self, name, t):
        if name == "lm_head.weight":  # an untied head: nn.Linear (vocab, C) in both
            return [("lm_head.weight", t)]
        if name in ("wte.weight", "wpe"):
            return [(f"transformer.{name.split('.')[0]}.weight", t)]
        if name.startswith("ln_f."):
            return [("transformer." + name, t)]
        _, i, rest = name.split(".", 2)
        base = f"transformer.h.{i}."
        if rest == "attn.qkv.weight":  # (3, C, C) -> (C, 3C): [q | k | v] along the output columns
            return [(base + "attn.c_attn.weight", rearrange(t, "three o i -> i (three o)"))]
        if rest == "attn.qkv.bias":
            return [(base + "attn.c_attn.bias", rearrange(t, "three o -> (three o)"))]
        for ours, theirs in self.LINEAR.items():
            if rest.startswith(ours + "."):
                kind = rest.rsplit(".", 1)[1]
                return [(base + theirs + "." + kind, t.t().contiguous() if kind == "weight" else t)]
        return [(base + rest, t)]  # ln_1, ln_2

    def from_hf(self, name, t, tied=True):
        if name == "lm_head.weight":
            return None if tied else (name, t)  # a tied head is wte (older exports still store the copy)
        if name.endswith(".attn.bias") or name.endswith(".attn.masked_bias"):
            return None  # causal-mask buffers of old exports
        name = name.removeprefix("transformer.")
        if "." not in name or (name.startswith("h.") and name.count(".") < 2):
            return name, t  # not a GPT-2 tensor: the caller names it
        if name in ("wte.weight", "wpe.weight"):
            return ("wte.weight", t) if name == "wte.weight" else ("wpe", t)
        if name.startswith("ln_f.") or not name.startswith("h."):
            return name, t
        _, i, rest = name.split(".", 2)
        base = f"blocks.{i}."
        if rest == "attn.c_attn.weight":
            return base + "attn.qkv.weight", rearrange(t, "i (three o) -> three o i", three=3).contiguous()
        if rest == "attn.c_attn.bias":
            return base + "attn.qkv.bias", rearrange(t, "(three o) -> three o", three=3).contiguous()
        for ours, theirs in self.LINEAR.items():
            if rest.startswith(theirs + "."):
                kind = rest.rsplit(".", 1)[1]
                return base + ours + "." + kind, (t.t().contiguous() if kind == "weight" else t)
        return base + rest, t

    def hf_config(self, m, eot_id=None):
        """plain GPT-2 plus the options megalite has; bos/eos are the tokenizer's end-of-text id (as GPT-2's
        50256), null for the byte tokenizer (it has none)."""
        m = {**dataclasses.asdict(ModelConfig()), **m}
        return {"architectures": [self.architecture], "model_type": "gpt2", "vocab_size": m["vocab_size"],
                "n_positions": m["block_size"], "n_embd": m["n_embd"], "n_layer": m["n_layer"],
                "n_head": m["n_head"], "n_inner": None, "activation_function": m["activation"],
                "layer_norm_epsilon": m["layer_norm_eps"], "resid_pdrop": m["dropout"], "embd_pdrop": m["dropout"],
                "attn_pdrop": m["dropout"], "initializer_range": 0.02, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
                "tie_word_embeddings": m["tie_embeddings"], "bos_token_id": eot_id, "eos_token_id": eot_id,
                "pad_token_id": None, "torch_dtype": "float32", "use_cache": True}

    def model_from_hf(self, hf, where):
        _check_fields(hf, where, self.HONOURED, self.ONLY_AT, self.IGNORED, "GPT2Config")
        for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            _positive_int(hf, key, where)
        if hf.get("n_inner") not in (None, 4 * hf["n_embd"]):
            raise ConvertError(f"{where}: n_inner = {hf['n_inner']} is not supported (megalite's MLP width is "
                               f"4 * n_embd = {4 * hf['n_embd']}; expected null or that)")
        _architectures(hf, where, ("GPT2LMHeadModel", "GPT2Model"))
        m = {ours: hf[theirs] for theirs, ours in self.HONOURED.items() if theirs in hf}
        cfg = ModelConfig(**m, dropout=0.0)  # defaults for what the folder leaves out are GPT2Config's too
        if cfg.activation not in ACTIVATIONS:
            raise ConvertError(f"{where}: activation_function = {json.dumps(cfg.activation)} is not supported "
                               f"(expected one of {', '.join(ACTIVATIONS)})")
        if not isinstance(cfg.tie_embeddings, bool):
            raise ConvertError(f"{where}: tie_word_embeddings = {cfg.tie_embeddings!r}, expected true or false")
        cfg.layer_norm_eps = _positive_float(hf, "layer_norm_epsilon", where, 1e-5)
        return dataclasses.asdict(cfg)


# ---------------------------------------------------------------- Llama
class Llama(Family):
    """transformers' LlamaForCausalLM: megalite's global names map one to one (docs/families.md), no reshapes."""
    name, model_type, architecture = "llama", "llama", "LlamaForCausalLM"
    TOP = {"wte.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight",
           "lm_head.weight": "lm_head.weight"}
    BLOCK = {"ln_1.weight": "input_layernorm.weight", "attn.q.weight": "self_attn.q_proj.weight",
             "attn.k.weight": "self_attn.k_proj.weight", "attn.v.weight": "self_attn.v_proj.weight",
             "attn.proj.weight": "self_attn.o_proj.weight", "ln_2.weight": "post_attention_layernorm.weight",
             "mlp.gate.weight": "mlp.gate_proj.weight", "mlp.up.weight": "mlp.up_proj.weight",
             "mlp.proj.weight": "mlp.down_proj.weight"}
    BLOCK_BACK = {v: k for k, v in BLOCK.items()}
    TOP_BACK = {v: k for k, v in TOP.items()}
    HONOURED = {"vocab_size": "vocab_size", "hidden_size": "n_embd", "num_hidden_layers": "n_layer",
                "num_attention_heads": "n_head", "num_key_value_heads": "n_kv_head",
                "intermediate_size": "intermediate_size", "max_position_embeddings": "block_size",
                "rms_norm_eps": "layer_norm_eps", "tie_word_embeddings": "tie_embeddings",
                "rope_theta": "rope_theta", "rope_scaling": "rope_scaling", "rope_parameters": "rope_scaling",
                "head_dim": None}  # head_dim: checked against hidden_size / heads below
    ONLY_AT = {"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,), "pretraining_tp": (1,),
               "model_type": ("llama",), "is_encoder_decoder": (False,), "sliding_window": (None,),
               "use_sliding_window": (False,), "tie_encoder_decoder": (False,)}
    IGNORED = {"attention_dropout"}  # dropout is a megalite training setting
    LLAMA3 = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

    def to_hf(self, name, t):
        if name in self.TOP:
            return [(self.TOP[name], t)]
        _, i, rest = name.split(".", 2)
        return [(f"model.layers.{i}.{self.BLOCK.get(rest, rest)}", t)]

    def from_hf(self, name, t, tied=True):
        if name == "lm_head.weight" and tied:
            return None  # a tied head is embed_tokens (some exports still store the copy)
        if name in self.TOP_BACK:
            return self.TOP_BACK[name], t
        if name.startswith("model.layers.") and name.count(".") >= 3:
            _, _, i, rest = name.split(".", 3)
            return f"blocks.{i}.{self.BLOCK_BACK.get(rest, rest)}", t
        return name, t  # not a Llama tensor: the caller names it

    def hf_config(self, m, eot_id=None):
        """LlamaConfig as transformers 4.x writes it (rope_theta + rope_scaling), which 5.x reads too."""
        cfg = ModelConfig(**{k: v for k, v in m.items()})
        scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
        return {"architectures": [self.architecture], "model_type": "llama", "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.n_embd, "intermediate_size": cfg.ffn_size, "num_hidden_layers": cfg.n_layer,
                "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads,
                "head_dim": cfg.n_embd // cfg.n_head, "hidden_act": "silu",
                "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.layer_norm_eps,
                "rope_theta": cfg.rope_theta, "rope_scaling": scaling, "attention_bias": False,
                "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1,
                "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": eot_id, "eos_token_id": eot_id,
                "pad_token_id": None, "initializer_range": 0.02, "torch_dtype": "float32", "use_cache": True}

    def model_from_hf(self, hf, where):
        _check_fields(hf, where, self.HONOURED, self.ONLY_AT, self.IGNORED, "LlamaConfig")
        sizes = {k: _positive_int(hf, k, where) for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                          "num_attention_heads", "intermediate_size")}
        C, H = sizes["hidden_size"], sizes["num_attention_heads"]
        kv = hf.get("num_key_value_heads") or H
        if hf.get("num_key_value_heads") is not None:
            kv = _positive_int(hf, "num_key_value_heads", where)
        if C % H:
            raise ConvertError(f"{where}: hidden_size = {C} is not a multiple of num_attention_heads = {H}")
        if H % kv:
            raise ConvertError(f"{where}: num_key_value_heads = {kv} does not divide num_attention_heads = {H}")
        if hf.get("head_dim") not in (None, C // H):
            raise ConvertError(f"{where}: head_dim = {hf['head_dim']} is not supported (megalite's head width is "
                               f"hidden_size / num_attention_heads = {C // H})")
        _architectures(hf, where, ("LlamaForCausalLM", "LlamaModel"))
        theta, scaling = self._rope(hf, where)
        m = dict(arch="llama", n_layer=sizes["num_hidden_layers"], n_head=H, n_embd=C, n_kv_head=kv,
                 vocab_size=sizes["vocab_size"], intermediate_size=sizes["intermediate_size"],
                 block_size=_positive_int({"m": hf.get("max_position_embeddings", 2048)}, "m", where),
                 layer_norm_eps=_positive_float(hf, "rms_norm_eps", where, 1e-6),
                 tie_embeddings=hf.get("tie_word_embeddings", False), rope_theta=theta, rope_scaling=scaling,
                 dropout=0.0)
        if not isinstance(m["tie_embeddings"], bool):
            raise ConvertError(f"{where}: tie_word_embeddings = {m['tie_embeddings']!r}, expected true or false")
        return dataclasses.asdict(ModelConfig(**m))

    def _rope(self, hf: dict, where: str) -> tuple[float, dict]:
        """(rope_theta, rope_scaling) from 4.x's `rope_theta` + `rope_scaling` or 5.x's `rope_parameters`."""
        params = hf.get("rope_parameters")
        field = "rope_parameters" if params is not None else "rope_scaling"
        scaling = dict(params if params is not None else hf.get("rope_scaling") or {})
        if not isinstance(params if params is not None else hf.get("rope_scaling") or {}, dict):
            raise ConvertError(f"{where}: {field} = {json.dumps(hf.get(field))}, expected an object or null")
        theta = _positive_float({"rope_theta": scaling.pop("rope_theta", hf.get("rope_theta", 10000.0))},
                                "rope_theta", where, 10000.0)
        kind = scaling.pop("rope_type", scaling.pop("type", "default"))
        if kind == "default":
            if scaling:
                raise ConvertError(f"{where}: {field}.{sorted(scaling)[0]} is not supported with rope_type "
                                   f"'default' (megalite reproduces plain RoPE there)")
            return theta, {}
        if kind != "llama3":
            raise ConvertError(f"{where}: {field}.rope_type = {json.dumps(kind)} is not supported (megalite models "
                               f"rope_type 'default' and 'llama3')")
        extra = sorted(set(scaling) - set(self.LLAMA3))
        if extra:
            raise ConvertError(f"{where}: {field}.{extra[0]} is not a field of rope_type 'llama3' megalite knows")
        for k in self.LLAMA3:
            if k not in scaling:
                raise ConvertError(f"{where}: {field}.{k} is missing (rope_type 'llama3' needs "
                                   f"{', '.join(self.LLAMA3)})")
        return theta, {"rope_type": "llama3", **{k: scaling[k] for k in self.LLAMA3}}


FAMILIES = {f.name: f for f in (GPT2(), Llama())}
BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES.values()}


def family_of(m: dict) -> Family:
    """The family of a megalite [model] dict (model.arch; older configs have none: GPT-2)."""
    return FAMILIES[m.get("arch", "gpt2")]
