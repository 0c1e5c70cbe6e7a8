"""Token data: prepare a corpus with a tokenizer, read it back, and draw batches.

The default tokenizer is UTF-8 bytes (vocab 256: nothing to download or train) and the default corpus is the
Python standard library's own sources, so a first run needs no network; `--tokenizer` takes a BPE (a
tokenizer.json, an HF tokenizer folder, GPT-2's vocab.json + merges.txt). On disk a corpus is a flat
``uint16`` (``uint32`` for a vocabulary above 65,536) ``.bin`` file plus a ``.json`` with the same stem that
says how to read it and which tokenizer made it (docs/tokenizers.md has the format).

Batches are a pure function of ``(seed, batch_index)``: every data-parallel
rank draws the same global batch and keeps only its own rows.  That makes a run
with N dp ranks see exactly the data a single process would, and makes resuming
a matter of restoring one integer.
"""

from __future__ import annotations

import hashlib
import json
import io
import os
import shutil
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..base.fs import (folder_locked, fsync_dir, identity as file_identity, kind_of, no_follow, open_read,
                      path_kind, read_all, unlink_quietly, what_is, write_new)
from ..base import limits
from ..base.corpus import DEFAULT_TEXT_FIELD, RECORD_SUFFIXES, records
from ..config import MAX_COUNT
from ..base.errors import DataError
from ..base.jsonio import loads
from ..tokenizer import FORCED_CUT, Tokenizer, load as load_tokenizer, of_token_file, read_text_pieces
from .masks import open_mask

if TYPE_CHECKING:  # torch is imported where batches are made: `megalite prepare` never loads it
    import torch

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
FORMAT = "megalite-tokens"
VERSION = 1
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".toml", ".c", ".h", *RECORD_SUFFIXES)
_SKIP_STDLIB_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3"}


def meta_path(path: str | Path) -> Path:
    """The JSON file that describes the token file at ``path``."""
    return Path(path).with_suffix(".json")


