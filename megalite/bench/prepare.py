"""`megalite bench prepare`: `megalite prepare`'s throughput beside the tokenizers library's own encode_batch.

The corpus is the Python standard library's sources, repeated under new names up to --size-mb (each file one
document, as prepare takes them); the tokenizer a byte-level BPE trained here on the first 4 MB (or
--tokenizer). Alternating, --rounds times each in this process:

    megalite prepare     read, decode, cut into pieces, encode (encode_batch, overlapped with the reading),
                         write the ids (uint16/uint32) and fsync: the whole command, streaming
    tokenizers           the same files read whole into memory, then `Tokenizer.encode_batch` on ~8 MB of
                         documents at a time (all of them at once would hold every Encoding: ~100 bytes per
                         token); each batch's ids kept as one uint32 array (what prepare writes to its file)

Both see the same text and must give the same ids: the count and sum of each side's ids are computed after
its timed region (prepare's read back from its file), so both time the same work: text in, ids out.
Each prepare round writes into a folder of its own, removed after the round (its .bin, .json and
tokenizer copy all go: a second round must not meet the first's outputs). Memory is the peak growth
of anonymous memory while each runs (sampled). The goal for prepare: >= 0.8x the library's rate.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np

from ..base.fs import read_all
from . import StreamTable, pair_verdict, sample_rss

REF_BATCH_BYTES = 8 << 20


def make_corpus(folder: Path, size_mb: float) -> list[Path]:
    """The stdlib's .py files (megalite's default corpus order), copied under new names until size_mb."""
    import sysconfig
    root = Path(sysconfig.get_paths()["stdlib"])
    srcs = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    files, total, i = [], 0, 0
    folder.mkdir(parents=True, exist_ok=True)
    while total < size_mb * 1e6:
        src = srcs[i % len(srcs)]
        dst = folder / f"{i:07d}-{src.name}"
        shutil.copyfile(src, dst)
        files.append(dst)
        total += dst.stat().st_size
        i += 1
    return files


def _reference(tok, files: list[Path]) -> list:
    """encode_batch over the files, ~REF_BATCH_BYTES of documents per call: each call's ids as one uint32
    array (summed by the caller, outside the timed region, as prepare's ids are)."""
    out, batch, size = [], [], 0

    def flush():
        out.append(np.fromiter((i for enc in tok.backend.encode_batch(batch) for i in enc.ids), dtype=np.uint32))

    for f in files:
        batch.append(read_all(f, follow=True).decode("utf-8", errors="replace"))  # the user's corpus: never a FIFO
        size += len(batch[-1])
        if size >= REF_BATCH_BYTES:
            flush()
            batch, size = [], 0
    if batch:
        flush()
    return out


def bench_prepare(size_mb: float = 32, vocab_size: int = 4096, tokenizer: Optional[str] = None, rounds: int = 3,
                  dir: Optional[str] = None, log=print) -> dict:
    from ..data import prepare
    from ..tokenizer import load, read_text_pieces, train_bpe
    work = Path(tempfile.mkdtemp(prefix="megalite-bench-prepare-", dir=dir))
    try:
        files = make_corpus(work / "corpus", size_mb)
        nbytes = sum(f.stat().st_size for f in files)
        if tokenizer:
            tok = load(tokenizer)
        else:
            head, acc = [], 0
            for f in files:
                head.append(f)
                acc += f.stat().st_size
                if acc > 4e6:
                    break
            tok = train_bpe((p for f in head for p in read_text_pieces(f)), vocab_size)
        log(f"bench prepare: {len(files):,} files, {nbytes / 1e6:,.1f} MB (the stdlib's sources, repeated); "
            f"{tok.kind} tokenizer of {tok.vocab_size:,} ids; {os.cpu_count()} cores (load average "
            f"{os.getloadavg()[0]:.1f} at the start)")
        t = StreamTable(["run", "round", "seconds", "MB/s", "tokens/s", "peak anon MiB"], [28, 5, 8, 8, 12, 13],
                        log=log)
        rates = {"prepare": [], "tokenizers": []}
        counts = {}
        for r in range(rounds):
            for kind in ("prepare", "tokenizers"):  # alternated: a drift in machine speed hits both
                round_dir = work / f"round-{r + 1}-{kind}"  # fresh each round: prepare refuses existing outputs
                round_dir.mkdir()
                out = round_dir / "tokens.bin"
                done = sample_rss()
                t0 = time.perf_counter()
                if kind == "prepare":
                    meta = prepare(files, out, tokenizer=tok, log=lambda *a: None)
                    dt = time.perf_counter() - t0
                    mem = done()["anon"]
                    ids = np.fromfile(out, dtype=meta["dtype"])  # checked outside the timed region
                    seps = meta["documents"] - 1  # the end-of-text ids between documents
                    sep = tok.eot_id if tok.eot_id is not None else 0
                    counts[kind] = (int(ids.size) - seps, int(ids.sum(dtype=np.int64)) - seps * sep)
                    n = int(ids.size)
                    del ids
                else:
                    parts = _reference(tok, files)
                    dt = time.perf_counter() - t0
                    mem = done()["anon"]
                    counts[kind] = (sum(int(p.size) for p in parts), sum(int(p.sum(dtype=np.int64)) for p in parts))
                    n = counts[kind][0]
                    del parts
                rates[kind].append(nbytes / dt)
                t.row(["megalite prepare" if kind == "prepare" else "tokenizers encode_batch", r + 1, f"{dt:.2f}",
                       f"{nbytes / dt / 1e6:.2f}", f"{n / dt:,.0f}", f"{mem:.0f}"])
                shutil.rmtree(round_dir)
        ratios = [a / b for a, b in zip(rates["prepare"], rates["tokenizers"])]
        same = counts["prepare"] == counts["tokenizers"]
        pair_verdict(ratios, "prepare / encode_batch throughput", 0.8, same,
                     f"{counts['prepare'][0]:,} ids of text in both", log)
        if not same:
            print(f"bench prepare: prepare and encode_batch disagree: {counts}", file=sys.stderr)
        return {"ratios": ratios, "same_ids": same, "rates": rates}
    finally:
        shutil.rmtree(work, ignore_errors=True)
