"""Issue 41: ZeRO-2 (gradients cut over dp x cp) and ZeRO-3 (weights too, gathered per block) against the single
process, GPT-2 and Llama, at dp 2 and 4 and at (tp, pp, dp) = (2, 2, 2) with sp and vpp 2; their checkpoints
resume at another zero level and dp. Tolerances as test_features_parallel.py (whose helpers these are): losses
1e-5 relative per step, parameters 1e-4 relative (1e-3 after 30 steps). Rows run 4 steps, three of them (ZeRO-2
and 3, Llama and GPT-2, dp 2 and 4, (2,2,2)+sp+vpp, cp 2) the issue's 30; `-m slow` runs every row over 30.

One 8-process launch runs every layout in sequence; the single-process references run in this process.
"""
import json

import pytest
import torch

import helpers as H
from safetensors.torch import load_file
from megalite.config import Config, resolve, validate
from megalite.base.errors import ConfigError
from megalite.parallel.data import dp_pieces
from megalite.run.train import train
from megalite.testing import gather_full_model, run_parallel
from test_features_parallel import BF16_LOSS_RTOL, _compare

STEPS = {"train.steps": 4}  # a checkpoint at step 2; resumed runs train steps 3 and 4
LONG = {"train.steps": 30}  # the 30 steps: a subset in the default run, every row in `-m slow`
LLAMA = {"model.arch": "llama", "model.n_kv_head": 2, "model.rope_theta": 500000.0}  # 4 heads, 2 kv heads
LLAMA_KV1 = {**LLAMA, "model.n_kv_head": 1}  # tp 2 > one kv head: both tp ranks hold the k/v rows alike
QWEN2_KV1 = {"model.arch": "qwen2", "model.n_kv_head": 1, "model.tie_embeddings": True}  # k/v biases shared too
QWEN3 = {"model.arch": "qwen3", "model.n_kv_head": 2, "model.head_size": 16, "model.rope_theta": 1e6}
M4 = {"train.micro_batch_size": 4}  # m = 2 micro-batches per dp rank at dp 2, 1 at dp 4
# (2,2,2) + sp + vpp 2: two chunks per stage, interleaved 1F1B over m = 2 micro-batches
A = {"parallel.tp": 2, "parallel.pp": 2, "parallel.dp": 2, "parallel.sp": True, "parallel.vpp": 2, **M4}
RUNS = [
    ("z1-A", {**A, "parallel.zero": 1, "checkpoint.dir": "{tmp}/ckpt-z1", "checkpoint.interval": 2}),
    ("z2-A", {**A, "parallel.zero": 2, "checkpoint.dir": "{tmp}/ckpt-z2", "checkpoint.interval": 2}),
    ("z3-A", {**A, "parallel.zero": 3, "train.recompute": "selective", "parallel.overlap_grad_reduce": True,
              "checkpoint.dir": "{tmp}/ckpt-z3", "checkpoint.interval": 2}),
    ("z3-A-llama", {**A, **LLAMA, **LONG, "parallel.zero": 3}),
    # Qwen3: per-head q/k norms (their gradients summed over tp, as chunks) and a decoupled head size
    ("z3-A-qwen3", {**A, **QWEN3, "parallel.zero": 3}),
    # tp 2 > n_kv_head 1: the k/v chunks (weights and Qwen2's biases) summed over the tp ranks sharing the head
    ("z2-kv1-llama", {"parallel.tp": 2, "parallel.dp": 4, "train.micro_batch_size": 2, **LLAMA_KV1,
                      "parallel.zero": 2}),
    ("z3-kv1-llama", {**A, **LLAMA_KV1, "parallel.zero": 3}),
    ("z3-kv1-qwen2", {"parallel.tp": 2, "parallel.dp": 4, "train.micro_batch_size": 2, **QWEN2_KV1,
                      "parallel.zero": 3, "parallel.overlap_grad_reduce": True}),
    ("z2-dp4-llama", {**LONG, "parallel.pp": 2, "parallel.dp": 4, "train.micro_batch_size": 2, **LLAMA,
                      "parallel.zero": 2}),
    # dp 4, full recomputation (a recomputed block is gathered before its recomputation), one all-gather per
    # step (the blocks stay whole from the first forward to the last backward), prefetch
    ("z3-dp4-keep", {"parallel.tp": 2, "parallel.dp": 4, "train.micro_batch_size": 1, "parallel.zero": 3,
                     "train.recompute": "full", "parallel.reshard_after_forward": False,
                     "parallel.overlap_grad_reduce": True}),
    # dp 8 with full recomputation and resharding on: a block freed after its forward is gathered again for its
    # backward, and the recomputed forward inside that backward must not free it (audit plant z5)
    ("z3-dp8", {"parallel.dp": 8, "train.micro_batch_size": 1, "parallel.zero": 3, "train.recompute": "full"}),
    # cp 2: the chunks cut over dp x cp = 4 (the ranks holding a stage's weights); bf16 autocast (fp32 chunks)
    ("z3-cp2", {**LONG, "parallel.cp": 2, "parallel.tp": 2, "parallel.dp": 2, "parallel.zero": 3, **M4}),
    ("z2-bf16", {**A, "parallel.zero": 2, "train.precision": "bf16"}),
    # resumed at another zero level and dp: ZeRO-3 (2,2,2) -> ZeRO-1 (1,2,4); ZeRO-2 (2,2,2) -> ZeRO-3 (2,1,4)
    ("z3-to-z1", {"parallel.pp": 2, "parallel.dp": 4, "train.micro_batch_size": 2, "parallel.zero1": True,
                  "checkpoint.resume": "{tmp}/ckpt-z3/step_00000002"}),
    ("z2-to-z3", {"parallel.tp": 2, "parallel.dp": 4, "train.micro_batch_size": 2, "parallel.zero": 3,
                  "checkpoint.resume": "{tmp}/ckpt-z2/step_00000002"}),
    # hybrid sharding, dp 4 = 2 groups x 2: cut within a group, all-reduced across; and its checkpoint resumed
    # at ZeRO-1 (2,2,2); the ZeRO-3 (2,2,2) checkpoint resumed at hybrid (1,2,4) ZeRO-2
    ("hsdp-z3", {"parallel.tp": 2, "parallel.dp": 4, "train.micro_batch_size": 2, "parallel.zero": 3,
                 "parallel.dp_shard": 2, "checkpoint.dir": "{tmp}/ckpt-h", "checkpoint.interval": 2}),
    ("hsdp-to-z1", {**A, "parallel.zero": 1, "checkpoint.resume": "{tmp}/ckpt-h/step_00000002"}),
    ("z3-to-hsdp", {"parallel.pp": 2, "parallel.dp": 4, "train.micro_batch_size": 2, "parallel.zero": 2,
                    "parallel.dp_shard": 2, "checkpoint.resume": "{tmp}/ckpt-z3/step_00000002"}),
]