def default_corpus_files(max_bytes: int = 4_000_000) -> list[Path]:
    """The stdlib's own ``.py`` files, sorted, up to ``max_bytes`` in total.

    Sorting by relative path keeps the corpus identical across machines with
    the same Python version; tests and vendored tools are skipped because they
    are large and repetitive.  Files are taken in order and the walk stops at
    the first file that would push the total past ``max_bytes``.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_STDLIB_DIRS]
        found += [Path(dirpath) / n for n in filenames if n.endswith(".py")]
    found.sort(key=lambda p: p.relative_to(root).as_posix())
    files, total = [], 0
    for path in found:
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        files.append(path)
        total += size
    return files


def expand_sources(sources: list[str | Path]) -> list[Path]:
    """Files named directly, plus text files found (sorted) under named folders."""
    files: list[Path] = []
    for source in sources:
        path = Path(source)
        if not path.exists():
            raise DataError(f"prepare: source '{source}' does not exist")
        if path.is_dir():
            found = [p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES]
            files.extend(sorted(found, key=lambda p: p.relative_to(path).as_posix()))
        elif not path.is_file():  # a FIFO or a device (/dev/zero) would block or never end
            raise DataError(f"prepare: source '{source}' is {kind_of(path.stat())}, expected a text file or a folder")
        else:
            files.append(path)
    return files


def token_dtype(vocab_size: int):
    """uint16 while every id fits (vocab <= 65,536), else uint32."""
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def tokenizer_path(out: Path) -> Path:
    """Where prepare keeps a copy of the tokenizer beside a token file (none for the byte tokenizer)."""
    return out.with_name(out.stem + ".tokenizer.json")


class _Progress:
    """`prepare: 1.20/3.40 GB (35%), 4.1 MB/s, 1,234,567 tokens, ETA 0m32s` on stderr: a line rewritten in
    place about once a second on a terminal, a new line every 10 s in a log."""

    def __init__(self, total: int, on: bool):
        self.total, self.on, self.t0 = total, on, time.monotonic()
        self.last, self.tty = self.t0, on and sys.stderr.isatty()
        self.every = 1.0 if self.tty else 10.0

    def show(self, done: int, tokens: int, final: bool = False) -> None:
        now = time.monotonic()
        if not self.on or (now - self.last < self.every and not final):
            return
        self.last = now
        rate = done / max(now - self.t0, 1e-9)
        eta = (self.total - done) / rate if rate > 0 else 0.0
        line = (f"prepare: {done / 1e9:.2f}/{self.total / 1e9:.2f} GB ({100 * done / max(self.total, 1):.0f}%), "
                f"{rate / 1e6:.1f} MB/s, {tokens:,} tokens, ETA {int(eta) // 60}m{int(eta) % 60:02d}s")
        print(f"\r{line}" if self.tty else line, end="\n" if final or not self.tty else "", file=sys.stderr,
              flush=True)


def _pieces(files: list[Path], piece_chars: int, specials: tuple = (), forced=None,
            text_field: str = DEFAULT_TEXT_FIELD):
    """(document index, text piece, its length) for every document in order: a plain file is one, and so is
    each line of a .jsonl file and each row of a .parquet file (base.corpus.records); each document's last
    item is (index, "", 0), even when it is empty. `forced`: a list that gets (file, character offset) for
    each cut made inside a run without any word boundary."""
    doc = 0
    for path in files:
        texts = (io.BytesIO(t) for t in records(path, text_field)) if path.suffix in RECORD_SUFFIXES else [path]
        for text in texts:
            note = None if forced is None else (lambda at, path=path: forced.append((path, at)))
            for piece in read_text_pieces(text, piece_chars, specials=specials, on_forced_cut=note):
                yield doc, piece, len(piece)
            yield doc, "", 0
            doc += 1


VAL_SPLITS = ("documents", "tail")


def is_val_document(index: int, val_fraction: float) -> bool:
    """Whether document `index` (0-based, in corpus order: files as named, folders sorted, records in file
    order) goes to the validation split: u = the 8-byte blake2b digest of the index's decimal digits, read as
    a big-endian integer / 2**64, and the document is held out when u < val_fraction. A fixed draw (no seed,
    the same on every machine), independent of the text, so ~val_fraction of the documents from all over
    the corpus, whatever order it comes in."""
    u = int.from_bytes(hashlib.blake2b(str(index).encode(), digest_size=8).digest(), "big") / 2**64
    return u < val_fraction


class _Split:
    """One split's ids as they are written: a file, its token count, the last document written to it (a
    separator goes between two documents of the same split) and how many documents it holds."""

    def __init__(self, f, sep: np.ndarray):
        self.f, self.sep, self.tokens, self.top, self.last, self.docs = f, sep, 0, -1, -1, 0

    def write(self, doc: int, arr: np.ndarray) -> None:
        if doc != self.last:
            if self.docs:
                self.f.write(self.sep.tobytes())
                self.tokens, self.top = self.tokens + self.sep.size, max(self.top, int(self.sep.max(initial=0)))
            self.last, self.docs = doc, self.docs + 1
        if arr.size:
            self.top = max(self.top, int(arr.max()))
            self.f.write(arr.tobytes())
            self.tokens += arr.size


def _batches(pieces, batch_chars: int):
    batch, size = [], 0
    for item in pieces:
        batch.append(item)
        size += item[2]
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encode(tok: Tokenizer, texts: list[str], dtype) -> list[np.ndarray]:
    """Each text's ids as an array: bytes straight from UTF-8 for the byte tokenizer, else the tokenizers
    library's encode_batch (its threads, without the GIL)."""
    if tok.is_byte:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(dtype) for t in texts]
    return [np.array(e.ids, dtype=dtype) for e in tok.backend.encode_batch(texts)]


def outputs(out: Path, sidecar: bool) -> list[Path]:
    """What `prepare --out OUT` writes: OUT, its .json and (for a tokenizer other than bytes) the tokenizer's
    copy OUT.tokenizer.json: each an output, refused when it exists unless --force, and then only if ours."""
    return [out, meta_path(out)] + ([tokenizer_path(out)] if sidecar else [])


def check_out(out: Path, force: bool, sidecar: bool = False) -> None:
    """`prepare --out`: an existing token file (or a .json or tokenizer copy beside --out) is replaced only
    with --force, and --force replaces only a token file `megalite prepare` wrote, recognised by its .json
    (format 'megalite-tokens', the .bin of the size it records, the tokenizer copy of the sha256 it records):
    never a file of anything else, never through a symlink."""
    if out.suffix != ".bin":
        raise DataError(f"prepare: output '{out}' must end with .bin")
    present = [p for p in outputs(out, sidecar) if os.path.lexists(p)]
    if not present:
        return
    what = f"--out {out}" if present[0] == out else f"'{present[0]}' (the .json beside --out {out})" \
        if present[0] == meta_path(out) else f"'{present[0]}' (the tokenizer copy beside --out {out})"
    if not force:
        raise DataError(f"prepare: {what} already exists (pass --force to replace a token file `megalite prepare` "
                        f"wrote)")
    why = _not_a_token_file(out, sidecar)
    if why:
        raise DataError(f"prepare: {what} already exists and is not a token file `megalite prepare` wrote ({why}); "
                        f"--force replaces only such a file: remove it yourself or choose another --out")


