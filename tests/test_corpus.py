"""What `megalite prepare` reads and holds out: whole documents drawn across the corpus for validation (against a
hand computation of the draw), the old tail split as an option, .jsonl and .parquet corpora (each record a
document, `--text-field`), and every kind of bad record refused in one line naming the file, the line or row
group and the field, with nothing written."""
import hashlib
import json
import os

import numpy as np
import pytest

from megalite.cli import main
from megalite.data import DataError, TokenDataset, prepare

EOT = "\n\n"  # the byte tokenizer's document separator


def quiet(*_args):
    pass


def by_hand(index: int, fraction: float) -> bool:
    """docs/training.md's rule, computed here from its words: blake2b (8-byte digest) of the index's decimal
    digits, big-endian, over 2**64, below the fraction."""
    digest = hashlib.blake2b(str(index).encode("ascii"), digest_size=8).digest()
    return sum(b << (8 * (7 - k)) for k, b in enumerate(digest)) < fraction * 2**64


def texts(n: int) -> list:
    return [f"document {i}: " + "word " * (i % 7 + 1) for i in range(n)]


def decode(path, split=None) -> str:
    if split is None:
        return np.fromfile(path, dtype=np.uint16).tobytes()[::2].decode()  # byte ids < 256: low bytes
    return bytes(TokenDataset(path, split).tokens.astype(np.uint8).tolist()).decode()


def test_validation_documents_are_drawn_across_the_corpus_as_computed_by_hand(tmp_path):
    docs = texts(60)
    src = tmp_path / "src"
    src.mkdir()
    for i, t in enumerate(docs):
        (src / f"{i:03d}.txt").write_text(t)  # a folder is read sorted: file i is document i
    meta = prepare([src], tmp_path / "t.bin", val_fraction=0.25, log=quiet)
    held = [i for i in range(60) if by_hand(i, 0.25)]
    assert held == [2, 6, 17, 18, 23, 29, 34, 47, 50, 51, 52, 55, 56, 58]  # spread over the whole corpus
    kept = [i for i in range(60) if i not in held]
    assert decode(tmp_path / "t.bin", "train") == EOT.join(docs[i] for i in kept)
    assert decode(tmp_path / "t.bin", "val") == EOT + EOT.join(docs[i] for i in held)  # each after a separator
    assert (meta["val_split"], meta["val_documents"], meta["documents"]) == ("documents", len(held), 60)
    assert meta["val_start"] == len(EOT.join(docs[i] for i in kept).encode())


def test_the_tail_split_is_an_option_and_the_fallback_for_a_single_document(tmp_path):
    docs = texts(60)
    src = tmp_path / "src"
    src.mkdir()
    for i, t in enumerate(docs):
        (src / f"{i:03d}.txt").write_text(t)
    meta = prepare([src], tmp_path / "tail.bin", val_fraction=0.25, log=quiet, val_split="tail")
    whole = EOT.join(docs)
    n = len(whole.encode())
    assert decode(tmp_path / "tail.bin") == whole  # corpus order
    assert (meta["val_split"], meta["val_start"], meta["val_documents"]) == ("tail", n - int(n * 0.25), 0)
    one = prepare([src / "002.txt"], tmp_path / "one.bin", val_fraction=0.25, log=quiet)  # drawn, yet alone
    assert (one["val_split"], one["val_start"]) == ("tail", len(docs[2]) - int(len(docs[2]) * 0.25))
    assert decode(tmp_path / "one.bin") == docs[2]


def test_a_run_uses_the_files_split_unless_data_val_fraction_says_otherwise(tmp_path):
    from megalite.config import Config
    src = tmp_path / "src"
    src.mkdir()
    for i, t in enumerate(texts(60)):
        (src / f"{i:03d}.txt").write_text(t)
    meta = prepare([src], tmp_path / "t.bin", val_fraction=0.25, log=quiet)
    assert Config().data.val_fraction == 0  # the default: the file's own split
    assert len(TokenDataset(tmp_path / "t.bin", "val")) == meta["num_tokens"] - meta["val_start"]
    n = meta["num_tokens"]
    assert len(TokenDataset(tmp_path / "t.bin", "val", 0.5)) == int(n * 0.5)