def _worker(rank, world_size, rdzv, tokens, out, runs):
    for name, overrides in runs:
        overrides = {k: v.format(tmp=out) if isinstance(v, str) else v for k, v in overrides.items()}
        tr = train(H.TINY.config(tokens, f"{out}/run-{name}", **{**STEPS, **overrides}), log=lambda *a: None)
        held = sum(p.untyped_storage().nbytes() for _, p in tr.params)  # zero 3: nothing gathered between steps
        with tr.grads.whole():
            params = gather_full_model(tr.params, tr.grid)
        units = [u for u in getattr(tr.grads, "units", []) if u.named]
        if rank == 0:
            torch.save({"history": tr.history, "params": params, "held": held, "units": len(units),
                        "reduced": getattr(tr.grads, "reduced", None)}, f"{out}/{name}.pt")


def _single(tokens, tmp, name, **overrides):
    tr = H.train_in_process(H.TINY.config(tokens, tmp / f"run-{name}", **{**STEPS, **overrides}))
    return {"history": tr.history, "params": gather_full_model(tr.params, tr.grid)}


FAMILIES = {"kv1-llama": LLAMA_KV1, "kv1-qwen2": QWEN2_KV1, "llama": LLAMA, "qwen3": QWEN3, "bf16": {
    "train.precision": "bf16"}}  # a run named ...-<key> is compared with one process of those settings


