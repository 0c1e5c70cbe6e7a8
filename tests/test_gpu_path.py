"""Issue 24 items 7-8: the fused AdamW kernel path, train.compile, gpu-check's FLOPs count, TensorBoard.

References: torch.optim.AdamW (the unfused and fused kernels), torch's own eager model for compile, a hand count
of GPT-2-124M's parameters (nanoGPT's get_num_params), and tensorboard's own event reader.
"""
import math
import sys

import pytest
import torch
import torch.nn as nn

import helpers as H
from megalite.run import metrics
from megalite.config import ModelConfig
from megalite.base.errors import ConfigError
from megalite.parallel.data import ShardedAdamW, use_fused
from megalite.parallel.grid import Layout, ParallelGrid
from megalite.parallel.partition import Partition, tag
from megalite.bench import gpu_check


# ---------------------------------------------------------------- fused AdamW
def _params(seed=0):
    """A decayed matrix, a decayed vector and an undecayed LayerNorm-like vector, as megalite tags them."""
    g = torch.Generator().manual_seed(seed)
    # long enough for the kernel's vectorized loop (AVX FMA: last-bit differences), with scalar tails
    spec = [("a.weight", (37, 29), True), ("a.bias", (37,), True), ("ln.weight", (29,), False)]
    return [(n, tag(nn.Parameter(torch.randn(s, generator=g)), Partition(s, None, placement="first", init="normal",
                                                                         decay=d))) for n, s, d in spec]


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) for s in ((37, 29), (37,), (29,))]


