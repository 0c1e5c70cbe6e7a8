"""Adversarial config.json inputs for the rotary families (issue 39's attack on the strict reader): each value
transformers 5 loads is either read as transformers reads it (megalite's logits = transformers' own forward on
the same folder) or refused in one line naming config.json, the field and what was expected. The reference for
every accepted case is transformers' AutoModelForCausalLM on the edited folder itself; the refusals name what
transformers does with the value in the test's comment.

Folders are saved once per module by transformers (tests/test_families.py's tiny models, 2 layers, width 64)."""
import json
import shutil

import pytest
import torch

from test_families import IDS, hf_folder, hf_logits
from megalite.base.errors import ConvertError
from megalite.convert import convert, split
from megalite.generate import load_model
from megalite.run.init_from import source

transformers = pytest.importorskip("transformers")
# YaRN where truncation matters: head width 16, original context 64 at theta 1e4 put beta_slow's dim at 2.02
# (ceil: 3), so the ramp differs with truncate off
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e4}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    return {case: hf_folder(root / case, case) for case in ("qwen2", "qwen3", "mistral")}


def _edit(folders, tmp_path, case, drop=(), **changes):
    dst = tmp_path / "edited"
    shutil.copytree(folders[case], dst)
    c = json.loads((dst / "config.json").read_text())
    c.update(changes)
    for k in drop:
        c.pop(k, None)
    (dst / "config.json").write_text(json.dumps(c))
    return dst


def _same_as_transformers(folder, out, check=True):
    theirs = hf_logits(folder)
    mine = load_model(convert(folder, out, quiet=True, check=check))(IDS).detach()
    d = (theirs - mine).abs().max().item()
    assert d <= 1e-5 * (1 + theirs.abs().max().item()), d


ROPE = ("rope_scaling", "rope_theta")  # dropped: rope_parameters alone, as transformers 5 writes it


@pytest.mark.parametrize("case,drop,changes", [
    # transformers reads rope_parameters.get("truncate", True): null is falsy, so no truncation
    ("qwen2", ROPE, dict(rope_parameters={**YARN, "truncate": None})),
    ("qwen2", ROPE, dict(rope_parameters={**YARN, "truncate": False})),
    # beta_fast or 32, beta_slow or 1, `if mscale and mscale_all_dim`: a 0 is the default
    ("qwen2", ROPE, dict(rope_parameters={**YARN, "beta_fast": 0, "beta_slow": 0})),
    ("qwen2", ROPE, dict(rope_parameters={**YARN, "mscale": 0, "mscale_all_dim": 1.0})),
    ("qwen2", ROPE, dict(rope_parameters={**YARN, "beta_fast": None, "attention_factor": None, "mscale": None})),
    # standardize_rope_params: original_max_position_embeddings defaults to max_position_embeddings
    ("qwen2", ROPE, dict(rope_parameters={k: v for k, v in YARN.items() if k != "original_max_position_embeddings"})),
    ("qwen3", ROPE, dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "rope_theta": 1e4})),
    # _compute_yarn_parameters: a null factor is max_position_embeddings / original_max_position_embeddings (64 / 16)
    ("qwen2", ROPE, dict(rope_parameters={**YARN, "factor": None, "original_max_position_embeddings": 16})),
    # convert_rope_params_to_dict moves a partial_rotary_factor into rope_parameters; 1 is every dim
    ("qwen2", ROPE, dict(rope_parameters={**YARN, "partial_rotary_factor": 1.0})),
    ("mistral", ROPE, dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1})),
    # a top-level rope_theta of null beside rope_parameters' own: transformers keeps rope_parameters'
    ("qwen3", (), dict(rope_theta=None)),
    # convert_rope_params_to_dict: `rope_scaling or rope_parameters`, so an empty rope_scaling is none
    ("qwen2", ("rope_theta",), dict(rope_scaling={}, rope_parameters=YARN)),
    # pinned, modelled as written: factor below 1 (transformers warns), the betas swapped (it warns), an explicit
    # attention_factor, DeepSeek's mscale pair (for these classes only their ratio scales cos and sin; the softmax
    # factor yarn_apply_mscale adds is MLA's), llama3 on a Qwen (ROPE_INIT_FUNCTIONS serves every family)
    ("qwen2", ROPE, dict(rope_parameters={**YARN, "factor": 0.5})),
    ("qwen2", ROPE, dict(rope_parameters={**YARN, "beta_fast": 1, "beta_slow": 32})),
    ("qwen3", ROPE, dict(rope_parameters={**YARN, "attention_factor": 1.3, "truncate": False})),
    ("mistral", ROPE, dict(rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.707})),
    ("qwen2", ROPE, dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                          "rope_theta": 1e4})),
    ("qwen2", ("rope_parameters", "rope_theta"), dict(rope_scaling={"type": "yarn", "factor": 4.0,
                                                                    "original_max_position_embeddings": 64})),
    # ACT2FN["swish"] is nn.SiLU
    ("mistral", (), dict(hidden_act="swish")),
])
def test_rope_and_act_values_read_as_transformers_reads_them(folders, tmp_path, case, drop, changes):
    _same_as_transformers(_edit(folders, tmp_path, case, drop, **changes), tmp_path / "m.safetensors")


