"""Defaults no test reached before (issue 42, item 4), each against its outside reference:

- an HF config.json without `tie_word_embeddings` and the other optional keys megalite reads: the defaults of
  transformers' config class (Llama: untied, rms_norm_eps 1e-6; GPT-2: tied), as AutoConfig reads them, and
  from_pretrained's logits on that folder;
- a Megatron Llama without `args` and without --norm-eps / --rope-theta: megatron-core's defaults
  (TransformerConfig.layernorm_epsilon, GPTModel's rotary_base); with --norm-eps: the flag's value; and a
  Megatron Llama whose args lack norm_epsilon / rotary_base: the same defaults;
- a Llama's initialisation: every linear drawn at transformers' initializer_range (0.02) as LlamaForCausalLM's
  _init_weights does, norm gains 1; the std of each tensor within 6 standard errors (1/sqrt(2n) relative);
- a torchtitan folder holding a model tensor megalite's Llama lacks: refused, not dropped; converted without
  --config / --norm-eps: torchtitan's own defaults (ComplexRoPE's theta, RMSNorm's eps), its forward's logits;
- GQA ring attention with 4 kv heads for 8 query heads at cp = 2 (2 query heads per kv head), at tp = 1 (4 kv
  heads on the rank) and tp = 2 (2 on the rank), where `repeat` and `repeat_interleave` give different models,
  against the single process, forward and the k / v gradients, both layouts in one launch of 4 ranks;
- llama3 rope scaling's band edges: megalite's model and the converter's reference forward (native.py) against
  transformers' own llama3 frequencies, with frequencies placed exactly on both edges and either side;
- a bf16 model file's dtypes: every floating tensor stored BF16, in the megalite file and in the HF export.
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import math
from types import SimpleNamespace

import pytest
import torch

from megalite.config import ModelConfig
from megalite.convert import convert, hints as hn, open_source
from megalite.model import GPTStage, rope_frequencies
from megalite.parallel.grid import ParallelGrid

transformers = pytest.importorskip("transformers")


# ---------------------------------------------------------------- optional config.json keys absent: class defaults
OPTIONAL = {"llama": ["tie_word_embeddings", "rms_norm_eps", "rope_parameters", "rope_theta", "rope_scaling",
                      "max_position_embeddings", "num_key_value_heads", "head_dim"],
            "gpt2": ["tie_word_embeddings", "layer_norm_epsilon", "n_inner", "activation_function"]}


@pytest.mark.parametrize("cls,hf_cls", [("llama", "LlamaForCausalLM"), ("gpt2", "GPT2LMHeadModel")])
def test_an_hf_config_without_its_optional_keys_is_read_with_the_classs_defaults(tmp_path, cls, hf_cls):
    """config.json without tie_word_embeddings (and the other keys megalite reads with a default): megalite's
    model is what transformers.AutoConfig reads from the same file (Llama untied, rms_norm_eps 1e-6, theta
    10000; GPT-2 tied, eps 1e-5, gelu_new), and its logits are from_pretrained's on that folder."""
    from megalite.convert.check import compare, megalite_runner
    if cls == "llama":
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                                       rms_norm_eps=1e-6, tie_word_embeddings=False)
    else:
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=32,
                                      tie_word_embeddings=True)
    model = getattr(transformers, hf_cls)(cfg)
    with torch.no_grad():  # weights far from init: an eps, a theta or a head that differs shows in the logits
        for n, p in model.named_parameters():
            p.mul_(15) if p.dim() > 1 else p.add_(0.1 * torch.randn(p.shape))
    model.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    gone = [k for k in OPTIONAL[cls] if raw.pop(k, "absent") != "absent"]
    assert "tie_word_embeddings" in gone
    (tmp_path / "config.json").write_text(json.dumps(raw))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    src = open_source(tmp_path)
    m = src.model
    assert m["tie_embeddings"] is theirs.tie_word_embeddings is (cls == "gpt2")
    assert ("lm_head.weight" in src.specs) is (cls == "llama")
    if cls == "llama":
        assert (m["layer_norm_eps"], m["rope_theta"], m["block_size"], m["n_kv_head"] or m["n_head"]) == (
            theirs.rms_norm_eps, theirs.rope_parameters["rope_theta"], theirs.max_position_embeddings,
            theirs.num_key_value_heads)
    else:
        assert (m["layer_norm_eps"], m["activation"]) == (theirs.layer_norm_epsilon, theirs.activation_function)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        d, kl, top = compare(lambda ids: ref(ids).logits, megalite_runner(src), 64, 16)
    print(f"{cls} without {gone}: max |d logit| {d:.2e}, KL {kl:.2e} (logits up to {top:.1f})")
    assert d < 1e-4 * (1 + top) and top > 3


