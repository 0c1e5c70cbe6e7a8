"""The fused AdamW kernel on the CPU, megalite's default optimizer step wherever torch has the kernel.

torch's CPU kernel computes a tensor in SIMD vectors and its last numel % (vector width) elements one by one, and
the two loops round differently; `parallel.data.fused_adamw` sends every element through the vector loop (each
piece's head of whole 64-element runs in place, the tails packed into one padded buffer), so an element gets the
same bits whichever piece holds it: a ZeRO-1 range cut anywhere, a ZeRO-2/3 chunk, a tp slice.
References: the kernel on the whole tensor, torch.optim.AdamW(fused=True) on whole tensors of whole runs, and the
ZeRO levels against each other (`test_gpu_path.py::test_fused_adamw_with_zero1_pieces`, bitwise).
"""
import random

import pytest
import torch

from megalite.parallel.data import VECTOR_RUN, fused_adamw

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _state(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g), torch.zeros(n), torch.zeros(n), g


def _train(n, cuts, steps=8, piecewise=fused_adamw):
    """`steps` AdamW steps of n weights, the kernel called on the pieces [cuts[i], cuts[i+1]); gradients spread
    over ten decades (small ones meet eps), clipping (grad_scale) on every other step."""
    w, m, v, g0 = _state(n)
    for s in range(1, steps + 1):
        g = torch.randn(n, generator=g0) * torch.logspace(-8, 2, n)
        groups = [[t[a:b] for a, b in zip(cuts, cuts[1:])] for t in (w, g, m, v)]
        piecewise(groups, torch.tensor(float(s)), grad_scale=torch.tensor(1 / 0.7) if s % 2 else None, **HYPER)
    return {"weights": w, "exp_avg": m, "exp_avg_sq": v, "last grads": g}


def _raw(groups, step, lr, betas, eps, weight_decay, grad_scale=None):
    """The kernel as torch calls it: each piece as it is."""
    torch._fused_adamw_(*groups, [], [step] * len(groups[0]), lr=lr, beta1=betas[0], beta2=betas[1],
                        weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False, grad_scale=grad_scale)


def _cuts(n, longest, seed):
    rng, cuts = random.Random(seed), [0]
    while cuts[-1] < n:
        cuts.append(min(n, cuts[-1] + rng.randint(1, longest)))
    return cuts


@pytest.mark.parametrize("longest", [15, 300])
def test_every_element_has_the_same_bits_wherever_its_piece_is_cut(longest):
    """5,003 weights cut at random into pieces of 1..15 elements (every one a tail) or 1..300: weights, moments
    and the unscaled gradients equal the whole tensor's step bitwise, over 8 steps with decay and clipping. The
    kernel called on the same pieces as they are does not (its scalar tails), which is what the runs prevent."""
    n = 5003
    whole = _train(n, [0, n])
    cut = _train(n, _cuts(n, longest, seed=longest))
    for k, t in whole.items():
        assert torch.equal(cut[k], t), (k, (cut[k] != t).sum().item())
    raw = _train(n, _cuts(n, longest, seed=longest), piecewise=_raw)
    cpu = torch.backends.cpu.get_cpu_capability()
    assert any(not torch.equal(raw[k], t) for k, t in whole.items()), \
        f"torch's kernel rounded its scalar tails as its vector loop on this CPU ({cpu})"


@pytest.mark.parametrize("sizes", [[64, 64], [1, 1], [63, 65, 1], [7] * 9, [VECTOR_RUN * 3, 5, VECTOR_RUN]])
def test_pieces_at_and_around_a_run_are_computed_alike(sizes):
    """Bounds of the cut: pieces of exactly one run (no tail), of one element (no head), 63 / 65, many tails
    that together fill less than one run, and whole runs beside a tail: all equal the whole tensor's step. (Two
    pieces at least: a single piece is the whole tensor's own call.)"""
    n = sum(sizes)
    cuts = [0]
    for k in sizes:
        cuts.append(cuts[-1] + k)
    whole, cut = _train(n, [0, n], steps=3), _train(n, cuts, steps=3)
    for k, t in whole.items():
        assert torch.equal(cut[k], t), k


def test_whole_runs_equal_torch_optim_adamw_fused_bitwise():
    """The outside reference: torch.optim.AdamW(fused=True) on tensors whose sizes are whole runs (so torch's
    kernel has no scalar tail either), decayed and not, six steps: the same bits as megalite's call."""
    g = torch.Generator().manual_seed(3)
    shapes = [(64, 3), (128,), (2, 64)]
    ours = [torch.randn(s, generator=g) for s in shapes]
    theirs = [torch.nn.Parameter(t.clone()) for t in ours]
    opt = torch.optim.AdamW([{"params": theirs[:2], "weight_decay": 0.1}, {"params": theirs[2:], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    moments = [(torch.zeros(t.numel()), torch.zeros(t.numel())) for t in ours]
    for s in range(1, 7):
        grads = [torch.randn(sh, generator=g) for sh in shapes]
        for p, gr in zip(theirs, grads):
            p.grad = gr.clone()
        opt.step()
        for lo, hi, wd in ((0, 2, 0.1), (2, 3, 0.0)):
            fused_adamw([[t.view(-1) for t in ours[lo:hi]], [gr.view(-1) for gr in grads[lo:hi]],
                         [m for m, _ in moments[lo:hi]], [v for _, v in moments[lo:hi]]], torch.tensor(float(s)),
                        lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b.data)
