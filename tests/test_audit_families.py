"""Issue 39's planted-bug audit of the model families (docs/reliability.md has the table): for each realistic
mistake in the family specs, YaRN, the sliding window and the converters that no earlier test caught, one small
check against an outside reference (transformers' config classes and forward, torch's grouped-query SDPA).
Each was confirmed by planting its mistake and watching it fail; one process, a few seconds in all."""
from __future__ import annotations

import pytest
import torch

from megalite.config import ModelConfig
from megalite.convert import convert
from megalite.convert.family import FAMILIES
from megalite.generate import load_model
from megalite.model import GPTStage
from megalite.parallel.grid import ParallelGrid
from test_families import IDS, hf_folder
from test_generate import assert_cache_is_the_full_forward

transformers = pytest.importorskip("transformers")
CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "mistral": "MistralConfig"}


# a config.json key megalite models -> (what transformers' config class holds, what megalite's [model] holds)
ABSENT = {"rope_theta": (lambda c: c.rope_parameters["rope_theta"], lambda m: m.rope_theta),
          "rms_norm_eps": (lambda c: c.rms_norm_eps, lambda m: m.layer_norm_eps),
          "tie_word_embeddings": (lambda c: c.tie_word_embeddings, lambda m: m.tie_embeddings),
          "max_position_embeddings": (lambda c: c.max_position_embeddings, lambda m: m.block_size),
          "head_dim": (lambda c: getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                       lambda m: m.head_dim),
          "sliding_window": (lambda c: getattr(c, "sliding_window", None), lambda m: m.sliding_window or None)}


@pytest.mark.parametrize("key", list(ABSENT))
@pytest.mark.parametrize("family", list(CLASSES))
def test_a_config_json_without_a_key_has_the_config_classes_default(family, key):
    """A config.json that leaves a modelled key out (Llama 2's first configs had no rope_theta; hand-written
    ones): megalite's [model] holds the value transformers' class reads, rope_theta also with 5.x's
    rope_parameters holding only its type. Planted: rope_theta absent read as 1e6 (Qwen's published value, not
    Qwen2Config's 10000): fails here. Found: max_position_embeddings absent was 2048 for every family (Qwen2Config
    and Qwen3Config say 32768, MistralConfig 131072): fixed in models/ (block_size only: the logits were equal)."""
    cls = getattr(transformers, CLASSES[family])
    hf = cls(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2).to_dict()
    theirs, mine = ABSENT[key]
    for gone in (key, "rope_parameters", "rope_scaling") if key == "rope_theta" else (key,):
        hf.pop(gone, None)
    for given in (hf, {**hf, "rope_parameters": {"rope_type": "default"}}) if key == "rope_theta" else (hf,):
        assert mine(ModelConfig(**FAMILIES[family].read_config(given, "config.json")[0])) == theirs(cls(**given))


def test_the_kv_cache_of_a_yarn_model_is_its_full_forward():
    """YaRN scales cos and sin by its attention factor on every path: the KV cache's (prefill, single tokens, a
    chunk over cached keys) gives the full forward's logits, which test_families checks against transformers'
    Qwen2 with the same rope_scaling. Planted: the factor dropped where the cache memoises cos and sin: fails."""
    cfg = ModelConfig(arch="qwen2", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=24, vocab_size=64,
                      dropout=0.0, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 6})
    model = GPTStage(cfg, ParallelGrid.single())
    model.init_weights(0)
    with torch.no_grad():  # weights of std 0.3 (attention far from uniform), biases off zero
        g = torch.Generator().manual_seed(5)
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g)) if p.dim() == 1 else p.normal_(0, 0.3, generator=g)
    assert_cache_is_the_full_forward(model.eval(), "qwen2 yarn (1,1,1)")