# ---------------------------------------------------------------- Megatron's defaults: megatron-core's
def _mcore_defaults():
    core = pytest.importorskip("megatron.core")  # noqa: F841
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    eps = TransformerConfig.__dataclass_fields__["layernorm_epsilon"].default
    theta = inspect.signature(GPTModel.__init__).parameters["rotary_base"].default
    return eps, theta


def _megatron_llama_tensors(L=2, C=32, H=4, KV=2, F=48, V=64):
    hd = C // H
    s = lambda *shape: SimpleNamespace(shape=shape)  # noqa: E731 (a DCP index entry: only its shape is read)
    lay = "decoder.layers."
    return {"embedding.word_embeddings.weight": s(V, C), "output_layer.weight": s(V, C),
            lay + "self_attention.linear_qkv.weight": s(L, (H + 2 * KV) * hd, C),
            lay + "self_attention.linear_proj.weight": s(L, C, H * hd),
            lay + "mlp.linear_fc1.weight": s(L, 2 * F, C), lay + "mlp.linear_fc2.weight": s(L, C, F)}


def test_a_megatron_llama_without_args_takes_megatron_cores_defaults():
    from megalite.convert import megatron
    from megalite.convert.megatron_llama import args_from_tensors
    eps, theta = _mcore_defaults()
    t = _megatron_llama_tensors()
    m = megatron.model_from_args(args_from_tensors(t, hn.Hints(num_heads=4), "idx"), "idx")
    assert (m["layer_norm_eps"], m["rope_theta"], m["rope_scaling"]) == (eps, theta, {})
    m = megatron.model_from_args(args_from_tensors(t, hn.Hints(num_heads=4, norm_eps=1e-6, rope_theta=5e5), "idx"),
                                 "idx")
    assert (m["layer_norm_eps"], m["rope_theta"]) == (1e-6, 5e5)


def test_a_megatron_llama_whose_args_lack_eps_and_base_takes_megatron_cores_defaults():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from megatron_ref import megatron_args
    from megalite.convert import megatron
    eps, theta = _mcore_defaults()
    a = vars(megatron_args(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                           add_bias_linear=False, add_qkv_bias=False, ffn_hidden_size=96))
    for k in ("norm_epsilon", "layernorm_epsilon", "rotary_base"):
        a.pop(k, None)
    m = megatron.model_from_args(a, "common.pt")
    assert (m["layer_norm_eps"], m["rope_theta"]) == (eps, theta)


# ---------------------------------------------------------------- initialisation: transformers' initializer_range
def test_a_llamas_initialisation_is_transformers():
    """transformers' LlamaPreTrainedModel._init_weights draws every nn.Linear and nn.Embedding from
    N(0, initializer_range = 0.02) and sets RMSNorm gains to 1. Each megalite tensor's std is compared with the
    same tensor of transformers' model at 6 standard errors of a std estimate (relative SE 1/sqrt(2n))."""
    C, H, KV, F, L, V = 128, 8, 4, 256, 2, 512
    m = ModelConfig(arch="llama", n_layer=L, n_head=H, n_kv_head=KV, n_embd=C, block_size=64, vocab_size=V,
                    intermediate_size=F, tie_embeddings=False)
    stage = GPTStage(m, ParallelGrid.single())
    stage.init_weights(seed=0)  # what a run does (run/train.py)
    ours = dict(stage.global_parameters())
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=C, intermediate_size=F, num_hidden_layers=L,
                                   num_attention_heads=H, num_key_value_heads=KV, tie_word_embeddings=False)
    torch.manual_seed(0)
    theirs = {}
    from megalite.convert.family import family_of
    fam = family_of(dict(arch="llama", n_layer=L, n_head=H, n_kv_head=KV, n_embd=C, block_size=64, vocab_size=V,
                         intermediate_size=F, tie_embeddings=False, rope_theta=10000.0, rope_scaling={},
                         layer_norm_eps=1e-5, dropout=0.0, activation="gelu_new"))
    hf = dict(transformers.LlamaForCausalLM(cfg).named_parameters())
    for name, p in ours.items():
        (hname, _), = fam.to_hf(name, p.detach())
        theirs[name] = hf[hname].detach()
    std0 = cfg.initializer_range
    report = []
    for name, p in ours.items():
        a, b = p.detach().float(), theirs[name].float()
        if a.dim() == 1:  # RMSNorm gains
            assert torch.all(a == 1) and torch.all(b == 1), name
            continue
        se = 6 / math.sqrt(2 * a.numel())
        sa, sb = a.std().item(), b.std().item()
        report.append(f"{name} {sa:.5f}/{sb:.5f}")
        assert abs(sa / std0 - 1) < se and abs(sb / std0 - 1) < se, (name, sa, sb, std0, se)
        assert abs(a.mean().item()) < 6 * std0 / math.sqrt(a.numel()), name
    print("; ".join(report))


