"""Issue 22's proofs: context parallelism (cp), the fourth axis.

Pure maths first (rank order and groups against Megatron's, the load-balanced split, the counter-based dropout
mask, the config's one-line errors, the write plan), then ring attention alone against
torch.nn.functional.scaled_dot_product_attention on the whole sequence (cp = 2 and 4, forward and gradients,
with dropout against the same attention computed densely), then training: every cp layout equal to the single
process (losses 1e-5 relative per step over 4 steps, parameters 1e-4), a cp = 2 checkpoint resumed at cp = 1
and a cp = 1 checkpoint resumed at cp = 2 continuing the uninterrupted curve.

Two launches (8 and 4 ranks); the single-process references run in this process. Model: 4 layers, width 32,
4 heads, 32-token sequences (cp = 4: 8 chunks of 4 tokens).
"""
import json
import math

import pytest
import torch
import torch.nn.functional as F

import helpers as H
from megalite.config import ConfigError, resolve, validate
from megalite.parallel.context import dropout_keep, local_positions, ring_attention, split_sequence
from megalite.parallel.grid import Axis, Coord, Layout
from megalite.testing import gather_full_model, run_parallel
from megalite.run.train import train

# ---------------------------------------------------------------- rank order and groups
# megatron-core 0.16.1: RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=2, order="tp-cp-ep-dp-pp").get_ranks(axis),
# printed and pasted (the test below asks RankGenerator itself, for more shapes).
MEGATRON_2222 = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    "cp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    "dp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
    "dp-cp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
    "tp-pp": [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]],
}


def _groups(layout: Layout) -> dict:
    """Every group of each axis (sorted member lists), from megalite's rank maths."""
    of = {"tp": layout.tp_ranks, "cp": layout.cp_ranks, "dp": layout.dp_ranks, "pp": layout.pp_ranks,
          "dp-cp": layout.dp_cp_ranks, "tp-pp": layout.mp_ranks}
    return {axis: sorted({tuple(sorted(f(c))) for c in layout.coords()}) for axis, f in of.items()}


def test_rank_order_and_groups_are_megatrons():
    lay = Layout(2, 2, 2, cp=2)  # (tp, pp, dp, cp): cp is the trailing field
    assert _groups(lay) == {k: sorted(tuple(g) for g in v) for k, v in MEGATRON_2222.items()}
    for r in range(lay.world_size):  # tp fastest, then cp, then dp, then pp; coord_of and rank_of are inverse
        c = lay.coord_of(r)
        assert r == c.tp + 2 * (c.cp + 2 * (c.dp + 2 * c.pp)) == lay.rank_of(c)
        assert lay.dp_cp_ranks(c).index(r) == lay.replica(c) == c.cp + 2 * c.dp  # the ZeRO-1 / write-plan cut
    # cp = 1 is the layout megalite had before cp: the same ranks, names and strings
    old = Layout(2, 2, 2)
    assert old.cp == 1 and old == Layout(2, 2, 2, 1) and str(old) == "tp=2 pp=2 dp=2"
    assert [old.rank_of(Coord(t, p, d)) for p in range(2) for d in range(2) for t in range(2)] == list(range(8))
    assert old.rank_of((1, 1, 1)) == 7 and old.dp_cp_ranks(Coord(0, 0, 0)) == old.dp_ranks(Coord(0, 0, 0))
    assert str(lay) == "tp=2 cp=2 pp=2 dp=2"


