"""Other trainers' Llamas, each conversion checked against the trainer that wrote it.

megatron-core 0.16 (tests/megatron_ref.py, the `mref` fixture) writes Llama-shaped GPTModels (RoPE, SwiGLU,
RMSNorm, GQA, untied, no linear biases) at TP=2 PP=2 (also without Megatron-LM's `args`), TP=4 PP=1 (Qwen-style
q/k/v biases, Llama 3 rope scaling) and PP=2 with 2 virtual chunks per stage, with its own forward's logits.
torchtitan 0.3.0 (tests/torchtitan_ref.py, the `ttref` fixture) writes a Llama3Model (ComplexRoPE with Llama 3
scaling, flex attention) under its >= 0.2 names, its <= 0.1 names with the `model.` prefix, and without, with
its own forward's logits. Each is read by megalite into megalite's Llama names and loaded into transformers'
LlamaForCausalLM (Qwen2ForCausalLM for q/k/v biases): the logits must equal the trainer's (1e-4 absolute).
Each planted reader bug (GQA groups off by one, gate/up swapped, no wq/wk permutation, vocab padding kept)
must fail that comparison.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from megalite.convert import hints as hn
from megalite.convert import megatron_llama
from megalite.convert.megatron import MegatronGPT
from megalite.convert.torchtitan import TorchtitanModel
from megalite.base.errors import ConvertError
from helpers import cli_in_process as cli  # `megalite ARGS` in this process

transformers = pytest.importorskip("transformers")
needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                    or importlib.util.find_spec("megatron.core") is None,
                                    reason="megatron-core is not installed (pip install -e '.[test]')")
needs_torchtitan = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                                      reason="torchtitan is not installed (pip install -e '.[test]' on Python >= 3.11)")
VOCAB, TOL = 256, 1e-4  # the real vocabulary (megatron's tensors hold 320 rows); the bound, absolute
PER_LAYER = {"ln_1.weight": "input_layernorm.weight", "attn.q.weight": "self_attn.q_proj.weight",
             "attn.k.weight": "self_attn.k_proj.weight", "attn.v.weight": "self_attn.v_proj.weight",
             "attn.q.bias": "self_attn.q_proj.bias", "attn.k.bias": "self_attn.k_proj.bias",
             "attn.v.bias": "self_attn.v_proj.bias", "attn.proj.weight": "self_attn.o_proj.weight",
             "ln_2.weight": "post_attention_layernorm.weight", "mlp.gate.weight": "mlp.gate_proj.weight",
             "mlp.up.weight": "mlp.up_proj.weight", "mlp.proj.weight": "mlp.down_proj.weight"}
TOP = {"wte.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"}


def hf_model(src):
    """transformers' own model on the tensors a megalite reader gives (megalite's Llama names are
    transformers' under a rename: LLAMA_NAMES)."""
    m = src.m
    rope = dict(m["rope_scaling"] or {"rope_type": "default"}, rope_theta=m["rope_theta"])
    qkv_bias = getattr(src, "qkv_bias", False)
    kw = dict(vocab_size=m["vocab_size"], hidden_size=m["n_embd"], intermediate_size=m["intermediate_size"],
              num_hidden_layers=m["n_layer"], num_attention_heads=m["n_head"], num_key_value_heads=m["n_kv_head"],
              rms_norm_eps=m["layer_norm_eps"], max_position_embeddings=max(m["block_size"], 16384),
              tie_word_embeddings=m["tie_embeddings"], rope_parameters=rope)
    if qkv_bias:  # Qwen-style: biases on q, k and v only
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw, use_sliding_window=False))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    sd = {}
    for n in src.names:
        if n.startswith("blocks."):
            _, i, rest = n.split(".", 2)
            sd[f"model.layers.{i}.{PER_LAYER[rest]}"] = src.get(n).float()
        else:
            sd[TOP[n]] = src.get(n).float()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model.eval()


def compare(src, ref: dict) -> tuple[float, float]:
    """(max |logit difference|, KL(reference || converted)) on the reference's tokens."""
    with torch.no_grad():
        got = hf_model(src)(ref["ids"]).logits.double()
    want = ref["logits"].double()[..., :VOCAB]
    assert got.shape == want.shape, f"converted logits {tuple(got.shape)}, the trainer's {tuple(want.shape)}"
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                    reduction="batchmean").item()
    return (got - want).abs().max().item(), kl


