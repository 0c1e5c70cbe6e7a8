"""The Python API: save_checkpoint / load_checkpoint with client_state, at the same layout (bitwise) and
resharded to another one; a missing checkpoint is an error; nothing is ever a pickle."""
import json
from pathlib import Path

import pytest
import torch

from helpers import CKPT, ok, train
from megalite.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from megalite.parallel.grid import Layout, ParallelGrid
from megalite.testing import gather_full_model, run_parallel
from megalite.run.train import build, train_step

CPU = torch.device("cpu")
CLIENT = {"epoch": 3, "note": "hello", "nested": {"lr_scale": 0.5, "ids": [1, 2, 3]}}


def _grid_and_trainer(tokens, tp, dp, zero1=False):
    cfg = CKPT.config(tokens, **{"parallel.tp": tp, "parallel.dp": dp, "parallel.zero1": zero1})
    grid = ParallelGrid.create(Layout(tp, 1, dp))
    return grid, build(cfg, grid, CPU)


def _full_moments(tr, grid) -> dict:
    """{name.exp_avg / name.exp_avg_sq: the whole global tensor} on every rank, from any layout."""
    import torch.distributed as dist
    from megalite.parallel.partition import partition_of, tp_box
    opt = tr.optimizer
    named = []
    for name, p in tr.params:
        part = partition_of(p)
        if part.tied_to:
            continue
        box_shape = [b - a for a, b in tp_box(part, grid.tp.rank, grid.tp.size)]
        for moment, store in (("exp_avg", opt.exp_avg), ("exp_avg_sq", opt.exp_avg_sq)):
            flat = store[name]
            if opt.zero1:  # this dp rank holds elements [a, b) of its tp slice: gather the dp pieces
                pieces = [None] * grid.dp.size
                dist.all_gather_object(pieces, flat.clone(), group=grid.dp.group)
                flat = torch.cat(pieces)
            t = flat.reshape(box_shape).clone()
            t.partition = part
            named.append((f"{name}.{moment}", t))
    return gather_full_model(named, grid)


def _assert_equal_dicts(a: dict, b: dict, what: str):
    assert a.keys() == b.keys(), what
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"{what}: {bad[:5]}"


def _api_worker(rank, world_size, tmp_dir, tokens):
    tmp = Path(tmp_dir)
    # ---- same layout, tp=2: bitwise parameters and moments, client_state, step, RNG, sampler
    grid, tr = _grid_and_trainer(tokens, tp=2, dp=1)
    for _ in range(2):
        train_step(tr)
    root = tmp / "ck-tp2"
    path = save_checkpoint(root, tr.step, tr.model, tr.optimizer, grid, client_state=CLIENT,
                           config=tr.cfg.to_dict(), tokens_seen=tr.tokens_seen, data_state=tr.sampler.state_dict())
    assert path == root / "step_00000002"
    rng_after_save = torch.get_rng_state()
    fresh = build(tr.cfg, grid, CPU)
    assert not all(torch.equal(p, q) for (_, p), (_, q) in zip(tr.params, fresh.params))  # load must matter
    info = load_checkpoint(root, fresh.model, fresh.optimizer, grid, model_config=tr.cfg.to_dict()["model"])
    assert info.client_state == CLIENT and info.path == path
    assert info.step == 2 and info.tokens_seen == tr.tokens_seen and info.data == {"batch_index": 2}
    assert info.same_layout and info.rng_restored and torch.equal(torch.get_rng_state(), rng_after_save)
    assert [n for n, _ in fresh.params] == [n for n, _ in tr.params]
    for (name, p), (_, q) in zip(tr.params, fresh.params):
        assert torch.equal(p, q), name
    _assert_equal_dicts(tr.optimizer.exp_avg, fresh.optimizer.exp_avg, "exp_avg")
    _assert_equal_dicts(tr.optimizer.exp_avg_sq, fresh.optimizer.exp_avg_sq, "exp_avg_sq")
    assert fresh.optimizer.step_count == tr.optimizer.step_count == 2
    fresh.step, fresh.tokens_seen = info.step, info.tokens_seen
    fresh.sampler.load_state_dict(info.data)
    assert train_step(fresh)["loss"] == train_step(tr)["loss"]  # and they keep training alike
    full_params = gather_full_model(tr.params, grid)
    full_moms = _full_moments(tr, grid)
    root_next = tmp / "ck-tp2-step3"
    save_checkpoint(root_next, tr.step, tr.model, tr.optimizer, grid)

    # ---- resharded: saved at tp=2 dp=1, loaded at tp=1 dp=2 (with ZeRO-1, so moments are pieces)
    grid2, other = _grid_and_trainer(tokens, tp=1, dp=2, zero1=True)
    info = load_checkpoint(root_next, other.model, other.optimizer, grid2)
    assert not info.same_layout and info.client_state == {} and info.step == 3
    _assert_equal_dicts(gather_full_model(other.params, grid2), full_params, "params tp=2 -> dp=2")
    _assert_equal_dicts(_full_moments(other, grid2), full_moms, "moments tp=2 -> dp=2 zero1")

    # ---- and back: saved at tp=1 dp=2 with ZeRO-1 pieces, loaded at tp=2 dp=1
    root_z = tmp / "ck-zero1"
    save_checkpoint(root_z, 3, other.model, other.optimizer, grid2, client_state={"from": "zero1"})
    back = build(tr.cfg, grid, CPU)
    info = load_checkpoint(root_z, back.model, back.optimizer, grid)
    assert info.client_state == {"from": "zero1"} and not info.same_layout
    for (name, p), (_, q) in zip(tr.params, back.params):
        assert torch.equal(p, q), name  # tr's own slices, bit for bit, after two reshards
    _assert_equal_dicts(tr.optimizer.exp_avg, back.optimizer.exp_avg, "exp_avg zero1 -> tp=2")
    _assert_equal_dicts(tr.optimizer.exp_avg_sq, back.optimizer.exp_avg_sq, "exp_avg_sq zero1 -> tp=2")

    # ---- a missing checkpoint raises on every rank, never returns None
    for missing in (tmp / "nothing-here", tmp / "ck-tp2" / "step_00000009"):
        with pytest.raises(CheckpointError):
            load_checkpoint(missing, back.model, back.optimizer, grid)