@pytest.mark.parametrize("case", ["qwen2-yarn", "mistral", "qwen3"])
def test_packed_documents_each_get_transformers_logits_of_that_document_alone(tmp_path, case):
    """Packed documents (data.document_mask: positions restart at each document, attention stays inside it) of
    a transformers folder: each document's logits are transformers' forward of that document alone (1e-5
    relative), with YaRN's attention factor, a sliding window shorter than a document, q/k norms. Planted: the
    factor dropped on the per-document positions path: fails the yarn case."""
    folder = hf_folder(tmp_path / "hf", case)
    model = load_model(convert(folder, tmp_path / "m.safetensors", quiet=True))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    cuts = [0, 7, 16]  # two documents per row: 7 and 9 tokens, both longer than Mistral's window of 5
    docs = torch.cat([torch.full((IDS.shape[0], b - a), d) for d, (a, b) in enumerate(zip(cuts, cuts[1:]))], dim=1)
    with torch.no_grad():
        got = model(IDS, docs=docs)
        for a, b in zip(cuts, cuts[1:]):
            want = hf(IDS[:, a:b]).logits
            d = (got[:, a:b] - want).abs().max().item()
            assert d <= 1e-5 * (1 + want.abs().max().item()), (case, a, d)


@pytest.mark.parametrize("groups", [2, 3])
def test_ring_attention_pairs_query_heads_with_kv_heads_as_torch_gqa_does(groups):
    """Grouped-query attention through the ring (cp, or dropout at cp = 1): query head i uses kv head
    i // groups (transformers' repeat_kv, torch's SDPA with enable_gqa), forward and gradients. Planted: the
    kv heads tiled (head i uses kv head i % kv_heads): fails here."""
    from megalite.model import _ring_core
    from megalite.parallel.grid import Axis
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 10, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 6 // groups, 10, 8, generator=g, requires_grad=True) for _ in range(2))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    got = _ring_core(q, k, v, groups, cp=Axis(1, 0))
    assert torch.allclose(got, want, atol=1e-6)
    for a, b in zip(torch.autograd.grad(want.square().sum(), (q, k, v)),
                    torch.autograd.grad(got.square().sum(), (q, k, v))):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("cp", [2, 3])
def test_the_ring_visits_no_block_that_the_sliding_window_hides_wholly(cp):
    """The (q chunk, kv chunk) blocks ring attention visits (context._blocks) each hold at least one pair the
    window shows (key j seen by query i iff i - window < j <= i, by hand), for chunk sizes 1-3 and every window;
    test_audit_plants checks the blocks and masks add up to the window's mask, which a block shown nothing
    would not change. Planted: a block kept whose nearest pair is exactly the window apart (`<=`): every
    logit the same, a block of scores and a ring hop's worth of work more: fails here."""
    from megalite.parallel.context import _blocks, chunk_ids
    for c in (1, 2, 3):
        for window in range(1, 2 * cp * c + 2):
            for r in range(cp):
                for src in range(cp):
                    for _, _, a, b in _blocks(chunk_ids(r, cp), chunk_ids(src, cp), c, window):
                        dist = torch.arange(a * c, (a + 1) * c)[:, None] - torch.arange(b * c, (b + 1) * c)[None]
                        assert bool(((dist >= 0) & (dist < window)).any()), (cp, c, window, a, b)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}
