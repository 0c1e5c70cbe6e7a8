"""Tensor-parallel layers and the vocab-parallel loss against plain single-process torch on full tensors.

Each check builds the full weights from a seed, gives each tp rank its slice (init_local / tp_box), runs
the layer and the torch reference on the same inputs, and compares outputs, the input gradient and the
weight/bias gradients (the local gradient must equal the matching slice of the reference gradient).
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

from megalite.parallel.grid import Axis
from megalite.parallel.partition import init_local, partition_of, shard_range, tp_box
from megalite.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                      vocab_parallel_cross_entropy)
from megalite.testing import run_parallel

TOL = dict(rtol=1e-5, atol=1e-6)


def _full(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _load(param, name, seed, tp: Axis, pad_value=0.0):
    """Fill a layer parameter with its slice of the full tensor; return the full tensor."""
    part = partition_of(param)
    full = init_local(name, part, "normal", seed, 1.0, 0, 1)
    local = init_local(name, part, "normal", seed, 1.0, tp.rank, tp.size)
    # init_local must hand out exactly the tp_box of the full tensor (+ zero padding)
    box = tp_box(part, tp.rank, tp.size)
    valid = tuple(slice(0, b - a) for a, b in box)
    assert torch.equal(local[valid], full[tuple(slice(a, b) for a, b in box)])
    assert local.sum() == local[valid].sum()
    if pad_value:
        mask = torch.ones_like(local, dtype=torch.bool)
        mask[valid] = False
        local[mask] = pad_value  # garbage in the padding must never matter
    with torch.no_grad():
        param.copy_(local)
    return full


def check_column(tp: Axis, stack: int, gather: bool):
    torch.manual_seed(0)
    B, T, n_in, n_out = 3, 5, 16, 24
    layer = ColumnParallelLinear(n_in, n_out, tp, bias=True, stack=stack, gather_output=gather)
    lead = (stack,) if stack > 1 else ()
    assert partition_of(layer.weight).global_shape == lead + (n_out, n_in)
    assert layer.weight.shape == lead + (n_out // tp.size, n_in)
    W = _load(layer.weight, "w", 1, tp)
    b = _load(layer.bias, "b", 2, tp)
    x = _full((B, T, n_in), 3)
    G = _full((B, T, stack * n_out), 4)  # weights of the scalar loss sum(y * G)

    W_ref, b_ref, x_ref = (t.clone().requires_grad_() for t in (W, b, x))
    y_ref = F.linear(x_ref, W_ref.reshape(-1, n_in), b_ref.reshape(-1))
    (y_ref * G).sum().backward()

    x_loc = x.clone().requires_grad_()
    y = layer(x_loc)
    lo, hi = shard_range(n_out, tp.rank, tp.size)
    if gather:
        assert stack == 1
        expect, g_mine = y_ref, G
    else:  # this rank's output columns of every stacked projection, in stack order
        expect = y_ref.reshape(B, T, stack, n_out)[..., lo:hi].reshape(B, T, -1)
        g_mine = G.reshape(B, T, stack, n_out)[..., lo:hi].reshape(B, T, -1)
    assert y.shape == expect.shape
    assert_close(y, expect.detach(), **TOL)
    (y * g_mine).sum().backward()
    assert_close(x_loc.grad, x_ref.grad, **TOL)  # all-reduced over tp: the full input gradient
    d = 1 if stack > 1 else 0
    assert_close(layer.weight.grad, W_ref.grad.narrow(d, lo, hi - lo), **TOL)
    assert_close(layer.bias.grad, b_ref.grad.narrow(d, lo, hi - lo), **TOL)


def check_row(tp: Axis):
    B, T, n_in, n_out = 3, 5, 24, 16
    layer = RowParallelLinear(n_in, n_out, tp, bias=True)
    assert layer.weight.shape == (n_out, n_in // tp.size) and layer.bias.shape == (n_out,)
    W = _load(layer.weight, "w", 5, tp)
    b = _load(layer.bias, "b", 6, tp)
    x = _full((B, T, n_in), 7)
    G = _full((B, T, n_out), 8)
    W_ref, b_ref, x_ref = (t.clone().requires_grad_() for t in (W, b, x))
    y_ref = F.linear(x_ref, W_ref, b_ref)
    (y_ref * G).sum().backward()

    lo, hi = shard_range(n_in, tp.rank, tp.size)
    x_loc = x[..., lo:hi].clone().requires_grad_()  # the input arrives split (a column layer's output)
    y = layer(x_loc)
    assert_close(y, y_ref.detach(), **TOL)  # partial sums all-reduced, bias added once
    (y * G).sum().backward()
    assert_close(x_loc.grad, x_ref.grad[..., lo:hi], **TOL)
    assert_close(layer.weight.grad, W_ref.grad[:, lo:hi], **TOL)
    assert_close(layer.bias.grad, b_ref.grad, **TOL)


def check_embedding(tp: Axis, vocab: int):
    B, T, C = 4, 9, 16
    emb = VocabParallelEmbedding(vocab, C, tp)
    rows = -(-vocab // tp.size)
    assert emb.weight.shape == (rows, C)
    E = _load(emb.weight, "wte", 9, tp, pad_value=1e3)
    ids = torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(10))
    ids[0, :4] = torch.tensor([0, vocab - 1, vocab // 2, rows % vocab])  # first/last ids, a shard boundary
    ids[1, :] = ids[0, 0]  # repeated ids accumulate their gradients
    G = _full((B, T, C), 11)
    E_ref = E.clone().requires_grad_()
    out_ref = F.embedding(ids, E_ref)
    (out_ref * G).sum().backward()

    out = emb(ids)
    assert_close(out, out_ref.detach(), **TOL)
    (out * G).sum().backward()
    lo, hi = shard_range(vocab, tp.rank, tp.size)
    assert_close(emb.weight.grad[:hi - lo], E_ref.grad[lo:hi], **TOL)
    assert torch.count_nonzero(emb.weight.grad[hi - lo:]) == 0  # padding rows get no gradient


def check_cross_entropy(tp: Axis, vocab: int):
    B, T = 3, 7
    width = -(-vocab // tp.size)
    logits = _full((B, T, vocab), 12) * 3
    target = torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(13))
    target[0, :3] = torch.tensor([0, vocab - 1, width % vocab])  # first/last class, a shard boundary
    w = _full((B, T), 14)  # weights of the scalar loss sum(loss * w)

    ref_logits = logits.clone().requires_grad_()
    loss_ref = F.cross_entropy(ref_logits.reshape(-1, vocab), target.reshape(-1), reduction="none").reshape(B, T)
    (loss_ref * w).sum().backward()

    lo, hi = shard_range(vocab, tp.rank, tp.size)
    pad = torch.full((B, T, width - (hi - lo)), 50.0)  # huge padding logits must never be counted
    local = torch.cat([logits[..., lo:hi], pad], dim=-1).requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, vocab, tp)
    assert loss.shape == (B, T)
    assert_close(loss, loss_ref.detach(), **TOL)
    (loss * w).sum().backward()
    assert_close(local.grad[..., :hi - lo], ref_logits.grad[..., lo:hi], **TOL)
    assert torch.count_nonzero(local.grad[..., hi - lo:]) == 0
    # the mean loss, as the model uses it
    local2 = local.detach().clone().requires_grad_()
    vocab_parallel_cross_entropy(local2, target, vocab, tp).mean().backward()
    ref2 = logits.clone().requires_grad_()
    F.cross_entropy(ref2.reshape(-1, vocab), target.reshape(-1)).backward()
    assert_close(local2.grad[..., :hi - lo], ref2.grad[..., lo:hi], **TOL)


def check_all(tp: Axis):
    for stack, gather in [(1, False), (3, False), (1, True)]:
        check_column(tp, stack, gather)
    check_row(tp)
    for vocab in (256, 250):
        check_embedding(tp, vocab)
        check_cross_entropy(tp, vocab)


def check_sp_dropout(tp: Axis):
    """Sequence parallelism changes where the residual stream's dropout runs (seq/tp of the tokens per rank),
    not which elements drop: a tp-sharded GPT with dropout 0.1 gives the same loss with sp on and off (the
    mask is drawn whole from the tp ranks' shared stream and each rank keeps its chunk). A per-rank mask of
    the chunk's shape would drop other elements (and shift the stream the attention dropout draws from)."""
    from megalite.config import ModelConfig
    from megalite.model import GPTStage
    from megalite.parallel.grid import Layout, ParallelGrid
    one = Axis(1, 0)
    grid = ParallelGrid(Layout(tp.size, 1, 1), tp.rank, tp, one, one, tp, one)
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(3))
    losses = {}
    for sp, dropout in ((False, 0.1), (True, 0.1), (False, 0.0)):
        model = GPTStage(ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64, dropout=dropout),
                         grid, sp=sp)
        model.init_weights(1)
        model.train()
        torch.manual_seed(5)  # the tp ranks share one stream (parallel.rng.seed_everything)
        losses[sp, dropout] = model(ids[:, :-1], ids[:, 1:]).item()
    assert losses[True, 0.1] == pytest.approx(losses[False, 0.1], rel=1e-6), (tp.size, losses)
    assert abs(losses[False, 0.1] - losses[False, 0.0]) > 1e-3, losses  # dropout acted


def _worker(rank, world_size, tmp_dir):
    g01, g23 = dist.new_group([0, 1]), dist.new_group([2, 3])  # every rank creates every group, in order
    g4 = dist.new_group([0, 1, 2, 3])
    check_all(Axis(2, rank % 2, g01 if rank < 2 else g23))
    check_all(Axis(4, rank, g4))
    check_all(Axis(1, 0))
    check_sp_dropout(Axis(2, rank % 2, g01 if rank < 2 else g23))
    check_sp_dropout(Axis(4, rank, g4))


def test_tp1_in_process():
    check_all(Axis(1, 0))


def test_tp2_and_tp4(tmp_path):
    run_parallel(_worker, 4, tmp_path)
