"""Mistral (transformers' MistralForCausalLM): a Llama whose attention sees at most `sliding_window` keys back
(query i attends to keys j with i - sliding_window < j <= i, transformers' sliding_window_overlay); null: none.
MistralConfig's default is 4096, so a config.json without the key has that window. MistralForCausalLM never
reads `layer_types` (its config warns; without a window transformers' mask then fails): a list is accepted
only where it says what the model does, every layer "sliding_attention" beside a window; refused otherwise."""
from __future__ import annotations

from ..base.errors import ConvertError
from . import hf as H
from .llama import LLAMA_KEYS, LlamaHF
from .spec import FamilySpec, Features, meta_ffn


class MistralHF(LlamaHF):
    model_type, config_class, name = "mistral", "MistralConfig", "mistral"
    architectures = ("MistralForCausalLM", "MistralModel")
    ONLY_AT = {}
    max_positions_default = 4096 * 32
    kv_heads_default = 8  # the config class's num_key_value_heads default

    def own_keys(self):
        return ("sliding_window", "layer_types")

    def own_model(self, hf, where):
        w = hf.get("sliding_window", 4096)
        w = 0 if w is None else H.positive_int({"sliding_window": w}, "sliding_window", where)
        types = H.layer_types(hf, H.layer_count(hf, where), where)
        if types is not None and (not w or any(t != "sliding_attention" for t in types)):
            raise ConvertError(f"{where}: layer_types = {H._show(types)}: MistralForCausalLM applies sliding_window "
                               f"= {H._show(w or None)} to every layer and never reads layer_types (expected no "
                               f"layer_types, or every entry \"sliding_attention\" beside a sliding_window)")
        return {"sliding_window": w}

    def own_config(self, m):
        return {"sliding_window": m["sliding_window"] or None}


SPEC = FamilySpec(
    name="mistral", about="Mistral: a Llama with sliding-window attention",
    features=Features(head_size=True, sliding_window=True), keys=LLAMA_KEYS + ("sliding_window",),
    defaults={"tie_embeddings": False}, ffn_size=meta_ffn, hf=MistralHF())