def test_prepare_reads_jsonl_and_parquet_records_as_documents(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    docs = texts(12)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"id": i, "body": t}) + "\n" + ("\n" if i == 3 else "")
                                              for i, t in enumerate(docs[:5])))
    pq.write_table(pa.table({"body": docs[5:], "n": list(range(7))}), tmp_path / "b.parquet", row_group_size=3)
    assert main(["prepare", str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet"), "--out", str(tmp_path / "r.bin"),
                 "--text-field", "body", "--val-split", "tail"]) == 0
    assert decode(tmp_path / "r.bin") == EOT.join(docs)
    line = capsys.readouterr().out.strip()
    assert line.startswith("prepare: wrote ") and " from 2 files (12 documents) to " in line, line
    meta = json.loads((tmp_path / "r.json").read_text())
    assert meta["documents"] == 12
    # a folder of them, with the document draw: records are documents of the draw like files are
    (tmp_path / "f").mkdir()
    os.replace(tmp_path / "a.jsonl", tmp_path / "f" / "a.jsonl")
    os.replace(tmp_path / "b.parquet", tmp_path / "f" / "b.parquet")
    meta = prepare([tmp_path / "f"], tmp_path / "d.bin", val_fraction=0.3, log=quiet, text_field="body")
    held = [i for i in range(12) if by_hand(i, 0.3)]
    assert held and meta["val_documents"] == len(held)
    assert decode(tmp_path / "d.bin", "val") == EOT + EOT.join(docs[i] for i in held)


def _bad(tmp_path, name, write, field="text"):
    path = tmp_path / name
    write(path)
    out = tmp_path / "out.bin"
    with pytest.raises(DataError) as e:
        prepare([path], out, log=quiet, text_field=field)
    msg = str(e.value)
    assert "\n" not in msg and f"'{path}'" in msg, msg
    assert sorted(p.name for p in tmp_path.iterdir()) == [name], "something was written"
    path.unlink()
    return msg


def test_bad_records_are_one_line_naming_the_file_the_place_and_the_field(tmp_path):
    good = json.dumps({"text": "fine"}) + "\n"
    cases = [  # (file content, what the message must say)
        (good + '{"text": 7}\n', ["line 2", "field 'text' is a number, expected a string"]),
        (good + good + '{"txt": "x"}\n', ["line 3", "field 'text' is missing"]),
        ('{"text": null}\n', ["line 1", "field 'text' is null"]),
        (good + "[1, 2]\n", ["line 2", "is an array, expected a JSON object"]),
        (good + '{"text": "cut\n', ["line 2", "is not JSON"]),
        ('{"text": "\\ud800"}\n', ["line 1", "field 'text' holds '\\ud800'", "lone surrogate"]),
        ("[" * 100_000 + "\n", ["line 1", "nests too deeply"]),
    ]
    for content, want in cases:
        msg = _bad(tmp_path, "c.jsonl", lambda p: p.write_text(content, encoding="utf-8", errors="surrogatepass"))
        assert all(w in msg for w in want), (want, msg)
    (tmp_path / "c.jsonl").write_bytes(b'{"text": "\xff"}\n')
    with pytest.raises(DataError, match=r"line 1 is not JSON"):
        prepare([tmp_path / "c.jsonl"], tmp_path / "o.bin", log=quiet)


def test_a_jsonl_line_past_the_record_cap_is_refused_without_reading_it_whole(tmp_path, monkeypatch):
    import megalite.base.corpus as C
    monkeypatch.setattr(C, "MAX_RECORD_BYTES", 1000)
    msg = _bad(tmp_path, "big.jsonl", lambda p: p.write_text(json.dumps({"text": "x" * 5000}) + "\n"))
    assert "line 1 is longer than" in msg


