"""data.document_mask with context parallelism and attention dropout (model.py, parallel/context.py).

The loss of a packed batch is each document's own loss computed alone by transformers' model on the same
weights (helpers.document_reference_loss, as tests/test_documents.py does in one process), at cp = 2 and 4 with
documents crossing the ring's chunk boundaries, at tp x cp with sp, cp x pp, pp with vpp, and (slow) tp x cp x pp
and (2, 2, 2). Every layout resumes the single process's checkpoint, so every layout holds the same weights.
Planted in the cp launch: positions not restarted under cp (learned positions), positions counted along each
rank's own tokens, and another rank's key chunk read with this rank's own document ids (the ids not carried):
each moves the loss off the reference.
With dropout, a document's loss has an exactly zero gradient with respect to every other document's tokens.
"""
from __future__ import annotations

import copy
import shutil

import pytest
import torch

import helpers as H
from megalite.testing import run_parallel

# (tp, cp, pp, vpp, sp); dp fills the world
LAYOUTS_4 = [(1, 4, 1, 1, False), (1, 2, 1, 1, False), (2, 2, 1, 1, True), (1, 2, 2, 1, False),
             (1, 1, 2, 2, False)]
LAYOUTS_8 = [(2, 2, 2, 1, False), (2, 1, 2, 1, False)]
DROPOUT = 0.1


def _config(path, vocab, tmp, arch):
    return H.TINY.config(path, tmp / "run", **{"model.vocab_size": vocab, "train.steps": 2, "model.block_size": 64,
                                              "data.packing": "documents", "data.document_mask": True,
                                              "train.global_batch_size": 8, "checkpoint.dir": str(tmp / "ck"),
                                              "model.arch": arch})


def _worker(rank, world_size, tmp_dir, cfg, layouts, plant):
    """Each layout resumes the single process's checkpoint (a copy per layout) and computes batch 7's loss;
    with `plant`, the cp = 2 layout also computes it with each planted bug."""
    from megalite.parallel import context
    from megalite.run.train import run_pipeline, train
    import megalite.model
    out = {}
    for n, (tp, cp, pp, vpp, sp) in enumerate(layouts):
        p = cfg.parallel
        p.tp, p.cp, p.pp, p.vpp, p.sp, p.dp = tp, cp, pp, vpp, sp, world_size // (tp * cp * pp)
        cfg.checkpoint.dir, cfg.train.out_dir = f"{tmp_dir}/ck{n}", f"{tmp_dir}/run{n}"
        tr = train(cfg, log=lambda *a: None)
        b = tr.sampler.batch_at(7)
        out[(tp, cp, pp, vpp, sp)] = run_pipeline(tr, b.x, b.y, False, b.mask, b.counted, b.docs)
        if plant and (tp, cp, pp) == (1, 2, 1):
            restart = megalite.model.split_sequence  # planted: each token at its global position under cp
            megalite.model.split_sequence = lambda pos, cp: context.local_positions(pos.shape[1], cp).expand(
                pos.shape[0], -1)
            out["positions not restarted"] = run_pipeline(tr, b.x, b.y, False, b.mask, b.counted, b.docs)
            # planted: positions counted along this rank's own tokens (chunk 2cp-1-r continues chunk r's count)
            megalite.model.split_sequence = lambda pos, cp: megalite.model.document_positions(
                (restart(pos, cp) == 0).cumsum(1))
            out["positions counted per rank"] = run_pipeline(tr, b.x, b.y, False, b.mask, b.counted, b.docs)
            megalite.model.split_sequence = restart
            carried = context._Blocks.doc  # planted: another rank's key chunk read with this rank's own ids
            context._Blocks.doc = lambda self, k: carried(self, k if k in self.mine else self.mine[0])
            out["ids not carried"] = run_pipeline(tr, b.x, b.y, False, b.mask, b.counted, b.docs)
            context._Blocks.doc = carried
    if plant:  # training with attention dropout at tp 2 x cp 2 (dp = pp = 1: one RNG stream, as the single process)
        p = cfg.parallel
        p.tp, p.cp, p.pp, p.vpp, p.sp, p.dp = 2, 2, 1, 1, False, 1
        cfg.model.dropout, cfg.checkpoint.dir, cfg.train.out_dir = DROPOUT, "", f"{tmp_dir}/dropout"
        out["dropout"] = [r["loss"] for r in train(cfg, log=lambda *a: None).history]
    if rank == 0:
        torch.save(out, f"{tmp_dir}/losses.pt")