# ---------------------------------------------------------------- torchtitan
needs_torchtitan = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan missing")
TITAN_NAMES = {"tok_embeddings.weight": (64, 32), "norm.weight": (32,), "lm_head.weight": (64, 32)}
TITAN_LAYER = {"attention_norm.weight": (32,), "attention.qkv_linear.wq.weight": (32, 32),
               "attention.qkv_linear.wk.weight": (16, 32), "attention.qkv_linear.wv.weight": (16, 32),
               "attention.wo.weight": (32, 32), "ffn_norm.weight": (32,), "feed_forward.w1.weight": (48, 32),
               "feed_forward.w2.weight": (32, 48), "feed_forward.w3.weight": (48, 32)}


def _titan_folder(path, extra: dict = {}):
    import warnings
    import torch.distributed.checkpoint as dcp
    g = torch.Generator().manual_seed(0)
    state = {n: torch.randn(s, generator=g) for n, s in TITAN_NAMES.items()}
    state.update({f"layers.{i}.{n}": torch.randn(s, generator=g) for i in range(2) for n, s in TITAN_LAYER.items()})
    state.update(extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path)
    return path


@pytest.mark.parametrize("extra", ["layers.0.attention.q_norm.weight", "layers.1.feed_forward.w4.weight",
                                   "rope.freqs_cis"])
def test_a_torchtitan_tensor_megalites_llama_lacks_is_refused(tmp_path, extra):
    from megalite.base.errors import ConvertError
    from megalite.convert.torchtitan import TorchtitanModel
    TorchtitanModel(_titan_folder(tmp_path / "ok"), hn.Hints(num_heads=4))  # the folder without it converts
    with pytest.raises(ConvertError, match=rf"tensor '{extra}' is not part of a torchtitan Llama .*refusing to "
                                           rf"drop it") as e:
        TorchtitanModel(_titan_folder(tmp_path / "bad", {extra: torch.ones(8)}), hn.Hints(num_heads=4))
    assert "\n" not in str(e.value)


def _torchtitan_defaults():
    """torchtitan's own defaults for what a DCP folder cannot tell: RoPE theta, RMSNorm eps."""
    from torchtitan.models.common import ComplexRoPE, RMSNorm
    theta = ComplexRoPE.Config.__dataclass_fields__["theta"].default
    eps = RMSNorm.Config.__dataclass_fields__["eps"].default
    return theta, eps


def _titan_model_with_its_defaults():
    """torchtitan 0.3's Llama3Model built with its own defaults for what a DCP folder cannot tell (RoPE theta
    and scaling: ComplexRoPE.Config's; eps: RMSNorm.Config's), weights far from init; as tests/torchtitan_ref.py
    builds it, with flex attention eager (the compiled form is the same op)."""
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers
    FlexAttention._compiled_flex_attn = flex_attention
    init = {"weight": torch.nn.init.normal_}
    cfg = Llama3Model.Config(
        dim=32, vocab_size=64, tok_embeddings=Embedding.Config(num_embeddings=64, embedding_dim=32, param_init=init),
        norm=RMSNorm.Config(normalized_shape=32, param_init=init),
        lm_head=Linear.Config(in_features=32, out_features=64, param_init=init),
        layers=_build_llama3_layers(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, hidden_dim=48,
                                    rope=ComplexRoPE.Config(dim=8, max_seq_len=64), attn_backend="flex"))
    torch.manual_seed(0)
    model = Llama3Model(cfg)
    model.init_states()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * r if p.dim() == 1 else 0.3 * r)
    return model.eval()


