"""Other trainers' Qwen3 checkpoints, each conversion checked against the trainer that wrote it.

torchtitan 0.3.0 (tests/torchtitan_ref.py, the `ttref` fixture) builds a Qwen3Model as its registry builds every
dense size (fused wqkv, q/k RMSNorm of the head width before CosSinRoPE, eps 1e-6, tied embeddings) with a head
width of its own (4 heads of 32 over a width of 64), runs its forward and saves its state with DCP;
`megalite convert --from dcp --arch qwen3` must give torchtitan's logits (1e-5 relative) in megalite's own model
and in transformers' Qwen3ForCausalLM after `--format hf`. megatron-core 0.16 (tests/megatron_ref.py, `mref`)
builds a GPTModel with qk_layernorm and kv_channels 32 at TP=2, saved with and without Megatron-LM's args: read
as a Qwen3, the same bound against megatron-core's forward. Planted reader bugs (k and v swapped, rotate-half read
as interleaved pairs, q and k norms swapped, q_norm dropped) each fail that comparison; those inside the converter
(q_norm dropped) also fail `--check`, which runs the stored tensors in their own layout through the same name
table (so a wrong table entry is caught by this test, not by --check).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from megalite import models
from megalite.base.errors import ConvertError
from megalite.convert import hints as hn
from megalite.convert.check import megalite_runner
from megalite.convert.torchtitan import TorchtitanModel
from megalite.generate import load_model
from helpers import cli_in_process as cli  # `megalite ARGS` in this process

transformers = pytest.importorskip("transformers")
needs_torchtitan = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                                      reason="torchtitan is not installed (pip install -e '.[test]' on Python >= 3.11)")
QWEN3 = models.qwen3.SPEC.name


def _close(want: torch.Tensor, got: torch.Tensor) -> float:
    d = (got.double() - want.double()).abs().max().item()
    assert d <= 1e-5 * (1 + want.abs().max().item()), d
    return d


def qwen3_config(ref: dict, folder: Path, **kw) -> Path:
    """transformers' own config.json of the reference's Qwen3 (Qwen3Config.save_pretrained)."""
    c = ref["config"] if "config" in ref else MEGATRON_QWEN3
    keys = dict(vocab_size=c["vocab_size"], hidden_size=c["dim"], intermediate_size=c["ffn_hidden"],
                num_hidden_layers=c["n_layers"], num_attention_heads=c["n_heads"], num_key_value_heads=c["n_kv_heads"],
                head_dim=c["head_dim"], rms_norm_eps=c["eps"], rope_theta=c["rope_theta"],
                max_position_embeddings=64, tie_word_embeddings=True)
    transformers.Qwen3Config(**{**keys, **kw}).save_pretrained(folder)
    return folder / "config.json"


@needs_torchtitan
def test_torchtitan_qwen3_equals_torchtitans_forward(ttref, tmp_path):
    """--config (tied, as the config says) and flags only (torchtitan's own theta and eps; the head kept apart):
    megalite's model = torchtitan's forward; --format hf -> Qwen3ForCausalLM = the same."""
    ref = torch.load(ttref / "qwen3.pt")
    cfg = qwen3_config(ref, tmp_path / "cfg")
    folder = ttref / "qwen3-step-10"
    rc, _, err = cli("convert", folder, "--from", "dcp", "--arch", QWEN3, "--config", cfg,
                     "--out", tmp_path / "t.safetensors")
    assert rc == 0 and "check:" in err and "skipped 2 training entries" in err, err
    model = load_model(tmp_path / "t.safetensors")
    assert (model.cfg.arch, model.cfg.tie_embeddings, model.cfg.head_dim) == (QWEN3, True, 32)
    with torch.no_grad():
        d = _close(ref["logits"], model(ref["ids"]))
    flags = TorchtitanModel(folder, hn.Hints(num_heads=4), arch=QWEN3)  # torchtitan's own theta and eps
    from torchtitan.models.qwen3 import _0_6b, _EPS
    theta = _0_6b("flex").layers[0].attention.rope.theta  # its registry's (1e6 in every dense size)
    assert (flags.m["rope_theta"], flags.m["layer_norm_eps"], flags.m["tie_embeddings"]) == (theta, _EPS, False)
    d2 = _close(ref["logits"], megalite_runner(flags)(ref["ids"]))
    rc, _, err = cli("convert", folder, "--from", "dcp", "--arch", QWEN3, "--config", cfg, "--format", "hf",
                     "--out", tmp_path / "hf")
    assert rc == 0, err
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        d3 = _close(ref["logits"], hf(ref["ids"]).logits)
    print(f"torchtitan Qwen3 -> megalite (--config, tied) {d:.2e}; flags only (untied) {d2:.2e}; "
          f"--format hf -> {type(hf).__name__} {d3:.2e} (logits up to {ref['logits'].abs().max():.1f})")
    assert type(hf).__name__ == "Qwen3ForCausalLM"


def _table(**swap):
    """Qwen3's torchtitan table with entries swapped."""
    t = dict(models.qwen3.SPEC.torchtitan.PER_LAYER)
    for a, b in swap.items():
        t[a], t[b] = t[b], t[a]
    return t


@needs_torchtitan
def test_a_torchtitan_qwen3_folder_read_as_another_family_is_one_line(ttref, tmp_path):
    ref = torch.load(ttref / "qwen3.pt")
    folder = ttref / "qwen3-step-10"
    cases = [(["--arch", models.llama.SPEC.name, "--num-heads", 4],
              "tensor 'layers.0.attention.k_norm.weight' is not part of a torchtitan Llama 3 (4 such; a torchtitan Qwen3's: --arch qwen3)"),
             (["--arch", models.llama.SPEC.name, "--config", qwen3_config(ref, tmp_path / "a")],
              "its model_type is a qwen3, contradicting --arch llama"),
             (["--arch", QWEN3, "--config", qwen3_config(ref, tmp_path / "b", head_dim=16)],
              "head_dim = 16 contradicts tensor 'layers.0.attention.qkv_linear.wq.weight'"),
             (["--arch", models.mistral.SPEC.name, "--num-heads", 4], "a DCP folder is read as a model only for"),
             (["--arch", QWEN3, "--config", qwen3_config(ref, tmp_path / "c", rope_scaling={
                 "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})],
              "rope_scaling rope_type 'yarn': megalite reads a torchtitan Qwen3 with no rope scaling")]
    for args, pattern in cases:
        rc, _, err = cli("convert", folder, "--from", "dcp", *args, "--out", tmp_path / "bad.safetensors")
        assert rc == 2 and len(err.strip().splitlines()) == 1 and pattern in err, (args, err)
    assert not list(tmp_path.glob("bad*"))


@needs_torchtitan
def test_a_tied_config_over_two_different_tensors_is_refused(ttref, tmp_path):
    """tie_word_embeddings true, but lm_head is not tok_embeddings: refused naming both, nothing dropped."""
    import shutil
    import torch.distributed.checkpoint as dcp
    ref = torch.load(ttref / "qwen3.pt")
    src = TorchtitanModel(ttref / "qwen3-step-10", hn.Hints(num_heads=4), arch=QWEN3)
    state = {src.stored(n): src.ck.read(src.stored(n)) for n in src.names}
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    dcp.save(state, checkpoint_id=str(tmp_path / "untied"), no_dist=True)
    h = hn.merge_config(hn.Hints(), qwen3_config(ref, tmp_path / "cfg"))
    with pytest.raises(ConvertError, match=r"tie_word_embeddings is true, but tensors 'tok_embeddings\.weight' "
                                           r"and 'lm_head\.weight' differ"):
        TorchtitanModel(tmp_path / "untied", h, arch=QWEN3).get("wte.weight")
    shutil.rmtree(tmp_path / "untied")


# ---------------------------------------------------------------- megatron-core
needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                    or importlib.util.find_spec("megatron.core") is None,
                                    reason="megatron-core is not installed (pip install -e '.[test]')")
VOCAB = 256  # the real vocabulary (megatron's tensors hold 320 rows)
# tests/megatron_ref.py's qwen3_tp2 as a transformers config would say it (untied, as megatron's GPTModel there)
MEGATRON_QWEN3 = dict(vocab_size=VOCAB, dim=64, ffn_hidden=96, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
                      eps=1e-5, rope_theta=1e6)


@needs_megatron
def test_megatron_qwen3_equals_megatron_cores_forward(mref, tmp_path):
    """megatron-core's GPTModel with qk_layernorm and kv_channels 32 (over 64 / 4 heads) at TP=2, saved as
    Megatron-LM does and by dist_checkpointing.save alone (then --num-heads, --rope-theta): a Qwen3, megalite's
    logits = megatron-core's; --format hf -> Qwen3ForCausalLM = the same."""
    from megalite.convert.megatron import MegatronGPT
    ref = torch.load(mref / "qwen3_tp2.pt")
    want = ref["logits"][..., :VOCAB]
    ds = []
    cfg = hn.merge_config(hn.Hints(), qwen3_config({}, tmp_path / "cfg", tie_word_embeddings=False))
    for folder, h in (("qwen3_tp2", hn.Hints()), ("qwen3_tp2_noargs", hn.Hints(num_heads=4, rope_theta=1e6)),
                      ("qwen3_tp2_noargs", cfg)):
        src = MegatronGPT(mref / folder, VOCAB, h)
        assert (src.m["arch"], src.m["head_size"], src.m["n_kv_head"]) == (QWEN3, 32, 2), src.m
        ds.append(_close(want, megalite_runner(src)(ref["ids"])))
    rc, _, err = cli("convert", mref / "qwen3_tp2", "--vocab-size", VOCAB, "--arch", QWEN3, "--format", "hf",
                     "--out", tmp_path / "hf")
    assert rc == 0 and "check:" in err, err
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        d = _close(want, hf(ref["ids"]).logits)
    print(f"megatron Qwen3 tp2 -> megalite: with args {ds[0]:.2e}, without (flags / --config) {ds[1]:.2e} / "
          f"{ds[2]:.2e}; --format hf -> "
          f"{type(hf).__name__} {d:.2e} (logits up to {want.abs().max():.1f})")
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    rc, _, err = cli("convert", mref / "qwen3_tp2", "--vocab-size", VOCAB, "--arch", models.llama.SPEC.name,
                     "--out", tmp_path / "bad.safetensors")
    assert rc == 2 and "--arch llama contradicts" in err and "make a qwen3" in err, err
    llama_cfg = tmp_path / "llama.json"
    llama_cfg.write_text(json.dumps({"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2}))
    rc, _, err = cli("convert", mref / "qwen3_tp2_noargs", "--config", llama_cfg, "--vocab-size", VOCAB,
                     "--out", tmp_path / "bad.safetensors")
    assert rc == 2 and "its model_type is a llama, but the arguments and tensors" in err and "make a qwen3" in err, err


def _megatron():
    from megalite.convert import megatron
    return megatron


def _q_norm_dropped(get):
    return lambda self, name: torch.ones_like(get(self, name)) if name.endswith("q_norm.weight") else get(self, name)


PLANTED = {  # bug -> (the trainer, plant it, does --check see it)
    "torchtitan: k and v swapped in the table": ("torchtitan", lambda mp: mp.setattr(
        type(models.qwen3.SPEC.torchtitan), "PER_LAYER", _table(**{"attn.k.weight": "attn.v.weight"})), False),
    "torchtitan: rotate-half read as interleaved pairs": ("torchtitan", lambda mp: mp.setattr(
        type(models.qwen3.SPEC.torchtitan), "interleaved", True), False),
    "torchtitan: q_norm dropped": ("torchtitan", lambda mp: mp.setattr(
        TorchtitanModel, "get", _q_norm_dropped(TorchtitanModel.get)), True),
    "megatron: q/k layernorm names swapped": ("megatron", lambda mp: mp.setattr(
        type(models.qwen3.SPEC.megatron), "PER_LAYER", {"attn.q_norm.weight": "self_attention.k_layernorm.weight",
                                                        "attn.k_norm.weight": "self_attention.q_layernorm.weight"}),
        False),
    "megatron: q_layernorm dropped": ("megatron", lambda mp: mp.setattr(
        _megatron().MegatronGPT, "get", _q_norm_dropped(_megatron().MegatronGPT.get)), True),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_planted_qwen3_reader_bugs_fail(request, tmp_path, monkeypatch, bug):
    """Each fails the comparison with the trainer's forward; those inside the converter also fail --check (which
    reads through the same name table, so a wrong table entry is this test's to catch)."""
    kind, plant, check_sees = PLANTED[bug]
    mark = needs_torchtitan if kind == "torchtitan" else needs_megatron
    mark.args[0] and pytest.skip(mark.kwargs["reason"])
    if kind == "torchtitan":
        d = request.getfixturevalue("ttref")
        ref = torch.load(d / "qwen3.pt")
        read = lambda: TorchtitanModel(d / "qwen3-step-10", hn.Hints(num_heads=4), arch=QWEN3)  # noqa: E731
        args = [d / "qwen3-step-10", "--from", "dcp", "--arch", QWEN3, "--num-heads", 4]
    else:
        d = request.getfixturevalue("mref")
        ref = torch.load(d / "qwen3_tp2.pt")
        read = lambda: _megatron().MegatronGPT(d / "qwen3_tp2", VOCAB)  # noqa: E731
        args = [d / "qwen3_tp2", "--vocab-size", VOCAB]
    want = ref["logits"][..., :VOCAB]
    plant(monkeypatch)
    with pytest.raises(AssertionError):
        _close(want, megalite_runner(read())(ref["ids"]))
    rc, _, err = cli("convert", *args, "--out", tmp_path / "o.safetensors")
    print(f"planted {bug}: convert --check: rc {rc} {err.strip().splitlines()[-1][:140]}")
    assert (rc == 2 and "--check: " in err) == check_sees
