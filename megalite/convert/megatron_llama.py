"""Megatron-LM / megatron-core Llama-family checkpoints (RoPE, RMSNorm, SwiGLU, grouped-query attention, no
linear biases; Qwen2's q/k/v biases where `add_qkv_bias`; Qwen3's per-head q/k RMSNorm where `qk_layernorm`, with
its head width `kv_channels`) -> megalite's names and layout of the family with those features; and the
arguments a checkpoint without Megatron-LM's `args` (megatron-core's `dist_checkpointing.save` alone) would
have had, read from its tensors plus what the user tells (hints.py).

Megatron's layout (global tensors, whatever TP/PP/vpp it was saved at; layers stacked on a leading axis):
  * `self_attention.linear_qkv.weight` (L, G * (H/G + 2) * hd, C): per query group g, the rows of its H/G query
    heads, then its key head, then its value head: "(g (n d)) c" with n = H/G + 2. Query head i belongs to
    group i // (H/G), as in transformers' repeat_kv;
  * `mlp.linear_fc1.weight` (L, 2F, C): [gate; up] (megatron's swiglu sharded factory keeps this global
    order at any TP);
  * norms: TransformerEngine-style `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight` (also the
    local spec's sharded names), or the local `input_layernorm.weight` / `pre_mlp_layernorm.weight`;
  * rotary: rotate-half (as transformers) unless `rotary_interleaved`, then the pairs are permuted per head;
  * a family's own names beyond these (Qwen3's `self_attention.q_layernorm` / `k_layernorm`, (L, hd)) are its
    spec's `megatron` table (models/qwen3.py).
"""
from __future__ import annotations

import torch
from einops import rearrange

from .. import models
from ..base import limits
from ..base.errors import ConvertError
from . import hints as hn

LAYERS = "decoder.layers."


def _refuse(where: str, field: str, value, what: str) -> ConvertError:
    return ConvertError(f"{where}: {field} = {value!r}: megalite does not model {what} (its Llama is RoPE, "
                        f"RMSNorm, a SwiGLU MLP, grouped-query attention, no linear biases)")


def is_llama_args(a: dict) -> bool:
    return a.get("position_embedding_type") == "rope" or bool(a.get("use_rotary_position_embeddings"))


