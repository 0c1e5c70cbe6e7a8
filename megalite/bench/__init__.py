"""`megalite bench ckpt|train|plan|dcp|prepare`: what a user measures on their own system (the checkpoint path,
training throughput, a cluster's checkpoint before it exists, DCP conversion, prepare).

    ckpt.py    sync/async saves, loads (same layout and resharded), DCP and torch.save baselines,
               conversion to one file, and the disk's own bandwidth, in one run
    train.py   megalite vs a plain PyTorch GPT-2, pipeline bubbles per schedule, and a layout table

This module holds the small helpers: process memory from /proc, the page cache, tables, and the
instruments the gloo workers install (time inside torch.distributed, bytes saved for backward).
"""
from __future__ import annotations

import functools
import os
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterable, Optional


# ---------------------------------------------------------------- memory of this process (Linux /proc)
def _status(field: str) -> float:
    """A `/proc/self/status` field in MiB (0 where /proc is unavailable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def rss_mib() -> float:
    return _status("VmRSS")


def peak_rss_mib() -> float:
    """The high-water mark of the resident set since the process began or since `reset_peak_rss()`."""
    return _status("VmHWM")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (writing 5 to clear_refs, Linux >= 4.0); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def track_rss(interval: float = 0.005):
    """Start measuring one row's memory; call the result to stop: (peak RSS MiB, its growth over the RSS at the
    start). The peak is VmHWM reset to the current RSS where the kernel allows it; elsewhere VmHWM would still
    hold whatever an earlier row (or the imports) peaked at, so VmRSS is polled in a thread instead: a row is
    never charged with another's leftovers."""
    exact = reset_peak_rss()
    base = rss_mib()
    if exact:
        def done() -> tuple[float, float]:
            peak = max(peak_rss_mib(), base)
            return peak, peak - base
        return done
    peak, stop = [base], threading.Event()

    def poll():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_mib())
            stop.wait(interval)

    th = threading.Thread(target=poll, daemon=True)
    th.start()

    def done_polled() -> tuple[float, float]:
        stop.set()
        th.join()
        top = max(peak[0], rss_mib())
        return top, top - base
    return done_polled


def sample_rss(interval: float = 0.005):
    """Poll RssAnon and RssFile (VmHWM lumps them together) in a thread; call the result to stop it and
    get the peak growth of anonymous memory and of mapped file pages, {"anon": MiB, "file": MiB}."""
    peak, stop = {"RssAnon": 0.0, "RssFile": 0.0}, threading.Event()
    anon0, file0 = _status("RssAnon"), _status("RssFile")

    def poll():
        while not stop.is_set():
            for k in peak:
                peak[k] = max(peak[k], _status(k))
            stop.wait(interval)

    th = threading.Thread(target=poll, daemon=True)
    th.start()

    def done() -> dict:
        stop.set()
        th.join()
        return {"anon": peak["RssAnon"] - anon0, "file": peak["RssFile"] - file0}
    return done


# ---------------------------------------------------------------- the page cache
def _files(paths: Iterable[Path]) -> list[Path]:
    out = []
    for p in paths:
        p = Path(p)
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            out += [q for q in p.rglob("*") if q.is_file()]
    return out


def drop_page_cache(paths: Iterable[Path], system: bool = False) -> str:
    """Make the next reads of `paths` come from the disk; return how ("fadvise", "drop_caches", "none").

    By default each file's pages are written back and evicted with posix_fadvise(DONTNEED): no root
    needed, and the rest of the machine's cache (other jobs, Python's own modules) stays. With
    `system=True` the whole cache is dropped where allowed (root, writable /proc/sys)."""
    files = _files(paths)
    if system:
        os.sync()
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            return "drop_caches"
        except OSError:
            pass
    if not hasattr(os, "posix_fadvise"):
        return "none"
    for p in files:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def resident_bytes(paths: Iterable[Path]) -> Optional[int]:
    """Bytes of `paths` now in the page cache (util-linux `fincore`), or None if it cannot be told."""
    files = [str(p) for p in _files(paths)]
    if not files or not shutil.which("fincore"):
        return None
    r = subprocess.run(["fincore", "-b", "-n", "-o", "RES", *files], capture_output=True, text=True)
    try:
        return sum(int(x) for x in r.stdout.split())
    except ValueError:
        return None


CACHE_HOW = {"fadvise": "cold (fdatasync + posix_fadvise(POSIX_FADV_DONTNEED) on every file before every read)",
             "drop_caches": "cold (sync; echo 1 > /proc/sys/vm/drop_caches before every read)",
             "none": "WARM (no way to evict it here: read numbers include page-cache hits)"}


CHUNK = 16 << 20


