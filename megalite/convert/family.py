"""Model families as transformers names them, asked of each family's spec (megalite/models/): its name table
(megalite <-> transformers, plus the few tensors that reshape) and its config.json both ways, field by field.

    family   transformers class    reshapes
    gpt2     GPT2LMHeadModel       Conv1D weights are (in, out): transposed; q/k/v fused as c_attn [q | k | v]
    llama    LlamaForCausalLM      none: megalite stores q/k in transformers' rotate-half layout (families.md)
    qwen2    Qwen2ForCausalLM      none (q/k/v biases by name)
    qwen3    Qwen3ForCausalLM      none (q_norm, k_norm by name)
    mistral  MistralForCausalLM    none

Each config.json field is modelled, harmless, or refused because its value would change the forward; every
refused field is named in one line (models/hf.py has the rule, docs/families.md the table).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .. import models
from ..config import ModelConfig


def complete(m: dict) -> dict:
    """A [model] dict with ModelConfig's defaults for every key it leaves out."""
    return dataclasses.asdict(ModelConfig(**m))


class Family:
    """One model family as transformers writes it: its spec's transformers table, with [model] dicts made
    complete on the way."""

    def __init__(self, spec: models.FamilySpec):
        self.spec, self.hf = spec, spec.hf
        self.name, self.model_type, self.architecture = spec.name, spec.hf.model_type, spec.hf.architecture
        self.vocab_rows, self.stored = spec.hf.vocab_rows, spec.hf.STORED

    def to_hf(self, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return self.hf.to_hf(name, t)

    def from_hf(self, name: str, t: torch.Tensor, tied: bool = True) -> Optional[tuple[str, torch.Tensor]]:
        """(megalite name, tensor), or None for a tensor megalite does not keep (a tied head's copy)."""
        return self.hf.from_hf(name, t, tied)

    def hf_config(self, m: dict, eot_id: Optional[int] = None) -> dict:
        return self.hf.hf_config(complete(m), eot_id)

    def read_config(self, hf: dict, where: str) -> tuple[dict, list]:
        """(the complete [model] dict config.json describes, its harmless keys); refuses what it cannot
        reproduce, every such key in one line."""
        m, harmless = self.hf.model_from_hf(hf, where)
        return complete(m), harmless

    def model_from_hf(self, hf: dict, where: str) -> dict:
        return self.read_config(hf, where)[0]


FAMILIES = {name: Family(s) for name, s in models.FAMILIES.items()}
BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES.values()}


def family_of(m: dict) -> Family:
    """The family of a megalite [model] dict (model.arch; older configs have none: the default family)."""
    return FAMILIES[models.spec_of(m).name]