def _check_runs(tmp_path, token_file, runs):
    """Launch `runs` on 8 ranks, then compare each with one process of its family and step count."""
    run_parallel(_worker, 8, tmp_path / "rdzv8", args=(token_file, tmp_path, runs))
    refs, failures = {}, []
    for name, overrides in runs:
        run = torch.load(tmp_path / f"{name}.pt")
        resumed = "checkpoint.resume" in overrides
        family = next((k for k in FAMILIES if name.endswith(k)), "")
        steps = overrides.get("train.steps", STEPS["train.steps"])
        if (family, steps) not in refs:
            refs[family, steps] = _single(token_file, tmp_path, f"ref-{family}-{steps}", **FAMILIES.get(family, {}),
                                          **{"train.steps": steps})
        bf16 = family == "bf16"  # test_features_parallel's bf16 tolerance (2^-8 / 4), against bf16 at (1,1,1)
        # parameters: 3e-4 after 4 steps; after 30 AdamW steps 1e-3 (the rounding of the reductions grows in the
        # zero-initialised biases, whose norms stay small: measured 1.6e-4 on a qkv bias at dp 4 after 30 steps;
        # after 4, z3-kv1-qwen2's k bias (norm 0.015) 2.6e-5 to 1.9e-4 over train seeds 1-3 with the elementwise
        # AdamW, 2.6e-5 to 1.2e-4 with the fused kernel: last-bit noise that Adam's 1/sqrt(v) enlarges where
        # gradients are small. A real fault moves them by ~lr: a decayed bias is off by 1e-2 relative)
        _compare(name, run, refs[family, steps], BF16_LOSS_RTOL if bf16 else 1e-5,
                 None if bf16 else 3e-4 if steps <= 4 else 1e-3, failures, first_step=3 if resumed else 1)
        level = overrides.get("parallel.zero", 0)
        if level >= 2:
            # each unit (a block, the rest of the stage) reduce-scatters once per micro-batch and step
            m = 16 // (overrides["train.micro_batch_size"] * overrides["parallel.dp"])  # cp: the same rows
            assert run["reduced"] == (steps - 2 if resumed else steps) * m * run["units"], (name, run["reduced"])
        if level == 3:
            assert run["held"] == 0, (name, "weights left gathered between steps", run["held"])
    assert not failures, "\n".join(failures)


def test_zero_2_and_3_match_one_process_and_resume_at_other_levels(tmp_path, token_file):
    _check_runs(tmp_path, token_file, RUNS)
    man = json.loads((tmp_path / "ckpt-z3" / "step_00000002" / "manifest.json").read_text())
    assert man["config"]["parallel"]["zero"] == 3 and man["layout"]["zero1"] is True
    # the same training at ZeRO-1, 2 and 3 converts to one model file (the rounding of the reductions aside)
    from megalite.convert import convert
    files = {z: convert(tmp_path / f"ckpt-z{z}" / "step_00000002", tmp_path / f"z{z}.safetensors", quiet=True)
             for z in (1, 2, 3)}
    print("converted files bitwise equal: z2 = z3", files[2].read_bytes() == files[3].read_bytes(),
          ", z1 = z3", files[1].read_bytes() == files[3].read_bytes())
    assert files[2].read_bytes() == files[3].read_bytes()
    one, three = load_file(files[1]), load_file(files[3])
    assert one.keys() == three.keys() and max(H.rel_err(one[k], three[k]) for k in one) < 1e-4
    # the ZeRO-3 (2,2,2) checkpoint resumed at ZeRO-1 in one process (1,1,1) continues as the uninterrupted run
    failures = []
    _compare("z3-to-111", _single(token_file, tmp_path, "z3-to-111", **{
        "parallel.zero1": True, "checkpoint.resume": str(tmp_path / "ckpt-z3" / "step_00000002")}),
        torch.load(tmp_path / "z3-A.pt"), 1e-5, 1e-4, failures, first_step=3)
    assert not failures, "\n".join(failures)


