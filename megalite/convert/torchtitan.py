"""A torchtitan Llama 3 step folder (DCP) seen as a megalite Llama (`convert --from dcp --arch llama`).

Names, as torchtitan's checkpointer writes them (torchtitan/components/checkpoint.py and its model's
state_dict):
  * >= 0.2: `layers.N.attention.qkv_linear.{wq,wk,wv}.weight`, `lm_head.weight` (a fused `wqkv` parameter is
    split back into wq/wk/wv by a state_dict hook before saving);
  * <= 0.1: `layers.N.attention.{wq,wk,wv}.weight`, `output.weight`;
  * the rest alike: `tok_embeddings.weight`, `layers.N.attention.wo.weight`, `layers.N.attention_norm.weight`,
    `layers.N.feed_forward.{w1,w2,w3}.weight` (gate, down, up), `layers.N.ffn_norm.weight`, `norm.weight`;
  * before torchtitan PR #1347 (June 2025) a full checkpoint kept the model under a `model.` prefix; since
    then the model's keys are at the top level beside `optimizer.*`, `lr_scheduler.*`, `dataloader.*` and
    `train_state.*`, which are skipped and listed (never unpickled).
Rotary layout: torchtitan's RoPE is the complex form (each head's dims 2i, 2i+1 rotate together); megalite
stores transformers' rotate-half, so wq and wk rows are permuted per head (hints.interleaved_to_rotate_half).
What DCP cannot tell (heads, kv heads, rope theta and scaling, eps) comes from the flags or --config.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from ..base.errors import ConvertError
from . import hints as hn
from .common import ForeignModel, model_partitions
from .dcp import METADATA, DcpFolder

TRAINING = ("optimizer.", "lr_scheduler.", "dataloader.", "train_state.")
PER_LAYER = {  # megalite -> torchtitan (>= 0.2 name, <= 0.1 name)
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
TOP = {"wte.weight": ("tok_embeddings.weight",) * 2, "ln_f.weight": ("norm.weight",) * 2,
       "lm_head.weight": ("lm_head.weight", "output.weight")}


class TorchtitanLlama(ForeignModel):
    """A torchtitan Llama as a Source (common.ForeignModel): `m` (megalite's [model] dict), `names`,
    `shape(name)`, `get(name)` (the stored dtype, megalite's layout), `skipped` (the training entries left out)
    and `naming` ('>= 0.2' or '<= 0.1', prefix)."""

    def __init__(self, path, h: hn.Hints, permute: bool = True):
        self.folder = Path(path)
        self.ck = DcpFolder(self.folder)
        self.guards = [self.folder]
        self.where = where = str(self.folder / METADATA)
        names = set(self.ck.tensors)
        self.prefix = "model." if "model.tok_embeddings.weight" in names else ""
        p = self.prefix
        if p + "tok_embeddings.weight" not in names:
            raise ConvertError(f"{where}: no tensor 'tok_embeddings.weight' (or 'model.tok_embeddings.weight'): not a "
                               f"torchtitan Llama checkpoint")
        new = any(n.startswith(p + "layers.") and ".attention.qkv_linear." in n for n in names)
        self.naming = ("torchtitan >= 0.2" if new else "torchtitan <= 0.1") + (", 'model.' prefix" if p else "")
        col = 0 if new else 1
        layers = sorted({int(m.group(1)) for n in names if (m := re.match(re.escape(p) + r"layers\.(\d+)\.", n))})
        if layers != list(range(len(layers))) or not layers:
            raise ConvertError(f"{where}: layer numbers {layers[:8]} are not 0..L-1")
        self.src = {}
        for ours, theirs in TOP.items():
            self.src[ours] = p + theirs[col]
        for i in layers:
            for ours, theirs in PER_LAYER.items():
                self.src[f"blocks.{i}.{ours}"] = f"{p}layers.{i}.{theirs[col]}"
        tied = self.src["lm_head.weight"] not in names
        if tied:
            del self.src["lm_head.weight"]
        shape = lambda ours: tuple(self.ck.tensors[self.src[ours]].shape) if self.src[ours] in names else None  # noqa
        V, C = shape("wte.weight")
        q, k, w1 = shape("blocks.0.attn.q.weight"), shape("blocks.0.attn.k.weight"), shape("blocks.0.mlp.gate.weight")
        if q is None or k is None or w1 is None:
            miss = next(self.src[n] for n in ("blocks.0.attn.q.weight", "blocks.0.attn.k.weight",
                                              "blocks.0.mlp.gate.weight") if shape(n) is None)
            raise ConvertError(f"{where}: tensor '{miss}' is missing, expected for a torchtitan Llama")
        H, KV, hd = hn.heads(h, C, q[0], k[0], where, self.src["blocks.0.attn.q.weight"],
                             self.src["blocks.0.attn.k.weight"])
        if hd * H != C:
            raise ConvertError(f"{where}: tensor '{self.src['blocks.0.attn.q.weight']}' has {q[0]} rows, expected "
                               f"the hidden size {C} (megalite's head width is hidden / heads)")
        for told, what in ((h.norm, "rms"), (h.mlp, "swiglu")):
            if told is not None and told != what:
                raise ConvertError(f"--{'norm' if what == 'rms' else 'mlp'} {told}: a torchtitan Llama has "
                                   f"{'RMSNorm' if what == 'rms' else 'a SwiGLU MLP (w1, w3, w2)'}")
        if h.vocab_size is not None and h.vocab_size != V:
            raise ConvertError(f"--config {h.config}: vocab_size = {h.vocab_size} contradicts tensor "
                               f"'{self.src['wte.weight']}' of {V} rows")
        hn.even_head_width(H, hd)
        self.m = hn.llama_model(len(layers), H, KV, C, w1[0], V, tied,
                                10000.0 if h.rope_theta is None else h.rope_theta, h.rope_scaling,
                                1e-5 if h.norm_eps is None else h.norm_eps,
                                2048 if h.block_size is None else h.block_size)
        self.shapes = hn.llama_shapes(self.m)
        self.names = list(self.shapes)
        self.parts = model_partitions(self.m)
        self.permute = permute
        for ours, want in self.shapes.items():
            info = self.ck.tensors.get(self.src[ours])
            if info is None:
                raise ConvertError(f"{where}: tensor '{self.src[ours]}' is missing, expected for a Llama of "
                                   f"{len(layers)} layers")
            if tuple(info.shape) != want:
                raise ConvertError(f"{where}: tensor '{self.src[ours]}' has size {list(info.shape)}, expected "
                                   f"{list(want)} for {H} heads, {KV} key/value heads, hidden {C}, MLP {w1[0]}")
        used = set(self.src.values())
        self.skipped = sorted(n for n in list(names) + list(self.ck.others) if n not in used)
        extra = [n for n in self.skipped if not n.startswith(TRAINING)]
        if extra:
            raise ConvertError(f"{where}: tensor '{extra[0]}' is not part of a torchtitan Llama ({len(extra)} such); "
                               f"refusing to drop it")

    @property
    def native(self) -> dict:
        """Where each part is stored (per-layer names with {i}), for the own-layout reference (native.py)."""
        layer = lambda ours: self.src[f"blocks.0.{ours}"].replace("layers.0.", "layers.{i}.", 1)  # noqa: E731
        return {"family": "torchtitan", "embed": self.src["wte.weight"], "ln_1": layer("ln_1.weight"),
                "wq": layer("attn.q.weight"), "wk": layer("attn.k.weight"), "wv": layer("attn.v.weight"),
                "proj": layer("attn.proj.weight"), "ln_2": layer("ln_2.weight"), "w1": layer("mlp.gate.weight"),
                "w3": layer("mlp.up.weight"), "fc2": layer("mlp.proj.weight"), "ln_f": self.src["ln_f.weight"],
                "head": self.src.get("lm_head.weight"), "interleaved": True}

    def reference(self):
        """The source's own-layout forward (native.py): what --check compares the converted model against."""
        from .native import reference_logits
        return lambda ids: reference_logits(self, ids).float()

    def raw(self, theirs: str, layer) -> torch.Tensor:
        return self.ck.read(theirs if layer is None else theirs.format(i=layer)).double()

    def shape(self, name: str) -> tuple:
        return self.shapes[name]

    def stored(self, name: str) -> str:
        return self.src[name]

    def get(self, name: str) -> torch.Tensor:
        t = self.ck.read(self.src[name])
        if self.permute and name.endswith(("attn.q.weight", "attn.k.weight")):
            t = hn.interleaved_to_rotate_half(t, self.m["n_head" if name.endswith("q.weight") else "n_kv_head"])
        return t.contiguous()
