"""Megatron-LM / megatron-core GPT checkpoints (`ckpt_format = torch_dist`) -> megalite's names and layout.

What is read: the iteration folder (a checkpoint root's `latest_checkpointed_iteration.txt` names it),
`metadata.json` (must say torch_dist), the training arguments Megatron-LM saves in `common.pt` (through the
allow-list unpickler: argparse.Namespace, dtypes, megatron's enums, nothing run), and the model's tensors
from the DCP index and chunks (dcp.py). Optimizer states, RNG states and `_extra_state` entries are not read.

What megalite reproduces is a GPT-2: learned absolute positions, LayerNorm with bias, a GeLU MLP of width
4 * hidden, multi-head attention with biases, tied or untied output layer. Anything else in the arguments
or the tensors (RoPE, SwiGLU, RMSNorm, grouped-query attention, MoE, ...) is refused in one line naming it.

The layout, whatever TP/PP it was saved at (DCP stores global tensors):
  * layers are stacked on a leading axis: `decoder.layers.<module>` of shape (L, ...); layer i is row i;
  * norms carry TransformerEngine-style names even with the local spec (`linear_qkv.layer_norm_weight` is
    the attention's input LayerNorm, `mlp.linear_fc1.layer_norm_weight` the MLP's);
  * the fused QKV rows are grouped per head, [q_h | k_h | v_h] for h = 0..H-1; megalite stacks [q | k | v]
    with heads inside each: "(h three d) c -> three (h d) c";
  * the vocabulary is padded (Megatron-LM pads to a multiple of make_vocab_size_divisible_by * TP): kept, or
    cut to --vocab-size rows.
Megatron's fused bias-GeLU (`bias_gelu_fusion`, on by default in Megatron-LM) is the tanh approximation
(megatron/core/fusions/fused_bias_gelu.py): megalite's "gelu_new"; unfused F.gelu is the exact "gelu".
"""
from __future__ import annotations

import dataclasses
import re
import zipfile
from pathlib import Path
from typing import Optional

import torch
from einops import rearrange

from .. import models
from ..base import limits
from ..base.fs import open_read, path_kind, read_all
from ..config import ModelConfig, model_from
from ..base.errors import ConfigError, ConvertError
from ..base.jsonio import loads
from . import hints as hn
from . import megatron_llama, unpickle
from .common import ForeignModel, model_partitions
from .dcp import DcpFolder

LATEST = "latest_checkpointed_iteration.txt"
COMMON, META_JSON = "common.pt", "metadata.json"
LAYERS = "decoder.layers."


def iteration_folder(path: Path) -> Path:
    """The folder of one iteration: `path` itself, or the one its latest_checkpointed_iteration.txt names."""
    if (path / META_JSON).is_file():
        return path
    latest = path / LATEST
    if latest.exists():  # a FIFO there is refused at open, naming what it is
        raw = read_all(latest, limits.FILE_BYTES["line"] + 1, follow=True)  # one byte past: a longer file is refused
        limits.within(len(raw), "line", str(latest), ConvertError)
        text = raw.decode("utf-8", errors="replace").strip()
        digits = limits.MAX_ITERATION_DIGITS  # ASCII digits only: str.isdigit() also takes '²', which int() refuses
        name = "release" if text == "release" else f"iter_{int(text):07d}" \
            if re.fullmatch(f"[0-9]{{1,{digits}}}", text) else None
        if name is None:
            raise ConvertError(f"{latest}: holds {limits.describe(text, 40)}, expected an iteration number (at most "
                               f"{digits} digits) or 'release'")
        if (path / name / META_JSON).is_file():
            return path / name
        _refuse_legacy(path / name)
        raise ConvertError(f"{latest} names iteration folder '{name}', which has no {META_JSON} (expected a "
                           f"torch_dist checkpoint there)")
    _refuse_legacy(path)
    raise ConvertError(f"{path}: not a Megatron torch_dist checkpoint (expected {META_JSON}, or {LATEST})")


def _refuse_legacy(folder: Path) -> None:
    if folder.is_dir() and any(folder.glob("mp_rank_*")):
        raise ConvertError(f"{folder}: a legacy Megatron checkpoint (mp_rank_XX/model_optim_rng.pt: whole pickles, "
                           f"which megalite never runs); expected ckpt_format torch_dist")