def llama_from_args(a: dict, where: str) -> dict:
    """megalite's Llama [model] dict from Megatron-LM's arguments; what it does not model is refused."""
    get = a.get
    if get("normalization", "LayerNorm") != "RMSNorm":
        raise _refuse(where, "normalization", get("normalization", "LayerNorm"), "RoPE with LayerNorm")
    if not get("swiglu"):
        raise _refuse(where, "swiglu", get("swiglu"), "a RoPE model without a SwiGLU MLP")
    if get("add_bias_linear", True):
        raise _refuse(where, "add_bias_linear", True, "a Llama with biases on every linear layer")
    for n in ("num_experts", "num_moe_experts"):
        if get(n):
            raise _refuse(where, n, get(n), "a mixture of experts (MoE)")
    for flag, what in (("multi_latent_attention", "multi-latent attention (MLA)"),
                       ("qk_l2_norm", "L2-normalised queries and keys (qk_l2_norm)"),
                       ("layernorm_zero_centered_gamma", "zero-centred norm gains (weight + 1)"),
                       ("apply_layernorm_1p", "zero-centred norm gains (weight + 1)"),
                       ("apply_residual_connection_post_layernorm", "a residual taken after the norm"),
                       ("rotary_seq_len_interpolation_factor", "linearly interpolated RoPE positions"),
                       ("window_size", "sliding-window attention"), ("mtp_num_layers", "multi-token prediction"),
                       ("hybrid_override_pattern", "a hybrid (Mamba) layer pattern"),
                       ("heterogeneous_layers_config_path", "heterogeneous layers")):
        if get(flag):
            raise _refuse(where, flag, get(flag), what)
    if get("rotary_percent", 1.0) != 1.0:
        raise _refuse(where, "rotary_percent", get("rotary_percent"), "RoPE on part of each head")
    for n in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings"):
        limits.number(get(n), f"{where}: {n}", ConvertError, 1, limits.MAX_SIZE)
    C, H = get("hidden_size"), get("num_attention_heads")
    G = get("num_query_groups") if get("group_query_attention") else H
    if C % H or not isinstance(G, int) or G < 1 or H % G:
        raise ConvertError(f"{where}: hidden_size = {C}, num_attention_heads = {H}, num_query_groups = {G}: expected "
                           f"heads dividing the hidden size and query groups dividing the heads")
    hd = C // H if get("kv_channels") is None else limits.number(get("kv_channels"), f"{where}: kv_channels",
                                                                  ConvertError, 1, limits.MAX_SIZE)
    scaling = None
    if get("use_rope_scaling"):  # megatron's Llama 3.x scaling: factor from args, the rest fixed in its code
        factor = limits.finite(get("rope_scaling_factor", 8.0), f"{where}: rope_scaling_factor", ConvertError, True)
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    eps = limits.finite(get("norm_epsilon", get("layernorm_epsilon", 1e-5)), f"{where}: norm_epsilon", ConvertError,
                        positive=True)
    theta = limits.finite(get("rotary_base", 10000), f"{where}: rotary_base", ConvertError, positive=True)
    m = hn.llama_model(get("num_layers"), H, G, C, get("ffn_hidden_size"), 1,
                       not get("untie_embeddings_and_output_weights"), theta, scaling, eps,
                       get("max_position_embeddings"), head_size=hd)
    m["_interleaved"] = bool(get("rotary_interleaved"))  # the reader's business, not the model's: popped there
    m["_qkv_bias"] = bool(get("add_qkv_bias"))
    m["_qk_norm"] = bool(get("qk_layernorm"))
    return m


