"""Llama (transformers' LlamaForCausalLM): RMSNorm, rotary positions (rope_theta; rope_scaling none, llama3 or
yarn), q, k, v apart with fewer kv heads (GQA), SwiGLU, no biases, an untied head by default.

`LlamaHF` is the transformers table of every Llama-shaped family (Qwen2, Qwen3 and Mistral subclass it with their
own config keys): megalite's global names map one to one onto transformers' (docs/families.md), no reshapes,
because megalite stores q and k in transformers' rotate-half layout.
"""
from __future__ import annotations

from ..base.errors import ConvertError
from . import hf as H
from .spec import FamilySpec, Features, meta_ffn

LLAMA_KEYS = ("n_kv_head", "intermediate_size", "rope_theta", "rope_scaling", "head_size")
ROPE_KEYS = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
             "yarn": ("factor", "original_max_position_embeddings")}
YARN_OPTIONAL = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")
# _compute_yarn_parameters reads these as `value or default` (beta_fast or 32, `if mscale and mscale_all_dim`):
# a 0 there is the default, read as absent
YARN_OR_DEFAULT = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")


class LlamaHF:
    model_type, config_class = "llama", "LlamaConfig"
    architectures = ("LlamaForCausalLM", "LlamaModel")
    vocab_rows = ("wte.weight", "lm_head.weight")
    TOP = {"wte.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight",
           "lm_head.weight": "lm_head.weight"}
    BLOCK = {"ln_1.weight": "input_layernorm.weight", "attn.q.weight": "self_attn.q_proj.weight",
             "attn.k.weight": "self_attn.k_proj.weight", "attn.v.weight": "self_attn.v_proj.weight",
             "attn.proj.weight": "self_attn.o_proj.weight", "ln_2.weight": "post_attention_layernorm.weight",
             "mlp.gate.weight": "mlp.gate_proj.weight", "mlp.up.weight": "mlp.up_proj.weight",
             "mlp.proj.weight": "mlp.down_proj.weight",
             # Qwen2's q/k/v biases and Qwen3's per-head norms: names of every Llama-shaped family
             "attn.q.bias": "self_attn.q_proj.bias", "attn.k.bias": "self_attn.k_proj.bias",
             "attn.v.bias": "self_attn.v_proj.bias", "attn.q_norm.weight": "self_attn.q_norm.weight",
             "attn.k_norm.weight": "self_attn.k_norm.weight"}
    HONOURED = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                "rope_theta", "rope_scaling", "rope_parameters", "head_dim", "hidden_act"}
    ONLY_AT = {"attention_bias": (False,), "mlp_bias": (False,), "model_type": ("llama",),
               "sliding_window": (None,), "use_sliding_window": (False,)}
    HARMLESS = ()
    STORED = (("num_hidden_layers", "layers model.layers.0, 1, ... of", "layers", r"model\.layers\.([0-9]{1,9})\."),
              ("vocab_size", "rows of model.embed_tokens.weight in", 0, ("model.embed_tokens.weight",)),
              ("hidden_size", "columns of model.embed_tokens.weight in", -1, ("model.embed_tokens.weight",)))
    tie_default = False  # the config class's tie_word_embeddings default
    head_dim_default = None  # None: hidden_size / num_attention_heads (LlamaConfig); Qwen3Config: 128
    head_dim_nullable = True  # LlamaConfig and MistralConfig read head_dim null as hidden / heads
    max_positions_default = 2048  # the config class's max_position_embeddings default
    kv_heads_default = None  # num_key_value_heads absent: None is num_attention_heads (LlamaConfig)
    name = "llama"

    @property
    def architecture(self) -> str:
        return self.architectures[0]

    def to_hf(self, name, t):
        if name in self.TOP:
            return [(self.TOP[name], t)]
        _, i, rest = name.split(".", 2)
        return [(f"model.layers.{i}.{self.BLOCK.get(rest, rest)}", t)]

    def from_hf(self, name, t, tied=True):
        if name == "lm_head.weight" and tied:
            return None  # a tied head is embed_tokens (some exports still store the copy)
        top = {v: k for k, v in self.TOP.items()}
        if name in top:
            return top[name], t
        if name.startswith("model.layers.") and name.count(".") >= 3:
            _, _, i, rest = name.split(".", 3)
            back = {v: k for k, v in self.BLOCK.items()}
            return f"blocks.{i}.{back.get(rest, rest)}", t
        return name, t  # not a tensor of this family: the caller names it

    def hf_config(self, m: dict, eot_id=None) -> dict:
        """The config class as transformers 4.x writes it (rope_theta + rope_scaling), which 5.x reads too; `m` a
        complete [model] dict."""
        D = m["head_size"] or m["n_embd"] // m["n_head"]
        out = {"architectures": [self.architecture], "model_type": self.model_type, "vocab_size": m["vocab_size"],
               "hidden_size": m["n_embd"], "intermediate_size": m["intermediate_size"] or meta_ffn(m),
               "num_hidden_layers": m["n_layer"], "num_attention_heads": m["n_head"],
               "num_key_value_heads": m["n_kv_head"] or m["n_head"], "head_dim": D, "hidden_act": "silu",
               "max_position_embeddings": m["block_size"], "rms_norm_eps": m["layer_norm_eps"],
               "rope_theta": m["rope_theta"], "rope_scaling": dict(m["rope_scaling"]) or None,
               "attention_dropout": 0.0, "tie_word_embeddings": m["tie_embeddings"], "bos_token_id": eot_id,
               "eos_token_id": eot_id, "pad_token_id": None, "initializer_range": 0.02, "torch_dtype": "float32",
               "use_cache": True}
        return {**out, **self.own_config(m)}

    def own_config(self, m: dict) -> dict:
        """The config keys this family's class adds (LlamaConfig: its biases off, pretraining_tp 1)."""
        return {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}

    def model_from_hf(self, hf: dict, where: str) -> tuple[dict, list]:
        """(the [model] keys config.json sets, with the config class's defaults for what it leaves out; the
        harmless keys)."""
        harmless = self.check_keys(hf, where)
        sizes = {k: H.positive_int(hf, k, where) for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                           "num_attention_heads", "intermediate_size")}
        C, Hn = sizes["hidden_size"], sizes["num_attention_heads"]
        kv = hf.get("num_key_value_heads", self.kv_heads_default)  # null: num_attention_heads (every class)
        kv = Hn if kv is None else H.positive_int({"num_key_value_heads": kv}, "num_key_value_heads", where)
        if Hn % kv:
            absent = "" if "num_key_value_heads" in hf else f" (absent: {self.config_class}'s default)"
            raise ConvertError(f"{where}: num_key_value_heads = {kv}{absent} does not divide num_attention_heads = "
                               f"{Hn}")
        if hf.get("hidden_act", "silu") not in ("silu", "swish"):  # ACT2FN: both are SiLU
            raise ConvertError(f"{where}: hidden_act = {H._show(hf['hidden_act'])} is not supported (megalite "
                               f"reproduces only \"silu\", SwiGLU)")
        D = self._head_dim(hf, C, Hn, where)
        H.architectures(hf, where, self.architectures)
        positions = H.positive_int(hf, "max_position_embeddings", where, self.max_positions_default)
        theta, scaling = rope_from_hf(hf, where, positions)
        m = dict(arch=self.name, n_layer=sizes["num_hidden_layers"], n_head=Hn, n_embd=C, n_kv_head=kv,
                 vocab_size=sizes["vocab_size"], intermediate_size=sizes["intermediate_size"],
                 block_size=positions,
                 layer_norm_eps=H.positive_float(hf, "rms_norm_eps", where, 1e-6),
                 tie_embeddings=H.boolean(hf, "tie_word_embeddings", where, self.tie_default),
                 rope_theta=theta, rope_scaling=scaling, dropout=0.0, **self.own_model(hf, where))
        if D != C // Hn:
            m["head_size"] = D
        return m, harmless

    def check_keys(self, hf: dict, where: str) -> list:
        """The harmless keys of config.json `hf`; every key whose value changes the forward refused in one line
        (models/hf.py's rule, the one reading of a config.json: import, split, generate and convert --config)."""
        harmless = H.classify(hf, self.HONOURED | set(self.own_keys()), {**self.ONLY_AT, "model_type":
                              (self.model_type,)}, self.HARMLESS, where, self.config_class)
        self.own_model(hf, where)  # the family's own keys (its window and layer types) refused here too
        return harmless

    def own_keys(self) -> tuple:
        return ()

    def own_model(self, hf: dict, where: str) -> dict:
        return {}

    def _head_dim(self, hf: dict, C: int, Hn: int, where: str) -> int:
        given = hf.get("head_dim", self.head_dim_default)
        if given is None and "head_dim" in hf and not self.head_dim_nullable:
            raise ConvertError(f"{where}: field 'head_dim' = null, expected a positive integer ({self.config_class} "
                               f"does not read null as hidden_size / num_attention_heads)")
        if given is None:
            if C % Hn:
                raise ConvertError(f"{where}: hidden_size = {C} is not a multiple of num_attention_heads = {Hn}")
            return C // Hn
        D = H.positive_int({"head_dim": given}, "head_dim", where)
        if D != C // Hn and not self.decoupled_head_dim:
            raise ConvertError(f"{where}: head_dim = {D} is not supported for {self.config_class} (megalite's head "
                               f"width is hidden_size / num_attention_heads = {C // Hn} there)")
        return D

    decoupled_head_dim = True  # transformers' Llama, Mistral, Qwen2 and Qwen3 all take a head_dim of their own


