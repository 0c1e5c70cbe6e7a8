"""Bring your own state (issue 21, class 4): the whole state_dict of a model (buffers, 0-dim tensors, integer
dtypes), of every torch.optim optimizer and of every torch.optim.lr_scheduler scheduler comes back exactly;
loading is as strict as torch's load_state_dict; what cannot be saved is refused on every rank before any
rank writes.

The lists come from torch itself (torch.optim.__all__, torch.optim.lr_scheduler.__all__): a class torch adds
fails here until it is built (or skipped with its reason) below. The outside reference everywhere is torch:
its own state_dict() before the save against after the load, torch's own strict load_state_dict error, and
the same object trained on uninterrupted.
"""
import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.optim as O
import torch.optim.lr_scheduler as L

from megalite.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from megalite.parallel.grid import ParallelGrid
from megalite.testing import run_parallel

GRID = ParallelGrid.single()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One thread, like the workers: on a shared 2-core machine torch's default oversubscribes it (a BatchNorm
    of 6 x 8 took 0.1 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Net(nn.Module):
    """Parameters, a learnable 0-dim scale, BatchNorm (float buffers and a 0-dim int64 num_batches_tracked),
    an int32 and a bool buffer of its own, and a non-persistent buffer (not part of the state_dict)."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1, self.bn, self.fc2 = nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.register_buffer("seen", torch.zeros(3, dtype=torch.int32))
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.register_buffer("scratch", torch.ones(2), persistent=False)

    def forward(self, x):
        out = self.fc2(torch.tanh(self.bn(self.fc1(x)))) * self.scale
        if self.training:
            self.seen += 1
        return out * self.mask


def _batches(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 5, generator=g) for _ in range(n)]


def _step(net, opt, x, sparse=False):
    def closure():
        opt.zero_grad()
        loss = (net(torch.tensor([1, 4, 7])) if sparse else net(x)).pow(2).mean()
        loss.backward()
        return loss
    opt.step(closure)


def _equal_state(a, b, what):
    """Two state_dicts (model or optimizer) equal exactly: keys, values, tensor dtypes, Python types."""
    assert type(a) is type(b), (what, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b) or set(a) == set(b), (what, set(a) ^ set(b))
        for k in a:
            _equal_state(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _equal_state(x, y, f"{what}[{i}]")
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (what, a, b)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), what
    else:
        assert a == b, (what, a, b)


# ---------------------------------------------------------------- every torch.optim optimizer
def _optimizer_classes():
    return [n for n in O.__all__ if isinstance(getattr(O, n), type) and issubclass(getattr(O, n), O.Optimizer)
            and getattr(O, n) is not O.Optimizer]


def _build_optimizer(name, net):
    """A sensible construction of each: Muon takes only matrices; SparseAdam needs sparse gradients (an
    nn.Embedding(sparse=True) module); the rest take every parameter."""
    cls = getattr(O, name)
    if name == "Muon":
        return cls([p for p in net.parameters() if p.dim() == 2], lr=0.02)
    if name == "LBFGS":
        return cls(net.parameters(), lr=0.5, history_size=3, max_iter=2)
    return cls(net.parameters(), lr=0.01)


def _module_for(name, seed):
    if name == "SparseAdam":
        torch.manual_seed(seed)
        return nn.Embedding(10, 4, sparse=True)
    return Net(seed)


def test_the_lists_are_torchs_own():
    assert len(_optimizer_classes()) >= 14 and "Adafactor" in _optimizer_classes()
    assert set(SCHEDULERS) | set(SKIPPED_SCHEDULERS) == {n for n in L.__all__ if isinstance(getattr(L, n), type)}


@pytest.mark.parametrize("name", _optimizer_classes())
def test_every_torch_optim_optimizer_round_trips_exactly(tmp_path, name):
    """Train 3 steps (model in train mode: BatchNorm statistics and the int buffer move), save, load into a
    fresh model and optimizer built with another seed and lr: the model's and the optimizer's state_dicts are
    torch's own before the save, and 2 more steps equal 2 more steps of the uninterrupted original."""
    sparse = name == "SparseAdam"
    net = _module_for(name, 0)
    opt = _build_optimizer(name, net)
    xs = _batches(5, 1)
    for x in xs[:3]:
        _step(net, opt, x, sparse)
    if name == "LBFGS":  # its history is lists of flattened tensors of every parameter together: no layout of it
        with pytest.raises(CheckpointError, match=r"^optimizer state '(old_dirs|old_stps|ro|al)' of parameter "
                                                  r"'[\w.]+' is a list: only tensors and numbers are checkpointed"):
            save_checkpoint(tmp_path / "ck", 3, net, opt, GRID)
        assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())
        return
    save_checkpoint(tmp_path / "ck", 3, net, opt, GRID)
    fresh = _module_for(name, 7)
    opt2 = _build_optimizer(name, fresh)
    for g in opt2.param_groups:
        g["lr"] = 123.0  # the checkpoint's hyperparameters win, as torch's load_state_dict does
    load_checkpoint(tmp_path / "ck", fresh, opt2, GRID)
    _equal_state(net.state_dict(), fresh.state_dict(), f"{name} model")
    _equal_state(opt.state_dict(), opt2.state_dict(), f"{name} optimizer")
    for x in xs[3:]:
        _step(net, opt, x, sparse)
        _step(fresh, opt2, x, sparse)
    _equal_state(net.state_dict(), fresh.state_dict(), f"{name} model after 2 more steps")