def _reference(bpe_docs, tmp_path, arch):
    """(config, the single process's loss of batch 7, transformers' per-document reference, the 2 steps' losses
    of the single process, which saved its checkpoint)."""
    transformers = pytest.importorskip("transformers")
    from megalite.convert import convert
    from megalite.run.train import run_pipeline
    path, vocab = bpe_docs
    cfg = _config(path, vocab, tmp_path, arch)
    tr = H.train_in_process(cfg)
    convert(tmp_path / "ck", tmp_path / "hf", fmt="hf", quiet=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    b = tr.sampler.batch_at(7)
    chunk = 64 // 8  # cp = 4: 8 chunks of 8 tokens; some document runs across a chunk's end
    assert any(int(r[k * chunk - 1]) == int(r[k * chunk]) >= 0 for r in b.docs for k in range(1, 8))
    return (cfg, run_pipeline(tr, b.x, b.y, False, b.mask, b.counted, b.docs), H.document_reference_loss(hf, b),
            [r["loss"] for r in tr.history])


def _launch(cfg, tmp_path, world, layouts, plant):
    for n in range(len(layouts)):
        shutil.copytree(tmp_path / "ck", tmp_path / f"ck{n}")
    run_parallel(_worker, world, tmp_path, args=(cfg, layouts, plant))
    return torch.load(tmp_path / "losses.pt")


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_document_masked_loss_at_cp_2_and_4_is_each_documents_own_loss(bpe_docs, tmp_path, arch):
    """cp = 4 (8 chunks of 8 tokens), cp = 2 with dp = 2, tp x cp with sp, cp x pp, pp with vpp (4 ranks): the
    single process's loss and transformers' per-document one; training with attention dropout 0.1 at tp 2 x
    cp 2 the single process's losses; gpt2's learned positions and qwen3's rotary ones
    (its qk-norm makes a young model's attention scores large enough for positions to show: llama's move a
    planted positions bug's loss only ~10x the layouts' rounding after 2 steps, qwen3's ~5,000x)."""
    cfg, single, want, plain = _reference(bpe_docs, tmp_path, arch)
    drop = copy.deepcopy(cfg)
    drop.model.dropout, drop.checkpoint.dir, drop.train.out_dir = DROPOUT, "", str(tmp_path / "dropout")
    dropped = [r["loss"] for r in H.train_in_process(drop).history]
    assert dropped[0] != pytest.approx(plain[0], rel=1e-4)  # dropout acted
    got = _launch(cfg, tmp_path, 4, LAYOUTS_4, plant=True)
    assert got["dropout"] == pytest.approx(dropped, rel=1e-5)  # the same attention weights dropped at tp2 x cp2
    print({k: f"{v - want:.2e}" for k, v in got.items() if k != "dropout"}, f"single {single - want:.2e}")
    for layout in LAYOUTS_4:
        assert got[layout] == pytest.approx(want, rel=1e-5) and got[layout] == pytest.approx(single, rel=1e-5), layout
    # each plant far outside the layouts' distance; rotary attention sees only i - j, so qwen3's positions not
    # restarted (global ones: the same differences inside a document) change nothing but rounding
    plants = ["positions counted per rank", "ids not carried"] + (["positions not restarted"] if arch == "gpt2" else [])
    for planted in plants:
        assert abs(got[planted] - want) > 100 * max(abs(got[k] - want) for k in LAYOUTS_4) + 1e-5, planted


@pytest.mark.slow
def test_document_masked_loss_at_tp_cp_pp_and_2_2_2(bpe_docs, tmp_path):
    """tp = cp = pp = 2 and tp = pp = dp = 2 (8 ranks), qwen3 (rotary, qk-norm): transformers' loss."""
    cfg, single, want, _ = _reference(bpe_docs, tmp_path, "qwen3")
    got = _launch(cfg, tmp_path, 8, LAYOUTS_8, plant=False)
    for layout in LAYOUTS_8:
        assert got[layout] == pytest.approx(want, rel=1e-5) and got[layout] == pytest.approx(single, rel=1e-5), layout


def test_a_block_whose_chunks_share_no_document_is_skipped():
    """cp = 2, rank 0 holds chunks 0 and 3 (of 4 chunks of 4 tokens): with a document in chunk 3 that began in
    chunk 2 the block (3, 0) is skipped unless some row's chunk 3 holds a document of chunk 0."""
    from megalite.parallel.context import _Blocks
    from megalite.parallel.grid import Axis
    q = torch.zeros(2, 1, 8, 4)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3]] * 2)
    mine = lambda d, src: [(a, b) for _, _, a, b in _Blocks(q, Axis(2, 0), 0.0, 0, 0, docs=d).blocks(src)]  # noqa
    assert mine(docs, 0) == [(0, 0), (3, 3)] and mine(None, 0) == [(0, 0), (3, 0), (3, 3)]
    assert mine(docs, 1) == [(3, 1), (3, 2)]
    docs[1] = torch.tensor([0] * 16)  # one row whose document spans the whole sequence: the block is computed
    assert mine(docs, 0) == [(0, 0), (3, 0), (3, 3)]