EXPORTED = {"llama": {"n_kv_head": 2, "rope_scaling": LLAMA3},
            "qwen2": {"n_kv_head": 1, "tie_embeddings": True, "rope_theta": 1e6,
                      "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}},
            "qwen3": {"n_kv_head": 2, "head_size": 32}, "mistral": {"n_kv_head": 2, "sliding_window": 5}}


@pytest.mark.parametrize("family", list(EXPORTED))
def test_an_exported_config_json_reads_back_as_the_same_model_here_and_in_transformers(family):
    """`convert --format hf`'s config.json: megalite reads back the [model] it was written from, and transformers'
    class reads the q/k/v biases, head width, window, tie and rotary base megalite's model has. Planted: Qwen2's
    export inheriting Llama's `attention_bias: false` (transformers' Qwen2 ignores it; megalite then refuses
    its own export): fails here."""
    fam = FAMILIES[family]
    m = dict(arch=family, n_layer=2, n_head=4, n_embd=64, vocab_size=96, block_size=32, **EXPORTED[family])
    hf = fam.hf_config(m)
    back, _ = fam.read_config(hf, "config.json")
    assert {k: back[k] for k in m} == m
    cfg = getattr(transformers, CLASSES[family])(**hf)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    attn = model.model.layers[0].self_attn
    mine = GPTStage(ModelConfig(**back), ParallelGrid.single())
    assert (attn.q_proj.bias is not None) == (mine.blocks["0"].attn.q.bias is not None)
    assert attn.head_dim == mine.blocks["0"].attn.head_dim
    assert cfg.tie_word_embeddings == back["tie_embeddings"] and cfg.rope_parameters["rope_theta"] == back["rope_theta"]
    assert getattr(cfg, "sliding_window", None) == (back["sliding_window"] or None)


def test_megatron_interleaved_rotary_with_qkv_biases_gives_megatron_cores_attention_scores():
    """A Megatron-LM checkpoint with --rotary-interleaved and --add-qkv-bias (a Qwen2-style Llama): q and k as
    megalite reads them (fused rows split, each head's pairs moved to rotate-half), turned by megalite's rotary,
    give the attention scores of megatron-core's interleaved RoPE (`_apply_rotary_pos_emb_bshd`) on megatron's
    own q and k. Planted: the biases' rows left interleaved while the weights' are moved: fails here."""
    pytest.importorskip("megatron.core")
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megalite.convert.megatron_llama import llama_sources
    from megalite.model import rope_cos_sin, rotate
    H, G, hd, C, T = 4, 2, 8, 16, 6
    n = H // G
    g = torch.Generator().manual_seed(0)
    W, x = torch.randn((n + 2) * G * hd, C, generator=g), torch.randn(T, C, generator=g)
    b = torch.randn(W.shape[0], generator=g)
    # megatron: fused rows "(g n d)", per group its n query heads, then its key head and its value head
    y = (x @ W.T + b).view(T, G, n + 2, hd)
    inv = RotaryEmbedding(hd, 1.0, rotary_interleaved=True, use_cpu_initialization=True).inv_freq.float()
    freqs = (torch.arange(T).float()[:, None] * inv).repeat_interleave(2, -1)[:, None, None]  # get_emb's, interleaved
    qm, km = (_apply_rotary_pos_emb_bshd(t.reshape(T, 1, -1, hd), freqs, rotary_interleaved=True)
              for t in (y[:, :, :n], y[:, :, n]))  # (T, 1, heads, hd)
    want = torch.einsum("ihd,jhd->hij", qm[:, 0], km[:, 0].repeat_interleave(n, dim=1))
    src = llama_sources(dict(arch="qwen2", n_head=H, n_kv_head=G, n_layer=1, _interleaved=True), set())
    fn = {name: src[f"blocks.0.attn.{name}"][2] for name in ("q.weight", "q.bias", "k.weight", "k.bias")}
    cos, sin = rope_cos_sin(inv, torch.arange(T), torch.float32)
    q, k = (rotate((x @ fn[f"{p}.weight"](W).T + fn[f"{p}.bias"](b)).view(T, -1, hd).transpose(0, 1), cos, sin)
            for p in "qk")  # (heads, T, hd)
    got = q @ k.repeat_interleave(n, dim=0).transpose(1, 2)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_qwen3_head_norms_take_the_configs_rms_norm_eps_as_transformers(tmp_path):
    """Qwen3's q_norm and k_norm use config.rms_norm_eps (transformers' Qwen3Attention), like the block norms. At
    the published 1e-6 (or Megatron's 1e-5) a wrong eps moves logits by ~1e-6, inside every tolerance; at 0.5 it
    shows: megalite's logits = transformers' (1e-5 relative). Planted: the head norms' eps fixed at 1e-6: fails."""
    cfg = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=0.5,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if name.endswith("norm.weight") else
                    0.2 * torch.randn(p.shape, generator=g))
        model.save_pretrained(tmp_path / "hf")
        want = model(IDS).logits
        got = load_model(convert(tmp_path / "hf", tmp_path / "m.safetensors", check=False, quiet=True))(IDS)
    assert (got - want).abs().max().item() <= 1e-5 * (1 + want.abs().max().item())