def test_yarn_truncate_null_reaches_training_and_split_unscaled(folders, tmp_path):
    """train.init_from and split read config.json with the same reader: a null truncate is no truncation there
    too (before: truncated, a silently different model where no --check runs)."""
    src = _edit(folders, tmp_path, "qwen2", ROPE, rope_parameters={**YARN, "truncate": None})
    assert source(str(src)).model["rope_scaling"]["truncate"] is False
    _same_as_transformers(src, tmp_path / "m.safetensors", check=False)
    split(src, tmp_path / "ck", 2, 1, 1, quiet=True)  # runs the self-check against transformers


@pytest.mark.parametrize("rope,field,expected", [
    ({**YARN, "factor": True}, "rope_parameters.factor", "a positive number"),
    ({**YARN, "factor": "4"}, "rope_parameters.factor", "a positive number"),
    ({**YARN, "original_max_position_embeddings": 0}, "rope_parameters.original_max_position_embeddings",
     "a positive number"),
    ({**YARN, "beta_fast": -1}, "rope_parameters.beta_fast", "a positive number"),
    ({**YARN, "attention_factor": 0}, "rope_parameters.attention_factor", "a positive number"),
    ({**YARN, "truncate": 0}, "rope_parameters.truncate", "true, false or null"),
    ({**YARN, "partial_rotary_factor": 0.5}, "rope_parameters.partial_rotary_factor", "1"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0, "rope_theta": 1e4},
     "rope_parameters.high_freq_factor", "larger than low_freq_factor"),
    ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}, "rope_parameters.rope_type", "'yarn'"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8, "rope_theta": 1e4},
     "rope_parameters.rope_type", "'yarn'"),
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, "rope_parameters.rope_type", "'yarn'"),
    ({"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}, "rope_parameters.mrope_section",
     "plain RoPE"),
])
def test_rope_values_megalite_cannot_reproduce_are_refused_naming_the_field(folders, tmp_path, rope, field, expected):
    src = _edit(folders, tmp_path, "qwen2", ROPE, rope_parameters=rope)
    with pytest.raises(ConvertError) as e:
        convert(src, tmp_path / "m.safetensors", quiet=True)
    msg = str(e.value)
    assert "\n" not in msg and "config.json" in msg and field in msg and expected in msg, msg
    assert not (tmp_path / "m.safetensors").exists()


FULL, SLIDING = ["full_attention"] * 2, ["sliding_attention"] * 2


@pytest.mark.parametrize("case,drop,changes", [
    # Qwen2Config: layer i slides only where use_sliding_window and i >= max_window_layers
    ("qwen2", ("layer_types",), dict(use_sliding_window=True, sliding_window=5, max_window_layers=2)),
    ("qwen3", (), dict(use_sliding_window=True, sliding_window=5, max_window_layers=0, layer_types=FULL)),
    ("qwen2", ("layer_types",), dict(use_sliding_window=False, sliding_window=5, max_window_layers=0)),
    ("qwen3", (), dict(layer_types=None)),
    # MistralForCausalLM never reads layer_types (MistralConfig warns): accepted where they say what it does
    ("mistral", (), dict(layer_types=SLIDING)),
    # pinned: the window at and past its bounds, absent (MistralConfig's 4096), null (none)
    ("mistral", (), dict(sliding_window=1)),
    ("mistral", (), dict(sliding_window=1000)),
    ("mistral", ("sliding_window",), {}),
    ("mistral", ("head_dim",), {}),
    ("mistral", (), dict(head_dim=None)),
    ("qwen2", ("tie_word_embeddings",), {}),
    ("qwen2", (), dict(torch_dtype="bfloat16", dtype="float16")),
])
def test_window_keys_read_as_transformers_reads_them(folders, tmp_path, case, drop, changes):
    _same_as_transformers(_edit(folders, tmp_path, case, drop, **changes), tmp_path / "m.safetensors")


