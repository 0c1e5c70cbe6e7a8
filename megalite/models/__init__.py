"""The model families megalite builds, one spec file each (spec.py says what a spec holds). Adding a family is
one new file here, its line below, its tests and its row in docs/families.md."""
from __future__ import annotations

from . import gpt2, llama, mistral, qwen2, qwen3
from .spec import COMMON_KEYS, OPTIONAL_KEYS, FamilySpec, Features  # noqa: F401 (the package's interface)

FAMILIES: dict[str, FamilySpec] = {s.name: s for s in (gpt2.SPEC, llama.SPEC, qwen2.SPEC, qwen3.SPEC, mistral.SPEC)}
DEFAULT = "gpt2"  # a [model] without `arch` (older configs and checkpoints)
BY_MODEL_TYPE = {s.hf.model_type: s for s in FAMILIES.values()}


def family_for(**features) -> FamilySpec:
    """The first registered family whose features are these (a Megatron-LM Llama with q/k/v biases is a Qwen2);
    KeyError when none is."""
    for s in FAMILIES.values():
        if all(getattr(s.features, k) == v for k, v in features.items()):
            return s
    raise KeyError(features)


def spec(name) -> FamilySpec:
    """The spec of family `name` (KeyError for a name not registered: config.validate names the field first)."""
    return FAMILIES[name]


def spec_of(m) -> FamilySpec:
    """The spec of a [model] dict or ModelConfig (no `arch`: the default family)."""
    name = m.get("arch", DEFAULT) if isinstance(m, dict) else getattr(m, "arch", DEFAULT)
    return FAMILIES[name]
