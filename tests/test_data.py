"""Behaviour of megalite.data: token files on disk, splits, and dp-consistent batches."""

import json
import os

import numpy as np
import pytest
import torch

from megalite import data as D
from megalite.tokenizer import byte_tokenizer
from megalite.data import (BatchSampler, DataError, TokenDataset, default_corpus_files,
                           ensure_data, eval_batches, prepare)


def quiet(*_args, **_kwargs):
    pass


@pytest.fixture
def corpus(tmp_path):
    """A small folder of text files, a nested one, and a file that prepare must ignore."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "b.txt").write_text("beta line\n" * 50, encoding="utf-8")
    (src / "a.py").write_text("print('héllo wörld ✓')\n" * 40, encoding="utf-8")
    (src / "sub" / "c.md").write_text("# gamma 🚀\n" * 30, encoding="utf-8")
    (src / "image.png").write_bytes(b"\x89PNG not text")
    return src


@pytest.fixture
def token_file(tmp_path, corpus):
    out = tmp_path / "data" / "tokens.bin"
    prepare([corpus], out, val_fraction=0.25, log=quiet, val_split="tail")  # corpus order (test_corpus: documents)
    return out


def test_tokenizer_round_trip_non_ascii():
    tok = byte_tokenizer()
    text = "plain, naïve café, 日本語, emoji 🚀"
    ids = tok.encode(text)
    assert tok.vocab_size == 256
    assert all(0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8")) > len(text)
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text
    # a cut multi-byte character decodes with a replacement char instead of raising
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"


def test_prepare_writes_tokens_and_meta(tmp_path, corpus, token_file):
    expected = "\n\n".join((corpus / name).read_text(encoding="utf-8") for name in ("a.py", "b.txt", "sub/c.md"))
    tokens = np.fromfile(token_file, dtype=np.uint16)
    assert byte_tokenizer().decode(tokens.tolist()) == expected

    meta = json.loads(token_file.with_suffix(".json").read_text())
    assert meta["format"] == "megalite-tokens" and meta["version"] == 1
    assert meta["tokenizer"] == "byte" and meta["vocab_size"] == 256 and meta["dtype"] == "uint16"
    assert meta["num_tokens"] == tokens.size == len(expected.encode("utf-8"))
    assert meta["val_start"] == tokens.size - int(tokens.size * 0.25)
    assert meta["sources"] == [str(corpus)]
    # no temp files left behind
    assert sorted(p.name for p in token_file.parent.iterdir()) == ["tokens.bin", "tokens.json"]


def test_prepare_single_file_and_return_value(tmp_path):
    src = tmp_path / "one.log"  # a file named directly is used whatever its suffix
    src.write_text("x" * 100)
    meta = prepare([str(src)], tmp_path / "deep" / "t.bin", val_fraction=0.1, log=quiet)
    assert meta["num_tokens"] == 100 and meta["val_start"] == 90
    assert json.loads((tmp_path / "deep" / "t.json").read_text()) == meta


def test_prepare_errors(tmp_path):
    with pytest.raises(DataError, match=r"prepare: source '.*nope' does not exist"):
        prepare([tmp_path / "nope"], tmp_path / "t.bin", log=quiet)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "x.png").write_bytes(b"123")
    with pytest.raises(DataError, match="no text found"):
        prepare([tmp_path / "empty"], tmp_path / "t.bin", log=quiet)
    with pytest.raises(DataError, match=r"must end with \.bin"):
        prepare([tmp_path / "empty"], tmp_path / "t.dat", log=quiet)


def test_splits(token_file):
    all_tokens = np.fromfile(token_file, dtype=np.uint16)
    val_start = json.loads(token_file.with_suffix(".json").read_text())["val_start"]
    train, val = TokenDataset(token_file, "train"), TokenDataset(token_file, "val")
    assert len(train) == val_start and len(val) == all_tokens.size - val_start
    np.testing.assert_array_equal(np.concatenate([train.tokens, val.tokens]), all_tokens)
    assert isinstance(train.tokens, np.memmap)


def test_dp_ranks_concatenate_to_single_process_batch(token_file):
    ds = TokenDataset(token_file, "train")
    single = BatchSampler(ds, block_size=16, global_batch_size=8, dp_rank=0, dp_size=1, seed=3)
    ranks = [BatchSampler(ds, 16, 8, dp_rank=r, dp_size=4, seed=3) for r in range(4)]
    for _ in range(3):
        x1, y1 = single.next_batch()
        parts = [s.next_batch() for s in ranks]
        assert x1.shape == (8, 16) and x1.dtype == torch.int64
        assert all(x.shape == (2, 16) for x, _ in parts)
        torch.testing.assert_close(torch.cat([x for x, _ in parts]), x1)
        torch.testing.assert_close(torch.cat([y for _, y in parts]), y1)


def test_batches_are_windows_of_the_split_and_y_is_shifted(token_file):
    ds = TokenDataset(token_file, "train")
    tokens = torch.from_numpy(np.asarray(ds.tokens, dtype=np.int64))
    x, y = BatchSampler(ds, 32, 16, 0, 1, seed=0).next_batch()
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    for row_x, row_y in zip(x, y):
        windows = tokens.unfold(0, 33, 1)
        match = (windows == torch.cat([row_x, row_y[-1:]])).all(dim=1)
        assert match.any()


def test_offsets_cover_both_ends(tmp_path):
    # a split of exactly block_size + 2 tokens has two possible windows; both must be drawn
    src = tmp_path / "s.txt"
    src.write_text("abcdef")
    out = tmp_path / "t.bin"
    prepare([src], out, val_fraction=0.0, log=quiet)
    x, _ = BatchSampler(TokenDataset(out, "train"), 4, 64, 0, 1, seed=0).next_batch()
    assert {byte_tokenizer().decode(r.tolist()) for r in x} == {"abcd", "bcde"}


def test_determinism_and_seed_sensitivity(token_file):
    ds = TokenDataset(token_file, "train")
    a = [BatchSampler(ds, 16, 4, 0, 1, seed=7).next_batch() for _ in range(2)]
    b = [BatchSampler(ds, 16, 4, 0, 1, seed=7).next_batch() for _ in range(2)]
    torch.testing.assert_close(a, b)
    s = BatchSampler(ds, 16, 4, 0, 1, seed=7)
    first, second = s.next_batch(), s.next_batch()
    assert not torch.equal(first[0], second[0])
    assert not torch.equal(BatchSampler(ds, 16, 4, 0, 1, seed=8).next_batch()[0], first[0])


def test_state_dict_resume(token_file):
    ds = TokenDataset(token_file, "train")
    s = BatchSampler(ds, 16, 4, 1, 2, seed=11)
    for _ in range(5):
        s.next_batch()
    state = json.loads(json.dumps(s.state_dict()))  # must survive JSON
    assert state == {"batch_index": 5}
    expected = [s.next_batch() for _ in range(3)]
    resumed = BatchSampler(ds, 16, 4, 1, 2, seed=11)
    resumed.load_state_dict(state)
    torch.testing.assert_close([resumed.next_batch() for _ in range(3)], expected)
    with pytest.raises(DataError, match="batch_index"):
        resumed.load_state_dict({"step": 3})


def test_eval_batches_fixed_dp_split_and_distinct_from_train(token_file):
    ds = TokenDataset(token_file, "val")
    full = eval_batches(ds, 8, 4, 0, 1, num_batches=3, seed=5)
    assert len(full) == 3 and full[0][0].shape == (4, 8)
    torch.testing.assert_close(full, eval_batches(ds, 8, 4, 0, 1, num_batches=3, seed=5))
    halves = [eval_batches(ds, 8, 4, r, 2, num_batches=3, seed=5) for r in range(2)]
    for i in range(3):
        torch.testing.assert_close(torch.cat([halves[0][i][0], halves[1][i][0]]), full[i][0])
    assert not torch.equal(full[0][0], BatchSampler(ds, 8, 4, 0, 1, seed=5).next_batch()[0])


def test_missing_bin(tmp_path):
    with pytest.raises(DataError, match=r"data\.path: token file '.*missing\.bin' does not exist"):
        TokenDataset(tmp_path / "missing.bin", "train")


def test_missing_json(token_file):
    token_file.with_suffix(".json").unlink()
    with pytest.raises(DataError, match=r"data\.path: metadata '.*tokens\.json'.*does not exist"):
        TokenDataset(token_file, "train")


def test_wrong_format_or_version(token_file):
    mpath = token_file.with_suffix(".json")
    meta = json.loads(mpath.read_text())
    mpath.write_text(json.dumps({**meta, "version": 2}))
    with pytest.raises(DataError, match=r"data\.path: .*version 1"):
        TokenDataset(token_file, "train")
    mpath.write_text("{not json")
    with pytest.raises(DataError, match=r"data\.path: .*not valid JSON"):
        TokenDataset(token_file, "train")


def test_size_mismatch(token_file):
    with open(token_file, "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(DataError, match=r"data\.path: token file .* bytes, expected"):
        TokenDataset(token_file, "train")


def test_empty_split(tmp_path, corpus):
    out = tmp_path / "t.bin"
    prepare([corpus], out, val_fraction=0.0, log=quiet)
    with pytest.raises(DataError, match=r"data\.path: the val split .* is empty"):
        TokenDataset(out, "val")
    with pytest.raises(DataError, match="split must be 'train' or 'val'"):
        TokenDataset(out, "test")


def test_block_size_too_large(token_file):
    ds = TokenDataset(token_file, "val")
    with pytest.raises(DataError, match=r"model\.block_size"):
        BatchSampler(ds, len(ds), 4, 0, 1, seed=0)
    BatchSampler(ds, len(ds) - 1, 4, 0, 1, seed=0).next_batch()  # the largest block that fits
    with pytest.raises(DataError, match=r"model\.block_size"):
        eval_batches(ds, len(ds), 4, 0, 1, num_batches=1, seed=0)


def test_batch_not_divisible(token_file):
    ds = TokenDataset(token_file, "train")
    with pytest.raises(DataError, match=r"train\.global_batch_size: 6 .* data-parallel size 4"):
        BatchSampler(ds, 8, 6, 0, 4, seed=0)
    with pytest.raises(DataError, match=r"eval\.batch_size"):
        eval_batches(ds, 8, 6, 0, 4, num_batches=1, seed=0, batch_field="eval.batch_size")


def test_default_corpus_files():
    files = default_corpus_files(max_bytes=300_000)
    assert files and files == default_corpus_files(max_bytes=300_000)
    assert all(f.suffix == ".py" and f.is_file() for f in files)
    assert sum(f.stat().st_size for f in files) <= 300_000
    assert not any(set(f.parts) & {"site-packages", "test", "tests", "idlelib", "lib2to3"} for f in files)
    bigger = default_corpus_files(max_bytes=600_000)
    assert bigger[:len(files)] == files and len(bigger) > len(files)


def test_ensure_data_builds_once(tmp_path, monkeypatch):
    small = default_corpus_files(max_bytes=50_000)
    monkeypatch.setattr(D, "default_corpus_files", lambda max_bytes=4_000_000: small)
    out = tmp_path / "auto" / "tokens.bin"
    ensure_data(out, log=quiet)
    assert len(TokenDataset(out, "train")) > 0 and len(TokenDataset(out, "val")) > 0
    stamp = os.stat(out).st_mtime_ns
    ensure_data(out, log=quiet)
    assert os.stat(out).st_mtime_ns == stamp