class LlamaTitan:
    """torchtitan's names for this family (torchtitan/models/llama3: its model's state_dict as its checkpointer
    saves it), megalite name -> (torchtitan >= 0.2 name, <= 0.1 name); convert/torchtitan.py reads them.
    A fused `wqkv` parameter is split back into wq/wk/wv by a state_dict hook before saving (FusedQKVLinear)."""
    what = "Llama 3"
    TOP = {"wte.weight": ("tok_embeddings.weight",) * 2, "ln_f.weight": ("norm.weight",) * 2,
           "lm_head.weight": ("lm_head.weight", "output.weight")}
    PER_LAYER = {
        "ln_1.weight": ("attention_norm.weight",) * 2,
        "attn.q.weight": ("attention.qkv_linear.wq.weight", "attention.wq.weight"),
        "attn.k.weight": ("attention.qkv_linear.wk.weight", "attention.wk.weight"),
        "attn.v.weight": ("attention.qkv_linear.wv.weight", "attention.wv.weight"),
        "attn.proj.weight": ("attention.wo.weight",) * 2,
        "ln_2.weight": ("ffn_norm.weight",) * 2,
        "mlp.gate.weight": ("feed_forward.w1.weight",) * 2,
        "mlp.up.weight": ("feed_forward.w3.weight",) * 2,
        "mlp.proj.weight": ("feed_forward.w2.weight",) * 2,
    }
    # its RoPE: ComplexRoPE (each head's dims 2i, 2i+1 rotate together): wq / wk rows are permuted per head into
    # megalite's (transformers') rotate-half on the way in
    interleaved = True
    # what a DCP folder cannot tell, where no flag or --config does: ComplexRoPE.Config's theta, RMSNorm.Config's
    # eps (tests/test_defaults_reached.py reads both from torchtitan)
    rope_theta, norm_eps = 10000.0, 1e-5
    rope_scalings = ("llama3",)  # ComplexRoPE's "llama" scaling, transformers' llama3 (its yarn: hints refuse it)