def test_bad_parquet_files_are_one_line(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    import megalite.base.corpus as C
    msg = _bad(tmp_path, "n.parquet", lambda p: pq.write_table(pa.table({"text": ["a", "b", None, "d"]}), p,
                                                                row_group_size=2))
    assert "row group 1, row 0: field 'text' is null" in msg
    msg = _bad(tmp_path, "c.parquet", lambda p: pq.write_table(pa.table({"content": ["a"]}), p))
    assert "has no column 'text' (columns: content)" in msg
    msg = _bad(tmp_path, "i.parquet", lambda p: pq.write_table(pa.table({"text": [1, 2]}), p))
    assert "column 'text' holds int64, expected strings" in msg
    msg = _bad(tmp_path, "x.parquet", lambda p: p.write_bytes(b"PAR1 not really"))
    assert "is not a readable parquet file" in msg
    monkeypatch.setattr(C, "MAX_ROW_GROUP_BYTES", 100)
    msg = _bad(tmp_path, "g.parquet", lambda p: pq.write_table(pa.table({"text": ["y" * 50] * 10}), p,
                                                                row_group_size=5))
    assert "row group 0: column 'text' is" in msg and "bytes uncompressed" in msg


def test_records_are_read_one_jsonl_line_and_one_parquet_row_group_at_a_time(tmp_path, monkeypatch):
    """The same bounded memory as plain text: a 24 MB jsonl corpus is prepared with a traced peak far below its
    size, and a parquet file is read through read_row_group, one group after the other, never whole."""
    import tracemalloc
    line = json.dumps({"text": "word " * 2000}) + "\n"  # ~10 KB a record
    (tmp_path / "big.jsonl").write_text(line * 2400)
    size = (tmp_path / "big.jsonl").stat().st_size
    tracemalloc.start()
    try:
        prepare([tmp_path / "big.jsonl"], tmp_path / "big.bin", log=quiet, val_split="tail")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert size > 24e6 and peak < size / 3, (size, peak)
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": texts(10)}), tmp_path / "r.parquet", row_group_size=3)
    groups, real = [], pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", lambda self, i, **kw: groups.append(i) or real(self, i, **kw))
    monkeypatch.setattr(pq.ParquetFile, "read", lambda *a, **kw: pytest.fail("the whole file was read"))
    monkeypatch.setattr(pq, "read_table", lambda *a, **kw: pytest.fail("the whole file was read"))
    prepare([tmp_path / "r.parquet"], tmp_path / "r.bin", log=quiet, val_split="tail")
    assert groups == [0, 1, 2, 3]
    assert decode(tmp_path / "r.bin") == EOT.join(texts(10))


def test_tokenizer_train_reads_records_as_prepare_does(tmp_path):
    """`megalite tokenizer train` on a .jsonl and a .parquet file learns from their texts, not their bytes: the
    same tokenizer as from the same texts in plain files (JSON's quotes and parquet's binary never seen)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    docs = [f"the cat {i} sat on the mat; " * 40 for i in range(8)]
    (tmp_path / "plain").mkdir()
    for i, t in enumerate(docs):
        (tmp_path / "plain" / f"{i}.txt").write_text(t)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in docs[:4]))
    pq.write_table(pa.table({"body": docs[4:]}), tmp_path / "b.parquet", row_group_size=2)
    assert main(["tokenizer", "train", str(tmp_path / "plain"), "--vocab-size", "300", "--out",
                 str(tmp_path / "t1"), "--quiet"]) == 0
    assert main(["tokenizer", "train", str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet"), "--text-field", "body",
                 "--vocab-size", "300", "--out", str(tmp_path / "t2"), "--quiet"]) == 0
    assert (tmp_path / "t1" / "tokenizer.json").read_text() == (tmp_path / "t2" / "tokenizer.json").read_text()
