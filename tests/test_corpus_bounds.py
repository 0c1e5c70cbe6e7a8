"""The corpus readers' bounds on what they DECODE, not on what a file declares, with memory measured in a fresh
process (VmHWM): a 299-byte parquet file whose dictionary-encoded text column decodes to 1.2 GB is refused
before a row is read (the footer declares 1 MiB); the row-group bound finds the text column's own leaf when a
struct column precedes it; large_string and dictionary<string> (a pandas category) columns are text; a jsonl
line far past its cap is refused after reading no more than the cap (a reader that reads the whole line first
holds the whole line). Planted: the old reader (declared size, top-level column index, string only, or a
whole-line read) fails each."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megalite.base import corpus
from megalite.base.errors import DataError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

# VmHWM (this process's peak RSS), not ru_maxrss: Linux keeps ru_maxrss across exec, so a child of pytest
# would start at pytest's own peak
PEAK = """
import re, sys
from pathlib import Path
from megalite.base.corpus import records
from megalite.base.errors import DataError
hwm = lambda: int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
import pyarrow.parquet  # its import is not the reader's memory
base = hwm()
try:
    n = sum(1 for _ in records(Path(sys.argv[1]), "text"))
    said = f"read {n}"
except DataError as e:
    said = str(e)
print((hwm() - base) // 1024, said)
"""


def peak_mib(path: Path) -> tuple[int, str]:
    """(MiB the reader added to a fresh interpreter's peak RSS, what it said) for `records(path)`."""
    p = subprocess.run([sys.executable, "-c", PEAK, str(path)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    mib, said = p.stdout.strip().split(" ", 1)
    return int(mib), said


def test_a_dictionary_bomb_is_refused_on_its_decoded_size_within_64_mib(tmp_path):
    path = tmp_path / "bomb.parquet"
    one = pa.DictionaryArray.from_arrays(pa.array([0] * 1200, type=pa.int32()), pa.array(["x" * (1 << 20)]))
    pq.write_table(pa.table({"text": one}), path, compression="zstd", store_schema=False)
    assert path.stat().st_size < 1000 and pq.ParquetFile(path).schema_arrow.field("text").type == pa.string()
    mib, said = peak_mib(path)
    print(f"{path.stat().st_size} bytes -> 1,258,291,200 decoded: refused at +{mib} MiB peak")
    assert "row group 0: column 'text' decodes to 1,258,291,200 bytes of text" in said, said
    assert mib < 64, f"+{mib} MiB: the column was decoded (1.2 GB) before the bound was checked"


def test_the_row_group_bound_checks_the_text_column_after_a_struct(tmp_path, monkeypatch):
    path = tmp_path / "s.parquet"
    meta = pa.array([{"a": 1, "b": "y" * 10}] * 4)
    pq.write_table(pa.table({"meta": meta, "text": ["z" * 5000] * 4}), path, compression="none")
    monkeypatch.setattr(corpus, "MAX_ROW_GROUP_BYTES", 19_000)  # text: 20,000 bytes decoded; meta far less
    with pytest.raises(DataError, match=r"row group 0: column 'text' (is|decodes to) 2\d,\d{3} bytes"):
        list(corpus.records(path, "text"))
    monkeypatch.setattr(corpus, "MAX_ROW_GROUP_BYTES", 30_000)
    assert list(corpus.records(path, "text")) == [b"z" * 5000] * 4


@pytest.mark.parametrize("kind", ["large_string", "category"])
def test_large_string_and_pandas_category_columns_are_text(tmp_path, kind):
    path = tmp_path / f"{kind}.parquet"
    texts = ["one", "two", "one", "three"]
    col = pa.array(texts, type=pa.large_string()) if kind == "large_string" else \
        pa.array(texts).dictionary_encode()  # what pandas writes for a category column
    pq.write_table(pa.table({"text": col}), path)
    t = pq.ParquetFile(path).schema_arrow.field("text").type
    assert (pa.types.is_large_string(t) if kind == "large_string" else pa.types.is_dictionary(t)), t
    assert list(corpus.records(path, "text")) == [x.encode() for x in texts]


def test_a_jsonl_line_far_past_its_cap_is_refused_after_reading_at_most_the_cap(tmp_path):
    path = tmp_path / "long.jsonl"
    with open(path, "wb") as f:
        f.write(json.dumps({"text": "ok"}).encode() + b"\n")
        f.truncate(f.tell() + 512 * (1 << 20))  # a 512 MiB line (sparse: no disk), no newline
    mib, said = peak_mib(path)
    print(f"a 512 MiB line, cap {corpus.MAX_RECORD_BYTES >> 20} MiB: refused at +{mib} MiB peak")
    assert "line 2 is longer than 64 MiB" in said, said
    assert mib < 200, f"+{mib} MiB: the whole line was read before the cap was checked"