def _run_sharded(fused, steps=6, hold_at=()):
    params, grid = _params(), ParallelGrid.single()
    opt = ShardedAdamW(params, grid.tp, grid.dp, False, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
    for s in range(steps):
        for (_, p), g in zip(params, _grads(s)):
            p.grad = g.clone()
        if s in hold_at:
            opt.hold([(n, i) for n, _ in params for i in range(3)])
        opt.step(1e-2 * (s + 1), grad_scale=0.5 if s % 2 else 1.0)
    return params, opt


def _run_torch(fused, steps=6):
    params = [p for _, p in _params()]
    opt = torch.optim.AdamW([{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=fused, foreach=False if not fused else None)
    for s in range(steps):
        for g_ in opt.param_groups:
            g_["lr"] = 1e-2 * (s + 1)
        for p, g in zip(params, _grads(s)):
            p.grad = g * (0.5 if s % 2 else 1.0)  # megalite's grad_scale is the clip factor applied first
        opt.step()
    return params


def test_fused_adamw_matches_unfused_and_torch():
    """Fused and elementwise steps agree to 1e-6 relative (the documented tolerance; the kernel's vectorized
    loop rounds differently in the last bit), and both match torch.optim.AdamW, fused and unfused, over six
    steps with clipping on every other step."""
    unfused, _ = _run_sharded(False)
    fused, opt = _run_sharded(True)
    assert opt.fused
    for ref in (_run_torch(False), _run_torch(True)):
        for (name, a), b, c in zip(unfused, fused, ref):
            torch.testing.assert_close(b[1].data, a.data, rtol=1e-6, atol=1e-7, msg=name)
            torch.testing.assert_close(a.data, c.data, rtol=1e-5, atol=1e-6, msg=name)
    for (name, a), (_, b) in zip(unfused, fused):
        torch.testing.assert_close(opt.exp_avg_sq[name], _run_sharded(False)[1].exp_avg_sq[name], rtol=1e-6, atol=0)


def test_fused_adamw_keeps_the_held_out_of_place_step():
    """After a hold (async checkpoint) the step writes new buffers (the held tensors are untouched) and lands
    bitwise where the fused in-place steps land (the same kernel on a copy)."""
    plain, _ = _run_sharded(True)
    params, grid = _params(), ParallelGrid.single()
    opt = ShardedAdamW(params, grid.tp, grid.dp, False, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    before = {}
    for s in range(6):
        for (_, p), g in zip(params, _grads(s)):
            p.grad = g.clone()
        if s == 3:
            before = {n: (p.data, p.data.clone()) for n, p in params}
            opt.hold([(n, i) for n, _ in params for i in range(3)])
        opt.step(1e-2 * (s + 1), grad_scale=0.5 if s % 2 else 1.0)
    for n, p in params:
        held, copy = before[n]
        assert p.data.data_ptr() != held.data_ptr() and torch.equal(held, copy), n  # the snapshot stayed as it was
    for (n, a), (_, b) in zip(plain, params):
        assert torch.equal(b.data, a.data), n


def _zero1_worker(rank, world_size, tmp, tokens):
    from megalite.testing import gather_full_model
    from megalite.run.train import build, train_step
    torch.set_num_threads(1)
    out = {}
    runs = [(f, z, 0.0) for f in ("off", "on") for z in (0, 1, 2, 3)] + [(f, 1, 1.0) for f in ("off", "on")]
    for fused, zero, clip in runs:
        cfg = H.TINY.config(tokens, f"{tmp}/run", **{"train.fused_adamw": fused, "parallel.dp": 2,
                                                     "parallel.zero": zero, "train.grad_clip": clip,
                                                     "train.micro_batch_size": 8 if clip == 0.0 else 2,
                                                     "model.n_embd": 24 if clip == 0.0 else 32})
        tr = build(cfg, ParallelGrid.create(Layout(1, 1, 2)), torch.device("cpu"))
        assert tr.optimizer.fused == (fused == "on") and tr.optimizer.level == zero
        losses = [train_step(tr)["loss"] for _ in range(3)]
        with tr.grads.whole():
            out[fused, zero, clip] = (losses, gather_full_model(tr.params, tr.grid))
    # One micro-batch per rank and no clipping: every ZeRO level updates the same bits as ZeRO 0, with either
    # kernel. At dp 2 the gradients are the same bits (a + b, halved), and an element's update does not depend
    # on the piece that holds it (ZeRO-1's range cut mid-tensor, ZeRO-2/3's chunks of every tensor; width 24,
    # so that biases, norms and their chunks end in part-vectors: fused_adamw's runs). (ZeRO-2/3 reduce each
    # micro-batch and add the norm's squares chunk by chunk: with several micro-batches or clipping, the same
    # values in another order.)
    for fused in ("off", "on"):
        for zero in (1, 2, 3):
            (la, pa), (lb, pb) = out[fused, 0, 0.0], out[fused, zero, 0.0]
            assert la == lb, (fused, zero, la, lb)
            assert [n for n in pa if not torch.equal(pa[n], pb[n])] == [], (fused, zero)
    # last-bit differences of the kernel, grown by three steps of Adam's normalisation: measured 3.3e-7 at
    # most (a qkv bias), against updates of ~lr = 3e-3
    off, on = out["off", 1, 1.0], out["on", 1, 1.0]
    assert max(abs(a - b) for a, b in zip(off[0], on[0])) < 1e-6, out
    for name, t in off[1].items():
        torch.testing.assert_close(on[1][name], t, rtol=1e-5, atol=1e-6)


def test_fused_adamw_with_zero1_pieces(token_file, tmp_path):
    """dp 2, ZeRO 0 to 3, three steps, one micro-batch per rank, no clipping: each level's weights and losses
    are bitwise ZeRO 0's, with the fused kernel (the default) and with the elementwise ops; with clipping at
    ZeRO-1, fused and elementwise agree within 1e-6 (losses) and 1e-6 absolute (weights)."""
    from megalite.testing import run_parallel
    run_parallel(_zero1_worker, 2, tmp_path, args=(str(token_file),))


def test_fused_adamw_setting():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not use_fused("off", cpu) and use_fused("auto", cpu) and use_fused("on", cpu)  # torch >= 2.4 has it
    assert use_fused("auto", cuda) and not use_fused("off", cuda)


def test_fused_adamw_bad_setting_is_one_line(tiny_config):
    from megalite.config import validate
    with pytest.raises(ConfigError, match=r"^train\.fused_adamw = 'yes': expected 'auto', 'on' or 'off'$"):
        validate(tiny_config(**{"train.fused_adamw": "yes"}), 1)


# ---------------------------------------------------------------- gpu-check's arithmetic
def test_flops_per_token_is_the_hand_count_of_gpt2_124m():
    """N = 12 L h^2 + 13 L h + V h + 2 h (every parameter but wpe) = 123,689,472 at V = 50304; with wpe's
    1024 x 768 that is configs/gpt2-124m.toml's 124,475,904, and the model built from it agrees."""
    m = ModelConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304)
    assert gpu_check.n_params(m) == 123_689_472 == 124_475_904 - 1024 * 768
    assert gpu_check.flops_per_token(m, 1024) == 6 * 123_689_472 + 12 * 12 * 768 * 1024
    small = ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=40)
    from megalite.model import GPTStage
    built = sum(p.numel() for n, p in GPTStage(small, ParallelGrid.single()).global_parameters() if n != "wpe")
    assert gpu_check.n_params(small) == built


def test_datasheet_peaks():
    assert gpu_check.datasheet_peak("NVIDIA H200") == ("H200", 989.0)
    assert gpu_check.datasheet_peak("NVIDIA H100 80GB HBM3") == ("H100", 989.0)
    assert gpu_check.datasheet_peak("NVIDIA H100 PCIe") == ("H100 PCIe", 756.0)
    assert gpu_check.datasheet_peak("NVIDIA A100-SXM4-80GB") == ("A100", 312.0)
    assert gpu_check.datasheet_peak("NVIDIA GeForce RTX 4090") is None


# ---------------------------------------------------------------- train.compile
@pytest.mark.slow  # inductor compiles two graphs on the CPU: ~30-90 s here, under load
def test_compile_equals_eager(tiny_config):
    """Three steps of the tiny model compiled and eager: the same losses within 1e-5, the same weights within
    1e-5 (inductor may fuse differently), and dynamo really compiled the blocks."""
    from torch._dynamo.utils import counters
    from megalite.testing import gather_full_model
    from megalite.run.train import build, train_step
    runs = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for on in (False, True):
            cfg = tiny_config(**{"train.compile": on, "train.steps": 3})
            counters.clear()
            tr = build(cfg, ParallelGrid.single(), torch.device("cpu"))
            runs[on] = ([train_step(tr)["loss"] for _ in range(3)], gather_full_model(tr.params, tr.grid))
            if on:
                assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])
    finally:
        torch.set_num_threads(threads)
    (le, pe), (lc, pc) = runs[False], runs[True]
    assert all(math.isfinite(x) for x in lc) and max(abs(a - b) for a, b in zip(le, lc)) < 1e-5, (le, lc)
    for name in pe:
        torch.testing.assert_close(pc[name], pe[name], rtol=1e-5, atol=1e-5, msg=name)


