"""GPT-2 (transformers' GPT2LMHeadModel): LayerNorm, a learned position table, one fused (3, C, C) qkv with
biases, fc -> activation -> proj with biases, residual projections at std / sqrt(2 n_layer), a tied head.

Names: transformers stores Conv1D weights as (in, out), so they are transposed; c_attn is [q | k | v] along its
output columns, megalite's qkv (3, C, C) the same rows stacked."""
from __future__ import annotations

from einops import rearrange

from ..base.errors import ConvertError
from . import hf as H
from .spec import FamilySpec, Features

ACTIVATIONS = ("gelu_new", "gelu", "relu")


class GPT2HF:
    model_type, architecture, config_class = "gpt2", "GPT2LMHeadModel", "GPT2Config"
    architectures = ("GPT2LMHeadModel", "GPT2Model")
    vocab_rows = ("wte.weight", "lm_head.weight")  # megalite tensors with one row per token id
    LINEAR = {"attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}  # Conv1D: (in, out)
    HONOURED = {"vocab_size": "vocab_size", "n_positions": "block_size", "n_embd": "n_embd", "n_layer": "n_layer",
                "n_head": "n_head", "layer_norm_epsilon": "layer_norm_eps", "activation_function": "activation",
                "tie_word_embeddings": "tie_embeddings", "n_inner": None}  # n_inner: null or 4 * n_embd
    ONLY_AT = {"scale_attn_weights": (True,), "scale_attn_by_inverse_layer_idx": (False,),
               "reorder_and_upcast_attn": (False,), "n_special": (0,), "model_type": ("gpt2",)}
    # config.json's sizes as the stored tensors show them: (key, what, how to read it from the shapes)
    STORED = (("n_layer", "blocks h.0, h.1, ... of", "layers", r"(?:transformer\.)?h\.([0-9]{1,9})\."),
              ("vocab_size", "rows of wte.weight in", 0, ("transformer.wte.weight", "wte.weight")),
              ("n_embd", "columns of wte.weight in", -1, ("transformer.wte.weight", "wte.weight")),
              ("n_positions", "rows of wpe.weight in", 0, ("transformer.wpe.weight", "wpe.weight")))

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
        """(megalite name, tensor), or None for a tensor megalite does not keep (a tied head's copy)."""
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

    def hf_config(self, m: dict, eot_id=None) -> dict:
        """Plain GPT-2 plus the options megalite has, from a complete [model] dict; bos/eos are the tokenizer's
        end-of-text id (as GPT-2's 50256), null for the byte tokenizer (it has none)."""
        return {"architectures": [self.architecture], "model_type": "gpt2", "vocab_size": m["vocab_size"],
                "n_positions": m["block_size"], "n_embd": m["n_embd"], "n_layer": m["n_layer"],
                "n_head": m["n_head"], "n_inner": None, "activation_function": m["activation"],
                "layer_norm_epsilon": m["layer_norm_eps"], "resid_pdrop": m["dropout"], "embd_pdrop": m["dropout"],
                "attn_pdrop": m["dropout"], "initializer_range": 0.02, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
                "tie_word_embeddings": m["tie_embeddings"], "bos_token_id": eot_id, "eos_token_id": eot_id,
                "pad_token_id": None, "torch_dtype": "float32", "use_cache": True}

    def check_keys(self, hf: dict, where: str) -> list:
        """The harmless keys of config.json `hf`; every key whose value changes the forward refused in one line."""
        return H.classify(hf, self.HONOURED, self.ONLY_AT, (), where, self.config_class)

    def model_from_hf(self, hf: dict, where: str) -> tuple[dict, list]:
        """(the [model] keys config.json sets, GPT2Config's defaults for what it leaves out; its harmless keys)."""
        harmless = self.check_keys(hf, where)
        sizes = {k: H.positive_int(hf, k, where) for k in ("vocab_size", "n_positions", "n_embd", "n_layer",
                                                           "n_head")}
        if hf.get("n_inner") not in (None, 4 * sizes["n_embd"]):
            raise ConvertError(f"{where}: n_inner = {hf['n_inner']} is not supported (megalite's MLP width is "
                               f"4 * n_embd = {4 * sizes['n_embd']}; expected null or that)")
        H.architectures(hf, where, self.architectures)
        act = hf.get("activation_function", "gelu_new")
        if act not in ACTIVATIONS:
            raise ConvertError(f"{where}: activation_function = {H._show(act)} is not supported (expected one of "
                               f"{', '.join(ACTIVATIONS)})")
        m = dict(arch="gpt2", vocab_size=sizes["vocab_size"], block_size=sizes["n_positions"],
                 n_embd=sizes["n_embd"], n_layer=sizes["n_layer"], n_head=sizes["n_head"], activation=act,
                 tie_embeddings=H.boolean(hf, "tie_word_embeddings", where, True),
                 layer_norm_eps=H.positive_float(hf, "layer_norm_epsilon", where, 1e-5), dropout=0.0)
        return m, harmless


SPEC = FamilySpec(
    name="gpt2", about="GPT-2: LayerNorm, learned positions, fused qkv with biases, GeLU MLP, tied head",
    features=Features(norm="layer", positions="learned", fused_qkv=True, qkv_bias=True, dense_bias=True,
                      mlp="act", init="scaled"),
    keys=("activation",), hf=GPT2HF(), readers=("megatron",))
