"""A transformers config.json as transformers and the hub write it (issue 38, item 1): every key modelled,
harmless (listed once, on one line) or refused because its value would change the forward (all of them named in
one line, nothing written). The outside reference: transformers' own save_pretrained and its forward."""
import json
import shutil

import pytest
import torch

from megalite.base.errors import ConvertError
from megalite.convert import convert, split
from megalite.generate import load_model

transformers = pytest.importorskip("transformers")
IDS = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama saved by transformers itself (its config.json exactly as 5.x writes it), norms perturbed."""
    d = tmp_path_factory.mktemp("hfcfg") / "hf"
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(d)
    with torch.no_grad():
        logits = model(IDS).logits
    return d, logits


def _edit(src, dst, drop=(), **changes):
    shutil.copytree(src, dst)
    c = json.loads((dst / "config.json").read_text())
    for k in drop:
        c.pop(k, None)
    c.update(changes)
    (dst / "config.json").write_text(json.dumps(c))
    return dst


HUB_CARD = {"is_llama_config": True, "rope_interleaved": False, "transformers.js_config": {"dtype": "q4"},
            "_name_or_path": "someone/SmolLM2-135M-Instruct", "unk_token_id": 0, "pretraining_tp": 1,
            "use_cache": False, "torch_dtype": "bfloat16", "transformers_version": "4.42.3",
            "initializer_range": 0.041666, "mlp_bias": False, "attention_bias": False, "temperature": 0.7,
            "_attn_implementation_autoset": True, "some_future_flag": None, "another_new_key": False}


def test_transformers_own_config_comes_in_as_saved(tmp_path, saved, capsys):
    """transformers 5.x's own config.json (dtype, transformers_version, a list of eos ids, ...) imports with
    --check, and its logits are transformers'."""
    folder, logits = saved
    f = convert(folder, tmp_path / "m.safetensors")
    err = capsys.readouterr().err
    assert "harmless fields ignored" in err and "transformers_version" in err and err.count("harmless") == 1
    assert (load_model(f)(IDS).detach() - logits).abs().max() < 1e-5


def test_hub_card_and_4x_keys_are_harmless(tmp_path, saved, capsys):
    """The keys a hub model card carries and transformers 4.x wrote (rope_theta + rope_scaling null,
    torch_dtype, ...), and unknown keys with default-like values: accepted, listed once on one line."""
    folder, logits = saved
    c = json.loads((folder / "config.json").read_text())
    four = {"rope_theta": c.get("rope_parameters", {}).get("rope_theta", 10000.0), "rope_scaling": None}
    src = _edit(folder, tmp_path / "hub", drop=("rope_parameters", "dtype"), **HUB_CARD, **four)
    f = convert(src, tmp_path / "m.safetensors")
    line = [ln for ln in capsys.readouterr().err.splitlines() if "harmless" in ln]
    assert len(line) == 1
    for key in ("is_llama_config", "transformers.js_config", "_name_or_path", "unk_token_id", "some_future_flag"):
        assert key in line[0], key
    assert (load_model(f)(IDS).detach() - logits).abs().max() < 1e-5
    split(src, tmp_path / "ck", 2, 1, 1, quiet=True)  # split reads it the same way


def test_every_math_changing_key_is_named_in_one_line_and_nothing_is_written(tmp_path, saved):
    folder, _ = saved
    bad = {"mlp_bias": True, "pretraining_tp": 2, "rope_interleaved": True, "num_local_experts": 8,
           "sliding_window": 16, "pruned_heads": {"0": [1]}}
    src = _edit(folder, tmp_path / "bad", **bad)
    for run in (lambda: convert(src, tmp_path / "m.safetensors"), lambda: split(src, tmp_path / "ck", 1, 1, 1)):
        with pytest.raises(ConvertError) as e:
            run()
        msg = str(e.value)
        assert "\n" not in msg and "6 fields would change the forward" in msg, msg
        for key in bad:
            assert key in msg, key
    assert not (tmp_path / "m.safetensors").exists() and not (tmp_path / "ck").exists()


@pytest.mark.parametrize("key,value", [("pretraining_tp", 1), ("rope_interleaved", False), ("unk_token_id", 7),
                                       ("is_llama_config", True), ("transformers.js_config", {"a": 1}),
                                       ("new_feature_switch", 0), ("use_sliding_window", False)])
def test_each_harmless_key_alone_is_accepted(tmp_path, saved, key, value):
    folder, logits = saved
    f = convert(_edit(folder, tmp_path / "k", **{key: value}), tmp_path / "m.safetensors", quiet=True)
    assert (load_model(f)(IDS).detach() - logits).abs().max() < 1e-5


@pytest.mark.parametrize("key,value", [("pretraining_tp", 4), ("rope_interleaved", True), ("new_feature", 3),
                                       ("use_sliding_window", True), ("attention_bias", True)])
def test_each_math_changing_key_alone_is_refused(tmp_path, saved, key, value):
    folder, _ = saved
    with pytest.raises(ConvertError, match=rf"1 field would change the forward: .*{key}"):
        convert(_edit(folder, tmp_path / "k", **{key: value}), tmp_path / "m.safetensors")


