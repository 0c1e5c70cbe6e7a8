"""data.eval: several named held-out sets, each reported as eval/NAME/loss and eval/NAME/bpb at train.eval_interval
in metrics.jsonl (and, through one function, TensorBoard and W&B); bad sets refused in one line."""
from __future__ import annotations

import math

import pytest

import helpers as H
from megalite.base.errors import ConfigError
from megalite.config import resolve, validate
from megalite.run.tensorboard_log import scalars


def test_named_sets_are_reported_at_each_eval_and_one_equal_to_validation_is_equal(token_file, tmp_path):
    """Set 'same' is the run's own validation split: its loss is val_loss exactly (the same batches); set 'other'
    is another file's; bits per byte = loss / ln 2 for byte tokens."""
    (tmp_path / "other").mkdir()
    other = H.make_token_file(tmp_path / "other", H.synthetic_text(20000))
    sets = [{"name": "same", "path": str(token_file)}, {"name": "other", "path": str(other), "split": "val"}]
    cfg = H.TINY.config(token_file, tmp_path / "run", **{"data.eval": sets, "train.steps": 4, "train.eval_interval": 2,
                                                        "model.n_layer": 2, "data.val_fraction": 0.0})
    H.train_in_process(cfg)
    recs = {r["step"]: r for r in H.metrics(tmp_path / "run")}
    for step in (2, 4):
        r = recs[step]
        assert r["eval/same/loss"] == r["val_loss"]
        assert r["eval/other/loss"] != r["val_loss"] and math.isfinite(r["eval/other/loss"])
        assert r["eval/other/bpb"] == pytest.approx(r["eval/other/loss"] / math.log(2))
    assert "eval/same/loss" not in recs[1] and "eval/other/loss" not in recs[3]
    tags = dict(scalars(recs[2]))  # what TensorBoard and W&B are given
    assert tags["eval/other/loss"] == recs[2]["eval/other/loss"] and tags["val/loss"] == recs[2]["val_loss"]


@pytest.mark.parametrize("sets, expected", [
    ([{"name": "a", "path": "x.bin"}, {"name": "a", "path": "y.bin"}], r"data.eval\[1\].name = 'a'"),
    ([{"name": "a b", "path": "x.bin"}], r"data.eval\[0\].name"),
    ([{"name": "a", "path": "x.bin", "split": "test"}], r"data.eval\[0\].split = 'test'"),
    ([{"name": "a"}], r"data.eval\[0\].path = None"),
])
def test_bad_sets_are_one_line(token_file, sets, expected):
    with pytest.raises(ConfigError, match=expected):
        validate(resolve(H.TINY.config(token_file, **{"data.eval": sets})))


def test_a_set_of_another_tokenizer_is_one_line_and_writes_nothing(token_file, tiny_toml, tmp_path):
    from megalite.data import prepare
    from megalite.tokenizer import train_bpe
    bpe = tmp_path / "bpe.bin"
    (tmp_path / "t.txt").write_text(H.stdlib_text()[:6000])
    prepare([tmp_path / "t.txt"], bpe, tokenizer=train_bpe([H.stdlib_text()[:5000]], 300), log=lambda *a: None)
    out = tmp_path / "out"
    rc, _, err = H.cli_in_process("train", "--config", tiny_toml, f'--data.eval=[{{name = "b", path = "{bpe}"}}]',
                                  f"--train.out_dir={out}", "--model.vocab_size=512")
    assert rc == 2 and "data.eval[0].path" in err and "another tokenizer" in err, err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