@needs_torchtitan
def test_a_torchtitan_folder_without_config_or_norm_eps_is_torchtitans_own_forward(tmp_path):
    """Converted with only the head count (which no tensor tells), megalite's model equals torchtitan's forward
    of a model built with torchtitan's defaults."""
    import torch.distributed.checkpoint as dcp
    from megalite.convert.check import megalite_runner
    from megalite.convert.torchtitan import TorchtitanModel
    theta, eps = _torchtitan_defaults()
    model = _titan_model_with_its_defaults()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(16).unsqueeze(0).expand(2, 16)
    with torch.no_grad():
        want = model(ids, positions, model.get_attention_masks(positions))
    dcp.save({k: v.detach().clone() for k, v in model.state_dict().items()}, checkpoint_id=str(tmp_path / "t"),
             no_dist=True)
    src = TorchtitanModel(tmp_path / "t", hn.Hints(num_heads=4))
    assert (src.model["rope_theta"], src.model["layer_norm_eps"], src.model["rope_scaling"]) == (theta, eps, {})
    got = megalite_runner(src)(ids)
    d = (got - want).abs().max().item()
    print(f"torchtitan defaults (theta {theta}, eps {eps}) -> megalite: max |d logit| {d:.2e} (logits up to "
          f"{want.abs().max():.1f})")
    assert d < 1e-4 * (1 + want.abs().max().item())


# ---------------------------------------------------------------- GQA ring attention, 2 query heads per kv head, cp=2
GQA = dict(arch="llama", n_layer=2, n_head=8, n_kv_head=4, n_embd=64, block_size=32, vocab_size=128,
           intermediate_size=96, tie_embeddings=False)


def _gqa_batch():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 128, (2, 32), generator=g)
    return ids, torch.roll(ids, -1, 1)


def _gqa_model(grid):
    model = GPTStage(ModelConfig(**GQA), grid)
    model.init_weights(seed=11)  # the full weights from one seed, each rank keeping its slice
    with torch.no_grad():  # far from uniform attention: a kv head read by the wrong query heads shows
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(15)
    return model


def _gqa_single():
    model = _gqa_model(ParallelGrid.single())
    ids, tgt = _gqa_batch()
    logits = model(ids)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten())
    loss.backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


GQA_LAYOUTS = {"tp1": (1, 1, 2, 2),  # 4 kv heads on each rank, 2 query heads each (dp = 2 fills the 4 ranks)
               "tp2": (2, 1, 1, 2)}  # kv heads split over tp: 2 on each rank, 2 query heads each


def _gqa_ring_worker(rank, world_size, tmp):
    """Both layouts in one launch of 4 ranks: the logits gathered over tp at this rank's positions, the gradients
    summed over cp and gathered over tp (each parameter's partition tag)."""
    import torch.distributed as dist
    from megalite.parallel.agree import everyone
    from megalite.parallel.context import local_positions, split_sequence
    from megalite.parallel.grid import Layout
    from megalite.parallel.tensor import vocab_parallel_cross_entropy
    from megalite.testing import gather_full_model
    for tag, lay in GQA_LAYOUTS.items():
        grid = ParallelGrid.create(Layout(*lay))
        ids, tgt = _gqa_batch()
        model = _gqa_model(grid)
        logits = model(split_sequence(ids, grid.cp))  # (B, T/cp, V/tp) at this rank's positions
        loss = vocab_parallel_cross_entropy(logits, split_sequence(tgt, grid.cp), 128, grid.tp).mean() / grid.cp.size
        loss.backward()  # the global mean: 1/cp of each rank's mean (equal token counts)
        grads = []
        for n, p in model.named_parameters():
            dist.all_reduce(p.grad, group=grid.cp.group)
            if hasattr(p, "partition"):
                p.grad.partition = p.partition  # gathered over tp as its parameter is
            grads.append((n, p.grad))
        full = torch.cat(everyone(logits.detach(), grid, grid.tp), dim=-1) if grid.tp.active else logits.detach()
        torch.save({"pos": local_positions(32, grid.cp), "logits": full, "grads": gather_full_model(grads, grid)},
                   f"{tmp}/gqa-{tag}-{rank}.pt")