def _not_a_token_file(out: Path, sidecar: bool = False) -> str:
    """'' when `out`, its .json (and tokenizer copy) are a token file prepare wrote, else why not."""
    mpath = meta_path(out)
    for p in outputs(out, sidecar):
        if os.path.lexists(p) and (p.is_symlink() or not p.is_file()):
            return f"'{p}' is {what_is(p)}"
    if not mpath.exists():
        return f"no '{mpath.name}' beside it says what it is"
    try:
        meta = loads(read_all(mpath, limits.FILE_BYTES["json"]), str(mpath), DataError)
    except (OSError, DataError):
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return f"'{mpath}' is not a '{FORMAT}' description"
    size = os.lstat(out).st_size if out.exists() else None
    width = np.dtype(TOKEN_DTYPES.get(meta.get("dtype"), np.uint16)).itemsize
    if size is not None and isinstance(meta.get("num_tokens"), int) and size != width * meta["num_tokens"]:
        return f"its size, {size} bytes, is not the {width * meta['num_tokens']} its .json records"
    tpath = tokenizer_path(out)
    if sidecar and os.path.lexists(tpath):
        with open_read(tpath) as f:
            sha = hashlib.sha256(f.read(limits.FILE_BYTES["tokenizer"] + 1)).hexdigest()
        if meta.get("tokenizer_file") != tpath.name or meta.get("tokenizer_sha256") != sha:
            return f"'{tpath}' is not the tokenizer copy '{mpath.name}' records"
    return ""