def test_the_documented_grid_is_layouts():
    """docs/parallelism.md's picture of (tp, cp, pp, dp) = (2, 2, 2, 1): each rank where its coordinate puts it,
    and each group line megalite's groups."""
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "docs/parallelism.md").read_text()
    pic = text[text.index("The grid of 8 processes at (tp, cp, pp, dp) = (2, 2, 2, 1)"):].split("```text\n")[1]
    pic = pic.split("```")[0]
    lay, groups = Layout(2, 2, 1, cp=2), _groups(Layout(2, 2, 1, cp=2))
    for t in range(2):  # row t: stage 0 cp 0, cp 1, stage 1 cp 0, cp 1
        row = re.search(rf"^  tensor-parallel {t} +(.*)$", pic, re.M)[1]
        assert [int(r) for r in re.findall(r"rank (\d+)", row)] == [
            lay.rank_of(Coord(t, p, 0, k)) for p in range(2) for k in range(2)], row
    shown = {m[1]: sorted(tuple(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", m[2]))
             for m in re.finditer(r"^  (tp|cp|dp x cp|pp) groups ((?:\{[\d,]+\} ?)+)", pic, re.M)}
    assert shown == {"tp": groups["tp"], "cp": groups["cp"], "dp x cp": groups["dp-cp"], "pp": groups["pp"]}


def test_groups_match_megatron_rank_generator():
    """megatron-core's own rank generator (its import is shared with test_docs and test_foreign_megatron in a
    suite run: ~0.5 s here then)."""
    RankGenerator = pytest.importorskip("megatron.core.parallel_state").RankGenerator
    for tp, cp, dp, pp in [(1, 2, 1, 1), (2, 2, 1, 2), (1, 4, 2, 1), (2, 2, 2, 2), (4, 2, 3, 2), (1, 8, 1, 2)]:
        gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
        assert _groups(Layout(tp, pp, dp, cp)) == {a: sorted(tuple(sorted(g)) for g in gen.get_ranks(a))
                                                   for a in MEGATRON_2222}, (tp, cp, dp, pp)


# ---------------------------------------------------------------- the load-balanced split
def test_load_balanced_split_by_hand():
    # T = 8, cp = 2: chunks [0 1] [2 3] [4 5] [6 7]; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert local_positions(8, Axis(2, 0)).tolist() == [0, 1, 6, 7]
    assert local_positions(8, Axis(2, 1)).tolist() == [2, 3, 4, 5]
    # cp = 4, T = 16: rank r holds chunks r and 7 - r; with sp over tp = 2, tp rank 1 keeps the second half
    assert local_positions(16, Axis(4, 1)).tolist() == [2, 3, 12, 13]
    assert local_positions(16, Axis(4, 1), Axis(2, 1), sp=True).tolist() == [12, 13]
    for cp in (2, 4):
        held = [local_positions(32, Axis(cp, r)) for r in range(cp)]
        assert sorted(torch.cat(held).tolist()) == list(range(32))  # a partition of the sequence
        # equal causal work: query at position i attends to i + 1 keys; every rank sums to the same
        assert len({int((h + 1).sum()) for h in held}) == 1
    x = torch.arange(2 * 16).view(2, 16)
    assert split_sequence(x, Axis(4, 3)).tolist() == [[6, 7, 8, 9], [22, 23, 24, 25]]
    assert split_sequence(x, Axis(1, 0)) is x


def test_split_matches_megatron_get_batch_on_this_cp_rank(monkeypatch):
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    utils = pytest.importorskip("megatron.core.utils")
    x = torch.arange(3 * 48).view(3, 48)
    for cp in (2, 3, 4):
        for r in range(cp):
            monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda cp=cp: cp)
            monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda r=r: r)
            want = utils.get_batch_on_this_cp_rank({"tokens": x.clone()})["tokens"]
            assert torch.equal(split_sequence(x, Axis(cp, r)), want), (cp, r)


# ---------------------------------------------------------------- attention dropout and ring attention
def _dense_attention(q, k, v, p=0.0, seed=0, head0=0):
    """Causal attention written out: softmax(q k^T / sqrt(d)) with the counter-based dropout mask, @ v."""
    T = q.shape[2]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    w = s.softmax(-1)
    if p:
        heads = torch.arange(head0, head0 + q.shape[1])
        w = w * dropout_keep(seed, p, q.shape[0], heads, torch.arange(T), torch.arange(T), q.device) / (1 - p)
    return w @ v


def test_dropout_mask_is_a_function_of_position():
    heads, pos = torch.arange(4), torch.arange(64)
    keep = dropout_keep(7, 0.25, 3, heads, pos, pos, "cpu")
    assert keep.shape == (3, 4, 64, 64) and keep.dtype == torch.bool
    n = keep.numel()
    assert abs(keep.float().mean().item() - 0.75) < 4 * math.sqrt(0.75 * 0.25 / n)  # 4 sigma
    # any block of it, computed alone (a cp rank's, a tp rank's heads), is the same block of the whole mask
    block = dropout_keep(7, 0.25, 3, heads[2:], pos[40:48], pos[8:16], "cpu")
    assert torch.equal(block, keep[:, 2:, 40:48, 8:16])
    assert not torch.equal(dropout_keep(8, 0.25, 3, heads, pos, pos, "cpu"), keep)  # another seed, another mask
    assert dropout_keep(2**62 - 1, 0.0, 1, heads, pos, pos, "cpu").all()
    # neighbours are independent: P(both kept) = 0.75^2 along every axis
    for a, b in ((keep[..., 1:], keep[..., :-1]), (keep[..., 1:, :], keep[..., :-1, :]),
                 (keep[:, 1:], keep[:, :-1]), (keep[1:], keep[:-1])):
        assert abs((a & b).float().mean().item() - 0.5625) < 0.01


