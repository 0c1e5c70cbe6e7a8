"""Issue 13's knobs without processes: config validation of sp / vpp / recompute / overlap, the (pp rank, chunk)
placement of every layer under virtual pipeline stages, and the interleaved 1F1B order."""
import pytest

from megalite.config import ConfigError, load_config, resolve, validate

GOOD = ["--parallel.tp=2", "--parallel.pp=2", "--parallel.dp=2", "--parallel.sp=true", "--parallel.vpp=2",
        "--parallel.overlap_grad_reduce=true", "--train.recompute=selective", "--train.global_batch_size=16",
        "--train.micro_batch_size=2"]


def test_new_fields_parse_and_validate():
    cfg = validate(resolve(load_config(None, GOOD), 8), 8)
    assert (cfg.parallel.sp, cfg.parallel.vpp, cfg.parallel.overlap_grad_reduce, cfg.train.recompute) == \
        (True, 2, True, "selective")
    d = load_config(None, []).to_dict()
    assert (d["parallel"]["sp"], d["parallel"]["vpp"], d["parallel"]["overlap_grad_reduce"],
            d["train"]["recompute"]) == (False, 1, False, "none")


@pytest.mark.parametrize("overrides,world,names", [
    (["--train.recompute=some"], 1, ["train.recompute = 'some'", "'selective'"]),
    (["--parallel.vpp=0"], 1, ["parallel.vpp = 0", "positive"]),
    (["--parallel.vpp=2"], 1, ["parallel.vpp = 2", "parallel.pp >= 2"]),
    (["--parallel.vpp=2", "--parallel.pp=4", "--model.n_layer=6"], 4, ["parallel.pp * parallel.vpp = 4*2",
                                                                       "model.n_layer = 6"]),
    (["--parallel.vpp=2", "--parallel.pp=4", "--model.n_layer=8", "--train.global_batch_size=12",
      "--train.micro_batch_size=2"], 4, ["micro-batches per step (6)", "multiple of parallel.pp = 4"]),
    (["--parallel.sp=true", "--parallel.tp=4", "--model.block_size=30"], 4,
     ["parallel.sp", "model.block_size) = 30", "parallel.tp = 4"]),
])
def test_bad_feature_values_are_one_line_errors(overrides, world, names):
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError) as e:
        validate(resolve(cfg, world), world)
    msg = str(e.value)
    assert "\n" not in msg
    for n in names:
        assert n in msg, (n, msg)


# ---------------------------------------------------------------- virtual pipeline placement
import torch

from megalite.parallel.pipeline import chunk_layers, interleaved_order, place_of, stage_of


def test_chunks_follow_megatrons_assignment():
    # 8 layers, pp=2, vpp=2: groups of 2; chunk j of rank r holds group j*pp + r
    assert chunk_layers(8, 2, 2) == [[range(0, 2), range(4, 6)], [range(2, 4), range(6, 8)]]
    assert chunk_layers(8, 4, 2)[1] == [range(1, 2), range(5, 6)]
    assert chunk_layers(4, 2, 1) == [[range(0, 2)], [range(2, 4)]]  # vpp 1: today's contiguous stages
    # uneven: 5 layers in 4 groups -> the first group gets the extra layer
    assert chunk_layers(5, 2, 2) == [[range(0, 2), range(3, 4)], [range(2, 3), range(4, 5)]]
    # too many chunks for the layers: Layout.validate's one-line error, naming both knobs
    with pytest.raises(ValueError, match=r"^parallel.vpp \* parallel.pp = 8 is larger than model.n_layer = 6 "):
        chunk_layers(6, 4, 2)


@pytest.mark.parametrize("n_layer,pp,vpp", [(8, 2, 2), (8, 4, 2), (4, 2, 2), (12, 3, 2), (7, 2, 3), (6, 3, 1)])
def test_place_of_is_the_inverse_of_chunk_layers(n_layer, pp, vpp):
    seen = []
    for r, chunks in enumerate(chunk_layers(n_layer, pp, vpp)):
        for j, layers in enumerate(chunks):
            for i in layers:
                assert place_of(f"layer.{i}", n_layer, pp, vpp) == (r, j)
                assert stage_of(f"layer.{i}", n_layer, pp, vpp) == r
                seen.append(i)
    assert sorted(seen) == list(range(n_layer))
    assert place_of("first", n_layer, pp, vpp) == (0, 0)
    assert place_of("last", n_layer, pp, vpp) == (pp - 1, vpp - 1)
    with pytest.raises(ValueError, match="layer.99"):
        place_of("layer.99", n_layer, pp, vpp)