@pytest.mark.slow  # every row at 30 steps (a checkpoint every 2): ~200 s here, against ~45 s for the default
def test_every_row_matches_one_process_over_30_steps(tmp_path, token_file):
    _check_runs(tmp_path, token_file, [(name, {**o, **LONG}) for name, o in RUNS])


def test_zero_levels_in_the_config():
    def cfg(**par):
        return Config.from_dict({"parallel": par})
    assert validate(resolve(cfg(zero1=True))).parallel.zero_level == 1  # the older spelling still means 1
    assert validate(resolve(cfg(zero=3))).parallel.zero == 3
    assert resolve(cfg()).parallel.zero_level == 0
    with pytest.raises(ConfigError, match=r"^parallel.zero1 = true contradicts parallel.zero = 2: .*$"):
        validate(resolve(cfg(zero1=True, zero=2)))
    with pytest.raises(ConfigError, match=r"^parallel.zero = 4: expected 0, 1, 2 or 3$"):
        validate(resolve(cfg(zero=4)))
    for bad in ({"dp": 4, "zero": 3, "dp_shard": 3}, {"dp": 4, "zero": 1, "dp_shard": 2}, {"dp": 4, "zero": 2,
                                                                                           "dp_shard": 1}):
        with pytest.raises(ConfigError, match=rf"^parallel.dp_shard = {bad['dp_shard']}: expected 0 .*$"):
            validate(resolve(cfg(**bad)))
    assert validate(resolve(cfg(dp=4, zero=2, dp_shard=2), 4)).parallel.dp_shard == 2
    assert validate(resolve(Config.from_dict({"parallel": {"zero": 3}, "train": {"compile": True}}))).train.compile


def test_hybrid_groups():
    from megalite.parallel.grid import Layout
    lay = Layout(2, 1, 4, 2)  # tp 2, dp 4, cp 2: every dp x cp group holds 8 ranks
    c = lay.coord_of(5)
    members = lay.dp_cp_ranks(c)
    assert lay.shard_ranks(c, 4) == members[:4] and lay.replicate_ranks(c, 4) == members[lay.replica(c) % 4::4]
    groups = {tuple(lay.shard_ranks(lay.coord_of(r), 2)) for r in range(lay.world_size)}
    assert sorted(r for g in groups for r in g) == list(range(16)) and all(len(g) == 2 for g in groups)


def test_the_per_tensor_cut_gives_each_rank_chunk_r_of_every_tensor():
    tensors = [("b", 10, 0), ("a", 3, 0), ("t", 5, 1)]  # (name, valid elements, space)
    assert [dp_pieces(tensors, r, 4, per_tensor=True) for r in range(4)] == [
        {"a": (0, 1), "b": (0, 3), "t": (0, 2)}, {"a": (1, 2), "b": (3, 6), "t": (2, 4)},
        {"a": (2, 3), "b": (6, 9), "t": (4, 5)}, {"a": (0, 0), "b": (9, 10), "t": (0, 0)}]
    # ZeRO-1's cut (one flat space, a then b) is unchanged
    assert dp_pieces(tensors, 0, 2) == {"a": (0, 3), "b": (0, 4), "t": (0, 3)}