def read_args(step: Path, required: bool = True) -> Optional[dict]:
    """The training arguments Megatron-LM saved in common.pt, as a dict (allow-list unpickled, nothing run);
    None where there are none and not `required` (megatron-core's dist_checkpointing.save alone)."""
    meta = step / META_JSON
    limits.within(meta.stat().st_size, "json", str(meta), ConvertError)
    doc = loads(read_all(meta, follow=True), str(meta), ConvertError)
    if not isinstance(doc, dict):
        raise ConvertError(f"{meta}: not a JSON object (expected megatron's checkpoint metadata)")
    backend = doc.get("sharded_backend")
    if backend != "torch_dist":
        raise ConvertError(f"{meta}: sharded_backend = {limits.describe(backend)}, expected 'torch_dist' (megalite "
                           f"reads megatron's DCP-based format)")
    path = step / COMMON
    if not path.is_file():
        raise ConvertError(f"{path}: is {path_kind(path)}, expected megatron's common state (torch.save)")
    try:
        with open_read(path, follow=True) as f, zipfile.ZipFile(f) as z:
            pkl = [n for n in z.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pkl) != 1:
                raise ConvertError(f"{path}: expected one <name>/data.pkl in the torch.save archive, found "
                                   f"{len(pkl)}")
            info = z.getinfo(pkl[0])
            if info.compress_type != zipfile.ZIP_STORED:  # torch.save stores; DEFLATE could inflate 1000-fold
                raise ConvertError(f"{path}: {pkl[0]} is compressed (zip method {info.compress_type}, "
                                   f"{info.file_size:,} bytes inflated); torch.save stores its records "
                                   f"uncompressed, and megalite reads only such")
            limits.within(info.file_size, "pickle", f"{path}: {pkl[0]}", ConvertError)
            data = z.read(pkl[0])
    except (zipfile.BadZipFile, OSError) as e:
        raise ConvertError(f"{path}: not a torch.save archive ({e})") from None
    try:
        common = unpickle.load(data, unpickle.MEGATRON_COMMON, persistent=lambda pid: None)  # storages: unread
    except unpickle.OverBudget as e:
        raise ConvertError(f"{path}: {e}") from None
    except unpickle.RefusedGlobal as e:
        raise ConvertError(f"{path}: the pickle names '{e.name}', which is not on megalite's allow-list for "
                           f"Megatron's common state; refusing to read it (nothing in it was run)") from None
    except Exception as e:  # noqa: BLE001 (any malformed pickle: one line naming the file)
        raise ConvertError(f"{path}: not a readable pickle ({type(e).__name__}: {e})") from None
    args = common.get("args") if isinstance(common, dict) else None
    if not (isinstance(args, unpickle.Record) and args.kind == "argparse.Namespace"):
        if not required:
            return None
        raise ConvertError(f"{path}: has no 'args' (Megatron-LM's training arguments), so the model's shape comes "
                           f"from its tensors: give what they cannot tell, --num-heads (and --num-kv-heads, "
                           f"--rope-theta, --norm-eps, ...), or --config with a transformers config.json")
    return args.fields()


# ---------------------------------------------------------------- the architecture: GPT-2 or refused
def _refuse(where: str, field: str, value, what: str) -> ConvertError:
    return ConvertError(f"{where}: {field} = {limits.describe(value)}: megalite does not model {what} (it reproduces GPT-2: "
                        f"learned positions, LayerNorm, a GeLU MLP, multi-head attention with biases)")


