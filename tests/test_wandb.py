"""train.wandb in W&B's offline mode: the run's own file (`<out_dir>/wandb/offline-run-*/run-*.wandb`, a
LevelDB-style log of W&B's protobuf records, read here with wandb's own protobuf classes) holds metrics.jsonl's
numbers at their steps; a missing package or a missing login is one line, before anything is written."""
import glob
import json
import os
import struct
import sys

import pytest

import helpers as H
from megalite.base.errors import ConfigError
from megalite.run import metrics


def wandb_history(run_file: str) -> list:
    """The history records of a .wandb file: a 7-byte header (":W&B", magic, version), then records in 32 KiB
    blocks, each chunk a 7-byte header (crc32, length, type: 1 whole, 2 first, 3 middle, 4 last) and its bytes."""
    from wandb.proto import wandb_internal_pb2 as pb
    data, pos, block, records, part = open(run_file, "rb").read(), 7, 1 << 15, [], b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):
            records.append(part)
    out = []
    for raw in records:
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            out.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    return out


def test_wandb_offline_run_holds_metrics_jsonl(tiny_config, tmp_path, monkeypatch):
    """... and writes nothing outside the run's folder: with a fresh HOME and no XDG folders, HOME stays empty;
    the debug logs wandb-core and its monitor write (~/.cache/wandb/logs/core-debug-*.log before) are in
    <out_dir>/wandb/cache, and the process's environment is as it was after."""
    pytest.importorskip("wandb")
    home = tmp_path / "home"
    home.mkdir()
    for var in ("XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_CONFIG_HOME", "WANDB_CACHE_DIR", "WANDB_DATA_DIR",
                "WANDB_ARTIFACT_DIR", "WANDB_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)  # W&B's ./artifacts default, were it used
    cfg = tiny_config(**{"train.wandb": True, "train.steps": 4, "train.eval_interval": 2, "checkpoint.dir": ""})
    H.train_in_process(cfg)
    assert sorted(str(p.relative_to(home)) for p in home.rglob("*")) == [], "W&B wrote outside the run's folder"
    assert list((tmp_path / "run" / "wandb" / "cache").rglob("core-debug-*.log")), "W&B's debug log is elsewhere"
    assert "WANDB_CACHE_DIR" not in os.environ
    (run_file,) = glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / "run-*.wandb"))
    history = wandb_history(run_file)
    rows = metrics.read(tmp_path / "run")
    assert [h["_step"] for h in history] == [r["step"] for r in rows] == [1, 2, 3, 4]
    for h, r in zip(history, rows):
        assert h["train/loss"] == pytest.approx(r["loss"], rel=1e-12) and h["train/lr"] == pytest.approx(r["lr"])
        assert ("val/loss" in h) == ("val_loss" in r)
        if "val_loss" in r:
            assert h["val/loss"] == pytest.approx(r["val_loss"], rel=1e-12)


def test_wandb_missing_or_without_login_is_one_line_and_writes_nothing(tiny_config, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    cfg = tiny_config(**{"train.wandb": True})
    with pytest.raises(ConfigError) as e:
        H.train_in_process(cfg)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("train.wandb = true needs the `wandb` package") \
        and "pip install wandb" in msg, msg
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("*")), "nothing is written"
    monkeypatch.delitem(sys.modules, "wandb")
    pytest.importorskip("wandb")
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))  # no saved login
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(ConfigError, match=r"^train\.wandb = true but W&B has no login: run `wandb login`, or set "
                                          r"WANDB_MODE=offline"):
        H.train_in_process(cfg)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("*")), "nothing is written"