def test_ring_attention_at_cp1_is_causal_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 24, 8, generator=g, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 3, 24, 8, generator=g)
    for p, ref in ((0.0, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
                   (0.2, lambda: _dense_attention(q, k, v, 0.2, seed=99, head0=5))):
        y = ring_attention(q, k, v, Axis(1, 0), dropout_p=p, seed=99, head0=5)
        want = ref()
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
        for a, b in zip(torch.autograd.grad(y, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _ring_check(rank, world_size, out):
    """On 4 ranks: cp = 4 (one ring) and cp = 2 (two rings): each rank's ring attention of its chunks equals the
    whole sequence's attention (SDPA; with dropout, the dense formula with the same mask) at its positions,
    forward and the gradients of its q, k, v."""
    from megalite.parallel.grid import ParallelGrid
    g = torch.Generator().manual_seed(3)
    B, H, T, D = 2, 4, 32, 8
    q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
    grad = torch.randn(B, H, T, D, generator=g)
    for lay in (Layout(1, 1, 1, 4), Layout(1, 1, 2, 2)):
        grid = ParallelGrid.create(lay)
        pos = local_positions(T, grid.cp)
        for p in (0.0, 0.1):
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = F.scaled_dot_product_attention(*full, is_causal=True) if not p else _dense_attention(
                *full, p, seed=1234, head0=4)
            ref_grads = torch.autograd.grad(ref, full, grad)
            mine = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
            y = ring_attention(*mine, grid.cp, dropout_p=p, seed=1234, head0=4)
            torch.testing.assert_close(y, ref[:, :, pos], rtol=1e-5, atol=1e-6, msg=lambda m: f"{lay} p={p}: {m}")
            for name, a, b in zip("qkv", torch.autograd.grad(y, mine, grad[:, :, pos]), ref_grads):
                torch.testing.assert_close(a, b[:, :, pos], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{lay} p={p} d{name}: {m}")


# ---------------------------------------------------------------- the config's one-line errors
def test_cp_layout_errors_are_one_line(tiny_config):
    def err(world=None, **kv):
        cfg = tiny_config(**kv)
        with pytest.raises(ConfigError) as e:
            validate(resolve(cfg, world), world)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert err(**{"parallel.cp": 3}) == ("parallel.cp = 3: the sequence length (train.seq_len, 0: model.block_size) "
                                          "= 16 is not divisible by 2 * parallel.cp = 6 (each sequence is cut into "
                                          "2*cp equal chunks, two per cp rank)")
    assert err(**{"parallel.cp": 2, "train.seq_len": 10}).startswith("parallel.cp = 2: the sequence length")
    assert err(**{"parallel.cp": 4, "parallel.tp": 4, "parallel.sp": True, "train.seq_len": 8}) == (
        "parallel.sp with parallel.cp = 4: a cp rank's 2 tokens (train.seq_len, 0: model.block_size, / cp) are not "
        "divisible by parallel.tp = 4")
    assert err(**{"parallel.cp": 0}) == "parallel.cp = 0: must be a positive integer"
    assert err(4, **{"parallel.cp": 2, "parallel.tp": 2, "parallel.dp": 2}) == \
        "world size 4 != parallel.tp*cp*pp*dp = 2*2*1*2 = 8; launch 8 processes with `torchrun --nproc-per-node 8 -m " \
        "megalite train ...` (the same arguments after `train`)"
    assert err(6, **{"parallel.cp": 4, "parallel.dp": 0}) == (
        "parallel.dp is not set and world size 6 is not divisible by parallel.tp*cp*pp = 1*4*1; set tp, cp, pp "
        "(and dp) so that tp*cp*pp*dp = 6")
    cfg = resolve(tiny_config(**{"parallel.cp": 2, "parallel.dp": 0}), 8)
    assert cfg.parallel.dp == 4 and validate(cfg, 8) is cfg  # dp inferred as world / (tp * cp * pp)


# ---------------------------------------------------------------- checkpoints: written once, named with cp
def test_write_plan_writes_each_element_once_and_names_cp_folders():
    from megalite.checkpoint.plan import plan_writes
    from megalite.checkpoint.tree import coord_dir, parse_coord_dir
    from megalite.bench.plan import stage_tensors
    model = dict(n_layer=4, n_head=4, n_embd=32, block_size=32, vocab_size=256, dropout=0.0)
    lay = Layout(2, 2, 2, cp=2)
    stages = stage_tensors(model, lay.tp, lay.pp)
    written, per_rank = {}, []  # name -> [(box, flat)] over every rank; elements written per rank
    for c in lay.coords():
        items = plan_writes(stages[c.pp], c, lay, optimizer=False)
        per_rank.append(sum((it.flat[1] - it.flat[0]) if it.flat else it.box.numel for it in items))
        for it in items:
            written.setdefault(it.name, []).append((it.box, it.flat))
    for name, part in (np for s in stages for np in s if not np[1].tied_to):
        count = torch.zeros(part.global_shape, dtype=torch.int32)
        for box, flat in written[name]:
            region = torch.zeros(box.shape, dtype=torch.int32).view(-1)
            region[slice(*(flat or (0, box.numel)))] = 1
            count[box.index] += region.view(box.shape)
        assert count.eq(1).all(), f"{name}: written {count.min().item()}..{count.max().item()} times"
    # each stage's tp slice is cut over dp x cp = 4 ranks: every rank writes about a quarter of it (the cut is of
    # the stage's flat space, in which a tp-replicated tensor is written by one tp rank only: +-13% here)
    for t, p in {(c.tp, c.pp) for c in lay.coords()}:
        shares = [per_rank[lay.rank_of(Coord(t, p, d, k))] for d in range(2) for k in range(2)]
        assert min(shares) > 0 and max(shares) / min(shares) < 1.2, shares
    assert coord_dir(Coord(1, 0, 1, 1), 2) == "tp01-cp01-pp00-dp01"
    assert coord_dir(Coord(1, 0, 1), 1) == "tp01-pp00-dp01"  # cp = 1: the name older checkpoints have
    assert parse_coord_dir("tp01-cp01-pp00-dp01") == Coord(1, 0, 1, 1)
    assert parse_coord_dir("tp01-pp00-dp01") == Coord(1, 0, 1, 0)


# ---------------------------------------------------------------- training: cp layouts vs the single process
MODEL = {"model.block_size": 32}
STEPS = {"train.steps": 4}
MICRO4 = {"train.micro_batch_size": 4}
A = {"parallel.tp": 2, "parallel.cp": 2, "parallel.dp": 2, "parallel.sp": True, "parallel.zero1": True,
     "parallel.overlap_grad_reduce": True, "parallel.bucket_mb": 0.02, "train.recompute": "selective", **MICRO4}
B = {"parallel.cp": 2, "parallel.pp": 2, "parallel.dp": 2, "parallel.vpp": 2, "train.recompute": "full"}  # m = 4
C = {"parallel.cp": 4, "parallel.dp": 2, "parallel.zero1": True, **MICRO4}
R = {"parallel.cp": 2, "parallel.pp": 2, "parallel.dp": 2}  # plain 1F1B; resumes the single process's step 2
DROP = {"model.dropout": 0.1}
# dropout: pp = dp = 1, because pipeline stages and dp replicas draw from RNG streams of their own (tp and cp
# ranks share one, the single process's), and the reference runs the same micro-batch size (masks are drawn per
# micro-batch)
D = {"parallel.tp": 2, "parallel.cp": 2, "parallel.sp": True, "train.recompute": "selective", **DROP, **MICRO4}
E = {"parallel.cp": 4, "train.recompute": "full", "train.precision": "bf16", **MICRO4}
BF16_LOSS_RTOL = 2.0 ** -8 / 4  # as test_features_parallel.py (its derivation there)


def _worker(rank, world_size, rdzv, tokens, out, runs, then=None):
    if then is not None:  # a check that needs the same processes (one launch fewer)
        then(rank, world_size, out)
    for name, overrides in runs:
        tr = train(H.TINY.config(tokens, f"{out}/run-{name}", **{**MODEL, **STEPS, **overrides}), log=lambda *a: None)
        params = gather_full_model(tr.params, tr.grid)
        if rank == 0:
            torch.save({"history": tr.history, "params": params}, f"{out}/{name}.pt")


def _single(tokens, tmp, name, **overrides):
    tr = H.train_in_process(H.TINY.config(tokens, tmp / f"run-{name}", **{**MODEL, **STEPS, **overrides}))
    return {"history": tr.history, "params": gather_full_model(tr.params, tr.grid)}


def _compare(tag, run, ref, failures, loss_rtol=1e-5, param_rtol=1e-4, first_step=1, norm_rtol=1e-4):
    rec = {r["step"]: r for r in run["history"]}
    ref_rec = {r["step"]: r for r in ref["history"] if r["step"] >= first_step}
    got = {k: r["loss"] for k, r in rec.items()}
    want = {k: r["loss"] for k, r in ref_rec.items()}
    assert got.keys() == want.keys(), (tag, got.keys(), want.keys())
    # the same tokens at every step, whatever the layout (and across a resume at another one): batch_hash
    failures += [f"{tag} step {k}: batch_hash {rec[k]['batch_hash']} != the single process's {r['batch_hash']}"
                 for k, r in ref_rec.items() if rec[k]["batch_hash"] != r["batch_hash"]]
    # the gradient's scale too: clipping and Adam hide a gradient off by a constant factor from the losses
    # (a cp run whose gradients were multiplied by cp trains to the same losses within 1e-6), not its norm
    if norm_rtol is not None:
        failures += [f"{tag} step {k}: grad_norm {rec[k]['grad_norm']} != the single process's {r['grad_norm']}"
                     for k, r in ref_rec.items() if abs(rec[k]["grad_norm"] - r["grad_norm"]) > norm_rtol * r["grad_norm"]]
    worst = max(abs(got[k] - w) / abs(w) for k, w in want.items())
    print(f"{tag}: worst loss relative error {worst:.2e}")
    failures += [f"{tag} step {k}: loss {got[k]} != {w}" for k, w in want.items() if abs(got[k] - w) > loss_rtol * w]
    if param_rtol is not None:
        v_got, v_want = run["history"][-1]["val_loss"], ref["history"][-1]["val_loss"]  # evaluation too
        if abs(v_got - v_want) > loss_rtol * v_want:
            failures.append(f"{tag}: final val_loss {v_got} != {v_want}")
        err, name = max((H.rel_err(run["params"][k], ref["params"][k]), k) for k in ref["params"])
        print(f"{tag}: worst parameter relative error {err:.2e} ({name})")
        if err >= param_rtol:
            failures.append(f"{tag} {name}: parameter relative error {err:.2e}")


def test_cp_layouts_match_single_process_and_resume_across_cp(tmp_path, token_file):
    tmp = tmp_path
    ckpt_ref, ckpt_a = tmp / "ckpt-ref", tmp / "ckpt-A"
    ref = _single(token_file, tmp, "ref", **{"checkpoint.dir": str(ckpt_ref), "checkpoint.interval": 2})
    assert ref["history"][-1]["loss"] < ref["history"][0]["loss"]  # it does train
    eight = [("A", {**A, "checkpoint.dir": str(ckpt_a), "checkpoint.interval": 2, "checkpoint.async": True}),
             ("B", B),  # (1,2,2,2) interleaved, full recompute
             ("C", C),  # (1,4,1,2) zero1 over dp x cp = 8
             ("R", {**R, "checkpoint.resume": str(ckpt_ref / "step_00000002")})]  # (1,1,1,1) -> (1,2,2,2)
    run_parallel(_worker, 8, tmp / "rdzv8", args=(token_file, tmp, eight))
    four = [("D", D), ("E", E)]  # dropout at (2,2,1,1) + sp; bf16 at (1,4,1,1)
    run_parallel(_worker, 4, tmp / "rdzv4", args=(token_file, tmp, four, _ring_check))
    # cp = 2 -> cp = 1: the single process resumes A's step-2 checkpoint ((2,2,1,2), sp, ZeRO-1 over dp x cp)
    one = _single(token_file, tmp, "one", **{"checkpoint.resume": str(ckpt_a / "step_00000002")})
    drop = _single(token_file, tmp, "drop", **DROP, **MICRO4)  # masks are drawn per micro-batch: the same size
    bf16 = _single(token_file, tmp, "bf16", **{"train.precision": "bf16"})

    failures = []
    for name in "ABC":
        _compare(name, torch.load(tmp / f"{name}.pt"), ref, failures)
    _compare("R (cp=1 checkpoint resumed at (1,2,2,2), 1F1B)", torch.load(tmp / "R.pt"), ref, failures, first_step=3)
    _compare("cp=2 checkpoint resumed at cp=1", one, ref, failures, first_step=3)
    _compare("D (dropout 0.1)", torch.load(tmp / "D.pt"), drop, failures)
    _compare("E (bf16)", torch.load(tmp / "E.pt"), bf16, failures, loss_rtol=BF16_LOSS_RTOL, param_rtol=None,
             norm_rtol=None)
    assert drop["history"][0]["loss"] != pytest.approx(ref["history"][0]["loss"], rel=1e-4)  # dropout acted
    assert not failures, "\n".join(failures)
    # what each step trained on, written out from the token file by hand, and what the resumed launch recorded
    want = H.batch_hashes_by_hand(token_file, H.TINY.config(token_file, tmp).train.seed, 4, 16, 32)
    assert {r["step"]: r["batch_hash"] for r in ref["history"]} == want
    assert {r["step"]: r["batch_hash"] for r in H.metrics(tmp / "run-R")} == {k: want[k] for k in (3, 4)}

    # A's checkpoint: every rank of the (2,2,1,2) layout has its folder; the cp ranks wrote disjoint shares
    # (the manifest's exact-tiling check refuses a tensor stored twice), in the same format as any other
    from megalite.checkpoint.verify import tree, verify
    from megalite.convert import convert, reshard
    step2 = ckpt_a / "step_00000002"
    man = json.loads((step2 / "manifest.json").read_text())
    assert man["layout"] == {"tp": 2, "pp": 1, "dp": 2, "zero1": True, "cp": 2}
    assert sorted(p.name for p in step2.iterdir() if p.is_dir()) == [
        f"tp{t:02d}-cp{k:02d}-pp00-dp{d:02d}" for t in range(2) for k in range(2) for d in range(2)]
    assert verify(step2)[1] == []
    picture = tree(step2)
    assert "rank = tp + 2*(cp + 2*(dp + 2*pp))" in picture and "tp01-cp01-pp00-dp01  r7" in picture
    # a crafted manifest: a cp of the wrong type, or a cp folder listed under a cp = 1 layout, is one line
    from megalite.checkpoint.manifest import Manifest, sign
    from megalite.base.errors import CheckpointError
    for cp, want in (("2", r"layout\.cp = '2': must be a positive integer"),
                     (0, r"layout\.cp = 0: must be a positive integer"),
                     (1, r"file tp00-cp00-pp00-dp00/\S+ in 'files' belongs to no coordinate of layout tp=2 pp=1"),
                     (10**9, r"field 'layout' \(tp=2 cp=1000000000 pp=1 dp=2\) has 4000000000 coordinates but "
                             r"'files' lists 8 state\.json")):
        bad = json.loads(json.dumps(man))
        bad["layout"]["cp"] = cp
        with pytest.raises(CheckpointError, match=want) as e:
            Manifest.from_json(sign(bad))
        assert "\n" not in str(e.value)
    # offline: resharded to (1,1,1) and on to cp = 4 (ZeRO-1 kept), the same weights and moments, to the bit
    flat = reshard(step2, tmp / "re-111", 1, 1, 1, quiet=True)
    again = reshard(flat, tmp / "re-cp4", 1, 1, 2, cp=4, quiet=True)
    assert verify(again)[1] == [] and json.loads((again / "manifest.json").read_text())["layout"]["cp"] == 4
    from megalite.testing import full_state
    want = full_state(step2)
    for other in (flat, again):
        got = full_state(other)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    one_file = convert(step2, tmp / "a.safetensors", quiet=True)
    assert one_file.read_bytes() == convert(again, tmp / "b.safetensors", quiet=True).read_bytes()
    # and one file split at cp = 2 (weights only): every weight once, bitwise
    from megalite.convert import split
    cut = split(one_file, tmp / "split-cp2", 2, 1, 1, cp=2, quiet=True)
    assert verify(cut)[1] == [] and json.loads((cut / "manifest.json").read_text())["layout"]["cp"] == 2
    assert all(torch.equal(v, want[k]) for k, v in full_state(cut).items())


def test_bench_plan_plans_cp_layouts(capsys):
    """`megalite bench plan --cp`: the real write plan and manifest of a cp layout validate (every tensor tiled
    once over its tp x cp x pp x dp ranks), and a resume of it at cp = 1 reads what each rank needs."""
    from megalite.cli import build_parser
    from megalite.bench.plan import bench_plan_cli, plan_layout, plan_reshard
    flags = ["--n-layer", "4", "--n-embd", "32", "--n-head", "4", "--vocab-size", "256", "--block-size", "32"]
    bench_plan_cli(build_parser().parse_args(["bench", "plan", *flags, "--tp", "2", "--pp", "2", "--dp", "1,2",
                                              "--cp", "2", "--reshard-to", "1,1,2,4"]))
    out = capsys.readouterr().out
    assert "cp 2 (ranks = tp x cp x pp x dp)" in out and "\n2,2,2 cp2 " in out and "at 1,1,2 cp4:" in out
    with pytest.raises(ConfigError, match=r"^--cp 3: --block-size 32 is not divisible by 2 x cp = 6"):
        bench_plan_cli(build_parser().parse_args(["bench", "plan", *flags, "--cp", "3"]))
    model = dict(n_layer=4, n_head=4, n_embd=32, block_size=32, vocab_size=256, dropout=0.0)
    row, man = plan_layout(model, 2, 2, 2, zero1=True, cp=2)
    assert (row.layout, row.ranks, row.files, row.problems) == ("2,2,2 cp2", 16, 48, 0)
    assert man.layout == Layout(2, 2, 2, 2) and man.zero1
    back = plan_reshard(man, model, 1, 1, 2, zero1=True)
    assert back["ranks"] == 2 and back["read_over_needed_max"] < 1.5


# ---------------------------------------------------------------- the documented long-context example
def test_the_long_context_example_is_what_train_prints():
    """docs/parallelism.md's 2,048-token cp = 4 run (a real run's output, ~3 minutes on 2 cores; not rerun here):
    its command line is a valid layout of its 4 processes, and its start line is the one train prints for it."""
    import re
    import shlex
    from pathlib import Path
    from megalite.config import load_config
    from megalite.run.runlog import start_line
    root = Path(__file__).resolve().parents[1]
    text = (root / "docs/parallelism.md").read_text()
    marker = "tested-by: tests/test_context_parallel.py::test_the_long_context_example_is_what_train_prints"
    block = text[text.index(marker):].split("```console\n", 1)[1].split("```", 1)[0]
    command, *printed = block.split("\n")
    args = shlex.split(command.removeprefix("$ "))
    nproc = int(args[args.index("--nproc-per-node") + 1])
    rest = args[args.index("train") + 1:]
    config = rest[rest.index("--config") + 1]
    cfg = load_config(root / config, [a for a in rest if a.startswith("--") and "." in a.split("=")[0]])
    validate(resolve(cfg, nproc), nproc)
    assert (nproc, cfg.parallel.cp, cfg.model.block_size) == (4, 4, 2048)
    want = start_line(cfg, Layout(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.cp), "cpu", "fp32")
    assert want in printed, want
    assert any(re.match(r"runs/long/ckpt/step_\d+  \(tp=1 cp=4 pp=1 dp=1; rank = tp \+ 1\*\(cp \+ 4\*", ln)
               for ln in printed)


def test_round_trip_helper_takes_cp_layouts(tmp_path):
    """testing.assert_round_trip with a (tp, pp, dp, cp) layout: megalite's GPT trained at cp = 2 with ZeRO-1
    over dp x cp, loaded at (1, 1, 2) without it and saved again, every tensor and scalar bitwise."""
    from megalite.testing import assert_round_trip
    assert_round_trip(tmp_path, save_layout=(1, 1, 1, 2), load_layout=(1, 1, 2), zero1=(True, False))