def model_from_args(a: dict, where: str) -> dict:
    """A megalite [model] dict from Megatron-LM's arguments; the first thing megalite does not model is refused."""
    def get(name, default=None):
        return a.get(name, default)

    pos = get("position_embedding_type", "learned_absolute")
    if megatron_llama.is_llama_args(a):
        m = megatron_llama.llama_from_args(a, where)
        reader = {k: m.pop(k) for k in [k for k in m if k.startswith("_")]}  # the reader's flags, not fields
        try:  # every field as a config checks it (rope_theta above 1): what is written out can be read back
            return {**model_from(m, where), **reader}
        except ConfigError as e:
            raise ConvertError(str(e)) from None
    if pos != "learned_absolute":
        what = {"rope": "rotary position embeddings (RoPE)", "yarn": "rotary position embeddings (YaRN RoPE)",
                "mrope": "multimodal rotary position embeddings (MRoPE)", "none": "a model without position "
                "embeddings", "relative": "relative position embeddings"}.get(pos, "this position embedding") \
            if isinstance(pos, str) else "this position embedding"  # a list there is not hashable
        raise _refuse(where, "position_embedding_type", pos, what)
    if get("use_rotary_position_embeddings"):
        raise _refuse(where, "use_rotary_position_embeddings", True, "rotary position embeddings (RoPE)")
    if get("normalization", "LayerNorm") != "LayerNorm":
        raise _refuse(where, "normalization", get("normalization"),
                      f"{get('normalization')[:30] if isinstance(get('normalization'), str) else 'this norm'} "
                      f"(not LayerNorm)")
    for flag, what in (("swiglu", "SwiGLU (a gated SiLU MLP)"), ("gated_linear_unit", "a gated linear unit MLP"),
                       ("squared_relu", "a squared-ReLU MLP"), ("quick_geglu", "a quick-GeGLU MLP"),
                       ("multi_latent_attention", "multi-latent attention (MLA)"),
                       ("qk_layernorm", "LayerNorm on queries and keys (qk_layernorm)"),
                       ("layernorm_zero_centered_gamma", "zero-centred LayerNorm gains (weight + 1)"),
                       ("apply_layernorm_1p", "zero-centred LayerNorm gains (weight + 1)"),
                       ("apply_residual_connection_post_layernorm", "a residual taken after the LayerNorm"),
                       ("hybrid_layer_pattern", "a hybrid (Mamba) layer pattern"),
                       ("hybrid_override_pattern", "a hybrid (Mamba) layer pattern"),
                       ("heterogeneous_layers_config_path", "heterogeneous layers"),
                       ("experimental_attention_variant", "an experimental attention variant"),
                       ("window_size", "sliding-window attention"),
                       ("mtp_num_layers", "multi-token prediction layers")):
        if get(flag):
            raise _refuse(where, flag, get(flag), what)
    for n in ("num_experts", "num_moe_experts"):
        if get(n):
            raise _refuse(where, n, get(n), "a mixture of experts (MoE)")
    if not get("add_bias_linear", True) or not get("add_qkv_bias", True):
        field = "add_bias_linear" if not get("add_bias_linear", True) else "add_qkv_bias"
        raise _refuse(where, field, False, "linear layers without biases")
    for n in ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings"):
        limits.number(get(n), f"{where}: {n}", ConvertError, 1, limits.MAX_SIZE)
    C, H = get("hidden_size"), get("num_attention_heads")
    groups = get("num_query_groups") if get("group_query_attention") else None
    if groups not in (None, H):
        raise _refuse(where, "num_query_groups", groups, f"grouped-query attention ({groups} key/value groups "
                      f"for {H} heads)")
    if C % H:
        raise ConvertError(f"{where}: hidden_size = {C} is not a multiple of num_attention_heads = {H}")
    if get("kv_channels") not in (None, C // H):
        raise _refuse(where, "kv_channels", get("kv_channels"), f"a head width other than hidden_size / heads "
                      f"= {C // H}")
    if get("ffn_hidden_size") not in (None, 4 * C):
        raise _refuse(where, "ffn_hidden_size", get("ffn_hidden_size"), f"an MLP width other than 4 * "
                      f"hidden_size = {4 * C}")
    # Megatron-LM fuses bias + GeLU by default (--no-bias-gelu-fusion turns it off): the tanh approximation
    tanh = bool(get("openai_gelu")) or bool(get("bias_gelu_fusion", True))
    eps = limits.finite(get("layernorm_epsilon", get("norm_epsilon", 1e-5)), f"{where}: layernorm_epsilon",
                        ConvertError, positive=True)  # inf once converted to a model generate then refused
    m = ModelConfig(n_layer=get("num_layers"), n_head=H, n_embd=C, block_size=get("max_position_embeddings"),
                    vocab_size=1, dropout=0.0, tie_embeddings=not get("untie_embeddings_and_output_weights"),
                    layer_norm_eps=eps, activation="gelu_new" if tanh else "gelu")
    try:  # every field as a config checks it (finite, in range): what is written out can be read back
        return model_from(dataclasses.asdict(m), where)
    except ConfigError as e:
        raise ConvertError(str(e)) from None


# ---------------------------------------------------------------- tensor names and layouts
def _sources(m: dict, names: set) -> dict:
    """megalite name -> (megatron name, layer index or None, transform)."""
    def pick(*cands):
        return next((c for c in cands if c in names), cands[0])

    qkv = lambda t: rearrange(t, "(h three d) ... -> three (h d) ...", three=3, h=m["n_head"])  # noqa: E731
    ln1 = pick(LAYERS + "self_attention.linear_qkv.layer_norm_weight", LAYERS + "input_layernorm.weight")
    ln2 = pick(LAYERS + "mlp.linear_fc1.layer_norm_weight", LAYERS + "pre_mlp_layernorm.weight")
    per_layer = {"ln_1.weight": (ln1, None), "ln_1.bias": (ln1.replace("weight", "bias"), None),
                 "attn.qkv.weight": (LAYERS + "self_attention.linear_qkv.weight", qkv),
                 "attn.qkv.bias": (LAYERS + "self_attention.linear_qkv.bias", qkv),
                 "attn.proj.weight": (LAYERS + "self_attention.linear_proj.weight", None),
                 "attn.proj.bias": (LAYERS + "self_attention.linear_proj.bias", None),
                 "ln_2.weight": (ln2, None), "ln_2.bias": (ln2.replace("weight", "bias"), None),
                 "mlp.fc.weight": (LAYERS + "mlp.linear_fc1.weight", None),
                 "mlp.fc.bias": (LAYERS + "mlp.linear_fc1.bias", None),
                 "mlp.proj.weight": (LAYERS + "mlp.linear_fc2.weight", None),
                 "mlp.proj.bias": (LAYERS + "mlp.linear_fc2.bias", None)}
    out = {"wte.weight": ("embedding.word_embeddings.weight", None, None),
           "wpe": ("embedding.position_embeddings.weight", None, None),
           "ln_f.weight": ("decoder.final_layernorm.weight", None, None),
           "ln_f.bias": ("decoder.final_layernorm.bias", None, None),
           "lm_head.weight": ("output_layer.weight", None, None)}
    for i in range(m["n_layer"]):
        for ours, (theirs, fn) in per_layer.items():
            out[f"blocks.{i}.{ours}"] = (theirs, i, fn)
    return out


MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.", "encoder.", "mtp.")


class MegatronGPT(ForeignModel):
    """A Megatron GPT checkpoint as a Source (common.ForeignModel), GPT-2 or Llama family: `m` (the [model]
    dict), `names` (megalite's, in the model's order), `shape(name)`, and `get(name)`: one tensor, read from
    just the chunks that hold it (one layer of a stacked tensor reads that layer's chunks), in the checkpoint's
    dtype."""
    _last = (None, None)  # (what was read, the tensor): q/k/v and gate/up are slices of one fused read

    def __init__(self, path, vocab_size: Optional[int] = None, hints: Optional[hn.Hints] = None):
        self.step = iteration_folder(Path(path))
        self.where, self.guards = str(self.step), [Path(path), self.step]
        hints = hints or hn.Hints()
        args = read_args(self.step, required=not hints.given())
        self.ck = DcpFolder(self.step)
        where = f"{self.step / '.metadata'}"
        if args is None:  # megatron-core alone: the sizes from the tensors, the rest from the hints
            args = megatron_llama.args_from_tensors(self.ck.tensors, hints, where)
            m = model_from_args(args, f"{where} (with the flags given)")
        else:
            m = model_from_args(args, f"{self.step / COMMON}: args")
        vocab_size = hints.vocab_size if vocab_size is None else vocab_size
        _check_layers(self.ck, m, where)
        word = self.ck.tensors.get("embedding.word_embeddings.weight")
        if word is None or len(word.shape) != 2 or word.shape[1] != m["n_embd"]:
            got = "missing" if word is None else f"of size {list(word.shape)}"
            raise ConvertError(f"{where}: tensor 'embedding.word_embeddings.weight' is {got}, expected "
                               f"(padded vocabulary, {m['n_embd']})")
        padded = word.shape[0]
        if vocab_size is not None and not 1 <= vocab_size <= padded:
            raise ConvertError(f"--vocab-size {vocab_size}: expected 1 to the checkpoint's padded vocabulary "
                               f"{padded}")
        m["vocab_size"] = padded if vocab_size is None else vocab_size
        self.interleaved = m.pop("_interleaved", False)
        self.qkv_bias = m.pop("_qkv_bias", False)
        qk_norm = m.pop("_qk_norm", False)
        self.m = m
        if models.spec_of(m).features.positions == "rope":
            # Megatron-Bridge's Qwen2 (q/k/v biases) and Qwen3 (qk_layernorm): the family that has those features
            try:
                m["arch"] = models.family_for(positions="rope", qkv_bias=self.qkv_bias, qk_norm=qk_norm,
                                              sliding_window=False).name
            except KeyError:
                raise ConvertError(f"{where}: add_qkv_bias = {self.qkv_bias} with qk_layernorm = {qk_norm}: no "
                                   f"family megalite models has both") from None
            self.shapes = hn.llama_shapes(m, self.qkv_bias)
            self.parts = model_partitions(m)
            self.src = megatron_llama.llama_sources(dict(m, _interleaved=self.interleaved), set(self.ck.tensors))
            self._check_llama(where, padded)
        else:
            self.parts = model_partitions(m)
            self.shapes = {n: tuple(p.global_shape) for n, p in self.parts.items()}
            self.src = _sources(m, set(self.ck.tensors))
            self._check(where, padded)
        self.names = list(self.shapes)

    @property
    def native(self) -> dict:
        """Where each part of a Llama is stored, for the own-layout reference forward (native.py)."""
        qkv = LAYERS + "self_attention.linear_qkv."
        return {"family": "megatron", "embed": "embedding.word_embeddings.weight", "ln_1": self.src["blocks.0.ln_1.weight"][0],
                "qkv": qkv + "weight", "qkv_bias": self.qkv_bias and qkv + "bias",
                "proj": LAYERS + "self_attention.linear_proj.weight", "ln_2": self.src["blocks.0.ln_2.weight"][0],
                "fc1": LAYERS + "mlp.linear_fc1.weight", "fc2": LAYERS + "mlp.linear_fc2.weight",
                "ln_f": "decoder.final_layernorm.weight", "interleaved": self.interleaved,
                "head": None if self.m["tie_embeddings"] else "output_layer.weight",
                **{ours.split(".")[1]: theirs for ours, theirs in megatron_llama.own_names(self.m).items()}}

    def reference(self):
        """A Llama's own-layout forward (native.py) for --check; None for a GPT-2 (megalite's model on its
        tensors is the source side there)."""
        if models.spec_of(self.m).features.positions != "rope":
            return None
        from .native import reference_logits
        return lambda ids: reference_logits(self, ids).float()

    def raw(self, theirs: str, layer: Optional[int]) -> torch.Tensor:
        """A tensor as stored (one layer of a stacked one), float64."""
        region = [(0, n) for n in self.ck.tensors[theirs].shape]
        if layer is not None:
            region[0] = (layer, layer + 1)
        t = self.ck.read(theirs, tuple(region)).double()
        return t[0] if layer is not None else t

    def _check_llama(self, where: str, padded: int) -> None:
        want = megatron_llama.their_shapes(self.m, padded, self.qkv_bias)
        for name in self.shapes:
            theirs = self.src[name][0]
            want.setdefault(theirs, None)
        for theirs, shape in want.items():
            info = self.ck.tensors.get(theirs)
            if info is None:
                raise ConvertError(f"{where}: tensor '{theirs}' is missing, expected for this Llama")
            if shape is not None and tuple(info.shape) != shape:
                raise ConvertError(f"{where}: tensor '{theirs}' has size {list(info.shape)}, expected {list(shape)} "
                                   f"for {self.m['n_head']} heads in {self.m['n_kv_head']} query groups, hidden "
                                   f"{self.m['n_embd']}, MLP {self.m['intermediate_size']}"
                                   f"{megatron_llama.why(theirs)}")
        extra = sorted(n for n in self.ck.tensors if n.startswith(MODEL_PREFIXES) and n not in want)
        if extra:
            raise ConvertError(f"{where}: tensor '{extra[0]}' is not part of this Llama ({len(extra)} such; MoE "
                               f"experts or router?); refusing to drop it")

    def _check(self, where: str, padded: int) -> None:
        """Every tensor megalite needs is there at its size; no model tensor is left over (one would mean an
        architecture the arguments did not say, e.g. MoE router weights)."""
        m, used = self.m, set()
        for name, part in self.parts.items():
            theirs, layer, _ = self.src[name]
            want = tuple(part.global_shape)  # megalite's; megatron stacks layers and fuses (3, C) into 3C rows
            if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
                want = (want[0] * want[1],) + want[2:]
            if layer is not None:
                want = (m["n_layer"],) + want
            if name in ("wte.weight", "lm_head.weight"):
                want = (padded,) + want[1:]
            info = self.ck.tensors.get(theirs)
            if info is None:
                hint = {"embedding.position_embeddings.weight": " (no learned position embeddings: RoPE?)",
                        LAYERS + "self_attention.linear_qkv.bias": " (linear layers without biases?)"}.get(theirs, "")
                if "layer_norm_bias" in theirs or "layernorm.bias" in theirs:
                    hint = " (a norm without bias: RMSNorm?)"
                raise ConvertError(f"{where}: tensor '{theirs}' is missing, expected for a GPT-2-shaped model"
                                   f"{hint}")
            if tuple(info.shape) != want:
                raise ConvertError(f"{where}: tensor '{theirs}' has size {list(info.shape)}, expected {list(want)} "
                                   f"for this GPT-2 shape{_why(theirs, info.shape, m)}")
            used.add(theirs)
        extra = sorted(n for n in self.ck.tensors if n.startswith(MODEL_PREFIXES) and n not in used)
        if extra:
            raise ConvertError(f"{where}: tensor '{extra[0]}' is not part of a GPT-2-shaped model "
                               f"({len(extra)} such); refusing to drop it")

    def shape(self, name: str) -> tuple:
        return self.shapes[name]

    def stored(self, name: str) -> str:
        return self.src[name][0]

    def get(self, name: str) -> torch.Tensor:
        theirs, layer, fn = self.src[name]
        info = self.ck.tensors[theirs]
        region = [(0, n) for n in info.shape]
        if layer is not None:
            region[0] = (layer, layer + 1)
        if name in ("wte.weight", "lm_head.weight"):
            region[0] = (0, self.m["vocab_size"])
        key = (theirs, tuple(region))
        if self._last[0] == key:  # q, k and v (gate and up) are three (two) reads of one fused tensor
            t = self._last[1]
        else:
            t = self.ck.read(theirs, tuple(region))
            self._last = (key, t)
        if layer is not None:
            t = t[0]
        return (fn(t) if fn else t).contiguous()


def _check_layers(ck: DcpFolder, m: dict, where: str) -> None:
    """args.num_layers is the number of layers the index stores (dim 0 of every stacked decoder.layers.*
    tensor), checked before anything is built per layer: 20000 layers over two stored ones once spent a
    minute and 2 GB describing layers that are not there."""
    stored = sorted({t.shape[0] for n, t in ck.tensors.items() if n.startswith(LAYERS) and t.shape})
    if stored != [m["n_layer"]]:
        got = "no decoder.layers.* tensor" if not stored else \
            f"{' and '.join(str(n) for n in stored[:3])} layers in its stacked decoder.layers.* tensors"
        raise ConvertError(f"{where}: args.num_layers = {m['n_layer']}, but the index holds {got} (expected "
                           f"{m['n_layer']})")


def _why(theirs: str, shape, m: dict) -> str:
    C = m["n_embd"]
    if theirs.endswith("linear_qkv.weight") and len(shape) == 3 and shape[1] < 3 * C:
        return " (fewer key/value rows: grouped-query attention?)"
    if theirs.endswith("linear_fc1.weight") and len(shape) == 3 and shape[1] == 8 * C:
        return " (twice the MLP rows: a gated MLP such as SwiGLU?)"
    return ""
