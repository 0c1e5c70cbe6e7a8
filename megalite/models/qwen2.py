"""Qwen2 / Qwen2.5 (transformers' Qwen2ForCausalLM): a Llama with biases on q, k and v (split across tp with
their heads; with tp > kv heads each k/v bias is held, like its weight, by the ranks that share its head).
Sliding-window attention is refused: the published models leave it off (use_sliding_window: false)."""
from __future__ import annotations

from ..base.errors import ConvertError
from .llama import LLAMA_KEYS, LlamaHF
from .spec import FamilySpec, Features, meta_ffn


class Qwen2HF(LlamaHF):
    model_type, config_class, name = "qwen2", "Qwen2Config", "qwen2"
    architectures = ("Qwen2ForCausalLM", "Qwen2Model")
    ONLY_AT = {"use_sliding_window": (False,), "attention_bias": (True,)}
    HARMLESS = ("sliding_window", "max_window_layers")  # read by transformers only with use_sliding_window: true
    positions_default = 32768  # Qwen2Config's

    def own_keys(self):
        return ("layer_types",)

    def own_model(self, hf, where):
        return _full_attention_only(hf, where)

    def own_config(self, m):
        return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": m["n_layer"]}


def _full_attention_only(hf: dict, where: str) -> dict:
    types = hf.get("layer_types")
    if types is not None and (not isinstance(types, list) or any(t != "full_attention" for t in types)):
        raise ConvertError(f"{where}: layer_types = {str(types)[:80]}: megalite reproduces only "
                           f"\"full_attention\" layers for this family")
    return {}


SPEC = FamilySpec(
    name="qwen2", about="Qwen2/2.5: a Llama with q/k/v biases",
    features=Features(qkv_bias=True, head_size=True), keys=LLAMA_KEYS, defaults={"tie_embeddings": False},
    ffn_size=meta_ffn, hf=Qwen2HF(), readers=("megatron",))
