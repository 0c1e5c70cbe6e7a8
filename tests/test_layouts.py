"""Layout equivalence: the same config trained at any (tp, pp, dp), with or without ZeRO-1, gives the
single-process losses at every step and the same final parameters."""
import math

import pytest
import torch

from helpers import rel_err
from megalite.testing import gather_full_model, run_parallel
from megalite.train import train

LAYOUTS_2 = [(2, 1, 1), (1, 2, 1), (1, 1, 2)]
LAYOUTS_8 = [(2, 2, 2), (4, 2, 1), (1, 4, 2), (2, 1, 4)]


def _zero1s(layout):
    """ZeRO-1 shards over dp, so at dp = 1 it is the same optimizer (ShardedAdamW: zero1 and dp.active): one
    dp = 1 layout, (1, 2, 1), keeps `zero1 = true` there covered; the others run it where dp > 1."""
    return (False, True) if layout[2] > 1 or layout == (1, 2, 1) else (False,)


def _worker(rank, world_size, tmp_dir, cfg, layouts):
    for layout in layouts:
        for zero1 in _zero1s(layout):
            cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp = layout
            cfg.parallel.zero1 = zero1
            # small buckets with zero1: several gradient all-reduce and ZeRO-1 all-gather buckets
            cfg.parallel.bucket_mb = 0.02 if zero1 else 25.0
            tr = train(cfg, log=lambda *a: None)
            opt = tr.optimizer
            kept = sum(v.numel() for v in opt.exp_avg.values())
            valid = sum(opt.valid_numel(p) for _, p in tr.params)
            if zero1 and layout[2] > 1:  # this dp rank keeps only its piece of the AdamW moments
                assert kept <= sum(math.ceil(opt.valid_numel(p) / layout[2]) for _, p in tr.params) < valid
            else:
                assert kept == valid
            params = gather_full_model(tr.params, tr.grid)
            if rank == 0:
                torch.save({"history": tr.history, "params": params},
                           f"{tmp_dir}/{'-'.join(map(str, layout))}-zero1_{zero1}.pt")


def test_every_layout_matches_single_process(tmp_path, tiny_config, train_single):
    cfg = tiny_config()
    assert cfg.model.n_layer >= 4 and cfg.model.n_head % 4 == 0 and cfg.train.steps == 5
    ref = train_single(tiny_config())  # (tp, pp, dp) = (1, 1, 1)
    assert len(ref["loss"]) == 5 and ref["loss"][-1] < ref["loss"][0]  # it does train
    run_parallel(_worker, 2, tmp_path, args=(cfg, LAYOUTS_2))
    run_parallel(_worker, 8, tmp_path, args=(cfg, LAYOUTS_8))
    failures = []
    for layout in LAYOUTS_2 + LAYOUTS_8:
        for zero1 in _zero1s(layout):
            run = torch.load(tmp_path / f"{'-'.join(map(str, layout))}-zero1_{zero1}.pt")
            tag = f"(tp,pp,dp)={layout} zero1={zero1}"
            assert len(run["history"]) == 5, tag
            for want, got in zip(ref["history"], run["history"]):
                for key in ("loss", "grad_norm"):
                    if got[key] != pytest.approx(want[key], rel=1e-5):
                        failures.append(f"{tag} step {want['step']}: {key} {got[key]} != {want[key]}")
            want, got = ref["history"][-1]["val_loss"], run["history"][-1]["val_loss"]
            if got != pytest.approx(want, rel=1e-5):
                failures.append(f"{tag}: final val_loss {got} != {want}")
            assert run["params"].keys() == ref["params"].keys(), tag
            for name, want in ref["params"].items():
                got = run["params"][name]
                assert got.shape == want.shape, (tag, name)
                err = rel_err(got, want)
                if err >= 1e-4:
                    failures.append(f"{tag} {name}: relative error {err:.2e}")
    assert not failures, "\n".join(failures)