def write_file(path: Path, nbytes: int) -> None:
    """Write nbytes of random data in 16 MiB writes, then fsync: the disk's durable write speed."""
    buf = os.urandom(CHUNK)
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(memoryview(buf)[:min(left, CHUNK)])
        os.fsync(f.fileno())


def read_file(path: Path) -> None:
    """Read a file through one reused 16 MiB buffer: the disk's read speed, no allocation on the way."""
    buf = bytearray(CHUNK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def du(path: Path) -> int:
    path = Path(path)
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ---------------------------------------------------------------- numbers and tables
def spread(xs: list) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(xs), min(xs), max(xs)


def fmt_bytes(n: Optional[float]) -> str:
    if not n:
        return "-"
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{int(n)} B"


def table(headers: list[str], rows: list[list]) -> str:
    """A plain fixed-width table: first column left-aligned, the others right-aligned."""
    cells = [[str(c) for c in headers]] + [[("-" if c is None else str(c)) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def pair_verdict(ratios: list, ratio: str, goal: float, same: bool, same_what: str, log=print) -> float:
    """The two closing lines of a bench that alternates megalite with an outside tool: the median ratio over
    the pairs with its range and whether it meets `goal`, then whether both produced the same ids."""
    med = statistics.median(ratios)
    log(f"\n{ratio}: {med:.2f}x (median of {len(ratios)} alternated pairs; range {min(ratios):.2f}-"
        f"{max(ratios):.2f}); goal >= {goal}x: {'met' if med >= goal else 'NOT met'}")
    log(f"same ids: {'yes' if same else 'NO'} ({same_what})")
    return med


class StreamTable:
    """A table printed row by row as each row is measured (long benches are not silent until the end).

    Column widths are fixed when the header is printed: each column is as wide as its header or its entry
    in `widths` (a guess at the widest cell), whichever is larger; a longer cell widens only its own row.
    `text()` renders every row again with `table()`, aligned to the widest cell, for a final copy.
    """

    def __init__(self, headers: list[str], widths: Optional[list[int]] = None, log=None):
        # flushed: in a pipe (`megalite bench ... | tee`) print alone would hold the rows until the end
        log = log or functools.partial(print, flush=True)
        self.headers, self.rows, self.log = [str(h) for h in headers], [], log
        hint = list(widths or []) + [0] * (len(headers) - len(widths or []))
        self.widths = [max(len(h), w) for h, w in zip(self.headers, hint)]
        self._started = False

    def _line(self, cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, self.widths)))

    def row(self, cells: list) -> None:
        if len(cells) != len(self.headers):
            raise ValueError(f"StreamTable.row: {len(cells)} cells for {len(self.headers)} columns")
        if not self._started:
            self.log(self._line(self.headers))
            self.log("  ".join("-" * w for w in self.widths))
            self._started = True
        self.rows.append(list(cells))
        self.log(self._line([("-" if c is None else str(c)) for c in cells]))

    def text(self) -> str:
        return table(self.headers, self.rows)


# ---------------------------------------------------------------- instruments for gloo workers
class _TimedWork:
    def __init__(self, work, acc):
        self.work, self.acc = work, acc

    def wait(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return self.work.wait(*a, **k)
        finally:
            self.acc[0] += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self.work, name)


def patch_dist(acc: list) -> None:
    """Accumulate in acc[0] the seconds spent inside torch.distributed calls (and their waits)."""
    import torch.distributed as dist
    originals = {}
    for name in ("all_reduce", "all_gather", "broadcast", "send", "recv", "isend", "irecv", "barrier",
                 "batch_isend_irecv"):
        def wrapped(*a, _f=getattr(dist, name), **k):
            t0 = time.perf_counter()
            try:
                out = _f(*a, **k)
            finally:
                acc[0] += time.perf_counter() - t0
            if isinstance(out, list):  # batch_isend_irecv: one request per operation
                return [_TimedWork(w, acc) for w in out]
            return _TimedWork(out, acc) if hasattr(out, "wait") else out
        originals[wrapped] = getattr(dist, name)
        setattr(dist, name, wrapped)
    real_op = dist.P2POp  # it accepts only torch's own isend/irecv (the cp ring batches its hops with it)
    dist.P2POp = lambda op, *a, **k: real_op(originals.get(op, op), *a, **k)


class _Held:
    __slots__ = ("t", "key", "owner")

    def __init__(self, t, key, owner):
        self.t, self.key, self.owner = t, key, owner

    def __del__(self):
        self.owner.release(self.key)


class SavedBytes:
    """saved_tensors_hooks that count the bytes of distinct non-parameter storages saved for backward."""

    def __init__(self, params):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.refs, self.size, self.live, self.peak = {}, {}, 0, 0

    def pack(self, t):
        key = t.untyped_storage().data_ptr()
        if key in self.params:
            return t
        if not self.refs.get(key):
            self.size[key] = t.untyped_storage().nbytes()
            self.live += self.size[key]
            self.peak = max(self.peak, self.live)
        self.refs[key] = self.refs.get(key, 0) + 1
        return _Held(t, key, self)

    def unpack(self, h):
        return h.t if isinstance(h, _Held) else h

    def release(self, key):
        self.refs[key] -= 1
        if not self.refs[key]:
            self.live -= self.size.pop(key)


def paired(o: dict, other: str, raw: dict, pairs: int, run_single, log=print, label: str = "") -> list:
    """`pairs` back-to-back pairs of fresh processes, megalite and `other`, the order alternating: each pair's
    medians and ratios (wall clock and CPU time per step), then a row per side and the median ratios."""
    tokens = o["batch"] * o["model"]["block_size"]
    runs = {other: [], "megalite": []}
    w = len(other) + 8
    t = StreamTable(["pair", f"{other} ms/step", "megalite ms/step", "ratio", f"{other} cpu ms", "megalite cpu ms",
                     "cpu ratio"], [4, w, 16, 5, w, 15, 9], log=log)
    ratios, cpu_ratios = [], []
    for i in range(pairs):  # a pair runs back to back: drifts in machine speed hit both of its runs
        for kind in ((other, "megalite") if i % 2 == 0 else ("megalite", other)):
            runs[kind].append(run_single(kind, raw, o["steps"]))
        med = {k: statistics.median(runs[k][-1]["times"]) for k in runs}
        cpu = {k: statistics.median(runs[k][-1]["cpu"]) for k in runs}
        ratios.append(med[other] / med["megalite"])
        cpu_ratios.append(cpu[other] / cpu["megalite"])
        t.row([i + 1, f"{med[other] * 1000:.1f}", f"{med['megalite'] * 1000:.1f}", f"{ratios[-1]:.3f}",
               f"{cpu[other] * 1000:.1f}", f"{cpu['megalite'] * 1000:.1f}", f"{cpu_ratios[-1]:.3f}"])
    t = StreamTable(["model", "tokens/s", "ms/step (median)", "cpu ms/step (median)", "peak RSS MiB"],
                    [max(8, w - 8), 8, 16, 20, 12], log=log)
    rows = []
    for kind in runs:
        med = statistics.median(x for r in runs[kind] for x in r["times"])
        cpu = statistics.median(x for r in runs[kind] for x in r["cpu"])
        rows.append({"model": label + kind, "tokens_per_s": tokens / med, "ms_per_step": med * 1000,
                     "cpu_ms_per_step": cpu * 1000, "peak_rss_mib": max(r["maxrss_mib"] for r in runs[kind])})
        t.row([kind, f"{tokens / med:,.0f}", f"{med * 1000:.1f}", f"{cpu * 1000:.1f}", f"{rows[-1]['peak_rss_mib']:.0f}"])
    key = f"vs_{other}"
    rows[1].update({key: statistics.median(ratios), f"{key}_range": (min(ratios), max(ratios)), "pairs": ratios,
                    f"{key}_cpu": statistics.median(cpu_ratios), f"{key}_cpu_range": (min(cpu_ratios), max(cpu_ratios)),
                    "cpu_pairs": cpu_ratios})
    what = f"megalite / {other} tokens/s{' (' + label.rstrip('-').capitalize() + ')' if label else ''}"
    log(f"{what}: {statistics.median(ratios):.3f} (median of {pairs} pairs; range {min(ratios):.3f}-{max(ratios):.3f})")
    log(f"{what} by CPU time per step: {statistics.median(cpu_ratios):.3f} (median of {pairs} pairs; range "
        f"{min(cpu_ratios):.3f}-{max(cpu_ratios):.3f})")
    return rows


def reference_step(cfg, model, loss):
    """A training step of an outside `model` (bench.train's PlainGPT, a transformers class) with the config's recipe:
    torch.optim.AdamW (no decay on 1-d tensors, as megalite's tags say), clipping, megalite's batches (its
    BatchSampler) and LR schedule; `loss(model, x, y)` is one micro-batch's mean loss."""
    import torch
    from ..config import num_microbatches
    from ..data import BatchSampler, TokenDataset
    from ..run.schedule import lr_at
    t, m = cfg.train, num_microbatches(cfg)
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8)
    sampler = BatchSampler(TokenDataset(cfg.data.path, "train"), cfg.model.block_size, t.global_batch_size, 0, 1,
                           t.seed)
    done = [0]

    def step():
        for g in opt.param_groups:
            g["lr"] = lr_at(done[0], t)
        x, y = sampler.next_batch()
        opt.zero_grad(set_to_none=True)
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            (loss(model, xm, ym) / m).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        done[0] += 1
    return step