def prepare(sources: list[str | Path], out: str | Path, val_fraction: float = 0.1, log=print,
            tokenizer="byte", progress: bool = False, piece_chars: int = 1 << 17, batch_chars: int = 0,
            force: bool = False, val_split: str = "documents", text_field: str = DEFAULT_TEXT_FIELD) -> dict:
    """Tokenize text files into ``out`` (.bin) and its ``.json``; return the meta dict.

    Each plain file is a document, each line of a .jsonl file and each row of a .parquet file one (its
    `text_field`; base.corpus); documents are separated by the tokenizer's end-of-text token (two newlines
    for the byte tokenizer, which has none). Validation (`val_split`): "documents" holds out the documents
    `is_val_document` draws, ~`val_fraction` of them from all over the corpus, written after the training
    documents (the file is [train | val], val_start where they meet); with fewer than two documents, or a
    draw that leaves a split without one, it falls back to "tail": the last int(num_tokens * val_fraction)
    tokens, in corpus order (the split before documents were drawn). `tokenizer`: "byte", a tokenizer.json, an HF tokenizer folder,
    GPT-2's vocab.json, or a megalite.tokenizer.Tokenizer. Streams: files are read in pieces of
    ~`piece_chars` characters (cut where the tokenizer gives the ids of the whole text; a tokenizer that
    cannot be cut reads each file whole), ~`batch_chars` at a time (default: 2 pieces per core, 4 to 16)
    encoded in parallel by the tokenizers library's threads while the next batch is read, ids written as they
    come. Memory: a batch being encoded (~360 bytes per token at the peak: 512K characters, ~60 MB) and the
    next one's text, whatever the corpus size (a jsonl record or a parquet row group is read whole:
    base.corpus bounds both). A token file replaces an old one only once complete: the json is
    written last, so a token file with a json beside it is always complete. An existing output (the .bin,
    its .json, the tokenizer copy beside it) is replaced only with `force`, and only if prepare wrote it
    (`check_out`); of two runs to one `out`, the second to finish is refused (`_commit`).
    """
    out = Path(out)
    check_out(out, force)
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"prepare: val_fraction must be in [0, 1), got {val_fraction}")
    if val_split not in VAL_SPLITS:
        raise DataError(f"prepare: --val-split {val_split!r}: expected one of {', '.join(VAL_SPLITS)}")
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    check_out(out, force, sidecar=not tok.is_byte)
    found = {p: file_identity(p) for p in outputs(out, not tok.is_byte)}  # a writer finishing first changes these
    files = expand_sources(list(sources))
    if not files:
        raise DataError(f"prepare: no text found in sources {[str(s) for s in sources]} "
                        f"(folders are searched for {' '.join(TEXT_SUFFIXES)})")
    batch_chars = batch_chars or piece_chars * min(16, max(4, 2 * (os.cpu_count() or 1)))
    dtype = token_dtype(tok.vocab_size)
    sep = np.array([tok.eot_id] if tok.eot_id is not None else tok.encode("\n\n"), dtype=dtype)
    if not tok.streams_by_words():
        piece_chars = 1 << 62  # each file whole: a cut could change its ids
    out.parent.mkdir(parents=True, exist_ok=True)
    run_id = f"{os.getpid()}-{os.urandom(3).hex()}"  # two writers never share a temporary name
    temps = {p: p.with_name(f".{p.name}.tmp-{run_id}") for p in outputs(out, not tok.is_byte)}
    tmp = temps[out]
    tmp_val = out.with_name(f".{out.name}.val-tmp-{os.getpid()}")  # the held-out documents, appended at the end
    bar = _Progress(sum(f.stat().st_size for f in files), progress)
    chars, done_bytes, forced = 0, 0, []
    draw = val_split == "documents" and val_fraction > 0
    try:
        for t in (tmp, tmp_val):
            unlink_quietly(t)  # a stale one, or a symlink planted there: never written through
        with open(tmp, "wb", opener=no_follow) as f, open(tmp_val, "wb", opener=no_follow) as g, \
                ThreadPoolExecutor(max_workers=1) as pool:
            train, val = _Split(f, sep), _Split(g, sep)

            def write(batch, arrays):
                nonlocal chars
                for (doc, _, n), arr in zip(batch, arrays):
                    (val if draw and is_val_document(doc, val_fraction) else train).write(doc, arr)
                    chars += n

            pending = None  # (batch, future): encoded in a tokenizers thread while the next batch is read
            for batch in _batches(_pieces(files, piece_chars, tok.specials(), forced, text_field), batch_chars):
                nxt = (batch, pool.submit(_encode, tok, [text for _, text, _ in batch], dtype))
                if pending is not None:
                    write(pending[0], pending[1].result())
                    done_bytes += sum(n for _, _, n in pending[0])  # characters: ~bytes for most text
                    bar.show(done_bytes, train.tokens + val.tokens)
                pending = nxt
            if pending is not None:
                write(pending[0], pending[1].result())
            documents_in, held_out = train.docs + val.docs, val.docs
            if train.docs and val.docs:  # [train | sep | val]: val_start at the separator
                val_start = train.tokens
                f.write(sep.tobytes())
                g.flush()
                with open_read(tmp_val) as r:
                    shutil.copyfileobj(r, f, 1 << 20)
                num_tokens, top = train.tokens + sep.size + val.tokens, max(train.top, val.top, int(sep.max()))
            else:  # one split holds every document, in corpus order: the tail split
                whole = val if val.docs else train
                if whole is val:
                    g.flush()
                    with open_read(tmp_val) as r:
                        shutil.copyfileobj(r, f, 1 << 20)
                num_tokens, top, held_out = whole.tokens, whole.top, 0
                val_start = num_tokens - int(num_tokens * val_fraction)
            f.flush()
            os.fsync(f.fileno())
        unlink_quietly(tmp_val)
        bar.show(bar.total, num_tokens, final=True)
        if chars == 0 and len(files) == 1 and files[0].suffix not in RECORD_SUFFIXES:
            raise DataError(f"prepare: no text found in sources {[str(s) for s in sources]} "
                            f"(the file is empty)")
        if documents_in == 0:
            raise DataError(f"prepare: no documents found in sources {[str(s) for s in sources]} "
                            f"(every record file is empty)")
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "tokenizer": tok.kind,
            "tokenizer_sha256": tok.sha256,
            "vocab_size": tok.vocab_size,
            "eot_id": tok.eot_id,
            "max_token": top,  # checked against model.vocab_size when a run opens the file
            "dtype": np.dtype(dtype).name,
            "num_tokens": num_tokens,
            "val_start": val_start,
            "val_split": "documents" if held_out else "tail",
            "val_fraction": val_fraction,
            "val_documents": held_out,
            "documents": documents_in,
            "sources": [str(s) for s in sources],
        }
        if not tok.is_byte:
            meta["tokenizer_file"] = tokenizer_path(out).name  # relative to this json's folder
            write_new(temps[tokenizer_path(out)], tok.json.encode("utf-8"))
        write_new(temps[meta_path(out)], (json.dumps(meta, indent=2) + "\n").encode("utf-8"))
        _commit(out, temps, found)
    except BaseException:
        for t in [*temps.values(), tmp_val]:
            unlink_quietly(t)
        raise
    if forced:
        log(f"prepare: WARNING: {len(forced)} cut(s) inside runs of {piece_chars * FORCED_CUT:,} characters without "
            f"a space or any other word boundary, the first in {forced[0][0]} at character {forced[0][1]:,}: the "
            f"ids next to such a cut may differ from encoding the run whole (memory stays bounded)")
    docs = f" ({documents_in:,} documents)" if documents_in != len(files) else ""
    how = (f"{held_out:,} documents drawn across the corpus" if held_out
           else f"the last {val_fraction:.0%} of the tokens")
    log(f"prepare: wrote {num_tokens:,} tokens ({tok.kind} tokenizer, vocab {tok.vocab_size:,}, "
        f"{meta['dtype']}) from {len(files)} files{docs} to {out} (val: {how}, from token {val_start:,})")
    return meta