@pytest.mark.parametrize("case,changes,field,expected", [
    # transformers' own validator: layer_types must have num_hidden_layers entries
    ("qwen2", dict(layer_types=[]), "layer_types", "2 entries"),
    ("qwen3", dict(layer_types=["full_attention"] * 3), "layer_types", "2 entries"),
    ("qwen2", dict(layer_types="full_attention"), "layer_types", "a list"),
    # a window on some or all layers: Qwen2/Qwen3's sliding layers are not modelled
    ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1, layer_types=None),
     "layer_types", "\"full_attention\""),
    ("qwen3", dict(use_sliding_window=True, sliding_window=5, layer_types=["full_attention", "sliding_attention"]),
     "layer_types", "\"full_attention\""),
    ("qwen2", dict(use_sliding_window="yes"), "use_sliding_window", "true or false"),
    # the layer count is checked before the sliding layers are counted
    ("qwen2", dict(use_sliding_window=True, layer_types=None, num_hidden_layers=10**12 + 0.5), "num_hidden_layers",
     "a positive integer"),
    # Qwen2Attention reads getattr(config, "head_dim", ...) (null: a crash); Qwen3Config's head_dim is an int
    ("qwen2", dict(head_dim=None), "head_dim", "a positive integer"),
    ("qwen3", dict(head_dim=None), "head_dim", "a positive integer"),
    # MistralForCausalLM slides every layer (or none): a list that says otherwise is refused; without a window
    # transformers' mask fails on any layer_types
    ("mistral", dict(layer_types=FULL), "layer_types", "sliding_window"),
    ("mistral", dict(sliding_window=None, layer_types=FULL), "layer_types", "sliding_window"),
    ("mistral", dict(layer_types=["full_attention", "sliding_attention"]), "layer_types", "sliding_window"),
    ("mistral", dict(sliding_window=0), "sliding_window", "a positive integer"),
    # pinned: biases and activations a family's class does not have (MistralAttention and Qwen2Attention hard-code
    # their biases, so transformers would load random ones or drop stored ones)
    ("mistral", dict(attention_bias=True), "attention_bias", "not a MistralConfig field"),
    ("mistral", dict(mlp_bias=True), "mlp_bias", "not a MistralConfig field"),
    ("qwen2", dict(attention_bias=False), "attention_bias", "only attention_bias = true"),
    ("qwen3", dict(hidden_act="gelu"), "hidden_act", "\"silu\""),
    ("qwen2", dict(num_key_value_heads=3), "num_key_value_heads", "does not divide"),
    ("mistral", dict(sliding_window=5.0), "sliding_window", "a positive integer"),
])
def test_window_values_megalite_cannot_reproduce_are_refused_naming_the_field(folders, tmp_path, case, changes,
                                                                              field, expected):
    src = _edit(folders, tmp_path, case, **changes)
    with pytest.raises(ConvertError) as e:
        convert(src, tmp_path / "m.safetensors", quiet=True)
    msg = str(e.value)
    assert "\n" not in msg and "config.json" in msg and field in msg and expected in msg, msg