# ---------------------------------------------------------------- the schedules, recorded and simulated
class _Mark(torch.autograd.Function):
    """Identity that records ("F" | "B", micro, chunk) when its forward and its backward run."""

    @staticmethod
    def forward(ctx, x, op, log):
        ctx.op, ctx.log = op, log
        log.append(("F", *op))
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(("B", *ctx.op))
        return grad, None, None


class _NoWire:
    """A P2P that moves nothing: receives return a tensor of the stage's shape, sends are dropped."""

    def __init__(self, shape):
        self.shape = shape

    def recv_from(self, src, tag=0):
        return torch.ones(self.shape)

    def recv_forward(self):
        return torch.ones(self.shape)

    recv_backward = recv_forward

    def send_to(self, t, dst, tag=0):
        pass

    def send_forward(self, t):
        pass

    send_backward = send_forward

    def wait(self):
        pass


def _recorded(pp: int, r: int, m: int, vpp: int) -> list:
    """The ("F" | "B", micro, chunk) operations rank r of the REAL schedule runs (pipeline.one_f_one_b, or
    pipeline.interleaved with vpp > 1), in order: the schedule drives a stage function that records them."""
    from types import SimpleNamespace
    from megalite.parallel import pipeline as P
    from megalite.parallel.grid import Coord, Layout
    layout, coord = Layout(1, pp, 1), Coord(0, r, 0)
    grid = SimpleNamespace(layout=layout, coord=coord, is_first_stage=r == 0, is_last_stage=r == pp - 1)
    w, log = torch.ones(2, requires_grad=True), []

    def stage_fn(x, micro, chunk=0):
        out = _Mark.apply(x * w, (micro, chunk), log)
        last = chunk * pp + r == pp * vpp - 1
        return out.sum() if last else out

    inputs = [torch.ones(2) for _ in range(m)]
    if vpp == 1:
        P.one_f_one_b(stage_fn, inputs, m, grid, _NoWire((2,)))
    else:
        P.interleaved(stage_fn, inputs, m, grid, _NoWire((2,)), vpp)
    return log