def _against_fsdp2(rank, world_size, tmp_dir):
    """The same GPT-2 stage trained by megalite's ZeRO-3 (ShardedState + ShardedAdamW) and by PyTorch's FSDP2
    (`fully_shard` on each block, then on the stage; torch.optim.AdamW), each dp rank on its own rows."""
    import copy
    from torch.distributed.fsdp import fully_shard
    from megalite.config import ModelConfig
    from megalite.model import GPTStage
    from megalite.parallel.data import ShardedAdamW
    from megalite.parallel.grid import Layout, ParallelGrid
    from megalite.parallel.zero import ShardedState
    grid = ParallelGrid.create(Layout(1, 1, world_size))
    cfg = ModelConfig(**{**H.TINY_MODEL, "n_layer": 2})
    ours = GPTStage(cfg, grid)
    ours.init_weights(1234)
    theirs = copy.deepcopy(ours)
    params = sorted(ours.global_parameters(), key=lambda np_: np_[0])
    shards = ShardedState(params, list(ours.blocks.values()), ours, grid.tp, grid.dp, 3)
    opt = ShardedAdamW(params, grid.tp, grid.dp, zero=3, shards=shards)  # weight decay 0, betas (0.9, 0.95)
    for block in theirs.blocks.values():
        fully_shard(block)
    fully_shard(theirs)
    torch_opt = torch.optim.AdamW(theirs.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    gen = torch.Generator().manual_seed(7)
    x = torch.randint(0, 256, (world_size, 4, 16), generator=gen)[rank]  # this rank's rows, every step: the
    y = torch.randint(0, 256, (world_size, 4, 16), generator=gen)[rank]  # loss falls as they are learnt
    out = []
    def blocks():  # the storages of the block weights now (gathered ones among them)
        return {p.untyped_storage()._cdata for b in ours.blocks.values() for p in b.parameters()}

    for step in range(5):
        shards.zero()
        shards.arm(1)
        saved = []  # what autograd keeps for backward that views a block's gathered weight (a Linear's weight.t())
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: (saved.append(t) if t.untyped_storage()._cdata in blocks() else None, t)[1], lambda t: t):
            loss = ours(x, y)
        assert saved and sum(t.untyped_storage().nbytes() for t in saved) == 0, "forward left weights gathered"
        loss.backward()
        shards.finish()
        opt.step(3e-3)
        torch_opt.zero_grad()
        theirs_loss = theirs(x, y)
        theirs_loss.backward()
        torch_opt.step()
        pair = torch.stack([loss.detach(), theirs_loss.detach()])
        torch.distributed.all_reduce(pair)
        out.append((pair / world_size).tolist())
    if rank == 0:
        torch.save(out, f"{tmp_dir}/fsdp2.pt")


def test_zero_3_equals_pytorch_fsdp2_on_gloo(tmp_path):
    run_parallel(_against_fsdp2, 2, tmp_path)
    losses = torch.load(tmp_path / "fsdp2.pt")
    worst = max(abs(a - b) / abs(b) for a, b in losses)
    print(f"ZeRO-3 vs FSDP2 fully_shard, 5 steps at dp 2: worst loss relative difference {worst:.2e}")
    assert losses[-1][0] < losses[0][0] - 0.05  # it trains
    assert worst < 1e-5, losses


def _compiled_zero3(rank, world_size, tmp_dir, tokens):
    from torch._dynamo.utils import counters
    from megalite.parallel.grid import Layout, ParallelGrid
    from megalite.run.train import build, train_step
    torch.set_num_threads(1)
    losses = {}
    for on in (False, True):
        cfg = H.TINY.config(tokens, f"{tmp_dir}/run", **{"train.compile": on, "parallel.dp": 2, "parallel.zero": 3,
                                                         "model.n_layer": 2})
        counters.clear()
        tr = build(cfg, ParallelGrid.create(Layout(1, 1, 2)), torch.device("cpu"))
        losses[on] = [train_step(tr)["loss"] for _ in range(3)]
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])  # dynamo compiled the blocks
    assert losses[False] == losses[True], losses