# ---------------------------------------------------------------- every lr_scheduler scheduler
SCHEDULERS = {  # name -> (optimizer) -> scheduler, with arguments that make it change the LR within 8 steps
    "LambdaLR": lambda o: L.LambdaLR(o, lr_lambda=lambda e: 0.9 ** e),
    "MultiplicativeLR": lambda o: L.MultiplicativeLR(o, lr_lambda=lambda e: 0.95),
    "StepLR": lambda o: L.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: L.MultiStepLR(o, milestones=[3, 5], gamma=0.5),
    "ConstantLR": lambda o: L.ConstantLR(o, factor=0.5, total_iters=4),
    "LinearLR": lambda o: L.LinearLR(o, start_factor=0.25, total_iters=6),
    "ExponentialLR": lambda o: L.ExponentialLR(o, gamma=0.9),
    "SequentialLR": lambda o: L.SequentialLR(o, [L.ConstantLR(o, factor=0.5, total_iters=2),
                                                 L.MultiStepLR(o, milestones=[3, 4], gamma=0.5)], milestones=[2]),
    "CosineAnnealingLR": lambda o: L.CosineAnnealingLR(o, T_max=6),
    "ChainedScheduler": lambda o: L.ChainedScheduler([L.MultiStepLR(o, milestones=[4], gamma=0.5),
                                                      L.ExponentialLR(o, gamma=0.9)]),
    "ReduceLROnPlateau": lambda o: L.ReduceLROnPlateau(o, patience=1, factor=0.5),
    "CyclicLR": lambda o: L.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2),
    "CosineAnnealingWarmRestarts": lambda o: L.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2),
    "OneCycleLR": lambda o: L.OneCycleLR(o, max_lr=0.1, total_steps=10),
    "PolynomialLR": lambda o: L.PolynomialLR(o, total_iters=6, power=2.0),
}
SKIPPED_SCHEDULERS = {"LRScheduler": "the abstract base class: its get_lr raises NotImplementedError"}


def _sched_step(s, loss=1.0):
    if isinstance(s, L.ReduceLROnPlateau):
        s.step(loss)  # a plateau: the LR halves every other step
    else:
        s.step()


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_every_lr_scheduler_round_trips_exactly(tmp_path, name):
    """3 epochs, save with the scheduler, load into a freshly built one: its state_dict is torch's own before
    the save (a Counter of int milestones, an infinite `best`, types included), and the next 5 learning rates
    are the uninterrupted scheduler's."""
    def make():
        net = nn.Linear(3, 2)
        opt = O.SGD(net.parameters(), lr=0.1, momentum=0.9)
        return net, opt, SCHEDULERS[name](opt)
    net, opt, sched = make()
    for _ in range(3):
        opt.step()
        _sched_step(sched)
    save_checkpoint(tmp_path / "ck", 3, net, opt, GRID, scheduler=sched)
    net2, opt2, sched2 = make()
    load_checkpoint(tmp_path / "ck", net2, opt2, GRID, scheduler=sched2)
    _equal_state(sched.state_dict(), sched2.state_dict(), name)
    lrs = [[], []]
    for _ in range(5):
        for k, (o, s) in enumerate(((opt, sched), (opt2, sched2))):
            o.step()
            _sched_step(s)
            lrs[k].append([g["lr"] for g in o.param_groups])
    assert lrs[0] == lrs[1], name
    assert len({tuple(x) for x in lrs[0]}) > 1 or name == "ConstantLR", f"{name}: the LR never changed"


