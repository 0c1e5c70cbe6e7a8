"""Async saves without a copy: the checkpoint a held save writes is the state at the save, although the
optimizer steps on while it is being written; the held step (out of place, into the spare set) computes
the same bits as an in-place one; and two held saves in a row reuse the first one's tensors safely.

The writer is stopped by a gate (a patched `write_rank`) until the steps have run, so the race the
double buffering exists for is taken every time, not by chance. References: a synchronous save of the
same step (byte-identical files), and a twin trainer that steps in place with no save at all."""
import threading
from pathlib import Path

import torch

from helpers import CKPT, same_step_files
from megalite.checkpoint import AsyncSaver, load_checkpoint, save_checkpoint
from megalite.checkpoint import commit as save_mod
from megalite.checkpoint.plan import collect
from megalite.parallel.grid import Layout, ParallelGrid
from megalite.testing import run_parallel
from megalite.run.train import build, train_step

CPU = torch.device("cpu")


def _gated(monkeypatch_setattr):
    """Make every write_rank wait for the returned event (the background writer stalls mid-save)."""
    gate, started = threading.Event(), threading.Event()
    real = save_mod.write_rank

    def write_rank(folder, pay, rel, *more):
        started.set()
        assert gate.wait(60), "the test never opened the gate"
        return real(folder, pay, rel, *more)

    monkeypatch_setattr(save_mod, "write_rank", write_rank)
    return gate, started


def _state(tr) -> dict:
    out = {f"p.{n}": p.detach().clone() for n, p in tr.params}
    for n in tr.optimizer.exp_avg:
        out[f"m.{n}"] = tr.optimizer.exp_avg[n].clone()
        out[f"v.{n}"] = tr.optimizer.exp_avg_sq[n].clone()
    return out


def _same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"{what}: {bad[:4]}"


def _scenario(grid, cfg, tmp: Path, setattr_) -> None:
    """Two held async saves with steps run while each is stalled; every rank of `grid` runs it."""
    tr, twin = build(cfg, grid, CPU), build(cfg, grid, CPU)  # twin: in place, never saved
    for t in (tr, twin):
        train_step(t)
    saver = AsyncSaver()
    saver.reserve(collect(tr.params, tr.optimizer, grid, {}), tr.optimizer)
    gate, started = _gated(setattr_)
    for round_, step in enumerate((1, 3)):
        gate.set()
        save_checkpoint(tmp / "sync", step, tr.model, tr.optimizer, grid)  # the reference: same state, no hold
        gate.clear()
        started.clear()
        save_checkpoint(tmp / "async", step, tr.model, tr.optimizer, grid, saver=saver)
        assert tr.optimizer.held, "a host ShardedAdamW save must be held, not copied"
        assert started.wait(60) and saver.thread.is_alive()  # the writer is in the middle of the save
        for t in (tr, twin):  # round 2's step writes into the tensors round 1's save held
            for _ in range(2 - round_):
                train_step(t)
        _same(_state(tr), _state(twin), f"round {round_ + 1}: held steps vs in-place steps")
        gate.set()
        saver.wait()
        if grid.rank == 0:
            same_step_files(tmp / "sync" / f"step_{step:08d}", tmp / "async" / f"step_{step:08d}")
    # a load with the optimizer waits for a save still writing from its tensors (no torn checkpoint)
    save_checkpoint(tmp / "sync", 4, tr.model, tr.optimizer, grid)
    gate.clear()
    save_checkpoint(tmp / "async", 4, tr.model, tr.optimizer, grid, saver=saver)
    done = threading.Timer(0.5, gate.set)
    done.start()
    load_checkpoint(tmp / "sync" / "step_00000003", tr.model, tr.optimizer, grid)
    assert saver.thread is None, "load_checkpoint must wait for the held save first"
    done.join()
    if grid.rank == 0:
        same_step_files(tmp / "sync" / "step_00000004", tmp / "async" / "step_00000004")


def test_held_async_save_single_process(tmp_path, token_file, monkeypatch):
    _scenario(ParallelGrid.single(), CKPT.config(token_file), tmp_path, monkeypatch.setattr)


def test_held_async_save_with_fused_adamw(tmp_path, token_file, monkeypatch):
    """train.fused_adamw = on: a held step copies the held tensors into the spares and runs the fused kernel
    there; bitwise the in-place twin's, and the async files equal the sync ones."""
    cfg = CKPT.config(token_file, **{"train.fused_adamw": "on"})
    assert build(cfg, ParallelGrid.single(), CPU).optimizer.fused
    _scenario(ParallelGrid.single(), cfg, tmp_path, monkeypatch.setattr)


def _zero1_worker(rank, world_size, tmp_dir, tokens):
    cfg = CKPT.config(tokens, **{"parallel.dp": 2, "parallel.zero1": True})
    _scenario(ParallelGrid.create(Layout(1, 1, 2)), cfg, Path(tmp_dir),
              lambda obj, name, value: setattr(obj, name, value))


def test_held_async_save_zero1_dp2(tmp_path, token_file):
    """ZeRO-1: the held step writes only this rank's range of the spare set; the all-gather fills the rest."""
    run_parallel(_zero1_worker, 2, tmp_path, args=(str(token_file),))


def _sgd_case():
    """A torch.optim optimizer on a module with buffers: an async save copies it into host staging buffers
    reused from one save to the next. Returns (model, optimizer, step(k))."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)

    def step(k):
        opt.zero_grad()
        net(torch.randn(4, 6, generator=torch.Generator().manual_seed(k))).pow(2).sum().backward()
        opt.step()
    return net, opt, step


def _adamw_case(cfg):
    """megalite's trainer: an async save holds the live tensors and the next step writes out of place."""
    tr = build(cfg, ParallelGrid.single(), CPU)
    return tr.model, tr.optimizer, lambda k: train_step(tr)


def test_back_to_back_async_saves_wait_for_the_one_still_writing(tmp_path, token_file, monkeypatch):
    """A second async save submitted while the first is stalled mid-write (no saver.wait() between them, as a
    loop saving every step does): submit must wait for the first before it reuses the host staging buffers
    (torch.optim: copied) or holds the tensors again (megalite's AdamW: the step after it writes into the
    first save's buffers). Each checkpoint is byte-identical to a synchronous save of a twin at that step."""
    gate, started = _gated(monkeypatch.setattr)
    grid = ParallelGrid.single()
    cfg = CKPT.config(token_file)
    torch.set_num_threads(1)
    for what, make in (("sgd", _sgd_case), ("adamw", lambda: _adamw_case(cfg))):
        (net, opt, step), (twin, twin_opt, twin_step) = make(), make()
        saver, root = AsyncSaver(), tmp_path / what
        gate.set()
        for k in (1, 2):  # the references first (with the gate open, so no stalled save is let go by them)
            twin_step(k)
            save_checkpoint(root / "sync", k, twin, twin_opt, grid)
        gate.clear()
        started.clear()
        for k in (1, 2):
            step(k)
            if k == 2:  # the first save stays stalled for another 0.5 s: submit has to wait for it
                threading.Timer(0.5, gate.set).start()
            save_checkpoint(root / "async", k, net, opt, grid, saver=saver)
            if k == 1:
                assert started.wait(60) and saver.thread.is_alive()
        step(3)  # after the second submit: reaches neither save's bytes
        gate.set()
        saver.wait()
        for k in (1, 2):
            same_step_files(root / "sync" / f"step_{k:08d}", root / "async" / f"step_{k:08d}")