@pytest.mark.parametrize("changes,field", [
    (dict(use_sliding_window=True, sliding_window=4, max_window_layers=0, num_hidden_layers=2), "use_sliding_window"),
    (dict(use_sliding_window=True, sliding_window=4), "use_sliding_window"),  # which layers slide: not told
    # no layer list of 10**12 entries is built (a --config has no stored tensors to check the count against)
    (dict(use_sliding_window=True, sliding_window=4, num_hidden_layers=10**12), "layer 28 is \"sliding_attention\""),
    (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    (dict(layer_types=["full_attention"] * 3, num_hidden_layers=2), "layer_types"),
    (dict(tie_word_embeddings="false"), "tie_word_embeddings"),
    (dict(head_dim="16"), "head_dim"),  # before: '16' taken, then said to contradict the tensors
    (dict(head_dim=True), "head_dim"),
    # the scaling's original context read from it: named as itself (before: as rope_scaling's field)
    (dict(max_position_embeddings="32768", rope_parameters={k: v for k, v in YARN.items()
                                                            if k != "original_max_position_embeddings"}),
     ": max_position_embeddings"),
    (dict(max_position_embeddings=0), ": max_position_embeddings"),
])
def test_convert_config_refuses_the_window_and_types_an_import_refuses(tmp_path, changes, field):
    """`convert --config config.json` (Megatron-LM, torchtitan) reads the family's window and layer keys as the
    import does: a sliding layer is refused in one line, not a model without the window (before: layer_types and,
    after the import learnt use_sliding_window, that key too went unchecked on this path)."""
    from megalite.convert import hints as hn
    p = tmp_path / "config.json"
    base = dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=96)
    p.write_text(json.dumps(base))
    hn.merge_config(hn.Hints(), p)
    p.write_text(json.dumps({**base, "use_sliding_window": True, "layer_types": ["full_attention"] * 2}))
    hn.merge_config(hn.Hints(), p)  # every layer full: transformers' no window
    p.write_text(json.dumps({**base, "hidden_act": "swish"}))
    assert hn.merge_config(hn.Hints(), p).mlp == "swiglu"  # ACT2FN["swish"] is nn.SiLU, as the import reads it
    yarn = {k: v for k, v in YARN.items() if k != "original_max_position_embeddings"}
    for positions, want in ((None, 32768), (640, 640)):  # Qwen3Config's max_position_embeddings, or the file's
        told = {} if positions is None else {"max_position_embeddings": positions}
        p.write_text(json.dumps({**base, "rope_parameters": yarn, **told}))
        assert hn.merge_config(hn.Hints(), p).rope_scaling["original_max_position_embeddings"] == want
    p.write_text(json.dumps({**base, **changes}))
    with pytest.raises(ConvertError) as e:
        hn.merge_config(hn.Hints(), p)
    assert "\n" not in str(e.value) and field in str(e.value) and "config.json" in str(e.value), str(e.value)


def test_a_megatron_checkpoint_with_a_yarn_config_is_refused_naming_the_file(tmp_path):
    """megatron-core models only Llama 3's scaling: a --config with YaRN (read by the family's rope reader) is
    refused naming the file (before: 'rope_scaling rope_type = ...' with no file). The sizes are a tensor-less
    stand-in for a checkpoint without args (shapes are all args_from_tensors reads)."""
    from types import SimpleNamespace as NS
    from megalite.convert import hints as hn
    from megalite.convert.megatron_llama import LAYERS, args_from_tensors
    p = tmp_path / "config.json"
    p.write_text(json.dumps(dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                 rope_parameters=YARN)))
    shapes = {"embedding.word_embeddings.weight": (96, 64), LAYERS + "self_attention.linear_qkv.weight": (2, 128, 64),
              LAYERS + "self_attention.linear_proj.weight": (2, 64, 64), LAYERS + "mlp.linear_fc1.weight": (2, 192, 64),
              LAYERS + "mlp.linear_fc2.weight": (2, 64, 96)}
    with pytest.raises(ConvertError) as e:
        args_from_tensors({n: NS(shape=s) for n, s in shapes.items()}, hn.merge_config(hn.Hints(), p), "ck")
    assert "\n" not in str(e.value) and f"--config {p}: rope_scaling rope_type = 'yarn'" in str(e.value), str(e.value)


@pytest.mark.parametrize("cls,heads,kv", [("MistralConfig", 16, 8), ("Qwen3Config", 64, 32), ("LlamaConfig", 4, 4)])
def test_num_key_value_heads_absent_is_the_classs_default(tmp_path, cls, heads, kv):
    """config.json without num_key_value_heads: MistralConfig's default is 8 kv heads, Qwen2Config's and
    Qwen3Config's 32, LlamaConfig's the attention heads (before: always the attention heads, so a Mistral of 16
    heads over 8 kv heads was refused as disagreeing with its own tensors, which transformers loads)."""
    keys = dict(head_dim=4) if cls == "Qwen3Config" else {}
    cfg = getattr(transformers, cls)(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=64,
                                     **keys)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp_path / "hf")
    folder = tmp_path / "hf"
    c = json.loads((folder / "config.json").read_text())
    del c["num_key_value_heads"]
    (folder / "config.json").write_text(json.dumps(c))
    _same_as_transformers(folder, tmp_path / "m.safetensors")


def test_num_key_value_heads_absent_that_does_not_divide_is_named(folders, tmp_path):
    src = _edit(folders, tmp_path, "mistral", drop=("num_key_value_heads",))  # 4 heads: MistralConfig's 8 kv
    with pytest.raises(ConvertError, match=r"config\.json: num_key_value_heads = 8 \(absent: MistralConfig's "
                                           r"default\) does not divide num_attention_heads = 4$"):
        convert(src, tmp_path / "m.safetensors", quiet=True)