def test_multistep_milestones_stay_ints_in_the_file(tmp_path):
    """The Counter is written as [key, count] pairs with integer keys (plain JSON would make them strings)."""
    net = nn.Linear(3, 2)
    opt = O.SGD(net.parameters(), lr=0.1)
    sched = L.MultiStepLR(opt, milestones=[3, 5])
    path = save_checkpoint(tmp_path / "ck", 1, net, opt, GRID, scheduler=sched)
    saved = json.loads((path / "manifest.json").read_text())["scheduler"]["milestones"]
    assert saved == {"__py__": "Counter", "items": [[3, 1], [5, 1]]}


# ---------------------------------------------------------------- the model: buffers, 0-dim, dtypes, eval
def test_buffers_and_0dim_state_come_back_and_eval_outputs_match(tmp_path):
    net = Net(0)
    opt = O.AdamW(net.parameters(), lr=0.05)
    for x in _batches(3, 2):
        _step(net, opt, x)
    want = net.state_dict()
    assert want["bn.num_batches_tracked"].dim() == 0 and want["bn.num_batches_tracked"].dtype == torch.int64
    assert "scratch" not in want and int(want["bn.num_batches_tracked"]) == 3
    path = save_checkpoint(tmp_path / "ck", 3, net, opt, GRID)
    man = json.loads((path / "manifest.json").read_text())
    assert set(man["model"]) == set(want)  # torch's state_dict keys, nothing more, nothing less
    assert man["model"]["scale"]["shape"] == [] and man["model"]["mask"]["dtype"] == "bool"
    fresh = Net(5)
    fresh.scratch.fill_(9.0)  # not persistent: the checkpoint leaves it alone, as torch's load does
    load_checkpoint(tmp_path / "ck", fresh, None, GRID)
    _equal_state(want, fresh.state_dict(), "model")
    assert torch.equal(fresh.scratch, torch.full((2,), 9.0))
    x = _batches(1, 3)[0]
    net.eval(), fresh.eval()
    assert torch.equal(net(x), fresh(x))  # eval uses the running statistics: they came back


