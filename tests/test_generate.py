"""`megalite generate` as a practitioner uses it, against outside references:

- the KV cache: incremental decoding (prefill, then one token at a time, then a chunk) gives the full forward's
  logits at every position (1e-5), for GPT-2 (learned positions) and Llama (rotary, GQA), built at (1,1,1) and
  from model files written by (2,2,1) runs; sampling with and without the cache draws the same ids;
- the sampling filters (temperature, top-k, top-p) against a hand computation and transformers' warpers;
- transformers folders saved by transformers itself (GPT-2 and Llama, a byte-level BPE with added special
  tokens, a chat template and a list of eos ids): greedy ids equal transformers' `generate` (with its cache),
  the sample stops at the list's first id drawn, `--chat` gives `apply_chat_template`'s ids, `--stop` ends the
  text before its string.
"""
from __future__ import annotations

import json

import pytest
import torch

import helpers as H
from megalite.config import ModelConfig
from megalite.generate import generate, load_model, sample_text
from megalite.generate.cache import KVCache
from megalite.generate.sampling import filter_logits
from megalite.model import GPTStage
from megalite.parallel.grid import ParallelGrid

FAMILIES = {"gpt2": {}, "llama": {"arch": "llama", "n_kv_head": 2, "rope_theta": 10000.0}}  # 4 heads, 2 kv


def tiny(family: str, seed: int = 0) -> GPTStage:
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=24, vocab_size=64, dropout=0.0, **FAMILIES[family])
    model = GPTStage(cfg, ParallelGrid.single())
    model.init_weights(seed)
    with torch.no_grad():  # weights of std 0.3: attention that is far from uniform, so positions matter
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(seed + p.numel()))
    return model.eval()


@torch.no_grad()
def cached_logits(model, ids: torch.Tensor, cuts=(5, 6, 7, 8, 11)) -> torch.Tensor:
    """The logits of every position of ids (B, T), fed through a KV cache in pieces: the prompt up to cuts[0]
    (prefill), single tokens, then a chunk of several (a query block that sees cached keys), then the rest."""
    cache, out, start = KVCache(capacity=4), [], 0  # a small buffer: it grows twice on the way
    for end in (*cuts, ids.shape[1]):
        assert cache.length == start
        out.append(model(ids[:, start:end], cache=cache))
        start = end
    return torch.cat(out, dim=1)  # (B, T, V)


def assert_cache_is_the_full_forward(model, tag: str):
    ids = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.block_size), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
    got = cached_logits(model, ids)
    d = (got - full).abs().max().item()
    print(f"{tag}: cached vs full forward, largest |logit difference| {d:.2e} (logits up to {full.abs().max():.1f})")
    assert d <= 1e-5, (tag, d)
    for kw in ({"temperature": 0}, {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "seed": 3}):
        for prompt, n in ((ids[0, :5].tolist(), 12), (ids[0, :20].tolist(), 10)):  # the second outgrows the block
            with_cache = generate(model, prompt, max_new_tokens=n, warn=lambda m: None, **kw)
            assert with_cache == generate(model, prompt, max_new_tokens=n, warn=lambda m: None, kv_cache=False,
                                          **kw), (tag, kw, len(prompt))


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_cache_gives_the_full_forwards_logits_at_every_position(family):
    """Planted: rotary at positions 0.. for the cached tokens too (heads' `start` ignored), GPT-2's wpe rows
    from 0, the chunk's mask without its diagonal offset (tril(0)): each fails at 1e-5."""
    assert_cache_is_the_full_forward(tiny(family), f"{family} (1,1,1)")


def _train_221(rank, world_size, rdzv, tokens, out):
    from megalite.run.train import train
    for family in FAMILIES:
        model = {f"model.{k}": v for k, v in FAMILIES[family].items()}
        cfg = H.TINY.config(tokens, f"{out}/run-{family}", **{"parallel.tp": 2, "parallel.pp": 2, "train.steps": 2,
                                                              "checkpoint.dir": f"{out}/ckpt-{family}", **model})
        train(cfg, log=lambda *a: None)


def test_kv_cache_of_model_files_from_221_runs(tmp_path, token_file):
    """GPT-2 and a GQA Llama trained 2 steps at tp=2 pp=2 (one 4-process launch), each converted to one file:
    the cache gives the file's model its full forward's logits."""
    from megalite.convert import convert
    from megalite.testing import run_parallel
    run_parallel(_train_221, 4, tmp_path / "rdzv", args=(token_file, tmp_path))
    for family in FAMILIES:
        f = convert(tmp_path / f"ckpt-{family}", tmp_path / f"{family}.safetensors", quiet=True)
        model = load_model(f)
        assert (model.cfg.arch, model.cfg.n_layer) == (FAMILIES[family].get("arch", "gpt2"), H.TINY_MODEL["n_layer"])
        assert_cache_is_the_full_forward(model, f"{family} from (2,2,1)")


# ---------------------------------------------------------------- sampling filters
def test_sampling_filters_keep_the_tokens_a_hand_computation_keeps():
    """Probabilities 1/32, 1/2, 1/8, 1/4, 3/32 (logits log p). top-p keeps the fewest likeliest whose sum reaches
    p: 0.7 -> ids 1, 3 (0.75); 0.76 -> 1, 3, 2 (0.875); 0.1 -> 1 alone. top-k 3 -> 1, 3, 2. top-k then top-p
    renormalises in between: k 2 leaves 2/3, 1/3, so p 0.6 keeps id 1 alone and p 0.7 both. Temperature 2 takes
    sqrt(p) normalised: 0.0865 0.3460 0.1730 0.2447 0.1498; top-p 0.8 then keeps ids 1, 3, 2, 4 (0.346 + 0.2447
    + 0.173 = 0.764 < 0.8) and drops id 0. transformers' warpers agree on each."""
    p = torch.tensor([[1 / 32, 1 / 2, 1 / 8, 1 / 4, 3 / 32]])
    logits = p.log()

    def kept(**kw):
        out = filter_logits(logits, kw.pop("temperature", 1.0), **kw)
        return sorted(torch.isfinite(out[0]).nonzero().flatten().tolist())

    assert kept(top_p=0.7) == [1, 3] and kept(top_p=0.76) == [1, 2, 3] and kept(top_p=0.1) == [1]
    assert kept(top_p=1.0) == [0, 1, 2, 3, 4] and kept(top_k=3) == [1, 2, 3]
    assert kept(top_k=2, top_p=0.6) == [1] and kept(top_k=2, top_p=0.7) == [1, 3]
    probs = torch.softmax(filter_logits(logits, 2.0, top_k=0, top_p=0.8), -1)[0]
    root = torch.tensor([0.0, 0.5 ** 0.5, 0.125 ** 0.5, 0.5, (3 / 32) ** 0.5])  # id 0 dropped
    assert torch.allclose(probs, root / root.sum(), atol=1e-6), probs
    transformers = pytest.importorskip("transformers")
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    for t, k, tp in ((1.0, 0, 0.7), (2.0, 0, 0.8), (0.5, 3, 0.9), (1.0, 2, 0.6)):
        ref = TemperatureLogitsWarper(t)(None, logits.clone())
        ref = TopKLogitsWarper(k)(None, ref) if k else ref
        ref = TopPLogitsWarper(tp)(None, ref)
        assert torch.allclose(torch.softmax(ref, -1), torch.softmax(filter_logits(logits, t, k, tp), -1), atol=1e-6)