def args_from_tensors(tensors: dict, h: hn.Hints, where: str) -> dict:
    """The Megatron-LM arguments a checkpoint without them would have had: sizes from the tensors' global shapes
    (layers, hidden, MLP width, vocabulary, kv width), the rest from the hints; a hint contradicting a tensor is
    refused naming both."""
    hn.check_choice(h)

    def shape(name):
        t = tensors.get(name)
        return None if t is None else tuple(t.shape)

    word, qkv = shape("embedding.word_embeddings.weight"), shape(LAYERS + "self_attention.linear_qkv.weight")
    proj, fc1 = shape(LAYERS + "self_attention.linear_proj.weight"), shape(LAYERS + "mlp.linear_fc1.weight")
    fc2, wpe = shape(LAYERS + "mlp.linear_fc2.weight"), shape("embedding.position_embeddings.weight")
    for n, s in (("embedding.word_embeddings.weight", word), (LAYERS + "self_attention.linear_qkv.weight", qkv),
                 (LAYERS + "self_attention.linear_proj.weight", proj), (LAYERS + "mlp.linear_fc1.weight", fc1),
                 (LAYERS + "mlp.linear_fc2.weight", fc2)):
        if s is None or len(s) != (2 if n.startswith("embedding") else 3):
            raise ConvertError(f"{where}: tensor '{n}' is {'missing' if s is None else f'of size {list(s)}'}, "
                               f"expected a megatron GPT's (stacked over layers)")
    L, C, Q, F = qkv[0], word[1], proj[2], fc2[2]
    H, KV, hd = hn.heads(h, C, Q, (qkv[1] - Q) // 2, where, LAYERS + "self_attention.linear_proj.weight",
                         LAYERS + "self_attention.linear_qkv.weight", own_width=wpe is None)
    mlp = "swiglu" if fc1[1] == 2 * F else "gelu" if fc1[1] == F else None
    if mlp is None:
        raise ConvertError(f"{where}: tensor '{LAYERS}mlp.linear_fc1.weight' has {fc1[1]} rows for an MLP width of "
                           f"{F}: neither a GeLU (F rows) nor a SwiGLU (2F rows) MLP")
    if h.mlp is not None and (h.mlp == "swiglu") != (mlp == "swiglu"):
        raise ConvertError(f"--mlp {h.mlp} contradicts tensor '{LAYERS}mlp.linear_fc1.weight': {fc1[1]} rows for "
                           f"an MLP width of {F} make {'a SwiGLU' if mlp == 'swiglu' else 'an ungated'} MLP")
    ln_bias = any(n in tensors for n in (LAYERS + "self_attention.linear_qkv.layer_norm_bias",
                                         LAYERS + "input_layernorm.bias"))
    norm = "layer" if ln_bias else "rms"
    if h.norm == "rms" and ln_bias:
        raise ConvertError(f"--norm rms contradicts tensor '{LAYERS}self_attention.linear_qkv.layer_norm_bias' "
                           f"(a norm with a bias: LayerNorm)")
    norm = h.norm or norm
    eps = 1e-5 if h.norm_eps is None else h.norm_eps
    a = dict(num_layers=L, hidden_size=C, num_attention_heads=H, kv_channels=hd, ffn_hidden_size=F,
             group_query_attention=KV != H, num_query_groups=KV,
             untie_embeddings_and_output_weights="output_layer.weight" in tensors,
             add_bias_linear=LAYERS + "self_attention.linear_proj.bias" in tensors,
             add_qkv_bias=LAYERS + "self_attention.linear_qkv.bias" in tensors,
             qk_layernorm=LAYERS + "self_attention.q_layernorm.weight" in tensors,
             normalization="RMSNorm" if norm == "rms" else "LayerNorm", swiglu=mlp == "swiglu",
             layernorm_epsilon=eps, norm_epsilon=eps, bias_gelu_fusion=(h.mlp == "gelu_tanh"),
             rotary_base=10000.0 if h.rope_theta is None else h.rope_theta, rotary_percent=1.0)
    if wpe is not None:
        a.update(position_embedding_type="learned_absolute", max_position_embeddings=wpe[0])
        if h.rope_theta is not None:
            raise ConvertError(f"--rope-theta {h.rope_theta} contradicts tensor 'embedding.position_embeddings."
                               f"weight' (learned positions, no RoPE)")
    else:
        a.update(position_embedding_type="rope", max_position_embeddings=4096 if h.block_size is None else h.block_size)
        hn.even_head_width(H, hd)
        if h.rope_scaling:
            s = hn.rope_scaling(h.rope_scaling, f"--config {h.config}: rope_scaling")
            if (s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]) != (1.0, 4.0, 8192):
                raise ConvertError(f"--config {h.config}: rope_scaling {s}: a megatron-core model's Llama 3 scaling "
                                   f"has low/high_freq_factor 1/4 and original_max_position_embeddings 8192")
            a.update(use_rope_scaling=True, rope_scaling_factor=s["factor"])
    if H != KV and wpe is not None:
        a["num_query_groups"] = KV  # GPT-2 with GQA: refused by the GPT-2 path, naming it
    return a


def split_qkv(t: torch.Tensor, part: str, groups: int, per_group: int) -> torch.Tensor:
    """One of q (H*hd rows), k or v (G*hd rows each), head-major, from megatron's fused rows
    "(g n d) ..." with n = H/G + 2 (per group: its query heads, its key head, its value head)."""
    t = rearrange(t, "(g n d) ... -> g n d ...", g=groups, n=per_group + 2)
    sel = {"q": t[:, :per_group], "k": t[:, per_group:per_group + 1], "v": t[:, per_group + 1:]}[part]
    return sel.reshape(-1, *t.shape[3:])


def split_fc1(t: torch.Tensor, part: str) -> torch.Tensor:
    """gate or up from megatron's fused [gate; up] rows."""
    gate, up = t.chunk(2, dim=0)
    return gate if part == "gate" else up


def own_names(m: dict) -> dict:
    """The family's megatron names beyond a Llama's (its spec's `megatron` table), stacked over layers:
    megalite's per-layer name -> megatron's."""
    t = models.spec_of(m).megatron
    return {ours: LAYERS + theirs for ours, theirs in (t.PER_LAYER.items() if t is not None else ())}


