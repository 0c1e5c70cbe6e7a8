"""Reading a transformers config.json for any family: every key is modelled (mapped to a megalite [model] key),
harmless (it changes neither the weights nor the logits: names, versions, token ids, generation settings,
tool configs), or refused because its value would change the forward. Every refused key is named in one line,
not one per attempt; the harmless ones are listed once, on one informational line (docs/families.md has the
table).

    a key in the family's `honoured` table       modelled (its value checked where it is read)
    a key in `only_at` (common or the family's)  accepted at the listed values; any other value is refused
    a key in `harmless`, a key starting with "_", holding a ".", or ending in "token_id(s)"
                                                 harmless
    any other key                                harmless when its value is default-like (null, false, 0, "",
                                                 [] or {}); refused otherwise (megalite cannot tell what it does)
"""
from __future__ import annotations

import json
import math

from ..base import limits
from ..base.errors import ConvertError

# keys of transformers' PretrainedConfig (4.x and 5.x) and of the hub's model cards that change neither the
# weights nor the logits
HARMLESS = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_bfloat16", "use_cache",
    "output_past", "output_hidden_states", "output_attentions", "return_dict", "torchscript", "id2label",
    "label2id", "problem_type", "finetuning_task", "tokenizer_class", "prefix", "task_specific_params",
    "chunk_size_feed_forward", "initializer_range", "is_decoder", "gradient_checkpointing", "tf_legacy_loss",
    "is_llama_config", "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
    "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
    "output_scores", "return_dict_in_generate", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens", "attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
    "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
    "n_ctx", "predict_special_tokens", "max_window_layers"}
# keys every family accepts only at these values (the first is the one to name)
ONLY_AT = {"pretraining_tp": (1,), "is_encoder_decoder": (False,), "add_cross_attention": (False,),
           "tie_encoder_decoder": (False,), "cross_attention_hidden_size": (None,), "pruned_heads": ({},),
           "rope_interleaved": (False,), "partial_rotary_factor": (1.0, 1)}
DEFAULT_LIKE = (None, False, 0, "", [], {})


def harmless_key(key: str) -> bool:
    return key in HARMLESS or key.startswith("_") or "." in key or key.endswith(("token_id", "token_ids"))


def classify(hf: dict, honoured, only_at: dict, harmless, where: str, cls: str) -> list[str]:
    """The harmless keys of config.json `hf` (sorted); raises naming every key whose value megalite cannot
    reproduce, all in one line."""
    ok, refused = [], []
    for key, value in hf.items():
        allowed = only_at.get(key, ONLY_AT.get(key))
        if key in honoured:
            continue
        if allowed is not None:
            if not any(_same(value, a) for a in allowed):
                refused.append(f"{key} = {_show(value)} is not supported (megalite reproduces only "
                               f"{key} = {_show(allowed[0])})")
        elif key in harmless or harmless_key(key):
            ok.append(key)
        elif any(_same(value, d) for d in DEFAULT_LIKE):
            ok.append(key)
        else:
            refused.append(f"field '{key}' is not a {cls} field megalite knows ({key} = {_show(value)})")
    if refused:
        raise ConvertError(f"{where}: refusing to import a model megalite may not reproduce: {len(refused)} "
                           f"field{'s' if len(refused) > 1 else ''} would change the forward: {'; '.join(refused)}")
    return sorted(ok)


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float))
                                             and not isinstance(a, bool) and not isinstance(b, bool) and a == b)


def _show(v) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 128:
        return limits.describe(v)  # its size in bits, not 400 digits
    try:
        s = json.dumps(v)
    except (TypeError, ValueError):
        s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def positive_int(hf: dict, key: str, where: str, default=None) -> int:
    if key not in hf and default is None:
        raise ConvertError(f"{where}: field '{key}' is missing (expected it in a transformers config.json)")
    v = hf.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConvertError(f"{where}: field '{key}' = {_show(v)}, expected a positive integer")
    return v


def positive_float(hf: dict, key: str, where: str, default: float) -> float:
    v = hf.get(key, default)
    ok = not isinstance(v, bool) and isinstance(v, (int, float))
    try:
        ok = ok and math.isfinite(float(v)) and v > 0
    except OverflowError:  # a JSON integer no float holds (10**400): refused like inf, not a traceback
        ok = False
    if not ok:
        raise ConvertError(f"{where}: {key} = {_show(v)}, expected a positive number")
    return float(v)


def boolean(hf: dict, key: str, where: str, default: bool) -> bool:
    v = hf.get(key, default)
    if not isinstance(v, bool):
        raise ConvertError(f"{where}: {key} = {_show(v)}, expected true or false")
    return v


def architectures(hf: dict, where: str, allowed: tuple) -> None:
    arch = hf.get("architectures") or [allowed[0]]
    if not isinstance(arch, list) or any(a not in allowed for a in arch):
        raise ConvertError(f"{where}: architectures = {_show(arch)}, expected one of {', '.join(allowed)}")


def layer_count(hf: dict, where: str):
    """num_hidden_layers as a positive integer, or None where a partial config (`convert --config`) leaves it out
    or null (the tensors tell it)."""
    return None if hf.get("num_hidden_layers") is None else positive_int(hf, "num_hidden_layers", where)


def layer_types(hf: dict, n_layer, where: str):
    """config.json's `layer_types` (transformers 5: one "full_attention" / "sliding_attention" per layer), or None
    where absent or null; a value that is not a list of n_layer strings is refused (transformers' own
    validate_layer_type refuses a wrong count). n_layer None: a partial config (`convert --config`) whose
    num_hidden_layers the tensors tell."""
    types = hf.get("layer_types")
    if types is None:
        return None
    count_ok = n_layer is None or isinstance(types, list) and len(types) == n_layer
    if not isinstance(types, list) or not count_ok or not all(isinstance(t, str) for t in types):
        got = f"has {len(types)} entries" if isinstance(types, list) else "is not a list"
        raise ConvertError(f"{where}: layer_types = {_show(types)} {got}, expected a list of {n_layer or 'layer'} "
                           f"entries (one string per layer, num_hidden_layers = {n_layer})")
    return types
