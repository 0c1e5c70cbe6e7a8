"""`megalite bench documents`: a training step with document-masked attention against one on random windows.

One token file (the standard library's sources, --size-mb of them, each file cut at its top-level breaks into
documents: a function, a class, 2.8 KB of text on average; a byte-level BPE of --vocab-size ids trained on
them) and one model (GPT-2 shape: --n-layer, --n-embd, heads of 32, --block-size positions) at (1,1,1) in this
process; three settings of the same tokens per step (8 rows of block_size):

    windows                    data.packing = "windows": random windows across documents, causal attention
                               (SDPA's is_causal path)
    documents                  data.packing = "documents": rows of whole documents, attention still across them
    documents + document_mask  the same rows, attention block-causal inside each document and positions
                               restarting at each (SDPA with a boolean (B, 1, T, T) mask per layer)

After one untimed step of each, each round runs --steps steps of every setting, one step of each in turn (the
order rotated every step), so a drift in machine speed hits all alike; the ratios are per round (the setting's
median ms/step over the windows' of that round), their median over the rounds printed with their range, for
the wall time and for this process's CPU time (the steadier on a machine that other jobs load: one torch
thread, so CPU time is the step's work, not the time it waited for a core). No goal: the number is what
masking costs on this CPU (the GPU path, flex attention or varlen, is another measurement).
"""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

from . import StreamTable

SETTINGS = {"windows": dict(packing="windows", document_mask=False),
            "documents": dict(packing="documents", document_mask=False),
            "documents + document_mask": dict(packing="documents", document_mask=True)}


def _token_file(work: Path, size_mb: float, vocab_size: int) -> Path:
    """The stdlib's sources up to size_mb, each file cut at its top-level breaks (two blank lines: a function, a
    class, a block of imports) into documents of some hundreds of tokens, as web text's are, written as a jsonl
    corpus and prepared with a BPE trained on it."""
    import json
    from ..base.fs import read_all
    from ..data import default_corpus_files, prepare
    from ..tokenizer import train_bpe
    texts = [t for f in default_corpus_files(int(size_mb * 1e6))
             for t in read_all(f, follow=True).decode("utf-8", errors="replace").split("\n\n\n") if t.strip()]
    corpus = work / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = work / "docs.bin"
    prepare([corpus], out, tokenizer=train_bpe(texts, vocab_size), log=lambda *a: None, val_fraction=0.05)
    return out


def _trainer(path: Path, setting: dict, n_layer: int, n_embd: int, block: int, batch: int, vocab_size: int):
    import torch
    from ..config import load_config, resolve, validate
    from ..parallel.grid import ParallelGrid
    from ..run.train import build
    cfg = load_config(None, [f"--data.path={path}", f"--data.packing={setting['packing']}",
                             f"--data.document_mask={str(setting['document_mask']).lower()}",
                             f"--model.n_layer={n_layer}", f"--model.n_embd={n_embd}",
                             f"--model.n_head={max(1, n_embd // 32)}", f"--model.block_size={block}",
                             f"--model.vocab_size={vocab_size}", "--model.dropout=0.0",
                             f"--train.global_batch_size={batch}", f"--train.micro_batch_size={batch}",
                             "--train.eval_batches=1", "--train.seed=5"])
    return build(validate(resolve(cfg, 1), 1), ParallelGrid.single(), torch.device("cpu"))


def bench_documents(size_mb: float = 2.0, vocab_size: int = 4096, n_layer: int = 4, n_embd: int = 128,
                    block_size: int = 512, batch: int = 8, steps: int = 5, rounds: int = 3,
                    dir: Optional[str] = None, log=print) -> dict:
    import torch
    from ..run.train import train_step
    work = Path(tempfile.mkdtemp(prefix="megalite-bench-documents-", dir=dir))
    try:
        path = _token_file(work, size_mb, vocab_size)
        trainers = {k: _trainer(path, s, n_layer, n_embd, block_size, batch, vocab_size) for k, s in SETTINGS.items()}
        docs = trainers["documents"].sampler.packed.starts.size - 1
        log(f"bench documents: GPT-2 shape, {n_layer} layers, width {n_embd}, {block_size} positions; {batch} rows "
            f"of {block_size} tokens a step; {docs:,} documents of the stdlib's sources ({size_mb:g} MB, BPE of "
            f"{vocab_size:,} ids); {torch.get_num_threads()} torch threads, {os.cpu_count()} cores (load average "
            f"{os.getloadavg()[0]:.1f} at the start)")
        for tr in trainers.values():  # warm-up: first steps allocate and pick kernels
            train_step(tr)
        t = StreamTable(["setting", "round", "ms/step", "CPU ms/step", "documents a row", "counted targets"],
                        [26, 5, 8, 11, 15, 15], log=log)
        names = list(SETTINGS)
        wall, cpu = ({k: [] for k in names} for _ in range(2))
        for r in range(rounds):
            times = {k: ([], [], [], 0) for k in names}  # wall ms, CPU ms, documents a row, counted targets
            for i in range(steps):  # one step of each setting in turn, the order rotated every step
                for k in names[i % len(names):] + names[:i % len(names)]:
                    tr, (w, c, per_row, counted) = trainers[k], times[k]
                    b = tr.sampler.batch_at(tr.sampler.batch_index)  # what the step draws: counted, documents
                    per_row += [] if b.docs is None else (b.docs.max(dim=1).values + 1).tolist()
                    times[k] = (w, c, per_row, counted + b.counted)
                    t0, c0 = time.perf_counter(), time.process_time()
                    train_step(tr)
                    w.append(1000 * (time.perf_counter() - t0))
                    c.append(1000 * (time.process_time() - c0))
            for k in names:
                w, c, per_row, counted = times[k]
                wall[k].append(statistics.median(w))
                cpu[k].append(statistics.median(c))
                t.row([k, r + 1, f"{wall[k][-1]:.1f}", f"{cpu[k][-1]:.1f}",
                       f"{statistics.mean(per_row):.1f}" if per_row else "-",
                       f"{counted / (steps * batch * block_size):.1%}"])
        log("")
        ratios = {}
        for k in names[1:]:
            for what, ms in (("ms per step", wall), ("CPU ms per step", cpu)):
                rs = ratios[k, what] = [a / b for a, b in zip(ms[k], ms["windows"])]  # round by round
                log(f"{k} / windows {what}: {statistics.median(rs):.2f}x (median of {rounds} rounds; range "
                    f"{min(rs):.2f}-{max(rs):.2f})")
        log("")
        loader = {}
        for k in names:  # the loader alone: the batches of as many steps drawn again, against what a step takes
            tr, n = trainers[k], steps * rounds
            c0 = time.process_time()
            for i in range(n):
                tr.sampler.batch_at(i)
            drawn = n * batch * block_size / max(time.process_time() - c0, 1e-9)
            used = batch * block_size / (statistics.median(cpu[k]) / 1000)
            loader[k] = drawn / used
            log(f"{k} loader: {drawn:,.0f} tokens/s drawn (CPU), {loader[k]:,.0f}x the {used:,.0f} tokens/s "
                f"a training step consumes")
        log(f"load average {os.getloadavg()[0]:.1f} at the end")
        return {"ms": wall, "cpu_ms": cpu, "ratios": ratios, "loader": loader}
    finally:
        shutil.rmtree(work, ignore_errors=True)
