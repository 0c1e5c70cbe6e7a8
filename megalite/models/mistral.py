"""Mistral (transformers' MistralForCausalLM): a Llama whose attention sees at most `sliding_window` keys back
(query i attends to keys j with i - sliding_window < j <= i, transformers' sliding_window_overlay); null: none.
MistralConfig's default is 4096, so a config.json without the key has that window."""
from __future__ import annotations

from . import hf as H
from .llama import LLAMA_KEYS, LlamaHF
from .spec import FamilySpec, Features, meta_ffn


class MistralHF(LlamaHF):
    model_type, config_class, name = "mistral", "MistralConfig", "mistral"
    architectures = ("MistralForCausalLM", "MistralModel")
    ONLY_AT = {}
    positions_default = 4096 * 32  # MistralConfig's

    def own_keys(self):
        return ("sliding_window",)

    def own_model(self, hf, where):
        w = hf.get("sliding_window", 4096)
        return {"sliding_window": 0 if w is None else H.positive_int({"sliding_window": w}, "sliding_window", where)}

    def own_config(self, m):
        return {"sliding_window": m["sliding_window"] or None}


SPEC = FamilySpec(
    name="mistral", about="Mistral: a Llama with sliding-window attention",
    features=Features(head_size=True, sliding_window=True), keys=LLAMA_KEYS + ("sliding_window",),
    defaults={"tie_embeddings": False}, ffn_size=meta_ffn, hf=MistralHF())