# ---------------------------------------------------------------- attention dropout with documents
def test_ring_core_with_documents_is_sdpa_with_the_mask_and_its_dropout_the_dense_one():
    """The path dropout takes (ring attention, cp = 1) with `docs`: at p = 0 torch's SDPA with the block-causal
    boolean mask (the path without dropout), forward and gradients; at p = 0.3 the dense softmax of the same
    masked scores times the counter-based keep mask / (1 - p), so a cross-document weight is exactly 0."""
    import math
    import torch.nn.functional as F
    from megalite.model import _attention_core
    from megalite.parallel.context import dropout_keep, ring_attention
    from megalite.parallel.grid import Axis
    torch.manual_seed(0)
    B, Hs, T, D = 2, 3, 16, 8
    q, k, v = (torch.randn(B, Hs, T, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 9 + [1] * 3 + [-1] * 4])
    g = torch.randn(B, Hs, T, D, dtype=torch.float64)
    ring, sdpa = ring_attention(q, k, v, Axis(1, 0), docs=docs), _attention_core(q, k, v, 0.0, docs=docs)
    assert torch.allclose(ring, sdpa, atol=1e-6)
    for a, b in zip(torch.autograd.grad(ring, (q, k, v), g), torch.autograd.grad(sdpa, (q, k, v), g)):
        assert torch.allclose(a, b, atol=1e-6)
    p, seed = 0.3, 1234
    seen = torch.ones(T, T, dtype=torch.bool).tril() & (docs[:, None, :, None] == docs[:, None, None, :])
    weights = F.softmax((q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~seen, float("-inf")), dim=-1)
    keep = dropout_keep(seed, p, B, torch.arange(Hs), torch.arange(T), torch.arange(T), "cpu").double() / (1 - p)
    dense = (weights * keep) @ v
    assert torch.equal((weights * keep)[~seen.expand_as(weights)], torch.zeros(int((~seen).sum()) * Hs,
                                                                                dtype=torch.float64))
    ring = ring_attention(q, k, v, Axis(1, 0), dropout_p=p, seed=seed, docs=docs)
    assert torch.allclose(ring, dense, atol=1e-6)
    for a, b in zip(torch.autograd.grad(ring, (q, k, v), g), torch.autograd.grad(dense, (q, k, v), g)):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_with_dropout_a_documents_loss_has_no_gradient_from_another_document(bpe_docs, tmp_path, monkeypatch, arch):
    """model.dropout = 0.2 in training mode: the gradient of one document's loss with respect to the embedding
    of every token outside that document is exactly 0, and nonzero inside it; dropout is live (two passes
    differ). Planted: the dropout path without the document mask leaks gradient across documents."""
    import torch.nn.functional as F
    import megalite.model
    path, vocab = bpe_docs
    cfg = H.TINY.config(path, tmp_path / "run", **{"model.vocab_size": vocab, "model.n_layer": 2, "train.steps": 1,
                                                   "model.block_size": 64, "model.dropout": 0.2, "model.arch": arch,
                                                   "data.packing": "documents", "data.document_mask": True,
                                                   "train.global_batch_size": 4})
    tr = H.train_in_process(cfg)
    model, b = tr.model.train(True), tr.sampler.batch_at(3)
    row = max(range(b.x.shape[0]), key=lambda r: len(set(b.docs[r].tolist()) - {-1}))
    d = int(b.docs[row].max()) // 2  # a document in the middle of a row of several

    def embedding_grad():
        held = []
        handle = model.wte.register_forward_hook(lambda mod, inp, out: held.append(out) or out.retain_grad())
        logits = model(b.x, None, docs=b.docs)  # (B, T, V)
        handle.remove()
        at = b.docs[row] == d
        F.cross_entropy(logits[row][at], b.y[row][at], reduction="sum").backward()
        return held[0].grad.abs().sum(-1), at, logits.detach()  # (B, T)

    grad, at, first = embedding_grad()
    outside = torch.ones_like(grad, dtype=torch.bool)
    outside[row] = ~at
    assert torch.equal(grad[outside], torch.zeros(int(outside.sum()))) and bool((grad[row][at] > 0).all())
    assert not torch.equal(embedding_grad()[2], first)  # another pass, another dropout mask
    ring = megalite.model.ring_attention
    monkeypatch.setattr(megalite.model, "ring_attention", lambda *a, docs=None, **kw: ring(*a, **kw))
    leaked, _, _ = embedding_grad()
    assert leaked[outside].abs().sum() > 0