def test_what_a_state_dict_cannot_hold_is_refused_naming_it(tmp_path):
    class Extra(nn.Linear):
        def get_extra_state(self):
            return {"note": 1}

    class Empty(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(0, 3))

    class Complex(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("z", torch.zeros(2, dtype=torch.complex64))

    for module, says in ((Extra(2, 2), r"model state '_extra_state' is a dict, not a tensor"),
                         (Empty(), r"model state 'w' has shape \[0, 3\]: a tensor with no elements"),
                         (Complex(), r"model state 'z' is torch.complex64 \(expected one of float32, ")):
        with pytest.raises(CheckpointError, match=r"^checkpoint step 1 was not saved: " + says):
            save_checkpoint(tmp_path / "ck", 1, module, None, GRID)
        assert not (tmp_path / "ck").exists()


def test_load_is_as_strict_as_torchs_load_state_dict(tmp_path):
    """A checkpoint with a tensor the model lacks, into a model with one the checkpoint lacks: both named,
    the same keys torch's own strict load_state_dict names, and the model is untouched."""
    class Old(Net):
        def __init__(self, seed=0):
            super().__init__(seed)
            self.gone = nn.Linear(2, 2)

    class New(Net):
        def __init__(self, seed=0):
            super().__init__(seed)
            self.added = nn.Parameter(torch.ones(4))

    save_checkpoint(tmp_path / "ck", 1, Old(), None, GRID)
    new = New(3)
    before = {k: v.clone() for k, v in new.state_dict().items()}
    with pytest.raises(RuntimeError) as torch_says:  # (torch copies the matching keys before raising: not into `new`)
        New(3).load_state_dict(Old().state_dict(), strict=True)
    missing = {k for k in new.state_dict() if k not in Old().state_dict()}
    unexpected = {k for k in Old().state_dict() if k not in new.state_dict()}
    assert missing == {"added"} and unexpected == {"gone.weight", "gone.bias"}
    for k in missing | unexpected:
        assert f'"{k}"' in str(torch_says.value)  # torch names exactly these
    with pytest.raises(CheckpointError) as ours:
        load_checkpoint(tmp_path / "ck", new, None, GRID)
    msg = str(ours.value)
    assert "missing key(s) (the model has them, the checkpoint does not): 'added'" in msg
    assert "unexpected key(s) (the checkpoint has them, no rank's model does): 'gone.bias', 'gone.weight'" in msg
    assert "\n" not in msg
    _equal_state(before, dict(new.state_dict()), "untouched")


# ---------------------------------------------------------------- refused before any rank writes
class _Opaque:
    pass


@pytest.mark.parametrize("client, says", [
    ({"ids": (1, 2)}, "client_state.ids is a tuple"),
    ({"by_step": {3: "x"}}, "client_state.by_step has the key 3 (int; JSON keys are strings)"),
    ({"loss": float("nan")}, "client_state.loss is nan (JSON has no NaN or infinity)"),
    ({"seen": {1, 2}}, "client_state.seen is a set"),
    ({"obj": _Opaque()}, "client_state.obj is a _Opaque"),
    ({"t": torch.ones(2)}, "client_state.t is a Tensor"),
    ("epoch 3", "client_state is a str, expected a dict"),
], ids=["tuple", "int-key", "nan", "set", "object", "tensor", "not-a-dict"])
def test_client_state_that_is_not_json_is_refused_before_writing(tmp_path, client, says):
    net = Net()
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(tmp_path / "ck", 1, net, O.SGD(net.parameters(), lr=0.1), GRID, client_state=client)
    assert str(e.value).startswith(f"checkpoint step 1 was not saved: {says}") and "\n" not in str(e.value)
    assert not (tmp_path / "ck").exists()


def test_json_depth_is_bounded_both_ways(tmp_path):
    """client_state as deep as a manifest may be saves and loads; one level more is refused at save."""
    from megalite.base.jsonio import MAX_DEPTH
    def nest(n):
        v = 1
        for _ in range(n):
            v = {"a": v}
        return v
    net = Net()
    deepest = nest(MAX_DEPTH - 2)
    save_checkpoint(tmp_path / "ok", 1, net, None, GRID, client_state=deepest)
    assert load_checkpoint(tmp_path / "ok", Net(), None, GRID).client_state == deepest
    with pytest.raises(CheckpointError, match=r"client_state(\.a)+ is nested more than \d+ levels deep"):
        save_checkpoint(tmp_path / "no", 1, net, None, GRID, client_state=nest(MAX_DEPTH - 1))
    assert not (tmp_path / "no").exists()


def test_a_scheduler_state_that_cannot_be_carried_is_refused_before_writing(tmp_path):
    class Schedule:  # a callable object: LambdaLR stores its __dict__, here holding a function
        def __init__(self):
            self.fn = math.cos

        def __call__(self, epoch):
            return 1.0

    net = nn.Linear(3, 2)
    opt = O.SGD(net.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match=r"^checkpoint step 1 was not saved: scheduler state: "
                                              r"scheduler\.lr_lambdas\[0\]\.fn is a builtins\.builtin_function_"
                                              r"or_method \(<built-in function cos>\): only dicts, Counters"):
        save_checkpoint(tmp_path / "ck", 1, net, opt, GRID, scheduler=L.LambdaLR(opt, Schedule()))
    assert not (tmp_path / "ck").exists()


# ---------------------------------------------------------------- several ranks: agreed refusals, resharding
def _bad_on_one_rank(rank, world_size, tmp_dir):
    """Only rank 1's client_state is bad: every rank raises the same error naming rank 1; nothing written."""
    from megalite.parallel.grid import Layout
    grid = ParallelGrid.create(Layout(1, 1, 2))
    net = Net()
    client = {"ok": True} if rank == 0 else {"bad": Counter(a=1)}
    try:
        save_checkpoint(Path(tmp_dir) / "ck", 1, net, O.SGD(net.parameters(), lr=0.1), grid, client_state=client)
    except CheckpointError as e:
        assert str(e) == "checkpoint step 1 was not saved: rank 1: client_state.bad is a Counter (Counter({'a': " \
                         "1})); expected a JSON value (object, list, string, number, true/false, null)", str(e)
        assert e.shared
    else:
        raise AssertionError("saved")
    assert not (Path(tmp_dir) / "ck").exists()


# The state shapes torch.optim has, once each where sharding matters (every class is exact in one process
# above): moments and a 0-dim float step (Adam), 0-dim eta and mu beside a tensor (ASGD), two tensors and a
# step (Rprop), a momentum buffer with no step (SGD).
MULTI = ["Adam", "ASGD", "Rprop", "SGD"]


def _optimizers_resharded(rank, world_size, tmp_dir):
    """README's recipe model (up split over tp) with each optimizer of MULTI: 2 steps on gradients drawn from
    (name, step) (what assert_round_trip does), saved at (2,1,2), loaded at (1,2,2) in the same processes:
    every parameter and state tensor, whole, is bitwise what was saved. Adafactor at tp = 2 is refused
    naming the parameter, the state and the split."""
    from megalite.parallel.partition import init_local, partition_of
    from test_byo import _gather_full, recipe
    r = recipe()
    Layout = r["megalite"].Layout
    a, b = ParallelGrid.create(Layout(2, 1, 2)), ParallelGrid.create(Layout(1, 2, 2))
    tmp = Path(tmp_dir)
    out = {}
    for name in MULTI + ["Adafactor"]:
        net = r["build"](a)
        make = (lambda ps: O.SGD(ps, lr=0.01, momentum=0.9)) if name == "SGD" else \
            (lambda ps: getattr(O, name)(ps, lr=0.01))
        opt = make(net.parameters())
        for step in range(2):
            for n, p in net.named_parameters():
                p.grad = init_local(n, partition_of(p), "normal", 1 + step, 1.0, a.tp.rank, a.tp.size)
            opt.step()
        if name == "Adafactor":
            try:
                save_checkpoint(tmp / name, 2, net, opt, a)
            except CheckpointError as e:
                assert "state 'row_var' of parameter 'blocks.0.up.weight' has shape [64, 1], not the parameter's " \
                       "[64, 32], and the parameter is split over tp = 2" in str(e), str(e)
            else:
                raise AssertionError("Adafactor at tp = 2 was saved")
            continue
        save_checkpoint(tmp / name, 2, net, opt, a)
        live = _gather_full(net, opt, a)
        net2 = r["build"](b, seed=3)
        opt2 = make(net2.parameters())
        load_checkpoint(tmp / name, net2, opt2, b)
        loaded = _gather_full(net2, opt2, b)
        assert live.keys() == loaded.keys() and len(live) > 8, name
        for k, v in live.items():
            assert torch.equal(v, loaded[k]) and v.dtype == loaded[k].dtype, (name, k)
        out[name] = sorted({k for _, k in live})
    # megalite's ZeRO-1 AdamW on a module with buffers: the buffers are cut in a flat space of their own, so the
    # parameters' pieces stay the optimizer's and every dp rank writes its moments exactly as it holds them
    from megalite.parallel.data import ShardedAdamW
    c = ParallelGrid.create(Layout(1, 1, 4))
    nets, opts = [], []
    for seed in (0, 9):
        net = Net(seed)
        nets.append(net)
        opts.append(ShardedAdamW(list(net.named_parameters()), c.tp, c.dp, zero1=True, weight_decay=0.1))
    net, opt = nets[0], opts[0]
    for step in range(2):
        for n, p in net.named_parameters():
            p.grad = init_local(n, partition_of(p), "normal", 1 + step, 1.0, 0, 1)
        net(torch.randn(4, 5, generator=torch.Generator().manual_seed(step)))  # BatchNorm statistics move
        opt.step(1e-2)
    save_checkpoint(tmp / "zero1", 2, net, opt, c)
    load_checkpoint(tmp / "zero1", nets[1], opts[1], c)
    _equal_state(dict(net.state_dict()), dict(nets[1].state_dict()), "zero1 model")
    for store in ("exp_avg", "exp_avg_sq"):
        mine, theirs = getattr(opt, store), getattr(opts[1], store)
        assert all(torch.equal(mine[k], theirs[k]) for k in mine) and sum(v.numel() for v in mine.values()) > 0
    if rank == 0:
        torch.save(out, tmp / "keys.pt")


def test_several_ranks_agree_on_refusals_and_reshard_every_optimizer(tmp_path):
    run_parallel(_bad_on_one_rank, 2, tmp_path / "one")
    run_parallel(_optimizers_resharded, 4, tmp_path / "many")
    keys = torch.load(tmp_path / "many" / "keys.pt")
    assert set(keys) == set(MULTI)
    assert keys["Adam"] == ["exp_avg", "exp_avg_sq", "param", "step"] and "ax" in keys["ASGD"]