def _commit(out: Path, temps: dict, found: dict) -> None:
    """Move the finished outputs into place, the .json last (a token file with a .json beside it is always
    complete), under a lock on their folder and only if what is there is still what this run found when it
    started: of two `prepare` runs to one --out, the second to finish is refused instead of replacing the
    first's file (or a file that appeared meanwhile) without a word."""
    with folder_locked(out.parent):
        changed = [p for p, was in found.items() if file_identity(p) != was]
        if changed:
            raise DataError(f"prepare: '{changed[0]}' was written by another process while this one ran (two "
                            f"prepare runs to one --out?); this run's output is discarded and the other's kept: "
                            f"run again with --force to replace it, or choose another --out")
        for p in sorted(temps, key=lambda p: p == meta_path(out)):
            os.replace(temps[p], p)
    fsync_dir(out.parent)


def ensure_data(path: str | Path, log=print) -> None:
    """Build the default stdlib corpus at ``path`` unless it (and its json) already exist.

    Not safe to call from several ranks at once: the caller runs it on rank 0
    and barriers before anyone opens the data.
    """
    path = Path(path)
    if path.exists() and meta_path(path).exists():
        return
    log(f"data: '{path}' not found; building it from the Python standard library sources")
    prepare(default_corpus_files(), path, log=log, force=True)  # replaces only an incomplete corpus of its own


IDENTITY_BLOCKS, IDENTITY_BLOCK_BYTES = 16, 1 << 16  # what `identity` reads of a token file: 1 MiB at most