def test_save_load_same_layout_and_resharded(tmp_path, token_file):
    run_parallel(_api_worker, 2, tmp_path, args=(str(token_file),))
    roots = [tmp_path / "ck-tp2", tmp_path / "ck-tp2-step3", tmp_path / "ck-zero1"]
    man = json.loads((tmp_path / "ck-zero1" / "step_00000003" / "manifest.json").read_text())
    assert man["layout"] == {"tp": 1, "pp": 1, "dp": 2, "zero1": True} and man["client_state"] == {"from": "zero1"}
    _assert_no_pickle(roots)


# ---------------------------------------------------------------- single process: errors and pickles
@pytest.fixture(scope="module")
def single(tmp_path_factory, token_file):
    grid = ParallelGrid.single()
    tr = build(CKPT.config(token_file), grid, CPU)
    train_step(tr)
    root = tmp_path_factory.mktemp("api-single") / "ck"
    save_checkpoint(root, 1, tr.model, tr.optimizer, grid, client_state={"k": 1})
    return grid, tr, root


def test_missing_checkpoint_is_an_error_not_none(tmp_path, single):
    grid, tr, _ = single
    (tmp_path / "empty").mkdir()
    root = tmp_path / "dangling"
    root.mkdir()
    (root / "latest").write_text("step_00000005\n")
    for path in (tmp_path / "nope", tmp_path / "empty", root):
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(path, tr.model, tr.optimizer, grid)
        assert "\n" not in str(e.value)


def test_load_without_optimizer_and_client_state(single):
    grid, tr, root = single
    info = load_checkpoint(root, tr.model, None, grid)
    assert info.client_state == {"k": 1} and info.step == 1


def _assert_no_pickle(roots):
    seen = 0
    for root in roots:
        for f in Path(root).rglob("*"):
            if f.is_dir():
                continue
            seen += 1
            assert f.name == "latest" or f.suffix in (".json", ".safetensors"), f
            head = f.read_bytes()[:16]
            if f.suffix == ".safetensors":  # an 8-byte little-endian header length (0x80 = 128 is fine), then JSON
                assert head[8:9] == b"{", f
            else:
                assert not head.startswith(b"\x80") and not head.startswith(b"PK"), f  # pickle / torch.save zip
            if f.suffix == ".json":
                json.loads(f.read_text())
            elif f.suffix == ".safetensors":
                n = int.from_bytes(head[:8], "little")
                header = json.loads(f.read_bytes()[8:8 + n])
                assert all(v["dtype"] == "F32" for k, v in header.items() if k != "__metadata__")
    assert seen >= 4


def test_checkpoint_tree_has_no_pickle(single):
    _assert_no_pickle([single[2]])


class _Payload:
    """Unpickling this creates a marker file: proof that a loader executed a pickle."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("fix_manifest", [False, True])
def test_pickle_in_place_of_safetensors_is_refused_and_not_executed(tmp_path, single, fix_manifest):
    import shutil

    from megalite.checkpoint import manifest as mf
    from megalite.checkpoint.verify import verify
    grid, tr, root = single
    step = tmp_path / "ck" / "step_00000001"
    shutil.copytree(root / "step_00000001", step)
    marker = tmp_path / "EXECUTED"
    evil = step / "tp00-pp00-dp00" / "model.safetensors"
    torch.save({"wte.weight": _Payload(marker)}, evil)
    if fix_manifest:  # a matching size and a re-signed manifest: only the file format can give it away
        man = mf.read_json(step)
        man["files"]["tp00-pp00-dp00/model.safetensors"] = {"bytes": evil.stat().st_size,
                                                            "header_crc32c": mf.crc32c_file(evil)}
        mf.write_json(step, mf.sign(man))
    before = [p.detach().clone() for _, p in tr.params]
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(step, tr.model, tr.optimizer, grid)
    assert "model.safetensors" in str(e.value)
    assert not marker.exists(), "load_checkpoint executed a pickle"
    assert all(torch.equal(b, p) for b, (_, p) in zip(before, tr.params))  # nothing loaded
    problems = verify(step)[1]
    assert problems and any("model.safetensors" in p for p in problems)
    assert not marker.exists(), "verify executed a pickle"
    # the payload is live: an unsafe loader would have run it (so the checks above can fail)
    shutil.copy(evil, tmp_path / "evil.pt")  # (torch.load reads a *.safetensors name as safetensors)
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert marker.exists()


def test_checkpoint_saved_by_the_api_resumes_in_megalite_train(tmp_path, single, token_file):
    _, _, root = single
    p = ok(train(CKPT.toml(tmp_path / "tiny.toml", token_file), f"--checkpoint.resume={root}",
                 "--train.stop_at_step=2", f"--train.out_dir={tmp_path / 'out'}"))
    assert "resumed from" in p.stdout and "at step 1" in p.stdout
