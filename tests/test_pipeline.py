"""Pipeline schedules: 1F1B and all-forward-all-backward give the same losses and gradients, and both
match a single process (pp = 1)."""
import torch
import pytest

from helpers import grads_of, rel_err
from megalite.testing import gather_full_model, run_parallel
from megalite.run.train import train

# (name, (tp, pp, dp), global batch): micro-batch 2, so 8, 2, 4 and 8 micro-batches per step
CASES = [("pp4_m8", (1, 4, 1), 16), ("pp4_m2", (1, 4, 1), 4), ("pp2_dp2_m4", (1, 2, 2), 16),
         ("tp2_pp2_m8", (2, 2, 1), 16)]
SCHEDULES = ("1f1b", "afab")


def _layout_cfg(cfg, layout, schedule):
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp = layout
    cfg.parallel.schedule = schedule
    return cfg


def _worker(rank, world_size, tmp_dir, configs):
    for name, layout, cfg in configs:
        for schedule in SCHEDULES:
            tr = train(_layout_cfg(cfg, layout, schedule), log=lambda *a: None)
            params = gather_full_model(tr.params, tr.grid)
            grads = gather_full_model(grads_of(tr.params), tr.grid)
            if rank == 0:
                torch.save({"loss": [r["loss"] for r in tr.history], "params": params, "grads": grads},
                           f"{tmp_dir}/{name}-{schedule}.pt")


def test_schedules_agree_and_match_single_process(tmp_path, tiny_config, train_single):
    configs = [(name, layout, tiny_config(**{"train.steps": 2, "train.global_batch_size": gb}))
               for name, layout, gb in CASES]
    run_parallel(_worker, 4, tmp_path, args=(configs,))
    refs = {}
    for name, layout, cfg in configs:
        gb = cfg.train.global_batch_size
        if gb not in refs:
            refs[gb] = train_single(tiny_config(**{"train.steps": 2, "train.global_batch_size": gb}))
        ref = refs[gb]
        ref_loss, ref_params, ref_grads = ref["loss"], ref["params"], ref["grads"]
        runs = {s: torch.load(tmp_path / f"{name}-{s}.pt") for s in SCHEDULES}
        a, b = runs["1f1b"], runs["afab"]
        # same layout, same micro-batch order: the two schedules must agree bit for bit
        assert a["loss"] == b["loss"], name
        assert a["params"].keys() == b["params"].keys() == ref_params.keys()
        for key in ref_params:
            assert torch.equal(a["grads"][key], b["grads"][key]), (name, key)
            assert torch.equal(a["params"][key], b["params"][key]), (name, key)
        # and both equal the single process, up to the order of fp32 sums (tp splits the softmax sums and
        # matmuls; AdamW's normalised update amplifies rounding in near-zero gradients, e.g. the k bias)
        assert len(a["loss"]) == 2
        for got, want in zip(a["loss"], ref_loss):
            assert got == pytest.approx(want, rel=1e-5), name
        for key in ref_params:
            assert a["grads"][key].shape == ref_grads[key].shape
            assert rel_err(a["grads"][key], ref_grads[key]) < 1e-4, (name, key)
            assert rel_err(a["params"][key], ref_params[key]) < 1e-4, (name, key)


def test_one_entry_point_picks_the_schedule_of_every_config(monkeypatch):
    """pipeline.get_schedule (Megatron's get_forward_backward_func) for every (parallel.schedule, parallel.vpp,
    training or evaluating) a config can choose: each SCHEDULES entry is chosen by some config, the interleaved
    ones get vpp, and interleaved afab is interleaved 1F1B with every forward first."""
    from megalite.parallel import pipeline as P
    picked = {}
    for schedule in ("1f1b", "afab"):
        for vpp in (1, 2, 3):
            for training in (True, False):
                run = P.get_schedule(schedule, vpp, training)
                fn, kw = (run.func, run.keywords) if vpp > 1 else (run, {})
                assert kw == ({"vpp": vpp} if vpp > 1 else {}), (schedule, vpp, training)
                picked[schedule, vpp > 1, training] = fn
    assert picked == {("1f1b", False, True): P.one_f_one_b, ("afab", False, True): P.afab,
                      ("1f1b", True, True): P.interleaved, ("afab", True, True): P.interleaved_afab,
                      ("1f1b", False, False): P.forward_only, ("afab", False, False): P.forward_only,
                      ("1f1b", True, False): P.interleaved_forward_only,
                      ("afab", True, False): P.interleaved_forward_only}
    assert set(picked.values()) == set(P.SCHEDULES.values())
    seen = []
    monkeypatch.setattr(P, "interleaved", lambda *a, **k: seen.append(k) or [])
    P.get_schedule("afab", 2)(None, [], 4, None, None)
    assert seen == [{"all_warmup": True}]