@pytest.mark.slow  # inductor compiles a block's graph in two processes: ~20-60 s here
def test_zero_3_with_compiled_blocks_equals_eager(tmp_path, token_file):
    """train.compile with ZeRO-3 at dp 2: the gather/free hooks run outside the compiled graph (zero.eager), so
    each compiled block takes the gathered weights as inputs; 3 steps, the eager run's losses bit for bit.
    Planted: without zero.eager, inductor's graph is handed a freed weight (`wrong number of dimensions1`)."""
    run_parallel(_compiled_zero3, 2, tmp_path, args=(token_file,))


TABLE = [(1, 4, 1), (1, 2, 2), (1, 1, 4), (2, 2, 1), (2, 1, 2)]  # (tp, pp, dp) on 4 ranks


def _memory_table(rank, world_size, tmp_dir, tokens):
    from datetime import timedelta
    from megalite.bench.memory import held_bytes, predict
    from megalite.config import num_microbatches
    from megalite.parallel.grid import Layout, ParallelGrid
    from megalite.run.train import build, train_step
    rows = []
    for tp, pp, dp in TABLE:
        grid = ParallelGrid.create(Layout(tp, pp, dp), timeout=timedelta(seconds=120))
        for zero in range(4):
            cfg = H.TINY.config(tokens, f"{tmp_dir}/run", **{"parallel.tp": tp, "parallel.pp": pp, "parallel.dp": dp,
                                                             "parallel.zero": zero})
            validate(resolve(cfg, world_size), world_size)
            tr = build(cfg, grid, torch.device("cpu"))
            held = held_bytes(tr)
            train_step(tr)
            assert held == held_bytes(tr), (held, held_bytes(tr))  # a step leaves what it found
            sent = {**tr.grads.sent}
            for k, v in tr.optimizer.sent.items():
                sent[k] = sent.get(k, 0) + v
            want = predict(H.TINY_MODEL, grid.layout, grid.coord, zero, num_microbatches(cfg))
            rows.append(((tp, pp, dp), zero, rank, held, sent, want))
    torch.save(rows, f"{tmp_dir}/memory-{rank}.pt")


def test_memory_per_rank_and_bytes_sent_equal_the_plan(tmp_path, token_file):
    """`bench plan --memory`'s count against live runs: each rank's distinct tensor storages (weights, gradients,
    AdamW moments) after build and after a step, and the bytes its collectives carried in one step, at dp 1/2/4
    x zero 0..3 x tp 1/2 (4 ranks: pp fills the rest; (tp, dp) = (2, 4) would need 8)."""
    run_parallel(_memory_table, 4, tmp_path, args=(token_file,))
    worst, rows = 0.0, []
    for rank in range(4):
        for layout, zero, r, held, sent, want in torch.load(tmp_path / f"memory-{rank}.pt"):
            for k in ("params", "grads", "optimizer"):
                worst = max(worst, abs(held[k] - want[k]) / want[k])
            got_sent = {k: sent.get(k, 0) for k in want["comm"]}
            assert got_sent == want["comm"], (layout, zero, r, got_sent, want["comm"])
            rows.append((layout, zero, r, held["params"] + held["grads"] + held["optimizer"]))
    print(f"memory: {len(rows)} rank rows, worst relative difference from the plan {worst:.2e}")
    assert worst < 0.01
    # ZeRO-3 at dp 4 holds about a quarter of zero 0's bytes on each rank (padding aside)
    z = {zero: b for layout, zero, r, b in rows if layout == (1, 1, 4) and r == 0}
    assert z[3] < 0.27 * z[0] and z[0] > z[1] > z[2] > z[3]


def test_bench_plan_memory_prints_each_stage():
    code, out, err = H.cli_in_process("bench", "plan", "--memory", "--tp", "2", "--pp", "2", "--dp", "2,4",
                                      "--zero", "3", "--n-layer", "4", "--n-embd", "64", "--n-head", "4",
                                      "--vocab-size", "256", "--block-size", "32")
    assert code == 0, err
    lines = [x for x in out.splitlines() if x.startswith("tp=2 pp=2")]
    assert [x.split()[3:6] for x in lines] == [["zero", "3", "stage"]] * 4, out