def test_tie_word_embeddings_absent_is_the_classes_default(tmp_path, saved):
    """LlamaConfig's default is untied: a config.json without the key keeps the stored lm_head (transformers
    does the same); the logits stay transformers'."""
    folder, logits = saved
    src = _edit(folder, tmp_path / "notie", drop=("tie_word_embeddings",))
    want = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()(IDS).logits
    f = convert(src, tmp_path / "m.safetensors", quiet=True)
    assert (load_model(f)(IDS).detach() - want.detach()).abs().max() < 1e-5


def test_rope_keys_that_disagree_are_refused(tmp_path, saved):
    folder, _ = saved
    src = _edit(folder, tmp_path / "r", rope_theta=5e5, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    with pytest.raises(ConvertError, match=r"rope_theta = 500000.0 and rope_parameters.rope_theta = 10000.0 disagree"):
        convert(src, tmp_path / "m.safetensors")
    src = _edit(folder, tmp_path / "s", rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                                      "original_max_position_embeddings": 16},
                rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    with pytest.raises(ConvertError, match=r"rope_parameters = .* and rope_scaling = .* disagree"):
        convert(src, tmp_path / "m.safetensors")


def test_a_tied_config_beside_a_different_stored_head_keeps_the_head_as_transformers(tmp_path, saved):
    """tie_word_embeddings: true, but model.safetensors holds an lm_head.weight unlike the embedding:
    transformers 5 keeps the stored head (it does not tie); megalite's logits are transformers'."""
    folder, logits = saved
    src = _edit(folder, tmp_path / "tied", tie_word_embeddings=True)
    want = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()(IDS).logits
    assert (want - logits).abs().max() < 1e-5  # transformers kept the head
    f = convert(src, tmp_path / "m.safetensors", quiet=True)
    assert (load_model(f)(IDS).detach() - want.detach()).abs().max() < 1e-5
    assert (load_model(split(src, tmp_path / "ck", 1, 1, 1, quiet=True))(IDS).detach() - want.detach()).abs().max() < 1e-5


def test_convert_config_flag_reads_config_json_as_the_import_does(tmp_path):
    """`convert --config` (other trainers' checkpoints) reads config.json with the family's own rules: a key that
    changes the forward is refused in the same line an import gives; two rope_thetas that disagree are refused;
    harmless keys pass."""
    from megalite.convert import hints as hn
    base = dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2, hidden_act="silu",
                rms_norm_eps=1e-5, vocab_size=96)
    p = tmp_path / "config.json"
    p.write_text(json.dumps({**base, **HUB_CARD}))
    assert hn.merge_config(hn.Hints(), p).num_heads == 4
    for bad, pattern in ((dict(mlp_bias=True, rope_interleaved=True), r"2 fields would change the forward: "
                                                                      r"mlp_bias = true .*rope_interleaved = true"),
                         (dict(rope_theta=5e5, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
                          r"rope_theta = 500000.0 and rope_parameters.rope_theta = 10000.0 disagree"),
                         (dict(model_type="gemma"), r"model_type = 'gemma', expected one of")):
        p.write_text(json.dumps({**base, **bad}))
        with pytest.raises(ConvertError, match=pattern):
            hn.merge_config(hn.Hints(), p)


def test_split_of_a_transformers_folder_runs_the_self_check(tmp_path, saved, monkeypatch, capsys):
    """split checks megalite's model on the folder's tensors against transformers' own forward before writing,
    as convert does; a planted misreading (gate and up swapped) is refused and nothing is written."""
    from megalite.models.llama import LlamaHF
    folder, _ = saved
    split(folder, tmp_path / "ok", 2, 1, 1)
    assert "check: megalite's model on the source's tensors" in capsys.readouterr().err
    real = LlamaHF.from_hf

    def swapped(self, name, t, tied=True):
        swap = {"mlp.gate_proj.weight": "mlp.up_proj.weight", "mlp.up_proj.weight": "mlp.gate_proj.weight"}
        for a, b in swap.items():
            if name.endswith(a):
                return real(self, name[:-len(a)] + b, t, tied)
        return real(self, name, t, tied)
    monkeypatch.setattr(LlamaHF, "from_hf", swapped)
    with pytest.raises(ConvertError, match=r"--check: megalite's model on the source's tensors: the result's "
                                           r"logits differ"):
        split(folder, tmp_path / "bad", 2, 1, 1)
    assert not (tmp_path / "bad").exists()
    split(folder, tmp_path / "unchecked", 2, 1, 1, check=False, quiet=True)  # --no-check: written as read


def test_generate_of_a_transformers_folder_runs_the_self_check(tmp_path, saved, monkeypatch):
    """megalite generate on a transformers folder checks megalite's model against transformers' forward first;
    a planted misreading is refused in one line (exit 2) instead of sampling from a wrong model."""
    from helpers import cli_in_process as cli
    from megalite.models.llama import LlamaHF
    folder, _ = saved
    rc, out, err = cli("generate", "--model", folder, "--prompt", "AB", "--max-new-tokens", 3, "--temperature", 0)
    assert rc == 0, err
    real = LlamaHF.from_hf
    monkeypatch.setattr(LlamaHF, "from_hf", lambda self, name, t, tied=True: real(
        self, name, t.flip(0) if name.endswith("down_proj.weight") else t, tied))
    rc, out, err = cli("generate", "--model", folder, "--prompt", "AB", "--max-new-tokens", 3)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "--check: megalite's model on the source's" in err, err
    rc, out, err = cli("generate", "--model", folder, "--prompt", "AB", "--max-new-tokens", 3, "--no-check")
    assert rc == 0, err