def _simulate(pp: int, m: int, vpp: int, t_f: float = 1.0, t_b: float = 2.0):
    """Run every rank's op list, recorded from the real schedule (`_recorded`), as a discrete-event
    simulation: an op starts when its rank is free and its input has arrived (blocking receives, buffered
    sends, zero latency); each chunk's forward takes t_f/vpp, backward t_b/vpp. Returns (idle share of the
    step, max activations in flight on each rank); raises on a deadlock (no rank can make progress)."""
    ops = [_recorded(pp, r, m, vpp) for r in range(pp)]
    for r in range(pp):
        assert sorted(ops[r]) == sorted((k, i, j) for k in "FB" for i in range(m) for j in range(vpp)), (pp, m, r)
    n_virtual = pp * vpp
    ready = {}  # (kind, micro, virtual stage) -> time its input is available
    pos, clock, busy, inflight, peak = [0] * pp, [0.0] * pp, [0.0] * pp, [0] * pp, [0] * pp
    while any(pos[r] < len(ops[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(ops[r]):
                kind, micro, chunk = ops[r][pos[r]]
                s = chunk * pp + r
                need = None if (kind == "F" and s == 0) or (kind == "B" and s == n_virtual - 1) else (kind, micro, s)
                if need is not None and need not in ready:
                    break
                start = max(clock[r], ready.get(need, 0.0))
                dur = (t_f if kind == "F" else t_b) / vpp
                clock[r], busy[r] = start + dur, busy[r] + dur
                if kind == "F":
                    ready[("F", micro, s + 1)] = clock[r]
                    inflight[r] += 1
                    peak[r] = max(peak[r], inflight[r])
                else:
                    ready[("B", micro, s - 1)] = clock[r]
                    inflight[r] -= 1
                pos[r] += 1
                progressed = True
        if not progressed:
            raise AssertionError(f"deadlock at pp={pp} m={m} vpp={vpp}: positions {pos}")
    total = max(clock)
    return sum(total - b for b in busy) / (pp * total), peak


@pytest.mark.parametrize("pp,m", [(2, 4), (2, 8), (4, 4), (4, 8), (4, 12)])
def test_interleaved_order_runs_without_deadlock_and_shrinks_the_bubble(pp, m):
    vpp = 2
    for r in range(pp):
        ops = interleaved_order(pp, r, m, vpp)
        assert sorted(ops) == sorted([(k, i, j) for k in "FB" for i in range(m) for j in range(vpp)])
        for i in range(m):
            for j in range(vpp):
                assert ops.index(("F", i, j)) < ops.index(("B", i, j))
        assert _recorded(pp, r, m, vpp) == ops  # pipeline.interleaved runs the order it is given
    idle, _ = _simulate(pp, m, vpp)
    plain, _ = _simulate(pp, m, 1)
    assert plain == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-9)  # the simulator reproduces the 1F1B formula
    assert idle == pytest.approx((pp - 1) / (vpp * m + pp - 1), abs=1e-9)  # Narayanan et al. (2021)
    assert idle < plain


@pytest.mark.parametrize("pp,m", [(2, 1), (2, 4), (3, 2), (4, 3), (4, 4), (4, 8), (5, 7)])
def test_the_real_1f1b_schedule_has_the_papers_bubble_and_memory_bound(pp, m):
    """pipeline.one_f_one_b itself, recorded on every rank (not an order rebuilt from its warm-up count): the
    idle share is the PipeDream-Flush / Megatron formula (pp - 1) / (m + pp - 1) (Narayanan et al. 2021), and
    stage r never holds more than min(pp - r, m) micro-batches' activations: one warm-up forward more or less on
    any rank breaks one of the two."""
    idle, peak = _simulate(pp, m, 1)
    assert idle == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-9), (pp, m, idle)
    assert peak == [min(pp - r, m) for r in range(pp)], (pp, m, peak)


def test_afab_order_and_forward_only_order():
    ops = interleaved_order(2, 0, 4, 2, all_warmup=True)
    assert [k for k, _, _ in ops] == ["F"] * 8 + ["B"] * 8
    assert _simulate(2, 4, 2)[0] < 1


def test_inspect_names_an_interleaved_stages_layer_runs():
    from megalite.checkpoint.verify import _span
    rank0 = [i for chunk in chunk_layers(8, 2, 2)[0] for i in chunk]
    assert _span(rank0) == "0-1,4-5" and _span([2, 3]) == "2-3" and _span([]) == "-"


def test_bubble_idle_counts_the_common_window_as_the_formula_does():
    """megalite.bench.bubble.idle_of by hand: rank 0 runs 0..10 s with 2 s in torch.distributed, rank 1 runs
    1..8 s with 3 s: the window is 10 s, busy 8 s and 4 s, idle (2 + 6) / 20 = 0.4; the older own-window measure
    (2/10 + 3/7) / 2 misses rank 1's idle head and tail. The shortest step counts; plain 1F1B's idle sits beside V = 2."""
    from megalite.bench.bubble import idle_of, summarise
    step = [[(0.0, 10.0, 2.0)], [(1.0, 8.0, 3.0)]]
    r = idle_of(step)
    assert r["idle"] == pytest.approx(0.4) and r["step_ms"] == pytest.approx(10_000)
    assert r["idle_own"] == pytest.approx((2 / 10 + 3 / 7) / 2)
    # three steps: the one with the shortest window (9 s) is the one counted: busy 9 - 1 and 7 - 3 -> idle 1/3
    three = idle_of([[(0.0, 10.0, 2.0), (0.0, 9.0, 1.0), (0.0, 12.0, 9.0)], [(1.0, 8.0, 3.0)] * 3])
    assert three["idle"] == pytest.approx((1 / 9 + 5 / 9) / 2) and three["step_ms"] == pytest.approx(9000)
    rows = [[{"kind": "wait", "pp": 2, "vpp": v, "m": 4, "t_f": 0.02, "steps": s[0]} for v, s in ((1, step), (2, step))],
            [{"kind": "wait", "pp": 2, "vpp": v, "m": 4, "t_f": 0.02, "steps": s[1]} for v, s in ((1, step), (2, step))]]
    out = summarise(rows)
    assert [x["theory"] for x in out] == pytest.approx([1 / 5, 1 / 9])
    assert out[1]["plain_idle"] == out[0]["idle"] and out[1]["t_f_ms"] == pytest.approx(20)
