"""A torchtitan step folder (DCP) seen as a megalite model of a family torchtitan trains (`convert --from dcp
--arch llama` or `--arch qwen3`): the family's spec holds torchtitan's names (models/<family>.py, its
`torchtitan` table: Llama 3's and Qwen3's), this file how a folder is read with them.

Names, as torchtitan's checkpointer writes them (torchtitan/components/checkpoint.py and its model's
state_dict):
  * >= 0.2: `layers.N.attention.qkv_linear.{wq,wk,wv}.weight`, `lm_head.weight` (a fused `wqkv` parameter is
    split back into wq/wk/wv by a state_dict hook before saving);
  * <= 0.1: `layers.N.attention.{wq,wk,wv}.weight`, `output.weight`;
  * the rest alike: `tok_embeddings.weight`, `layers.N.attention.wo.weight`, `layers.N.attention_norm.weight`,
    `layers.N.feed_forward.{w1,w2,w3}.weight` (gate, down, up), `layers.N.ffn_norm.weight`, `norm.weight`;
    Qwen3 adds `layers.N.attention.{q_norm,k_norm}.weight`;
  * before torchtitan PR #1347 (June 2025) a full checkpoint kept the model under a `model.` prefix; since
    then the model's keys are at the top level beside `optimizer.*`, `lr_scheduler.*`, `dataloader.*` and
    `train_state.*`, which are skipped and listed (never unpickled).
Rotary layout, from the spec: Llama 3's ComplexRoPE (each head's dims 2i, 2i+1 rotate together) is permuted per
head into megalite's (transformers') rotate-half (hints.interleaved_to_rotate_half); Qwen3's CosSinRoPE is
rotate-half already.
Weight tying: a tied torchtitan model saves its one tensor under both `tok_embeddings` and `lm_head` (the
module state_dict keeps both names); megalite ties them where --config says tie_word_embeddings, after checking
the two are equal, else keeps the head apart (the same forward).
What DCP cannot tell (heads, kv heads, rope theta and scaling, eps) comes from the flags or --config; without
them theta and eps are torchtitan's own for the family (the spec's table).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import torch

from .. import models
from ..base.errors import ConvertError
from . import hints as hn
from .common import ForeignModel, model_partitions
from .dcp import METADATA, DcpFolder

TRAINING = ("optimizer.", "lr_scheduler.", "dataloader.", "train_state.")


class TorchtitanModel(ForeignModel):
    """A torchtitan model of family `arch` (default Llama) as a Source (common.ForeignModel): `m` (megalite's
    [model] dict), `names`, `shape(name)`, `get(name)` (the stored dtype, megalite's layout), `skipped` (the
    training entries left out) and `naming` ('>= 0.2' or '<= 0.1', prefix)."""

    def __init__(self, path, h: hn.Hints, permute: bool = True, arch: Optional[str] = None):
        self.spec = spec = models.spec(arch or models.llama.SPEC.name)
        names_of, what = spec.torchtitan, f"torchtitan {spec.torchtitan.what}"
        if h.family is not None and h.family != spec.name:
            raise ConvertError(f"--config {h.config}: its model_type is a {h.family}, contradicting --arch {spec.name}")
        self.folder, self.hints_config = Path(path), h.config
        self.ck = DcpFolder(self.folder)
        self.guards = [self.folder]
        self.where = where = str(self.folder / METADATA)
        names = set(self.ck.tensors)
        self.prefix = "model." if "model.tok_embeddings.weight" in names else ""
        p = self.prefix
        if p + "tok_embeddings.weight" not in names:
            raise ConvertError(f"{where}: no tensor 'tok_embeddings.weight' (or 'model.tok_embeddings.weight'): not a "
                               f"{what} checkpoint")
        new = any(n.startswith(p + "layers.") and ".attention.qkv_linear." in n for n in names)
        self.naming = ("torchtitan >= 0.2" if new else "torchtitan <= 0.1") + (", 'model.' prefix" if p else "")
        col = 0 if new else 1
        layers = sorted({int(m.group(1)) for n in names if (m := re.match(re.escape(p) + r"layers\.(\d+)\.", n))})
        if layers != list(range(len(layers))) or not layers:
            raise ConvertError(f"{where}: layer numbers {layers[:8]} are not 0..L-1")
        self.src = {}
        for ours, theirs in names_of.TOP.items():
            self.src[ours] = p + theirs[col]
        for i in layers:
            for ours, theirs in names_of.PER_LAYER.items():
                self.src[f"blocks.{i}.{ours}"] = f"{p}layers.{i}.{theirs[col]}"
        head = self.src["lm_head.weight"] in names
        tied = not head or bool(h.tie_embeddings)
        self._copy = self.src.pop("lm_head.weight") if tied and head else None  # a tied head's second name
        if tied and not head:
            del self.src["lm_head.weight"]
        shape = lambda ours: tuple(self.ck.tensors[self.src[ours]].shape) if self.src[ours] in names else None  # noqa
        V, C = shape("wte.weight")
        q, k, w1 = shape("blocks.0.attn.q.weight"), shape("blocks.0.attn.k.weight"), shape("blocks.0.mlp.gate.weight")
        if q is None or k is None or w1 is None:
            miss = next(self.src[n] for n in ("blocks.0.attn.q.weight", "blocks.0.attn.k.weight",
                                              "blocks.0.mlp.gate.weight") if shape(n) is None)
            raise ConvertError(f"{where}: tensor '{miss}' is missing, expected for a {what}")
        H, KV, hd = hn.heads(h, C, q[0], k[0], where, self.src["blocks.0.attn.q.weight"],
                             self.src["blocks.0.attn.k.weight"], own_width=spec.features.head_size)
        for told, kind in ((h.norm, "rms"), (h.mlp, "swiglu")):
            if told is not None and told != kind:
                raise ConvertError(f"--{'norm' if kind == 'rms' else 'mlp'} {told}: a {what} has "
                                   f"{'RMSNorm' if kind == 'rms' else 'a SwiGLU MLP (w1, w3, w2)'}")
        if h.vocab_size is not None and h.vocab_size != V:
            raise ConvertError(f"--config {h.config}: vocab_size = {h.vocab_size} contradicts tensor "
                               f"'{self.src['wte.weight']}' of {V} rows")
        hn.even_head_width(H, hd)
        kind = (h.rope_scaling or {}).get("rope_type")
        if kind is not None and kind not in names_of.rope_scalings:
            allowed = " or ".join(repr(k) for k in names_of.rope_scalings)
            raise ConvertError(f"--config {h.config}: rope_scaling rope_type '{kind}': megalite reads a {what} with "
                               f"{f'{allowed} rope scaling or none' if allowed else 'no rope scaling'}")
        self.m = hn.llama_model(len(layers), H, KV, C, w1[0], V, tied,
                                names_of.rope_theta if h.rope_theta is None else h.rope_theta, h.rope_scaling,
                                names_of.norm_eps if h.norm_eps is None else h.norm_eps,
                                2048 if h.block_size is None else h.block_size, spec.name, hd)
        self.shapes = hn.llama_shapes(self.m)
        self.names = list(self.shapes)
        self.parts = model_partitions(self.m)
        self.permute = permute and names_of.interleaved
        for ours, want in self.shapes.items():
            info = self.ck.tensors.get(self.src[ours])
            if info is None:
                raise ConvertError(f"{where}: tensor '{self.src[ours]}' is missing, expected for a {what} of "
                                   f"{len(layers)} layers")
            if tuple(info.shape) != want:
                raise ConvertError(f"{where}: tensor '{self.src[ours]}' has size {list(info.shape)}, expected "
                                   f"{list(want)} for {H} heads, {KV} key/value heads, hidden {C}, MLP {w1[0]}")
        used = set(self.src.values()) | {self._copy}
        self.skipped = sorted(n for n in list(names) + list(self.ck.others) if n not in used)
        extra = [n for n in self.skipped if not n.startswith(TRAINING)]
        if extra:
            raise ConvertError(f"{where}: tensor '{extra[0]}' is not part of a {what} ({len(extra)} such"
                               f"{_whose(extra[0][len(p):])}); refusing to drop it")

    @property
    def native(self) -> dict:
        """Where each part is stored (per-layer names with {i}), for the own-layout reference (native.py)."""
        layer = lambda ours: self.src[f"blocks.0.{ours}"].replace("layers.0.", "layers.{i}.", 1)  # noqa: E731
        return {"family": "torchtitan", "embed": self.src["wte.weight"], "ln_1": layer("ln_1.weight"),
                "wq": layer("attn.q.weight"), "wk": layer("attn.k.weight"), "wv": layer("attn.v.weight"),
                "proj": layer("attn.proj.weight"), "ln_2": layer("ln_2.weight"), "w1": layer("mlp.gate.weight"),
                "w3": layer("mlp.up.weight"), "fc2": layer("mlp.proj.weight"), "ln_f": self.src["ln_f.weight"],
                "head": self.src.get("lm_head.weight"), "interleaved": self.spec.torchtitan.interleaved,
                **({"q_norm": layer("attn.q_norm.weight"), "k_norm": layer("attn.k_norm.weight")}
                   if self.spec.features.qk_norm else {})}

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
        if name == "wte.weight" and self._copy is not None and not torch.equal(t, self.ck.read(self._copy)):
            raise ConvertError(f"--config {self.hints_config}: tie_word_embeddings is true, but tensors "
                               f"'{self.src[name]}' and '{self._copy}' differ (expected one tied tensor saved twice)")
        if self.permute and name.endswith(("attn.q.weight", "attn.k.weight")):
            t = hn.interleaved_to_rotate_half(t, self.m["n_head" if name.endswith("q.weight") else "n_kv_head"])
        elif self.permute and name.endswith(("q_norm.weight", "k_norm.weight")):  # a head's gains follow its dims
            t = hn.interleaved_to_rotate_half(t, 1)
        return t.contiguous()


def _whose(name: str) -> str:
    """'; a torchtitan Qwen3's: --arch qwen3' where another family torchtitan trains has tensor `name`."""
    rest = re.sub(r"^layers\.[0-9]+\.", "", name)
    for s in models.FAMILIES.values():
        t = s.torchtitan
        if t is not None and any(rest in names or name in names for names in (*t.PER_LAYER.values(), *t.TOP.values())):
            return f"; a torchtitan {t.what}'s: --arch {s.name}"
    return ""
