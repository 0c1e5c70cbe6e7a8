"""The Llama family through every axis: the layouts and features of test_layouts.py / test_features_parallel.py /
test_context_parallel.py, for a Llama with grouped-query attention, against the single-process run (1e-5
relative loss per step, 1e-4 parameters: those files' tolerances); a checkpoint saved at one layout resumes at
others (tp > n_kv_head included) and converts, splits, reshards and verifies as GPT-2's do.

One 8-process launch runs every layout in sequence (as test_features_parallel.py does); the references run in
this process; assert_round_trip adds two 4-process launches.
"""
import json

import pytest
import torch

import helpers as H
from megalite.testing import assert_round_trip, gather_full_model, run_parallel
from megalite.run.train import train

GQA = {"model.arch": "llama", "model.n_kv_head": 2, "model.rope_theta": 500000.0}  # 4 heads, 2 kv heads
MQA = {**GQA, "model.n_kv_head": 1}
STEPS = {"train.steps": 3}
MICRO4 = {"train.micro_batch_size": 4}
# (2,2,2) + sp + vpp 2 + selective recompute + overlapped dp reduction + ZeRO-1, saving at step 2
A = {"parallel.tp": 2, "parallel.pp": 2, "parallel.dp": 2, "parallel.sp": True, "parallel.vpp": 2,
     "train.recompute": "selective", "parallel.overlap_grad_reduce": True, "parallel.zero1": True,
     "parallel.bucket_mb": 0.02, **MICRO4}
# tp = 4 > n_kv_head = 2: each kv head held by two tp ranks; with sp, full recompute and ZeRO-1 over dp 2
SHARED = {"parallel.tp": 4, "parallel.dp": 2, "parallel.sp": True, "train.recompute": "full", "parallel.zero1": True,
          "train.micro_batch_size": 8}
# context parallelism: rotary at each token's global position (two chunks per rank), with tp and dp
CP = {"parallel.cp": 2, "parallel.tp": 2, "parallel.dp": 2, "parallel.zero1": True, **MICRO4}
CP4 = {"parallel.cp": 4, "parallel.tp": 2, "train.micro_batch_size": 8}
PP4 = {"parallel.tp": 2, "parallel.pp": 4}  # vpp 1, the resume target of A's checkpoint below
LAYOUT_3D = {"parallel.tp": 2, "parallel.pp": 2, "parallel.cp": 2, "parallel.sp": True, **MICRO4}


def _worker(rank, world_size, rdzv, tokens, out, runs):
    for name, overrides in runs:
        cfg = H.TINY.config(tokens, f"{out}/run-{name}", **{**STEPS, **overrides})
        tr = train(cfg, log=lambda *a: None)
        params = gather_full_model(tr.params, tr.grid)
        if rank == 0:
            torch.save({"history": tr.history, "params": params}, f"{out}/{name}.pt")


def _single(tokens, tmp, name, **overrides):
    tr = H.train_in_process(H.TINY.config(tokens, tmp / f"run-{name}", **{**STEPS, **overrides}))
    return {"history": tr.history, "params": gather_full_model(tr.params, tr.grid)}


def _compare(tag, run, ref, failures, first_step=1):
    got = {r["step"]: r["loss"] for r in run["history"]}
    want = {r["step"]: r["loss"] for r in ref["history"] if r["step"] >= first_step}
    assert got.keys() == want.keys(), (tag, got.keys(), want.keys())
    worst = max(abs(got[k] - w) / abs(w) for k, w in want.items())
    print(f"{tag}: worst loss relative error {worst:.2e}")
    if worst > 1e-5:
        failures.append(f"{tag}: loss relative error {worst:.2e} ({got} vs {want})")
    assert run["params"].keys() == ref["params"].keys(), tag
    perr = max((H.rel_err(run["params"][k], ref["params"][k]), k) for k in ref["params"])
    if perr[0] >= 1e-4:
        failures.append(f"{tag} {perr[1]}: parameter relative error {perr[0]:.2e}")