def llama_config(tmp_path: Path, **kw) -> Path:
    """A transformers config.json (5.x style: rope_parameters) for --config."""
    c = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", rms_norm_eps=1e-5, **kw)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(c))
    return p


def test_a_transformers_4x_or_5x_config_gives_the_same_hints(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    (tmp_path / "4").mkdir(), (tmp_path / "5").mkdir()
    v4 = llama_config(tmp_path / "4", num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=scaling)
    v5 = llama_config(tmp_path / "5", num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=131072, rope_parameters=dict(scaling, rope_theta=500000.0))
    for cfg in (v4, v5):
        h = hn.merge_config(hn.Hints(), cfg)
        assert (h.num_heads, h.num_kv_heads, h.rope_theta, h.vocab_size, h.block_size, h.norm, h.mlp) == \
            (32, 8, 500000.0, 128256, 131072, "rms", "swiglu")
        assert hn.rope_scaling(h.rope_scaling) == scaling


# ---------------------------------------------------------------- megatron-core
MEGATRON = {  # case -> (folder, hints)
    "tp2pp2": ("llama_tp2pp2", {}),
    "tp4 qkv-bias rope-scaling": ("llama_tp4", {}),
    "pp2 vpp2 rotary-interleaved": ("llama_pp2vpp2", {}),
    "tp2pp2 no args, flags": ("llama_tp2pp2_noargs", dict(num_heads=4, num_kv_heads=2, rope_theta=10000.0)),
}


@needs_megatron
@pytest.mark.parametrize("case", list(MEGATRON))
def test_megatron_llama_matches_megatron_cores_forward(mref, case):
    folder, hints = MEGATRON[case]
    ref = torch.load(mref / f"{folder.removesuffix('_noargs')}.pt")
    src = MegatronGPT(mref / folder, vocab_size=VOCAB, hints=hn.Hints(**hints))
    d, kl = compare(src, ref)
    print(f"megatron {case} -> megalite Llama names -> transformers: max |d logit| {d:.2e}, KL {kl:.2e}")
    assert src.m["arch"] == ("qwen2" if "qkv-bias" in case else "llama") and d < TOL
    if "qkv-bias" in case:  # Qwen-style biases: megalite's own Qwen2 model holds them (it refused them before)
        from megalite.convert.check import megalite_runner
        with torch.no_grad():
            d2 = (megalite_runner(src)(ref["ids"]).double() - ref["logits"][..., :VOCAB]).abs().max().item()
        print(f"megatron {case} -> megalite's Qwen2 model: max |d logit| {d2:.2e}")
        assert d2 < TOL


@needs_megatron
def test_megatron_llama_without_args_converts_through_the_cli_with_flags(mref, tmp_path):
    from megalite.generate import load_model
    rc, _, err = cli("convert", mref / "llama_tp2pp2_noargs", "--num-heads", 4, "--num-kv-heads", 2,
                     "--vocab-size", VOCAB, "--out", tmp_path / "m.safetensors")
    assert rc == 0, err
    ref = torch.load(mref / "llama_tp2pp2.pt")
    with torch.no_grad():
        d = (load_model(tmp_path / "m.safetensors")(ref["ids"]).double() - ref["logits"][..., :VOCAB]).abs().max()
    print(f"megatron tp2pp2 no args, CLI flags -> megalite file -> megalite's Llama: max |d logit| {d:.2e}")
    assert d < TOL


@needs_megatron
def test_megatron_llama_without_args_takes_a_transformers_config(mref, tmp_path):
    cfg = llama_config(tmp_path, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    src = MegatronGPT(mref / "llama_tp2pp2_noargs", hints=hn.merge_config(hn.Hints(), cfg))
    d, kl = compare(src, torch.load(mref / "llama_tp2pp2.pt"))
    print(f"megatron tp2pp2 no args, --config -> transformers: max |d logit| {d:.2e}, KL {kl:.2e}")
    assert src.m["vocab_size"] == VOCAB and d < TOL  # the padding cut to config.json's vocab_size


@needs_megatron
def test_gpt2_without_args_converts_with_num_heads(mref, tmp_path):
    """The issue's first case: a GPT-2 written by megatron-core's dist_checkpointing.save alone."""
    ref = torch.load(mref / "untied_tp2.pt")
    rc, _, err = cli("convert", mref / "untied_tp2_noargs", "--format", "hf-gpt2", "--out", tmp_path / "no")
    assert rc == 2 and "common.pt: has no 'args'" in err and "give what they cannot tell, --num-heads" in err, err
    rc, _, err = cli("convert", mref / "untied_tp2_noargs", "--num-heads", 4, "--mlp", "gelu_tanh", "--norm-eps", 1e-6,
                     "--format", "hf-gpt2", "--out", tmp_path / "hf")
    assert rc == 0, err
    with torch.no_grad():
        got = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()(ref["ids"]).logits
    d = (got - ref["logits"]).abs().max().item()
    print(f"megatron GPT-2 TP=2 no args, --num-heads 4 -> hf-gpt2: max |d logit| {d:.2e}")
    assert d < TOL


# ---------------------------------------------------------------- torchtitan
def titan_hints(ttref: Path, tmp_path: Path) -> hn.Hints:
    c = torch.load(ttref / "ref.pt")["config"]
    cfg = llama_config(tmp_path, num_attention_heads=c["n_heads"], num_key_value_heads=c["n_kv_heads"],
                       vocab_size=c["vocab_size"], rope_parameters=dict(
                           {k: v for k, v in c["rope_scaling"].items() if k != "scaling_factor"},  # torchtitan's name
                           rope_type="llama3", factor=c["rope_scaling"]["scaling_factor"], rope_theta=c["rope_theta"]))
    return hn.merge_config(hn.Hints(), cfg)


TITAN = {"step-10": "torchtitan >= 0.2", "step-10-v01": "torchtitan <= 0.1, 'model.' prefix",
         "step-10-v01-model-only": "torchtitan <= 0.1"}


@needs_torchtitan
@pytest.mark.parametrize("folder", list(TITAN))
def test_torchtitan_llama3_matches_torchtitans_forward(ttref, tmp_path, folder):
    src = TorchtitanModel(ttref / folder, titan_hints(ttref, tmp_path))
    d, kl = compare(src, torch.load(ttref / "ref.pt"))
    print(f"torchtitan {folder} ({src.naming}) -> transformers: max |d logit| {d:.2e}, KL {kl:.2e}; "
          f"{len(src.skipped)} training entries skipped")
    assert src.naming == TITAN[folder] and d < TOL
    if folder == "step-10":
        kinds = {n.split(".")[0] for n in src.skipped}
        assert kinds == {"optimizer", "lr_scheduler", "dataloader", "train_state"}, kinds


# ---------------------------------------------------------------- planted bugs: each must fail
def _shift_groups(t, part, groups, per_group):  # GQA groups read one group off
    return megatron_split_qkv(torch.roll(t, (per_group + 2) * (t.shape[0] // (groups * (per_group + 2))), 0),
                              part, groups, per_group)


def _padding_kept(self, name):  # the vocabulary padding not cut: every stored row of wte / lm_head
    if name in ("wte.weight", "lm_head.weight"):
        return self.raw(self.src[name][0], None).float()
    return megatron_get(self, name)


megatron_split_qkv, megatron_get = megatron_llama.split_qkv, MegatronGPT.get
PLANTED = {  # bug -> (plant it, the source it shows on)
    "GQA group order off by one": (lambda mp: mp.setattr(megatron_llama, "split_qkv", _shift_groups), "megatron"),
    "gate/up swapped": (lambda mp: mp.setattr(megatron_llama, "split_fc1",
                                              lambda t, part: t.chunk(2)[1 if part == "gate" else 0]), "megatron"),
    "vocab padding not cut": (lambda mp: mp.setattr(MegatronGPT, "get", _padding_kept), "megatron"),
    "wq/wk without the permutation": (lambda mp: mp.setattr(hn, "interleaved_to_rotate_half", lambda t, heads: t),
                                      "torchtitan"),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_planted_bugs_fail_the_test_and_the_check(request, monkeypatch, tmp_path, bug):
    plant, kind = PLANTED[bug]
    if kind == "megatron":
        needs_megatron.mark.args[0] and pytest.skip(needs_megatron.mark.kwargs["reason"])
        ref_dir = request.getfixturevalue("mref")
        ref, read = torch.load(ref_dir / "llama_tp2pp2.pt"), lambda: MegatronGPT(ref_dir / "llama_tp2pp2", VOCAB)
        args = [ref_dir / "llama_tp2pp2", "--vocab-size", VOCAB]
    else:
        needs_torchtitan.mark.args[0] and pytest.skip(needs_torchtitan.mark.kwargs["reason"])
        ref_dir = request.getfixturevalue("ttref")
        h = titan_hints(ref_dir, tmp_path)
        ref, read = torch.load(ref_dir / "ref.pt"), lambda: TorchtitanModel(ref_dir / "step-10", h)
        args = [ref_dir / "step-10", "--from", "dcp", "--arch", "llama", "--config", h.config]
    plant(monkeypatch)
    try:  # the test: against the trainer's own forward
        d, kl = compare(read(), ref)
        print(f"planted {bug}: max |d logit| {d:.2e}, KL {kl:.2e} against the trainer")
        assert d > 100 * TOL
    except (AssertionError, RuntimeError) as e:  # a shape that differs fails too (here: transformers' load)
        assert "converted logits" in str(e) or "size mismatch for model.embed_tokens.weight" in str(e), e
        print(f"planted {bug}: {str(e).splitlines()[-1][:160]} against the trainer")
    if bug == "vocab padding not cut":  # the writer stops it before the check runs: 320 rows for a 256-row spec
        with pytest.raises(ValueError, match=r"writer expected wte\.weight \[256, 64\], got 320 rows"):
            cli("convert", *args, "--out", tmp_path / "out.safetensors")
    else:
        rc, _, err = cli("convert", *args, "--out", tmp_path / "out.safetensors")  # the check, without the trainer
        print(f"planted {bug}: convert --check: {err.strip()}")
        assert rc == 2 and len(err.strip().splitlines()) == 1 and "--check: " in err and "nothing was written" in err
    assert not list(tmp_path.glob("out*"))


# ---------------------------------------------------------------- bad input: one line naming what is wrong
@needs_megatron
def test_hints_contradicting_the_tensors_are_one_line(mref, tmp_path):
    noargs = mref / "llama_tp2pp2_noargs"
    cases = [(dict(num_heads=3), r"--num-heads 3 does not divide the hidden size 64"),
             (dict(num_heads=4, num_kv_heads=4), r"--num-kv-heads 4 contradicts tensor 'decoder\.layers\.self_"
                                                 r"attention\.linear_qkv\.weight': its 32 rows are 2 key/value heads"),
             (dict(num_heads=4, mlp="gelu"), r"--mlp gelu contradicts tensor 'decoder\.layers\.mlp\.linear_fc1"
                                             r"\.weight': 192 rows for an MLP width of 96 make a SwiGLU MLP"),
             (dict(num_heads=4, norm="batch"), r"--norm 'batch': expected one of rms, layer")]
    for hints, pattern in cases:
        with pytest.raises(ConvertError, match=pattern) as e:
            MegatronGPT(noargs, hints=hn.Hints(**hints))
        assert len(str(e.value).splitlines()) == 1
    cfg = llama_config(tmp_path, num_attention_heads=8, num_key_value_heads=2)
    with pytest.raises(ConvertError, match=r"--num-heads 4 contradicts --config .*config\.json "
                                           r"\(num_heads = 8\)"):
        hn.merge_config(hn.Hints(num_heads=4), cfg)


@needs_torchtitan
def test_a_dcp_folder_that_does_not_fit_the_named_sizes_is_one_line(ttref, tmp_path):
    cases = [(hn.Hints(num_heads=4, num_kv_heads=1), r"--num-kv-heads 1 contradicts tensor 'layers\.0\.attention\."
                                                     r"qkv_linear\.wk\.weight': its 32 rows are 2 key/value heads"),
             (hn.Hints(num_heads=5), r"--num-heads 5 does not divide the hidden size 64"),
             (hn.Hints(num_heads=4, vocab_size=300), r"vocab_size = 300 contradicts tensor 'tok_embeddings\.weight' "
                                                     r"of 256 rows"),
             (hn.Hints(), r"the number of attention heads cannot be read from the tensors; give --num-heads")]
    for h, pattern in cases:
        with pytest.raises(ConvertError, match=pattern):
            TorchtitanModel(ttref / "step-10", h)
    with pytest.raises(ConvertError, match=r"rope_scaling rope_type 'yarn': megalite reads a torchtitan Llama 3 "
                                           r"with 'llama3' rope scaling or none"):
        cfg = llama_config(tmp_path, num_attention_heads=4, rope_parameters={  # a whole yarn table: refused later
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
        TorchtitanModel(ttref / "step-10", hn.merge_config(hn.Hints(), cfg))


# ---------------------------------------------------------------- through the CLI: one file, split, train
@needs_megatron
def test_megatron_llama_split_212_trains_from_transformers_loss(mref, tmp_path, convert_tokens):
    """convert (vocab cut) -> one megalite file -> split at (tp 2, pp 1, dp 2) -> one training step under
    torchrun: its loss is transformers' on megatron's weights for the same batch."""
    import helpers as H
    from megalite.data import BatchSampler, TokenDataset
    from megalite.generate import load_model
    rc, _, err = cli("convert", mref / "llama_tp2pp2", "--vocab-size", VOCAB, "--out", tmp_path / "m.safetensors")
    assert rc == 0, err
    ref = torch.load(mref / "llama_tp2pp2.pt")
    with torch.no_grad():  # the one file, run by megalite's own model
        d = (load_model(tmp_path / "m.safetensors")(ref["ids"]).double() - ref["logits"][..., :VOCAB]).abs().max()
    print(f"megatron tp2pp2 -> megalite file -> megalite's Llama: max |d logit| {d:.2e}")
    assert d < TOL
    rc, _, err = cli("split", tmp_path / "m.safetensors", "--tp", 2, "--pp", 1, "--dp", 2, "--out", tmp_path / "ck")
    assert rc == 0, err
    src = MegatronGPT(mref / "llama_tp2pp2", vocab_size=VOCAB)
    model = {k: v for k, v in src.m.items() if k not in ("dropout", "rope_scaling")}
    toml = H.CONVERT.toml(tmp_path / "llama.toml", convert_tokens, model=model)
    recs = H.torchrun_train(4, toml, tmp_path / "run", **{"parallel.tp": 2, "parallel.dp": 2, "train.steps": 1,
                                                           "checkpoint.resume": tmp_path / "ck",
                                                           "checkpoint.dir": tmp_path / "ck2"})
    cfg = H.CONVERT.config(convert_tokens, tmp_path / "run")
    s = BatchSampler(TokenDataset(convert_tokens, "train"), model["block_size"], cfg.train.global_batch_size, 0, 1,
                     cfg.train.seed)
    x, y = s.batch_at(0)
    with torch.no_grad():
        logits = hf_model(src)(x).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)).item()
    print(f"split (2,1,2) -> first training loss {recs[0]['loss']:.6f}; transformers on megatron's weights {want:.6f}")
    assert abs(recs[0]["loss"] - want) <= 1e-5 * abs(want)


@needs_torchtitan
def test_torchtitan_convert_cli_lists_what_it_skips_and_refuses_bad_input(ttref, tmp_path):
    cfg = titan_hints(ttref, tmp_path).config
    rc, out, err = cli("convert", ttref / "step-10", "--from", "dcp", "--arch", "llama", "--config", cfg,
                       "--out", tmp_path / "t.safetensors")
    assert rc == 0 and "convert: skipped 243 training entries (torchtitan >= 0.2): dataloader.dp_rank_0" in err, err
    from megalite.generate import load_model
    ref = torch.load(ttref / "ref.pt")
    with torch.no_grad():
        d = (load_model(tmp_path / "t.safetensors")(ref["ids"]) - ref["logits"]).abs().max().item()
    print(f"torchtitan step-10 -> megalite file -> megalite's Llama: max |d logit| {d:.2e}")
    assert d < TOL
    for args, pattern in ((["--num-heads", "3"], "--num-heads 3 does not divide the hidden size 64"),
                          (["--num-heads", "4", "--num-kv-heads", "4"], "--num-kv-heads 4 contradicts tensor"),
                          (["--config", cfg, "--num-heads", "2"], "--num-heads 2 contradicts --config"),
                          ([], "the number of attention heads cannot be read from the tensors")):
        rc, _, err = cli("convert", ttref / "step-10", "--from", "dcp", "--arch", "llama", *args,
                         "--out", tmp_path / "bad.safetensors")
        assert rc == 2 and len(err.strip().splitlines()) == 1 and pattern in err, (args, err)
        assert not list(tmp_path.glob("bad*"))


@needs_megatron
def test_megatron_moe_and_unmodelled_rope_are_one_line_and_nothing_written(mref, tmp_path):
    import shutil
    import sys
    sys.path.insert(0, str(Path(__file__).parent))
    from megatron_ref import LLAMA_FFN, LLAMA_LAYERS, LLAMA_PADDED, megatron_args
    sys.path.pop(0)
    base = dict(num_layers=LLAMA_LAYERS, ffn_hidden_size=LLAMA_FFN, position_embedding_type="rope",
                normalization="RMSNorm", swiglu=True, add_bias_linear=False, add_qkv_bias=False,
                group_query_attention=True, num_query_groups=2, untie_embeddings_and_output_weights=True,
                padded_vocab_size=LLAMA_PADDED)
    cases = {"moe": (dict(num_experts=8), r"num_experts = 8: megalite does not model a mixture of experts \(MoE\)"),
             "yarn": (dict(position_embedding_type="yarn"), r"position_embedding_type = 'yarn': megalite does not "
                                                            r"model rotary position embeddings \(YaRN RoPE\)"),
             "partial": (dict(rotary_percent=0.5), r"rotary_percent = 0\.5: megalite does not model RoPE on part")}
    for name, (change, pattern) in cases.items():
        src = tmp_path / name
        shutil.copytree(mref / "llama_tp2pp2", src)
        torch.save({"args": megatron_args(**{**base, **change}), "iteration": 10}, src / "iter_0000010" / "common.pt")
        rc, _, err = cli("convert", src, "--out", tmp_path / f"{name}.safetensors")
        import re
        assert rc == 2 and len(err.strip().splitlines()) == 1 and re.search(pattern, err), (name, err)
        assert not list(tmp_path.glob(f"{name}.safetensors*"))


@pytest.mark.parametrize("kind", ["megatron", "torchtitan"])
def test_format_hf_folders_load_in_transformers_with_the_trainers_logits(request, tmp_path, kind):
    """`convert --format hf`: AutoModelForCausalLM.from_pretrained of the folder gives the trainer's logits."""
    if kind == "megatron":
        needs_megatron.mark.args[0] and pytest.skip(needs_megatron.mark.kwargs["reason"])
        d = request.getfixturevalue("mref")
        ref, args = torch.load(d / "llama_tp2pp2.pt"), [d / "llama_tp2pp2", "--vocab-size", VOCAB]
    else:
        needs_torchtitan.mark.args[0] and pytest.skip(needs_torchtitan.mark.kwargs["reason"])
        d = request.getfixturevalue("ttref")
        ref = torch.load(d / "ref.pt")
        args = [d / "step-10", "--from", "dcp", "--arch", "llama", "--config", titan_hints(d, tmp_path).config]
    rc, _, err = cli("convert", *args, "--format", "hf", "--out", tmp_path / "hf")
    assert rc == 0 and "check: transformers' forward of the export" in err, err
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        got = model(ref["ids"]).logits.double()
    want = ref["logits"].double()[..., :VOCAB]
    diff = (got - want).abs().max().item()
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                    reduction="batchmean").item()
    print(f"{kind} -> convert --format hf -> from_pretrained: max |d logit| {diff:.2e}, KL {kl:.2e}")
    assert type(model).__name__ == "LlamaForCausalLM" and diff < TOL