def test_gqa_ring_attention_with_several_kv_heads_per_rank_equals_the_single_process(tmp_path):
    """tp = 1: 4 kv heads on each cp rank; tp = 2: 2 kv heads on each rank, each read by 2 query heads (the kv
    heads split over tp as the query heads are). Each against the single process."""
    from megalite.testing import run_parallel
    run_parallel(_gqa_ring_worker, 4, tmp_path)
    ref, ref_grads = _gqa_single()
    assert ref.abs().max() > 5  # logits far from uniform
    for tag in GQA_LAYOUTS:
        for r in range(4):
            got = torch.load(tmp_path / f"gqa-{tag}-{r}.pt")
            torch.testing.assert_close(got["logits"], ref[:, got["pos"]], rtol=1e-5, atol=1e-4,
                                       msg=lambda m: f"{tag} rank {r} logits: {m}")
            for n in ("blocks.0.attn.k.weight", "blocks.0.attn.v.weight", "blocks.1.attn.q.weight"):
                torch.testing.assert_close(got["grads"][n], ref_grads[n], rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"{tag} rank {r} {n}: {m}")


# ---------------------------------------------------------------- llama3 rope scaling at its band edges
def _edge_scaling(theta=10000.0, hd=32, ctx=64):
    """low/high_freq_factor chosen so that frequency 3's wavelength is exactly the low band's edge
    (ctx / low_freq_factor) and frequency 1's exactly the high band's (ctx / high_freq_factor)."""
    f = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    wave = 2 * math.pi / f
    return {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": ctx / wave[3].item(),
            "high_freq_factor": ctx / wave[1].item(), "original_max_position_embeddings": ctx}


def _transformers_llama3(theta, hd, s):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = transformers.LlamaConfig(hidden_size=hd * 4, num_attention_heads=4,
                                   rope_parameters={**s, "rope_theta": theta})
    inv, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    return inv.double()


@pytest.mark.parametrize("ctx", [64, 1000])
def test_llama3_rope_band_edges_match_transformers_in_the_model_and_the_reference_forward(ctx):
    from megalite.convert.native import _inv_freq
    theta, hd = 10000.0, 32
    s = _edge_scaling(theta, hd, ctx)
    theirs = _transformers_llama3(theta, hd, s)
    plain = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ref = _inv_freq(hd, theta, s)
    model = rope_frequencies(ModelConfig(arch="llama", n_head=4, n_embd=4 * hd, rope_theta=theta, rope_scaling=s))
    torch.testing.assert_close(ref, theirs, rtol=1e-6, atol=0)  # transformers computes in float32
    torch.testing.assert_close(model.double(), theirs, rtol=1e-6, atol=0)
    # the edges themselves: frequency 1 kept, frequency 3 slowed by the whole factor, 2 blended between
    assert ref[1].item() == pytest.approx(plain[1].item(), rel=1e-12)
    assert ref[3].item() == pytest.approx(plain[3].item() / 8, rel=1e-12)
    assert plain[2] / 8 < ref[2] < plain[2]
    assert torch.equal(ref[:1], plain[:1]) and torch.allclose(ref[4:], plain[4:] / 8, rtol=1e-15)


# ---------------------------------------------------------------- a bf16 model file's dtypes
def test_a_bf16_conversion_stores_every_floating_tensor_as_bf16(tmp_path):
    from safetensors import safe_open
    from test_convert_llama import llama_file
    f = llama_file(tmp_path / "m.safetensors", 2, False)
    out = convert(f, tmp_path / "bf16.safetensors", dtype="bf16", quiet=True)
    with safe_open(out, "pt") as s:
        dtypes = {n: s.get_slice(n).get_dtype() for n in s.keys()}
    assert dtypes and set(dtypes.values()) == {"BF16"}, dtypes
    src = open_source(out)
    assert {s.dtype for s in src.specs.values()} == {torch.bfloat16}
    hf = convert(f, tmp_path / "hf", fmt="hf", dtype="bf16", quiet=True)
    with safe_open(hf / "model.safetensors", "pt") as s:
        assert {s.get_slice(n).get_dtype() for n in s.keys()} == {"BF16"}
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