def identity(path: str | Path) -> str:
    """A token file's identity, the same on every host that holds the same file (unlike an inode or a
    modification time): its size, a hash of its .json and of 16 blocks of 64 KiB spread over it (the first and
    the last included), in milliseconds whatever its size. "missing" when there is no file; a file that cannot
    be read says why (the run itself then reports it)."""
    path = Path(path)
    h = hashlib.blake2b(digest_size=8)
    try:
        with open_read(path, follow=True) as f:
            size = os.fstat(f.fileno()).st_size
            for i in range(IDENTITY_BLOCKS):
                f.seek(max(0, size - IDENTITY_BLOCK_BYTES) * i // (IDENTITY_BLOCKS - 1))
                h.update(f.read(IDENTITY_BLOCK_BYTES))
        h.update(read_all(meta_path(path), 1 << 20, follow=True))
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    return f"{size} bytes, content hash {h.hexdigest()}"


class TokenDataset:
    """One split ("train" or "val") of a prepared token file, memory-mapped read-only.

    `val_fraction` (a training run's data.val_fraction): the last int(num_tokens * val_fraction) tokens are the
    validation split, as `prepare --val-fraction` computes it; None: the split the file's .json records."""

    def __init__(self, path: str | Path, split: str, val_fraction: float | None = None, what: str = "data.path"):
        path = Path(path)
        if split not in ("train", "val"):
            raise DataError(f"TokenDataset: split must be 'train' or 'val', got '{split}'")
        if not path.exists() and not path.is_symlink():
            raise DataError(f"{what}: token file '{path}' does not exist "
                            "(run `megalite prepare` or remove data.path to use the default corpus)")
        if not path.is_file():
            raise DataError(f"{what}: '{path}' is {path_kind(path)}, expected a token file written by "
                            f"`megalite prepare`")
        mpath = meta_path(path)
        if not mpath.exists():
            raise DataError(f"{what}: metadata '{mpath}' for token file '{path}' does not exist "
                            "(re-run `megalite prepare`)")
        raw = read_all(mpath, limits.FILE_BYTES["json"] + 1, follow=True)  # a regular file: a FIFO would block
        meta = loads(raw, f"{what}: metadata '{mpath}'", DataError, kind="json")
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise DataError(f"{what}: metadata '{mpath}' is not format '{FORMAT}' version {VERSION}")
        if meta.get("dtype") not in TOKEN_DTYPES:
            raise DataError(f"{what}: metadata '{mpath}' has dtype {meta.get('dtype')!r}, expected 'uint16' "
                            f"or 'uint32'")
        dtype = TOKEN_DTYPES[meta["dtype"]]
        num_tokens, val_start = meta.get("num_tokens"), meta.get("val_start")
        if not (isinstance(num_tokens, int) and isinstance(val_start, int) and 0 <= val_start <= num_tokens):
            raise DataError(f"{what}: metadata '{mpath}' needs integers 0 <= val_start <= num_tokens")
        if val_fraction is not None:
            val_start = num_tokens - int(num_tokens * val_fraction)
        size, itemsize = path.stat().st_size, np.dtype(dtype).itemsize
        if size != itemsize * num_tokens:
            raise DataError(f"{what}: token file '{path}' has {size} bytes, expected "
                            f"{itemsize * num_tokens} for num_tokens={num_tokens} ({meta['dtype']}) in '{mpath.name}'")
        lo, hi = (0, val_start) if split == "train" else (val_start, num_tokens)
        how = "" if val_fraction is None else f" (data.val_fraction = {val_fraction})"
        if hi <= lo:
            raise DataError(f"{what}: the {split} split of '{path}' is empty "
                            f"(num_tokens={num_tokens}, val_start={val_start}){how}")
        self.path, self.split, self.meta, self.how, self.what = path, split, meta, how, what
        vocab = meta.get("vocab_size", 256)  # a file that records none is the byte tokenizer's
        if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
            raise DataError(f"{what}: metadata '{mpath}' has vocab_size {vocab!r}, expected a positive integer")
        self.vocab_size = vocab
        self.limit = None  # the model's vocab size once check_vocab has run: every batch drawn is checked
        with open_read(path, follow=True) as f:  # the map outlives the descriptor; a FIFO is refused at open
            self.tokens = np.memmap(f, dtype=dtype, mode="r", shape=(num_tokens,))[lo:hi]
        mask = open_mask(path, meta, num_tokens, what)  # which targets count (data/masks.py); None: all
        self.mask = None if mask is None else mask[lo:hi]

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def tokenizer(self) -> Tokenizer:
        """The tokenizer that made this token file (tokenizer.of_token_file: the one owner of that question)."""
        return of_token_file(meta_path(self.path), self.meta, self.vocab_size)


SAMPLE_TOKENS = 1 << 20  # tokens read at start-up to check a recorded max_token (a strided sample)


def check_vocab(dataset: TokenDataset, model_vocab: int) -> None:
    """The data must fit the model, before step 1: its recorded vocab, and its token ids (the max recorded
    by `prepare`, confirmed on a strided sample; a file without a recorded max is scanned whole). Every
    batch drawn afterwards is checked too, so a corrupt id the sample missed stops the run, never trains."""
    mpath = meta_path(dataset.path)
    if dataset.vocab_size > model_vocab:
        raise DataError(f"{dataset.what}: '{mpath}' records vocab_size {dataset.vocab_size}, larger than "
                        f"model.vocab_size = {model_vocab} (token ids would not fit the embedding)")
    recorded = dataset.meta.get("max_token")
    toks = dataset.tokens
    if recorded is None:
        top = max((int(toks[i:i + SAMPLE_TOKENS].max()) for i in range(0, len(toks), SAMPLE_TOKENS)), default=0)
    else:
        if not isinstance(recorded, int) or isinstance(recorded, bool) or recorded < 0:
            raise DataError(f"{dataset.what}: '{mpath}' has max_token {recorded!r}, expected a non-negative integer")
        stride = max(1, len(toks) // SAMPLE_TOKENS)
        top = int(toks[::stride].max()) if len(toks) else 0
        if top > recorded:
            raise DataError(f"{dataset.what}: token file '{dataset.path}' holds id {top}, above the max_token "
                            f"{recorded} recorded in '{mpath.name}' (the file is corrupt; re-run `megalite prepare`)")
        top = recorded
    if top >= model_vocab:
        raise DataError(f"{dataset.what}: token file '{dataset.path}' holds token id {top}, expected ids below "
                        f"model.vocab_size = {model_vocab}")
    dataset.limit = model_vocab


def _check_shapes(dataset: TokenDataset, block_size: int, batch_size: int, dp_rank: int, dp_size: int,
                  batch_field: str) -> None:
    if block_size < 1 or len(dataset) < block_size + 1:
        raise DataError(f"train.seq_len (0: model.block_size): {block_size} needs at least {block_size + 1} tokens but the "
                        f"{dataset.split} split of '{dataset.path}' has {len(dataset)}{dataset.how}")
    if batch_size < 1 or dp_size < 1 or batch_size % dp_size != 0:
        raise DataError(f"{batch_field}: {batch_size} must be a positive multiple of the "
                        f"data-parallel size {dp_size}")
    if not 0 <= dp_rank < dp_size:
        raise DataError(f"data: dp_rank {dp_rank} must be in [0, {dp_size})")


class Batch(tuple):
    """This dp rank's rows of one global batch: the pair (x, y) of inputs and targets (b, T), plus `mask` (b, T)
    float32, 1 where a target counts (None: every target counts), and `counted`: the counted targets of the
    whole global batch (every dp rank's rows), the loss's denominator."""

    def __new__(cls, x, y, mask=None, counted: int | None = None):
        self = super().__new__(cls, (x, y))
        self.mask, self.counted = mask, int(y.numel()) if counted is None else counted
        self.docs = None  # (b, T) each input's document within its row (data/documents.py), or None
        return self

    @property
    def x(self):
        return self[0]

    @property
    def y(self):
        return self[1]


def rows_to_batch(rows: np.ndarray, mask_rows, dp_rank: int, dp_size: int) -> Batch:
    """The global batch's token rows (B, T + 1) and mask rows (B, T + 1) or None, as this dp rank's Batch."""
    per = rows.shape[0] // dp_size
    mine = slice(dp_rank * per, (dp_rank + 1) * per)
    import torch  # here, not at the top: `megalite prepare` never needs it (~200 MB of resident memory)
    x, y = torch.from_numpy(rows[mine, :-1].copy()), torch.from_numpy(rows[mine, 1:].copy())
    if mask_rows is None:
        return Batch(x, y, None, rows.shape[0] * (rows.shape[1] - 1))
    counted = int(mask_rows[:, 1:].sum())
    return Batch(x, y, torch.from_numpy(mask_rows[mine, 1:].astype(np.float32)), counted)


def _draw(dataset, block_size, batch_size, dp_rank, dp_size, rng) -> Batch:
    """Draw the global batch's start offsets from ``rng`` and slice out this dp rank's rows.

    All ranks draw all offsets so the result does not depend on dp_size.
    """
    starts = rng.integers(0, len(dataset) - block_size - 1, size=batch_size, endpoint=True)
    at = starts[:, None] + np.arange(block_size + 1)
    if dataset.limit is None and dataset.mask is None:  # rows of this rank only (the global batch: checked, masked)
        per_rank = batch_size // dp_size
        at = at[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        dp_rank, dp_size = 0, 1
    every = np.asarray(dataset.tokens[at], dtype=np.int64)
    if dataset.limit is not None and every.size and int(every.max()) >= dataset.limit:
        # the whole global batch, on every rank: all ranks stop at the same step
        pos = int(np.argmax(every.reshape(-1) >= dataset.limit))
        row, col = divmod(pos, block_size + 1)
        err = DataError(f"data.path: token file '{dataset.path}' holds token id {int(every.max())} "
                        f"(at token {int(starts[row]) + col} of the {dataset.split} split), expected ids "
                        f"below model.vocab_size = {dataset.limit}; the file is corrupt")
        raise err.everywhere()
    mask = None if dataset.mask is None else np.asarray(dataset.mask[at])
    batch = rows_to_batch(every, mask, dp_rank, dp_size)
    batch.counted = batch.counted if mask is not None else batch_size * block_size
    return batch


# ---------------------------------------------------------------- the batch hash (metrics.jsonl's batch_hash)
HASH_BITS = 32
_SPLITMIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer, elementwise on uint64 (wrapping arithmetic): a well-mixed 64-bit value per input."""
    golden, m1, m2 = _SPLITMIX
    z = z + golden
    z = (z ^ (z >> np.uint64(30))) * m1
    z = (z ^ (z >> np.uint64(27))) * m2
    return z ^ (z >> np.uint64(31))


def token_hash(ids, rows, positions, stream: int) -> int:
    """This rank's share of a global batch's hash: the sum, mod 2**32, of one 32-bit hash per token of
    `ids` (n, t), keyed by the token's place in the global batch: its row `rows` (n,), its position in
    the sequence `positions` (t,) and `stream` (0: the inputs x, 1: the targets y).

        h(row, pos, stream, id) = top 32 bits of splitmix64(splitmix64(row * 2**32 + pos) ^ (2 id + stream))

    A sum of keyed hashes does not depend on which rank holds which tokens, nor in what order: the shares of
    any layout (dp rows, cp chunks, micro-batches, pipeline stages) add up to the single process's number,
    so combining them is one more float64 in the loss's all-reduce (exact: a rank's share, inputs plus targets,
    is < 2**33, and 2**20 ranks' shares stay below 2**53), never a gather of the ids. A changed id, a row moved to another place or a
    different batch changes it (but for a 2**-32 chance)."""
    ids = np.asarray(ids, dtype=np.uint64)
    if ids.size == 0:
        return 0
    key = (np.asarray(rows, dtype=np.uint64)[:, None] << np.uint64(32)) + np.asarray(positions, dtype=np.uint64)
    h = _splitmix64(_splitmix64(key) ^ ((ids << np.uint64(1)) + np.uint64(stream))) >> np.uint64(32)
    return int(h.sum(dtype=np.uint64)) % (1 << HASH_BITS)


class BatchSampler:
    """Random (x, y) training batches, a pure function of (seed, batch index).

    Batch k uses ``PCG64([seed, k])``, so the state to checkpoint is just k.
    """

    def __init__(self, dataset: TokenDataset, block_size: int, global_batch_size: int,
                 dp_rank: int, dp_size: int, seed: int):
        _check_shapes(dataset, block_size, global_batch_size, dp_rank, dp_size, "train.global_batch_size")
        if not isinstance(seed, int) or seed < 0:
            raise DataError(f"train.seed: must be a non-negative integer, got {seed!r}")
        self.dataset, self.block_size, self.global_batch_size = dataset, block_size, global_batch_size
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.batch_index = 0

    def batch_at(self, k: int) -> Batch:
        """This rank's rows of batch ``k``, without moving the counter."""
        rng = np.random.Generator(np.random.PCG64([self.seed, k]))
        return _draw(self.dataset, self.block_size, self.global_batch_size, self.dp_rank, self.dp_size, rng)

    def next_batch(self) -> Batch:
        batch = self.batch_at(self.batch_index)
        self.batch_index += 1
        return batch

    def state_dict(self) -> dict:
        return {"batch_index": self.batch_index}

    def load_state_dict(self, state: dict) -> None:
        k = state.get("batch_index") if isinstance(state, dict) else None
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_COUNT:
            raise DataError(f"sampler state: 'batch_index' must be an integer in [0, {MAX_COUNT}], got {k!r}")
        self.batch_index = k


def eval_batches(dataset: TokenDataset, block_size: int, batch_size: int, dp_rank: int, dp_size: int,
                 num_batches: int, seed: int, batch_field: str = "train.global_batch_size"):
    """Fixed validation batches, so every eval compares the same tokens.

    Batch i uses ``PCG64([seed, 2**32 - 1 - i])``: a stream training batch
    indices will not reach.  ``batch_size`` is global and split across dp ranks
    exactly like training batches; ``batch_field`` names it in error messages.
    """
    _check_shapes(dataset, block_size, batch_size, dp_rank, dp_size, batch_field)
    out = []
    for i in range(num_batches):
        rng = np.random.Generator(np.random.PCG64([seed, 2**32 - 1 - i]))
        out.append(_draw(dataset, block_size, batch_size, dp_rank, dp_size, rng))
    return out


def eval_tokens_per_byte(dataset: TokenDataset, block_size: int, batch_size: int, num_batches: int, seed: int,
                         tok: Tokenizer):
    """Tokens per byte of text over exactly the targets `eval_batches` draws (every dp rank's rows), or None
    when they hold no text: a validation loss in nats per token is then loss * tokens / bytes / ln 2 bits
    per byte, one scale for a byte model and a BPE model."""
    return tokens_per_byte((y for _, y in eval_batches(dataset, block_size, batch_size, 0, 1, num_batches, seed)), tok)


def tokens_per_byte(targets, tok: Tokenizer):
    """Tokens per byte of text of the target tensors `targets` (each token's bytes in `tok`), None for none."""
    nbytes = np.asarray(tok.token_bytes(), dtype=np.int64)
    tokens = total = 0
    for y in targets:
        ids = y.numpy().reshape(-1)
        tokens += ids.size
        total += int(nbytes[np.minimum(ids, nbytes.size - 1)].sum())
    return tokens / total if total else None
