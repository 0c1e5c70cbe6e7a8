"""What a checkpoint's tensors cannot tell, told by the user: the flags of `megalite convert` (--num-heads,
--num-kv-heads, --rope-theta, --norm, --mlp, --norm-eps) or a transformers `config.json` (--config); and the
sizes a Llama or GPT-2 has, read from its tensors' shapes and checked against what was told.

A flag that contradicts the tensors is refused in one line naming both (the flag and the tensor's size); so is
a flag that contradicts the --config file.

Also the Llama family's global shapes under megalite's names (docs/families.md, "Names") and
the one reshaping other trainers need: torchtitan / Meta (and Megatron's `rotary_interleaved`) store each
head's q/k rows as interleaved pairs (complex RoPE: dims 2i, 2i+1 rotate together); megalite and transformers
store rotate-half (dims i, i + hd/2 rotate together).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import torch

from ..base import limits
from ..base.errors import ConvertError, UnsafeFileError
from ..base.fs import read_all
from ..base.jsonio import loads
from ..base.limits import FILE_BYTES
from .. import models
from ..config import ModelConfig
from ..models.hf import boolean
from ..models.llama import rope_from_hf as llama_rope

NORMS, MLPS = ("rms", "layer"), ("swiglu", "gelu", "gelu_tanh")


@dataclasses.dataclass
class Hints:
    """What the user told about the model (None: not told)."""
    num_heads: Optional[int] = None
    num_kv_heads: Optional[int] = None
    rope_theta: Optional[float] = None
    rope_scaling: Optional[dict] = None  # from --config only
    norm: Optional[str] = None  # rms | layer
    mlp: Optional[str] = None  # swiglu | gelu | gelu_tanh
    norm_eps: Optional[float] = None
    vocab_size: Optional[int] = None  # from --config: the real vocabulary (padding cut to it)
    block_size: Optional[int] = None
    config: Optional[str] = None  # the file the values came from, for error lines
    family: Optional[str] = None  # from --config: the family its model_type names
    head_dim: Optional[int] = None  # from --config: a head's width (None: hidden / heads)
    tie_embeddings: Optional[bool] = None  # from --config: tie_word_embeddings (its config class's default)

    def __post_init__(self):
        check_choice(self)  # a flag is typed and in range before anything reads it

    def given(self) -> bool:
        return any(v is not None for v in (self.num_heads, self.num_kv_heads, self.rope_theta, self.norm, self.mlp,
                                           self.norm_eps, self.config))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def merge_config(h: Hints, path: Path) -> Hints:
    """The values of a transformers config.json (4.x: rope_theta + rope_scaling; 5.x: rope_parameters) under
    the flags given; a flag that disagrees with the file is refused naming both."""
    try:
        raw = read_all(Path(path), FILE_BYTES["json"] + 1, follow=True)
    except OSError as e:
        why = e if isinstance(e, UnsafeFileError) else type(e).__name__  # a FIFO: what is there, said
        raise ConvertError(f"--config {path}: not a readable JSON file ({why})") from None
    c = loads(raw, f"--config {path}", ConvertError, kind="json")  # its size and depth within limits' budget
    if not isinstance(c, dict):
        raise ConvertError(f"--config {path}: expected a JSON object (a transformers config.json)")
    where = f"--config {path}"
    mt = c.get("model_type", models.llama.SPEC.hf.model_type)  # a config without one is read as LlamaConfig
    family = models.BY_MODEL_TYPE.get(mt) if isinstance(mt, str) else None
    if family is None:
        raise ConvertError(f"{where}: model_type = {limits.describe(mt)}, expected one of "
                           f"{', '.join(repr(k) for k in models.BY_MODEL_TYPE)}")
    family.hf.check_keys(c, where)  # the family's own reading: every key that changes the forward refused
    gpt2 = family.features.positions == "learned"  # GPT2Config's key names
    positions = None
    if not gpt2:  # also a scaling's original context when the file gives none: checked here, under its own name
        positions = c.get("max_position_embeddings")
        positions = family.hf.max_positions_default if positions is None else \
            limits.number(positions, f"{where}: max_position_embeddings", ConvertError, lo=1, hi=limits.MAX_SIZE)
    theta, scaling = (None, None) if gpt2 else llama_rope(c, where, positions)
    told = "rope_theta" in c or "rope_theta" in (c.get("rope_parameters") or {})
    act = c.get("activation_function" if gpt2 else "hidden_act", "gelu_new" if gpt2 else "silu")  # classes' defaults
    got = dict(num_heads=c.get("n_head" if gpt2 else "num_attention_heads"),
               num_kv_heads=None if gpt2 else c.get("num_key_value_heads"),
               rope_theta=theta if told else None,
               norm="layer" if gpt2 else "rms", norm_eps=c.get("layer_norm_epsilon" if gpt2 else "rms_norm_eps"),
               mlp={"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}.get(act, "?") if gpt2
               else ("swiglu" if act in ("silu", "swish") else f"{act}-gated"),  # ACT2FN: both SiLU
               vocab_size=c.get("vocab_size"), block_size=c.get("n_positions" if gpt2 else "max_position_embeddings"),
               head_dim=None if gpt2 else c.get("head_dim", family.hf.head_dim_default),
               tie_embeddings=None if gpt2 else boolean(c, "tie_word_embeddings", where, family.hf.tie_default))
    out = dataclasses.replace(h, config=str(path), rope_scaling=scaling or None, family=family.name)
    for k, v in got.items():
        mine = getattr(h, k)
        if v is None:
            continue
        if mine is not None and k not in ("vocab_size", "block_size") and mine != v:
            raise ConvertError(f"{_flag(k)} {mine} contradicts --config {path} ({k} = {v!r})")
        setattr(out, k, v if mine is None else mine)
    if out.mlp not in MLPS:
        raise ConvertError(f"--config {path}: activation {act!r}: megalite models SiLU-gated (SwiGLU) Llama MLPs "
                           f"and GeLU GPT-2 MLPs")
    check_choice(out, f"--config {path}")
    return out


def check_choice(h: Hints, where: Optional[str] = None) -> None:
    """Every value typed and in range (0 is a value, refused like -1, never read as "not given"): a flag is named
    as the flag, a value of a --config file as `--config FILE: field` (`where`)."""
    name_of = (lambda k: _flag(k)) if where is None else (lambda k: f"{where}: {k}")
    for name, allowed in (("norm", NORMS), ("mlp", MLPS)):
        v = getattr(h, name)
        if v is not None and v not in allowed:
            raise ConvertError(f"{name_of(name)} {limits.describe(v)}: expected one of {', '.join(allowed)}")
    for name in ("num_heads", "num_kv_heads", "vocab_size", "block_size", "head_dim"):
        if getattr(h, name) is not None:
            limits.number(getattr(h, name), name_of(name), ConvertError, lo=1, hi=limits.MAX_SIZE)
    for name in ("rope_theta", "norm_eps"):
        if getattr(h, name) is not None:
            limits.finite(getattr(h, name), name_of(name), ConvertError, positive=True)


def heads(h: Hints, hidden: int, q_rows: int, kv_rows: int, where: str, q_name: str, kv_name: str,
          own_width: bool = False) -> tuple:
    """(n_head, n_kv_head, head width) from --num-heads and the q / k widths the tensors have; `own_width`: a
    family whose head width may differ from hidden / heads (Qwen3's head_dim)."""
    if h.num_heads is None:
        raise ConvertError(f"{where}: the number of attention heads cannot be read from the tensors; give "
                           f"--num-heads (and --num-kv-heads for grouped-query attention), or --config config.json")
    H = h.num_heads
    if (hidden % H and not own_width) or q_rows % H:
        raise ConvertError(f"--num-heads {H} does not divide the hidden size {hidden} (the query width of tensor "
                           f"'{q_name}' is {q_rows})")
    hd = q_rows // H
    if h.head_dim is not None and h.head_dim != hd:
        raise ConvertError(f"--config {h.config}: head_dim = {h.head_dim} contradicts tensor '{q_name}': its "
                           f"{q_rows} rows are {H} heads of width {hd}")
    if kv_rows % hd:
        raise ConvertError(f"--num-heads {H} gives a head width of {hd}, which does not divide the key width "
                           f"{kv_rows} of tensor '{kv_name}'")
    KV = kv_rows // hd
    if h.num_kv_heads is not None and h.num_kv_heads != KV:
        raise ConvertError(f"--num-kv-heads {h.num_kv_heads} contradicts tensor '{kv_name}': its {kv_rows} rows "
                           f"are {KV} key/value heads of width {hd}")
    if H % KV:
        raise ConvertError(f"{where}: {KV} key/value heads do not divide {H} attention heads")
    return H, KV, hd


def even_head_width(H: int, hd: int) -> None:
    """A Llama's rotary embedding turns pairs of dims (i, i + hd/2): its head width must be even."""
    if hd % 2:
        raise ConvertError(f"--num-heads {H} gives a head width of {hd}, expected an even width (rotary "
                           f"embeddings turn pairs of dims)")


# ---------------------------------------------------------------- the Llama family under megalite's names
def llama_model(n_layer: int, n_head: int, n_kv_head: int, n_embd: int, ffn: int, vocab: int, tied: bool,
                theta: float, scaling: Optional[dict], eps: float, block_size: int, arch: Optional[str] = None,
                head_size: int = 0) -> dict:
    """megalite's [model] dict for a Llama-shaped family (`arch`, default Llama; n_kv_head, intermediate_size,
    rope_theta, rope_scaling; layer_norm_eps is RMSNorm's eps; head_size where a head's width is not
    n_embd / n_head), every other key at ModelConfig's default."""
    m = ModelConfig(arch=arch or models.llama.SPEC.name, n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head,
                    n_embd=n_embd, intermediate_size=ffn, vocab_size=vocab, block_size=block_size, dropout=0.0,
                    tie_embeddings=tied, rope_theta=float(theta), rope_scaling=rope_scaling(scaling),
                    layer_norm_eps=float(eps), head_size=0 if head_size * n_head == n_embd else head_size)
    return dataclasses.asdict(m)


def rope_scaling(s: Optional[dict], where: str = "rope_scaling") -> dict:
    """A transformers / torchtitan rope scaling table as megalite's ({}: none); what it does not model refused,
    named as `where` (`--config FILE: rope_scaling` where a config.json gave it)."""
    if not s:
        return {}
    kind = s.get("rope_type", s.get("type"))
    if kind != "llama3":
        raise ConvertError(f"{where} rope_type = {kind!r}: megalite models only Llama 3's ('llama3'), or none")
    out = {"rope_type": "llama3"}
    for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        out[k] = limits.finite(s.get(k), f"{where} {k}", ConvertError, positive=True)
    ctx = out["original_max_position_embeddings"]
    if float(ctx) != int(ctx):  # a count of positions: 8192.0 is 8192, 8192.5 is no context length
        raise ConvertError(f"{where} original_max_position_embeddings = {ctx!r}: expected a whole number of "
                           f"positions")
    out["original_max_position_embeddings"] = int(ctx)
    return out


def llama_shapes(m: dict, qkv_bias: bool = False) -> dict:
    """Global shape of every tensor of a megalite Llama-shaped family, in the model's order (with Qwen2's q/k/v
    biases where `qkv_bias`; with the per-head q/k norms where the family's spec has qk_norm)."""
    C, hd, F, V = m["n_embd"], m.get("head_size") or m["n_embd"] // m["n_head"], m["intermediate_size"], m["vocab_size"]
    qk_norm = models.spec_of(m).features.qk_norm
    q, kv = m["n_head"] * hd, m["n_kv_head"] * hd
    out = {"wte.weight": (V, C)}
    for i in range(m["n_layer"]):
        b = f"blocks.{i}."
        out.update({b + "ln_1.weight": (C,), b + "attn.q.weight": (q, C), b + "attn.k.weight": (kv, C),
                    b + "attn.v.weight": (kv, C)})
        if qkv_bias:
            out.update({b + "attn.q.bias": (q,), b + "attn.k.bias": (kv,), b + "attn.v.bias": (kv,)})
        if qk_norm:
            out.update({b + "attn.q_norm.weight": (hd,), b + "attn.k_norm.weight": (hd,)})
        out.update({b + "attn.proj.weight": (C, q), b + "ln_2.weight": (C,), b + "mlp.gate.weight": (F, C),
                    b + "mlp.up.weight": (F, C), b + "mlp.proj.weight": (C, F)})
    out["ln_f.weight"] = (C,)
    if not m["tie_embeddings"]:
        out["lm_head.weight"] = (V, C)
    return out


def interleaved_to_rotate_half(t: torch.Tensor, heads: int) -> torch.Tensor:
    """q or k rows of `heads` heads, each head's dims paired (2i, 2i+1) -> paired (i, i + hd/2):
    "(h d two) ... -> (h two d) ..." (transformers' permute in convert_llama_weights_to_hf.py)."""
    hd = t.shape[0] // heads
    return t.reshape(heads, hd // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()
