"""The two walks of issue 31, measured with benchmarks/walk.py (a sys.setprofile tracer): a convert of a foreign
(DCP) checkpoint enters at most 10 files of megalite/ from cli.main; the training loop's save enters none of the
validation side (the commit trusts what every rank reported instead of re-reading the step) and no more files
than it did when this test was written (19)."""
import warnings

import torch

from benchmarks.walk import walk_cli, walk_save

READING = {"checkpoint/validate.py", "checkpoint/read.py", "checkpoint/verify.py", "checkpoint/load.py"}


def test_a_convert_of_a_dcp_folder_enters_at_most_ten_files(tmp_path):
    import torch.distributed.checkpoint as dcp
    sd = {"model.wte": torch.randn(10, 6), "model.norm": torch.randn(6).to(torch.bfloat16),
          "model.ids": torch.arange(7), "optim.step": torch.tensor(12.0)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ...: saving in a single process"
        dcp.save(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    rc, walk = walk_cli(["convert", str(tmp_path / "dcp"), "--out", str(tmp_path / "m.safetensors")])
    assert rc == 0 and (tmp_path / "m.safetensors").is_file()
    assert len(walk.files) <= 10 and "config.py" not in walk.files, walk.report("convert")


def test_the_loops_save_reads_nothing_back(tiny_toml, tmp_path):
    walk = walk_save(["--config", str(tiny_toml), "--train.steps=2", "--checkpoint.interval=2",
                      f"--checkpoint.dir={tmp_path / 'ck'}"])
    assert (tmp_path / "ck" / "latest").is_file()
    # 19 before the families became specs; models/__init__.py and models/spec.py are the family's spec, asked by
    # ModelConfig (ffn_size, the family's keys) where it was a branch on the name (issue 39)
    assert not READING & set(walk.files) and len(walk.files) <= 21, walk.report("save")