def test_llama_layouts_match_single_process_and_resume_across_layouts(tmp_path, token_file):
    tmp = tmp_path
    ckpt = tmp / "ckpt-A"
    step2 = f"{ckpt}/step_00000002"
    eight = [
        ("A", {**GQA, **A, "checkpoint.dir": str(ckpt), "checkpoint.interval": 2}),
        ("A_resume", {**GQA, **A, "checkpoint.resume": step2}),  # same layout: bit-exact continuation
        ("shared", {**GQA, **SHARED}),
        ("shared_resume", {**GQA, **SHARED, "checkpoint.resume": step2}),  # (2,2,2) -> tp 4 > kv heads
        ("pp4_resume", {**GQA, **PP4, "checkpoint.resume": step2}),
        ("cp", {**GQA, **CP}),
        ("cp4_resume", {**GQA, **CP4, "checkpoint.resume": step2}),
        ("3d", {**GQA, **LAYOUT_3D}),
        ("mqa_shared", {**MQA, **SHARED}),  # every tp rank shares the one kv head
        ("mqa_cp", {**MQA, **CP, "parallel.sp": True}),
    ]
    run_parallel(_worker, 8, tmp / "rdzv8", args=(token_file, tmp, eight))
    ref = _single(token_file, tmp, "ref", **GQA)
    ref_mqa = _single(token_file, tmp, "ref_mqa", **MQA)
    one = _single(token_file, tmp, "one", **GQA, **{"checkpoint.resume": step2})  # resharded to (1,1,1)
    assert ref["history"][-1]["loss"] < ref["history"][0]["loss"]  # it trains
    assert "wpe.weight" not in ref["params"] and "lm_head.weight" in ref["params"]  # rotary, untied

    failures = []
    for name in ("A", "shared", "cp", "3d"):
        _compare(name, torch.load(tmp / f"{name}.pt"), ref, failures)
    for name in ("mqa_shared", "mqa_cp"):
        _compare(name, torch.load(tmp / f"{name}.pt"), ref_mqa, failures)
    for name in ("shared_resume", "pp4_resume", "cp4_resume"):
        _compare(name, torch.load(tmp / f"{name}.pt"), ref, failures, first_step=3)
    _compare("(1,1,1) resumed", one, ref, failures, first_step=3)
    a, a_resume = torch.load(tmp / "A.pt"), torch.load(tmp / "A_resume.pt")
    assert [r["loss"] for r in a_resume["history"]] == [r["loss"] for r in a["history"] if r["step"] > 2]
    assert all(torch.equal(a["params"][k], a_resume["params"][k]) for k in a["params"])
    assert not failures, "\n".join(failures)

    # the checkpoint describes itself: kv weights tagged with their 2 heads, names as docs/families.md
    man = json.loads((ckpt / "step_00000002" / "manifest.json").read_text())
    assert man["model"]["blocks.0.attn.k.weight"]["partition"] == {"dim": 0, "tied_to": None,
                                                                   "placement": "layer.0", "units": 2}
    assert man["model"]["blocks.0.attn.k.weight"]["shape"] == [16, 32]  # 2 kv heads x head_dim 8, C
    assert "units" not in man["model"]["blocks.0.attn.q.weight"]["partition"]

    # convert, split (to tp 4 > kv heads), reshard, verify, inspect: the tools read the manifest alone
    from megalite.cli import main as cli
    from megalite.convert import convert, reshard, split
    from megalite.testing import full_state
    one_file = convert(step2, tmp / "a.safetensors", quiet=True)
    s4 = split(one_file, tmp / "s4", 4, 1, 1, quiet=True)
    r = reshard(step2, tmp / "r4", 4, 1, 2, quiet=True)
    whole, back, resharded = full_state(step2), full_state(s4), full_state(r)
    for name, t in whole.items():
        assert torch.equal(resharded[name], t), name
        if name.startswith("model/"):
            assert torch.equal(back[name], t), name
    assert cli(["verify", str(r)]) == 0 and cli(["inspect", str(r)]) == 0


def test_llama_round_trip_helper_across_shared_kv_heads(tmp_path):
    """megalite.testing.assert_round_trip for a Llama: saved at tp 4 (kv heads shared by 2 ranks each) with ZeRO-1,
    loaded at (2, 2, 1): every tensor and moment bitwise what was saved."""
    model = {"arch": "llama", "n_layer": 4, "n_head": 4, "n_kv_head": 2, "n_embd": 32, "block_size": 16}
    assert_round_trip(tmp_path, save_layout=(4, 1, 1), load_layout=(2, 2, 1), model=model, steps=2,
                      zero1=(True, False))
