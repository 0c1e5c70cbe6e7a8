"""The records of a corpus file, as `megalite prepare` reads them: a `.jsonl` file holds one document per line
(a JSON object whose `text_field` is a string) and a `.parquet` file one per row (its `text_field` column,
strings), as most open corpora ship (FineWeb, The Pile, RedPajama: parquet or jsonl); a plain text file is one
document (data.prepare reads it in pieces). Memory stays bounded by what is in flight: one jsonl line (at most
MAX_RECORD_BYTES) or one parquet row group's text column (at most MAX_ROW_GROUP_BYTES decoded, counted on its
dictionary-encoded form before a row is yielded; pyarrow reads the file one row group at a time). A bad record
is one line naming the file, the line or row group and row, and the field.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from .errors import DataError
from .fs import by_descriptor, open_read

RECORD_SUFFIXES = (".jsonl", ".parquet")
MAX_RECORD_BYTES = 1 << 26  # 64 MiB: a jsonl line is parsed whole
MAX_ROW_GROUP_BYTES = 1 << 30  # 1 GiB: a parquet row group's text column is read whole
DEFAULT_TEXT_FIELD = "text"


def records(path: Path, field: str = DEFAULT_TEXT_FIELD) -> Iterator[bytes]:
    """The text of each record of a .jsonl or .parquet file, in order, as UTF-8."""
    return _jsonl(path, field) if path.suffix == ".jsonl" else _parquet(path, field)


def _jsonl(path: Path, field: str) -> Iterator[bytes]:
    """Each non-blank line's `field`; one line is held at a time (read with a cap: a line without an end is
    never read whole)."""
    with open_read(path, follow=True) as f:  # a FIFO refused at open, never waited on
        for number, raw in enumerate(iter(lambda: f.readline(MAX_RECORD_BYTES + 1), b""), start=1):
            where = f"prepare: '{path}' line {number}"
            if len(raw) > MAX_RECORD_BYTES:
                raise DataError(f"{where} is longer than {MAX_RECORD_BYTES >> 20} MiB (a record is read whole; "
                                f"split the document)")
            if not raw.strip():
                continue  # a blank line (a trailing newline, an editor's) is no record
            try:
                record = json.loads(raw)
            except RecursionError:
                raise DataError(f"{where}: the JSON nests too deeply, expected an object with a '{field}' "
                                f"string") from None
            except ValueError as e:  # UnicodeDecodeError included
                raise DataError(f"{where} is not JSON ({e}), expected an object with a '{field}' string") from None
            if not isinstance(record, dict):
                raise DataError(f"{where} is {_JSON_KINDS.get(type(record), 'a string or null')}, expected a JSON "
                                f"object with a '{field}' string")
            yield _text(record.get(field, _MISSING), where, field)


def _parquet(path: Path, field: str) -> Iterator[bytes]:
    """Each row's `field`, one row group at a time. The text column is read dictionary-encoded (as a dictionary
    of distinct strings and an index per row: never expanded), so its DECODED size is known before one row is
    yielded: a row group whose text decodes to more than MAX_ROW_GROUP_BYTES is refused (a 299-byte file whose
    one 1 MiB string repeats 1,200 times decodes to 1.2 GB; the footer declares 1 MiB). The footer's declared
    size is checked first, for the text column's own leaf (found by its path, not by its place among the
    top-level columns: a struct before it has several leaves). Strings, large strings and dictionaries of
    either (a pandas category) are text."""
    try:
        import pyarrow
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError(f"prepare: '{path}' is a parquet file, which needs the `pyarrow` package ({e}): "
                        f"`pip install pyarrow` (or megalite[parquet])") from None
    with by_descriptor(path) as name:  # a FIFO refused at open; pyarrow keeps a handle of its own on the file
        try:
            names = pq.ParquetFile(name).schema_arrow.names
            if field in names:
                pf = pq.ParquetFile(name, read_dictionary=[field])  # the text column as stored: never expanded
        except (pyarrow.ArrowException, OSError) as e:
            raise DataError(f"prepare: '{path}' is not a readable parquet file ({e})") from None
    if field not in names:
        raise DataError(f"prepare: '{path}' has no column '{field}' (columns: {', '.join(names[:20])}); "
                        f"--text-field names the text column")
    kind = pf.schema_arrow.field(field).type
    values = kind.value_type if pyarrow.types.is_dictionary(kind) else kind
    if not (pyarrow.types.is_string(values) or pyarrow.types.is_large_string(values)):
        raise DataError(f"prepare: '{path}' column '{field}' holds {kind}, expected strings")
    schema = pf.metadata.schema
    leaf = next((i for i in range(len(schema)) if schema.column(i).path == field), None)
    for rg in range(pf.metadata.num_row_groups):
        meta = pf.metadata.row_group(rg)
        size = meta.column(leaf).total_uncompressed_size if leaf is not None else 0
        if size > MAX_ROW_GROUP_BYTES:
            raise DataError(f"prepare: '{path}' row group {rg}: column '{field}' is {size:,} bytes "
                            f"uncompressed, above {MAX_ROW_GROUP_BYTES >> 20} MiB (a row group is read whole; "
                            f"rewrite the file with smaller row groups)")
        try:
            column = pf.read_row_group(rg, columns=[field]).column(0)
            decoded = sum(_decoded_bytes(chunk, pyarrow, pc) for chunk in column.chunks)
        except (pyarrow.ArrowException, OSError) as e:
            raise DataError(f"prepare: '{path}' row group {rg} cannot be read ({e})") from None
        if decoded > MAX_ROW_GROUP_BYTES:
            raise DataError(f"prepare: '{path}' row group {rg}: column '{field}' decodes to {decoded:,} bytes of "
                            f"text ({size:,} stored), above {MAX_ROW_GROUP_BYTES >> 20} MiB (a row group's text "
                            f"is read whole; rewrite the file with smaller row groups)")
        row = 0
        for chunk in column.chunks:
            for value in chunk:
                yield _text(value.as_py(), f"prepare: '{path}' row group {rg}, row {row}", field)
                row += 1
        del column


def _decoded_bytes(chunk, pyarrow, pc) -> int:
    """The bytes of text a column chunk holds once every row is decoded, counted without decoding it."""
    if pyarrow.types.is_dictionary(chunk.type):
        lengths = pc.take(pc.binary_length(chunk.dictionary), chunk.indices)
    else:
        lengths = pc.binary_length(chunk)
    return pc.sum(lengths).as_py() or 0


_MISSING = object()


def _text(value, where: str, field: str) -> bytes:
    if isinstance(value, str):
        try:
            return value.encode("utf-8")  # JSON may spell a lone surrogate (\\ud800): not text any tokenizer reads
        except UnicodeEncodeError as e:
            raise DataError(f"{where}: field '{field}' holds {value[e.start]!r} at character {e.start}, which is "
                            f"not text (a lone surrogate)") from None
    if value is _MISSING:
        raise DataError(f"{where}: field '{field}' is missing, expected a string (--text-field names another)")
    what = "null" if value is None else _JSON_KINDS.get(type(value), type(value).__name__)
    raise DataError(f"{where}: field '{field}' is {what}, expected a string")


_JSON_KINDS = {bool: "a boolean", int: "a number", float: "a number", list: "an array", dict: "an object"}