def rope_from_hf(hf: dict, where: str, max_positions: int = 2048) -> tuple[float, dict]:
    """(rope_theta, rope_scaling) from 4.x's `rope_theta` + `rope_scaling` or 5.x's `rope_parameters`, read as
    transformers 5 reads them (modeling_rope_utils: standardize_rope_params, _compute_yarn_parameters); both
    given and disagreeing is refused (transformers would read one of them). `max_positions`: the config's
    max_position_embeddings, a scaling's original_max_position_embeddings when it gives none."""
    params, old = hf.get("rope_parameters"), hf.get("rope_scaling")
    for key, v in (("rope_parameters", params), ("rope_scaling", old)):
        if v is not None and not isinstance(v, dict):
            raise ConvertError(f"{where}: {key} = {H._show(v)}, expected an object or null")
    old = old or None  # convert_rope_params_to_dict reads `rope_scaling or rope_parameters`: {} is none
    if params is not None and old is not None:
        a = {k: v for k, v in params.items() if k != "rope_theta"}
        b = {("rope_type" if k == "type" else k): v for k, v in old.items()}
        if {**a, "rope_type": a.get("rope_type", "default")} != {**b, "rope_type": b.get("rope_type", "default")}:
            raise ConvertError(f"{where}: rope_parameters = {H._show(params)} and rope_scaling = {H._show(old)} "
                               f"disagree (expected one of them, or the same scaling in both)")
    field = "rope_parameters" if params is not None else "rope_scaling"
    scaling = dict(params if params is not None else old or {})
    if params is not None and "rope_theta" in params and hf.get("rope_theta") is not None and \
            params["rope_theta"] != hf["rope_theta"]:  # a top-level null: transformers keeps rope_parameters'
        raise ConvertError(f"{where}: rope_theta = {H._show(hf['rope_theta'])} and rope_parameters.rope_theta = "
                           f"{H._show(params['rope_theta'])} disagree (expected one value)")
    theta = H.positive_float({"rope_theta": scaling.pop("rope_theta", hf.get("rope_theta", 10000.0))},
                             "rope_theta", where, 10000.0)
    if "partial_rotary_factor" in scaling:  # moved here by transformers 5 from the top level: 1 rotates every dim
        prf = scaling.pop("partial_rotary_factor")
        if not H._same(prf, 1):
            raise ConvertError(f"{where}: {field}.partial_rotary_factor = {H._show(prf)} is not supported "
                               f"(megalite rotates every dim of a head: expected 1)")
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    if kind == "default":
        if scaling:
            raise ConvertError(f"{where}: {field}.{sorted(scaling)[0]} is not supported with rope_type 'default' "
                               f"(megalite reproduces plain RoPE there)")
        return theta, {}
    if kind not in ROPE_KEYS:
        raise ConvertError(f"{where}: {field}.rope_type = {H._show(kind)} is not supported (megalite models "
                           f"rope_type 'default', {', '.join(repr(k) for k in ROPE_KEYS)})")
    need, optional = ROPE_KEYS[kind], YARN_OPTIONAL if kind == "yarn" else ()
    extra = sorted(set(scaling) - set(need) - set(optional))
    if extra:
        raise ConvertError(f"{where}: {field}.{extra[0]} is not a field of rope_type '{kind}' megalite knows")
    scaling.setdefault("original_max_position_embeddings", max_positions)  # standardize_rope_params' default
    if kind == "yarn" and "factor" in scaling and scaling["factor"] is None and isinstance(max_positions, int) \
            and not isinstance(max_positions, bool):  # _compute_yarn_parameters: the ratio of the two contexts
        key = f"{field}.original_max_position_embeddings"
        original = H.positive_float({key: scaling["original_max_position_embeddings"]}, key, where, 1.0)
        scaling["factor"] = max_positions / original
    missing = [k for k in need if scaling.get(k) is None]
    if missing:
        raise ConvertError(f"{where}: {field}.{missing[0]} is missing (rope_type '{kind}' needs {', '.join(need)})")
    out = {"rope_type": kind}
    for k in need + optional:
        v = scaling.get(k)
        if k == "truncate":  # read as rope_parameters.get("truncate", True): null is falsy, no truncation
            if v is not None and not isinstance(v, bool):
                raise ConvertError(f"{where}: {field}.truncate = {H._show(v)}, expected true, false or null")
            if k in scaling:
                out[k] = bool(v)
            continue
        if v is None or (k in YARN_OR_DEFAULT and H._same(v, 0)):
            continue
        H.positive_float({f"{field}.{k}": v}, f"{field}.{k}", where, 1.0)
        out[k] = v
    if kind == "llama3" and not out["high_freq_factor"] > out["low_freq_factor"]:
        raise ConvertError(f"{where}: {field}.high_freq_factor = {H._show(out['high_freq_factor'])} must be larger "
                           f"than low_freq_factor = {H._show(out['low_freq_factor'])}")
    return theta, out


SPEC = FamilySpec(
    name="llama", about="Llama: RMSNorm, rotary (llama3/yarn scaling), grouped-query attention, SwiGLU",
    features=Features(head_size=True), keys=LLAMA_KEYS,
    defaults={"tie_embeddings": False}, ffn_size=meta_ffn, hf=LlamaHF(), torchtitan=LlamaTitan(), readers=("megatron", "torchtitan"))