def llama_sources(m: dict, names: set) -> dict:
    """megalite name -> (megatron name, layer index, transform of that layer's tensor)."""
    def pick(*cands):
        return next((c for c in cands if c in names), cands[0])

    H, G = m["n_head"], m["n_kv_head"]
    inter = m.get("_interleaved")

    def qkv(part):
        def fn(t):
            out = split_qkv(t, part, G, H // G)
            if inter and part != "v":
                out = hn.interleaved_to_rotate_half(out, H if part == "q" else G)
            return out
        return fn

    ln1 = pick(LAYERS + "self_attention.linear_qkv.layer_norm_weight", LAYERS + "input_layernorm.weight")
    ln2 = pick(LAYERS + "mlp.linear_fc1.layer_norm_weight", LAYERS + "pre_mlp_layernorm.weight")
    qkvw, qkvb = LAYERS + "self_attention.linear_qkv.weight", LAYERS + "self_attention.linear_qkv.bias"
    per_layer = {"ln_1.weight": (ln1, None), "attn.q.weight": (qkvw, qkv("q")), "attn.k.weight": (qkvw, qkv("k")),
                 "attn.v.weight": (qkvw, qkv("v")), "attn.q.bias": (qkvb, qkv("q")),
                 "attn.k.bias": (qkvb, qkv("k")), "attn.v.bias": (qkvb, qkv("v")),
                 "attn.proj.weight": (LAYERS + "self_attention.linear_proj.weight", None), "ln_2.weight": (ln2, None),
                 "mlp.gate.weight": (LAYERS + "mlp.linear_fc1.weight", lambda t: split_fc1(t, "gate")),
                 "mlp.up.weight": (LAYERS + "mlp.linear_fc1.weight", lambda t: split_fc1(t, "up")),
                 "mlp.proj.weight": (LAYERS + "mlp.linear_fc2.weight", None),
                 **{ours: (theirs, None) for ours, theirs in own_names(m).items()}}
    out = {"wte.weight": ("embedding.word_embeddings.weight", None, None),
           "ln_f.weight": ("decoder.final_layernorm.weight", None, None),
           "lm_head.weight": ("output_layer.weight", None, None)}
    for i in range(m["n_layer"]):
        for ours, (theirs, fn) in per_layer.items():
            out[f"blocks.{i}.{ours}"] = (theirs, i, fn)
    return out


def their_shapes(m: dict, padded: int, qkv_bias: bool) -> dict:
    """The global shape each megatron tensor of this Llama must have (stacked over layers)."""
    L, C, H, G, F = m["n_layer"], m["n_embd"], m["n_head"], m["n_kv_head"], m["intermediate_size"]
    hd = m.get("head_size") or C // H
    out = {"embedding.word_embeddings.weight": (padded, C), "decoder.final_layernorm.weight": (C,),
           LAYERS + "self_attention.linear_qkv.weight": (L, (H + 2 * G) * hd, C),
           LAYERS + "self_attention.linear_proj.weight": (L, C, H * hd),
           LAYERS + "mlp.linear_fc1.weight": (L, 2 * F, C), LAYERS + "mlp.linear_fc2.weight": (L, C, F)}
    if qkv_bias:
        out[LAYERS + "self_attention.linear_qkv.bias"] = (L, (H + 2 * G) * hd)
    out.update({theirs: (L, hd) for theirs in own_names(m).values()})  # Qwen3's q/k norms: a head's width
    if not m["tie_embeddings"]:
        out["output_layer.weight"] = (padded, C)
    return out


def why(theirs: str) -> str:
    if theirs.endswith("mlp.linear_fc1.weight"):
        return " (rows: [gate; up], 2 x ffn_hidden_size)"
    if theirs.endswith("linear_qkv.weight"):
        return " (rows: per query group, its heads' q, then k, then v)"
    return ""
