"""Qwen2 / Qwen2.5 (transformers' Qwen2ForCausalLM): a Llama with biases on q, k and v (split across tp with
their heads; with tp > kv heads each k/v bias is held, like its weight, by the ranks that share its head).
Sliding-window layers are refused: the published models leave them off (use_sliding_window: false). A layer
slides, as Qwen2Config decides, where `layer_types` says so, or (without layer_types) where use_sliding_window
is true, sliding_window is not null and the layer's index is at least max_window_layers; a config whose layers
all come out "full_attention" is read as no window, whatever use_sliding_window and sliding_window say."""
from __future__ import annotations

from ..base.errors import ConvertError
from . import hf as H
from .llama import LLAMA_KEYS, LlamaHF
from .spec import FamilySpec, Features, meta_ffn


class Qwen2HF(LlamaHF):
    model_type, config_class, name = "qwen2", "Qwen2Config", "qwen2"
    architectures = ("Qwen2ForCausalLM", "Qwen2Model")
    ONLY_AT = {"attention_bias": (True,)}
    HARMLESS = ("sliding_window", "max_window_layers")  # read (below) only where use_sliding_window is true
    head_dim_nullable = False  # no head_dim field: Qwen2Attention reads a null one as it is
    max_positions_default = 32768
    kv_heads_default = 32  # the config class's num_key_value_heads default

    def own_keys(self):
        return ("layer_types", "use_sliding_window")

    def own_model(self, hf, where):
        return _full_attention_only(hf, where)

    def own_config(self, m):
        return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": m["n_layer"]}


def _full_attention_only(hf: dict, where: str) -> dict:
    """{} where every layer of this Qwen config attends in full (Qwen2Config / Qwen3Config's __post_init__
    decides which layers slide); a sliding layer refused in one line naming it."""
    n = H.layer_count(hf, where)
    sliding = H.boolean(hf, "use_sliding_window", where, False) and hf.get("sliding_window", 4096) is not None
    types = H.layer_types(hf, n, where)
    if types is None and sliding and n is None:
        raise ConvertError(f"{where}: use_sliding_window = true without layer_types or num_hidden_layers: megalite "
                           f"cannot tell which layers slide (it reproduces only \"full_attention\" layers)")
    if types is None and not sliding:
        return {}
    if types is None:
        first = hf.get("max_window_layers", 28)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ConvertError(f"{where}: max_window_layers = {H._show(first)}, expected a non-negative integer")
        if first < n:  # layers first, ..., n - 1 slide
            raise ConvertError(f"{where}: layer_types (from use_sliding_window = true, max_window_layers = {first}): "
                               f"layer {first} is \"sliding_attention\"; megalite reproduces only \"full_attention\" "
                               f"layers for this family")
        return {}
    wrong = [i for i, t in enumerate(types) if t != "full_attention"]
    if wrong:
        raise ConvertError(f"{where}: layer_types: layer {wrong[0]} is {H._show(types[wrong[0]])}; megalite "
                           f"reproduces only \"full_attention\" layers for this family")
    return {}


SPEC = FamilySpec(
    name="qwen2", about="Qwen2/2.5: a Llama with q/k/v biases",
    features=Features(qkv_bias=True, head_size=True), keys=LLAMA_KEYS, defaults={"tie_embeddings": False},
    ffn_size=meta_ffn, hf=Qwen2HF(), readers=("megatron",))
