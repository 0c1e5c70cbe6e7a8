"""The converter against real training runs under torchrun: models trained at different layouts convert to
the same file, and a resharded checkpoint (or an on-the-fly load at another layout) continues the run
exactly as if it had never stopped.

    (2,2,2)+zero1, 10 steps uninterrupted, saving step 5 on the way (one launch)
        -> reference losses of steps 6..10; step 5 resharded to (1,4,2) / (1,1,1) and resumed; resumed at (2,1,2)
"""
from __future__ import annotations

from safetensors.torch import load_file

import helpers as H
from megalite.checkpoint import manifest as mf
from megalite.checkpoint.tree import resolve
from megalite.checkpoint.verify import verify
from megalite.convert import convert, reshard

TOL = 1e-5


def assert_same_losses(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert abs(g["loss"] - w["loss"]) <= TOL * abs(w["loss"]), (g["step"], g["loss"], w["loss"])


def test_the_run_saved_step_5_on_the_way(run222_stop5, run222_full):
    assert [r["step"] for r in run222_full] == list(range(1, 11))
    man = mf.read(resolve(run222_stop5["ckpt"]))
    assert man.step == 5 and tuple(man.layout) == (2, 2, 2) and man.zero1
    assert verify(run222_stop5["ckpt"])[1] == []


def test_models_trained_at_different_layouts_convert_to_the_same_file(tmp_path, run111, run222_stop5):
    """(2,2,2)+zero1 under torchrun vs (1,1,1) in-process, same seed, 5 steps: equal within 1e-4 per tensor;
    and the (2,2,2) checkpoint resharded anywhere converts to the bytes of its direct conversion."""
    a = convert(run222_stop5["ckpt"], tmp_path / "a.safetensors", quiet=True)
    b = convert(run111["ckpt"], tmp_path / "b.safetensors", quiet=True)
    ta, tb = load_file(str(a)), load_file(str(b))
    assert list(ta) == list(tb)
    for k in ta:
        assert ta[k].shape == tb[k].shape
        assert H.rel_err(ta[k], tb[k]) < 1e-4, (k, H.rel_err(ta[k], tb[k]))
    init = run111["losses"][0]
    assert abs(run222_stop5["metrics"][0]["loss"] - init) <= 1e-4 * init  # same seed, same first batch
    for tp, pp, dp, z in [(1, 1, 1, False), (4, 1, 2, True), (1, 3, 1, None)]:
        ck = reshard(run222_stop5["ckpt"], tmp_path / f"r{tp}{pp}{dp}", tp, pp, dp, zero1=z, quiet=True)
        assert verify(ck)[1] == []
        out = convert(ck, tmp_path / f"r{tp}{pp}{dp}.safetensors", quiet=True)
        assert out.read_bytes() == a.read_bytes(), (tp, pp, dp)


def test_reshard_full_training_state_then_resume(tmp_path, convert_tokens, run222_stop5, run222_full):
    """Reshard the step-5 checkpoint to (1,4,2) and (1,1,1); both continue with the reference losses."""
    src = run222_stop5["ckpt"]
    before = H.tree_digest(src)
    ck142 = reshard(src, tmp_path / "ck142", 1, 4, 2, quiet=True)
    ck111 = reshard(src, tmp_path / "ck111", 1, 1, 1, zero1=False, quiet=True)
    for ck, lay in ((ck142, (1, 4, 2)), (ck111, (1, 1, 1))):
        man = mf.read(ck)
        assert tuple(man.layout) == lay
        assert man.step == 5 and man.data == {"batch_index": 5}
        assert man.optimizer["step"] == 5 and man.optimizer_state
        assert verify(ck)[1] == []
    assert H.tree_digest(src) == before
    # (1,1,1) in this process
    cfg = H.CONVERT.config(convert_tokens, tmp_path / "run111", **{"checkpoint.resume": str(ck111)})
    losses = [r["loss"] for r in H.train_in_process(cfg).history]
    assert_same_losses([{"step": 6 + i, "loss": v} for i, v in enumerate(losses)], run222_full[5:])
    # (1,4,2) under torchrun, 8 processes
    recs = H.torchrun_train(8, run222_stop5["toml"], tmp_path / "run142",
                            **{"parallel.tp": 1, "parallel.pp": 4, "parallel.dp": 2, "parallel.zero1": True,
                               "checkpoint.resume": ck142})
    assert_same_losses(recs, run222_full[5:])


def test_resume_at_another_layout_on_the_fly(tmp_path, run222_stop5, run222_full):
    """No reshard: 4 processes at (2,1,2) load the (2,2,2) checkpoint directly."""
    recs = H.torchrun_train(4, run222_stop5["toml"], tmp_path / "run212",
                            **{"parallel.tp": 2, "parallel.pp": 1, "parallel.dp": 2, "parallel.zero1": True,
                               "checkpoint.resume": run222_stop5["ckpt"]})
    assert_same_losses(recs, run222_full[5:])