def _compile_worker(rank, world_size, tmp, tokens, layout):
    from megalite.run.train import build, train_step
    torch.set_num_threads(1)
    losses = {}
    for on in (False, True):
        cfg = H.TINY.config(tokens, f"{tmp}/run", **{"train.compile": on, "parallel.tp": layout[0],
                                                     "parallel.pp": layout[1], "parallel.dp": layout[2]})
        tr = build(cfg, ParallelGrid.create(Layout(*layout)), torch.device("cpu"))
        losses[on] = [train_step(tr)["loss"] for _ in range(3)]
    assert max(abs(a - b) for a, b in zip(losses[False], losses[True])) < 1e-5, losses


@pytest.mark.slow  # two processes compiling: ~40-90 s each here
@pytest.mark.parametrize("layout", [(2, 1, 1), (1, 2, 1)], ids=["tp2", "pp2"])
def test_compile_equals_eager_across_ranks(layout, token_file, tmp_path):
    """Compiled blocks with tensor-parallel collectives inside (tp 2) and per pipeline stage (pp 2): the same
    three losses as eager within 1e-5 (measured: 0.0 at tp 2, 6e-8 at pp 2)."""
    from megalite.testing import run_parallel
    run_parallel(_compile_worker, 2, tmp_path, args=(str(token_file), layout))


