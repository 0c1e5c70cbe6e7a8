"""data.mixture (megalite/data/mixture.py): the blend against megatron-core's own helper, its bound, the windows'
permutation, the sampler's independence of dp and its resume, and the bad inputs refused in one line."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import helpers as H
from megalite.base.errors import ConfigError, DataError
from megalite.config import Config, resolve, validate
from megalite.data import mixture as M


def _megatron_blend(weights, n):
    helpers_cpp = pytest.importorskip("megatron.core.datasets.helpers_cpp")
    src, idx = np.zeros(n, dtype=np.int16), np.zeros(n, dtype=np.int64)
    helpers_cpp.build_blending_indices(src, idx, np.asarray(weights, dtype=np.float64), len(weights), n, False)
    return src, idx


@pytest.mark.parametrize("weights", [[1.0], [0.7, 0.3], [5, 3, 2], [1, 1, 7], [0.001, 0.5, 0.2, 0.299],
                                     list(np.random.default_rng(3).random(9) ** 3)])
def test_the_blend_is_megatron_cores_build_blending_indices(weights):
    """The same (source, sample-within-source) for every global sample as megatron-core 0.16's C++ helper, for
    the weights normalised as its BlendedDataset does; and continued from cursors it is the same sequence."""
    w = M.normalise(weights)
    n = 5000
    want_src, want_idx = _megatron_blend(w, n)
    src, idx, cursors = M.blend(w, n)
    assert np.array_equal(src, want_src) and np.array_equal(idx, want_idx)
    assert cursors == np.bincount(want_src, minlength=len(w)).tolist()
    head = M.blend(w, 1234)
    tail = M.blend(w, n - 1234, head[2])
    assert np.array_equal(np.concatenate([head[0], tail[0]]), want_src)
    assert np.array_equal(np.concatenate([head[1], tail[1]]), want_idx)


def test_the_blends_bound_at_every_n():
    """After n samples every source is less than one sample ahead of n * w_s (a source is drawn only while it
    is not ahead) and less than S - 1 behind (the counts sum to n); with S = 2 both are one sample. Megatron's
    rule does NOT keep every source within one sample: weights 1:1:7 leave source 0 1.11 samples behind at
    n = 85, which is why the bound stated in docs/training.md is the one above."""
    rng = np.random.default_rng(1)
    for trial in range(40):
        s = int(rng.integers(1, 8))
        w = M.normalise(rng.random(s) ** 3)
        src, _, _ = M.blend(w, 2000)
        counts = np.cumsum(np.eye(s)[src], axis=0)
        lag = counts - np.arange(1, 2001)[:, None] * w[None, :]
        assert lag.max() < 1 and lag.min() > -(max(s, 2) - 1), (w, lag.max(), lag.min())
    w = M.normalise([1, 1, 7])
    lag = np.cumsum(np.eye(3)[M.blend(w, 85)[0]], axis=0)[-1] - 85 * w
    assert lag.min() < -1.1


def test_each_epoch_visits_every_window_once_in_another_order():
    for n in (1, 2, 3, 17, 1000, 4097):
        orders = [M.permute(np.arange(n), n, M._key(7, 0, e, 0)) for e in range(3)]
        assert all(sorted(o.tolist()) == list(range(n)) for o in orders)
        if n > 16:
            assert not np.array_equal(orders[0], orders[1])


def _three(tmp_path):
    """Three byte-token files of different text and size."""
    files = []
    for i, (text, n) in enumerate([(H.stdlib_text(), 9000), (H.synthetic_text(), 5000), ("0123456789 " * 900, 0)]):
        d = tmp_path / f"src{i}"
        d.mkdir()
        files.append(H.make_token_file(d, text[:n] if n else text))
    return files


def _sampler(files, weights, dp_rank=0, dp=1, seq=16, batch=8):
    entries = [{"path": str(f), "weight": w} for f, w in zip(files, weights)]
    sources, w = M.open_sources(entries, "train", seq)
    M.one_tokenizer(sources, 256)
    return M.MixtureSampler(sources, w, batch, dp_rank, dp, seed=5)


def test_the_sampler_is_the_same_at_every_dp_and_resumes_from_its_cursors(tmp_path):
    files = _three(tmp_path)
    one = _sampler(files, [0.5, 0.3, 0.2])
    ref = [one.next_batch() for _ in range(6)]
    assert abs(one.cursors[0] / 48 - 0.5) < 1 / 48 and sum(one.cursors) == 48
    for dp in (2, 4):
        parts = [_sampler(files, [0.5, 0.3, 0.2], r, dp) for r in range(dp)]
        for k in range(6):
            rows = [p.next_batch() for p in parts]
            assert all(np.array_equal(np.concatenate([r[i] for r in rows]), ref[k][i]) for i in (0, 1))
    later = _sampler(files, [0.5, 0.3, 0.2], 1, 2)
    src = _sampler(files, [0.5, 0.3, 0.2])
    for _ in range(4):
        src.next_batch()
    later.load_state_dict(src.state_dict())  # a resume at dp = 2 from a dp = 1 checkpoint's state
    assert np.array_equal(later.next_batch()[0], ref[4][0][4:])
    with pytest.raises(DataError, match="continues the same blend"):
        _sampler(files, [0.6, 0.2, 0.2]).load_state_dict(src.state_dict())
    with pytest.raises(DataError, match="data.path alone"):
        later.load_state_dict({"batch_index": 3})


def test_a_run_on_a_mixture_resumes_at_another_dp_cp_and_micro_batch_with_the_same_batch_hash(tmp_path):
    """3 sources: one process, micro-batch 2, 4 steps is the reference. Then 2 ranks at dp = 2 (micro-batch 4)
    stop at step 2, resume at cp = 2 (micro-batch 8) to step 3, and one process (micro-batch 1) finishes step
    4: every step's batch_hash is the reference's; the start-up line prints the realised shares."""
    files = _three(tmp_path)
    mix = [{"path": str(f), "weight": w} for f, w in zip(files, (0.5, 0.3, 0.2))]
    base = {"data.mixture": mix, "train.steps": 4, "model.n_layer": 2, "checkpoint.dir": str(tmp_path / "ck")}
    ref = H.train_in_process(H.TINY.config(files[0], tmp_path / "a", **{**base, "checkpoint.dir": ""}))
    got, _, lines = H.resumed_across_layouts(files[0], tmp_path, base)
    assert got == [r["batch_hash"] for r in ref.history]
    assert any("a mixture of 3 sources" in line and "of 48 samples" in line for line in lines), lines


@pytest.mark.parametrize("mixture, expected", [
    ([{"path": "a.bin", "weight": -0.5}, {"path": "b.bin", "weight": 1.0}], r"data.mixture\[0\].weight = -0.5"),
    ([{"path": "a.bin", "weight": 0}, {"path": "b.bin", "weight": 0.0}], "sum to 0"),
    ([{"path": "a.bin", "weight": 1, "split": "val"}], "feed train"),
    ([{"path": "a.bin", "weight": 1, "share": 2}], r"data.mixture\[0\].share: unknown key"),
    ([{"path": "", "weight": 1}], r"data.mixture\[0\].path"),
])
def test_bad_weights_are_one_line(mixture, expected):
    cfg = Config()
    cfg.data.mixture = mixture
    with pytest.raises(ConfigError, match=expected):
        validate(resolve(cfg))


def test_bad_mixtures_on_the_command_line_are_one_line_and_write_nothing(tmp_path, tiny_toml):
    from megalite.tokenizer import train_bpe
    files = _three(tmp_path)
    bpe = tmp_path / "bpe.bin"
    from megalite.data import prepare
    prepare([files[0].with_name("corpus.txt")], bpe, tokenizer=train_bpe([H.stdlib_text()[:5000]], 300),
            log=lambda *a: None)
    out = tmp_path / "out"
    for mix, expected in [(f'[{{path = "{files[0]}", weight = -1}}]', "data.mixture[0].weight = -1"),
                          (f'[{{path = "{files[0]}", weight = 0}}]', "sum to 0"),
                          (f'[{{path = "{files[0]}", weight = 1}}, {{path = "{bpe}", weight = 1}}]',
                           "data.mixture[1].path: '")]:
        rc, _, err = H.cli_in_process("train", "--config", tiny_toml, f"--data.mixture={mix}",
                                      f"--train.out_dir={out}", "--model.vocab_size=512")
        assert rc == 2 and expected in err and len(err.strip().splitlines()) == 1, err
        assert "another tokenizer" in err or "[1]" not in expected
        assert not out.exists()


def test_bench_blend_rows_agree_with_megatron_core():
    pytest.importorskip("megatron.core.datasets.helpers_cpp")
    from megalite.bench.blend import bench_blend
    rows = bench_blend(sizes=(10**5, 10**6), block_size=256, log=lambda *a: None)
    assert [r[1] for r in rows] == ["390", "3,906"] and all(r[-1] == "yes" for r in rows)
