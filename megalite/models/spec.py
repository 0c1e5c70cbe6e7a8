"""What a model family is: its block as a set of features, its [model] keys, what it needs of a layout, and its
name tables. One spec file per family (gpt2.py, llama.py, qwen2.py, qwen3.py, mistral.py) fills one `FamilySpec`;
everything else (model.py, config.py, convert/) asks the spec and never compares a family's name.

The features (litgpt's Config and Megatron core's layer specs are the outside models):

    norm            "layer" (LayerNorm, weight and bias) | "rms" (RMSNorm, weight)
    positions       "learned" (a wpe table) | "rope" (rotary on q and k, rotate-half layout)
    fused_qkv       one stacked (3, C, C) weight (GPT-2) | q, k, v apart (kv heads may be fewer: GQA)
    qkv_bias        biases on q, k and v (Qwen2)
    dense_bias      biases on the attention output and on the MLP (GPT-2)
    qk_norm         RMSNorm over each head's q and k before rotary (Qwen3)
    mlp             "act" (fc -> model.activation -> proj) | "swiglu" (proj(silu(gate x) * up x))
    init            "scaled": residual projections at std / sqrt(2 n_layer) (GPT-2) | "normal" (transformers')
    head_size       a head's width may differ from n_embd / n_head (model.head_size; Qwen3's head_dim)
    sliding_window  attention sees at most model.sliding_window keys back (Mistral)

A spec is data plus a few functions; it imports nothing of megalite above base/ (config.py asks it for the
family's keys and defaults, model.py for the block's features, convert/ for the name tables).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional


@dataclass(frozen=True)
class Features:
    norm: str = "rms"
    positions: str = "rope"
    fused_qkv: bool = False
    qkv_bias: bool = False
    dense_bias: bool = False
    qk_norm: bool = False
    mlp: str = "swiglu"
    init: str = "normal"
    head_size: bool = False
    sliding_window: bool = False


# [model] keys every family has (ModelConfig's first block); a family's own keys are its spec's `keys`
COMMON_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "dropout", "tie_embeddings",
               "layer_norm_eps", "arch")
# The family-specific [model] keys and the value each has when it does not apply (ModelConfig's default).
OPTIONAL_KEYS = {"activation": "gelu_new", "n_kv_head": 0, "intermediate_size": 0, "rope_theta": 10000.0,
                 "rope_scaling": {}, "head_size": 0, "sliding_window": 0}


@dataclass(frozen=True)
class FamilySpec:
    """One model family. `keys`: the OPTIONAL_KEYS it takes (the others must stay at their value there);
    `defaults`: where its default differs from ModelConfig's (Llama's head is untied); `ffn_size(m)`: the MLP's
    hidden width from a [model] mapping when intermediate_size is 0; `hf`: its transformers table (the
    family's HF class, convert/); `megatron` and `torchtitan`: its names there, where megalite reads them."""
    name: str
    features: Features
    keys: tuple = ()
    defaults: dict = field(default_factory=dict)
    ffn_size: Callable[[dict], int] = lambda m: 4 * m["n_embd"]
    hf: Optional[object] = None
    megatron: Optional[object] = None
    torchtitan: Optional[object] = None
    about: str = ""  # one line for --help and docs
    readers: tuple = ()  # other trainers' checkpoints megalite reads as this family: "megatron", "torchtitan"

    def takes(self, key: str) -> bool:
        return key in self.keys


def meta_ffn(m: dict) -> int:
    """Meta's SwiGLU width from the model width: two thirds of 4C, rounded up to a multiple of 256."""
    return 256 * -(-(8 * m["n_embd"] // 3) // 256)