# ---------------------------------------------------------------- TensorBoard
def test_tensorboard_events_equal_metrics_jsonl(tiny_config, tmp_path):
    """train.tensorboard writes every step's numbers; tensorboard's own reader gives back metrics.jsonl's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    cfg = tiny_config(**{"train.tensorboard": True, "train.steps": 4, "train.eval_interval": 2,
                         "checkpoint.dir": ""})
    H.train_in_process(cfg)
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    rows = metrics.read(tmp_path / "run")
    assert len(rows) == 4
    # the scalars docs/training.md lists, every one of them (a byte-level run logs bits per byte too)
    documented = (("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
                  ("tokens_per_s", "train/tokens_per_s"), ("ms_per_step", "train/ms_per_step"),
                  ("val_loss", "val/loss"), ("val_bpb", "val/bits_per_byte"))
    assert sorted(acc.Tags()["scalars"]) == sorted(tb for _, tb in documented)
    for key, tb in documented:
        got = [(e.step, e.value) for e in acc.Scalars(tb)]
        want = [(r["step"], r[key]) for r in rows if key in r]
        assert [s for s, _ in got] == [s for s, _ in want], tb
        for (_, a), (_, b) in zip(got, want):
            assert a == pytest.approx(b, rel=1e-6), tb  # event files hold float32
    assert [s for s, _ in ((e.step, 0) for e in acc.Scalars("val/loss"))] == [2, 4]


def test_tensorboard_missing_is_one_line_and_writes_nothing(tiny_config, tmp_path, monkeypatch):
    for mod in [m for m in sys.modules if m == "tensorboard" or m.startswith(("tensorboard.", "torch.utils.tensorboard"))]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard -> ImportError
    cfg = tiny_config(**{"train.tensorboard": True})
    with pytest.raises(ConfigError) as e:
        H.train_in_process(cfg)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("train.tensorboard = true needs the `tensorboard` package") \
        and "pip install tensorboard" in msg, msg
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("*")), "nothing is written"


def test_tensorboard_resume_replaces_redone_steps(tmp_path):
    """A launch resumed at step 2 after an earlier one logged step 3: TensorBoard's reader shows step 3 once,
    with the redone value (purge_step), as metrics.read keeps the last record of a step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from megalite.run.tensorboard_log import Board
    first = Board(tmp_path, 0)
    for s in (1, 2, 3):
        first.write({"step": s, "loss": float(s)})
    first.close()
    second = Board(tmp_path, 2)
    for s in (3, 4):
        second.write({"step": s, "loss": 10.0 * s})
    second.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_tp1_cross_entropy_fast_path_equals_the_vocab_parallel_function():
    """At tp = 1 the loss is torch's F.cross_entropy; the vocab-parallel autograd function (what tp > 1 runs)
    gives the same per-token losses and logit gradients, within float32 rounding."""
    from megalite.parallel.tensor import _VocabParallelCrossEntropy, vocab_parallel_cross_entropy
    tp = ParallelGrid.single().tp
    g = torch.Generator().manual_seed(3)
    logits, target = torch.randn(3, 7, 50, generator=g) * 4, torch.randint(0, 50, (3, 7), generator=g)
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    fast = vocab_parallel_cross_entropy(a, target, 50, tp)
    slow = _VocabParallelCrossEntropy.apply(b.reshape(-1, 50), target.reshape(-1), 0, 50, tp).reshape(3, 7)
    torch.testing.assert_close(fast, slow, rtol=1e-6, atol=1e-6)
    (fast * torch.arange(21.0).reshape(3, 7)).sum().backward()
    (slow * torch.arange(21.0).reshape(3, 7)).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_bench_phases_times_both_models(tmp_path, monkeypatch):
    """The per-phase profile that docs/performance.md quotes runs, and times each phase of both models; its
    temp folder (token file, run folder) is removed."""
    import tempfile
    from benchmarks.phases import phases
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    lines = []
    med = phases(steps=1, n_layer=1, n_embd=32, block_size=16, batch=4, micro=2, log=lines.append)
    assert set(med) == {"megalite fwd+bwd", "megalite finalize", "megalite adamw", "plain fwd+bwd", "plain clip",
                        "plain adamw"} and all(v > 0 for v in med.values()), med
    assert [ln.split()[0] for ln in lines[2:]] == ["fwd+bwd", "grad", "adamw"], lines
    assert [p for p in tmp_path.iterdir() if p.name.startswith("megalite")] == [], "bench phases left its temp folder"
