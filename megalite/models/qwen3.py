"""Qwen3 (transformers' Qwen3ForCausalLM): a Llama with an RMSNorm over each head's q and k before rotary
(q_norm, k_norm: one weight of a head's width, shared by every head; replicated on every tp rank, its gradient
summed over tp since each rank holds other heads), a head width of its own (head_dim, 128 in every published
size), no q/k/v biases."""
from __future__ import annotations

from .llama import LLAMA_KEYS, LlamaTitan
from .qwen2 import Qwen2HF
from .spec import FamilySpec, Features, meta_ffn


class Qwen3HF(Qwen2HF):
    """Qwen2's config.json rules (the sliding layers, defaults of the sizes), without the q/k/v biases and with a
    head width of its own."""
    model_type, config_class, name = "qwen3", "Qwen3Config", "qwen3"
    architectures = ("Qwen3ForCausalLM", "Qwen3Model")
    ONLY_AT = {"attention_bias": (False,)}
    head_dim_default = 128  # Qwen3Config's
    # head_dim_nullable False as Qwen2's: Qwen3Config's head_dim is an int

    def own_config(self, m):
        return {"attention_bias": False, **super().own_config(m)}


class Qwen3Titan(LlamaTitan):
    """torchtitan's Qwen3 (torchtitan/models/qwen3, its state_dict_adapter.py's table): Llama 3's names plus
    `attention.q_norm` / `attention.k_norm` (one RMSNorm of a head's width each, applied before rotary in
    GQAttention.forward); its RoPE is CosSinRoPE, transformers' rotate-half, so no row is permuted."""
    what = "Qwen3"
    PER_LAYER = {**LlamaTitan.PER_LAYER, "attn.q_norm.weight": ("attention.q_norm.weight",) * 2,
                 "attn.k_norm.weight": ("attention.k_norm.weight",) * 2}
    interleaved = False
    rope_theta, norm_eps = 1e6, 1e-6  # every dense config of torchtitan's qwen3 registry; its _EPS
    # CosSinRoPE refuses llama scaling, and its yarn leaves the attention factor to the model, which Qwen3's
    # GQAttention never applies (head_dim ** -0.5): not transformers' yarn, so no scaling is read
    rope_scalings = ()


class Qwen3Megatron:
    """Megatron core's names beyond a Llama's (megatron/core/transformer/attention.py: `q_layernorm` and
    `k_layernorm` of `hidden_size_per_attention_head`, applied to each head before RoPE when `qk_layernorm`;
    Megatron-Bridge maps them to self_attn.q_norm / k_norm), per layer, megalite -> megatron."""
    PER_LAYER = {"attn.q_norm.weight": "self_attention.q_layernorm.weight",
                 "attn.k_norm.weight": "self_attention.k_layernorm.weight"}


SPEC = FamilySpec(
    name="qwen3", about="Qwen3: a Llama with per-head q/k RMSNorm before rotary and its own head width",
    features=Features(qk_norm=True, head_size=True), keys=LLAMA_KEYS, defaults={"tie_embeddings": False},
    ffn_size=meta_ffn, hf=Qwen3HF(), megatron=Qwen3Megatron(),
    torchtitan=Qwen3Titan(), readers=("megatron", "torchtitan"))
