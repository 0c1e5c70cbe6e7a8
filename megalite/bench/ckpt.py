"""`megalite bench ckpt`: megalite's checkpoint path against DCP, a naive torch.save and the disk itself.

Every rank of a gloo job builds a real GPTStage slice (random weights) and a ShardedAdamW with filled
moments, sized so that model + moments are about `size_mb` across all ranks. The same tensors (the
ones megalite's write plan gives each rank, under rank-unique keys) go through every method. Times
are wall times between barriers (max over ranks); each live row's peak RSS is the highest per-rank VmHWM
during the operation (reset before it; VmRSS polled where it cannot be reset: bench.track_rss), with the
growth over the RSS before it in parentheses. The summary compares memory only as that growth, per row
(median and max over its repeats): an absolute peak would charge a row with what an earlier row left
behind (rank 0 still holding a torch.load's pages).

Each measurement is printed as it is made (a table with one row per operation and repeat), then the
summary table of medians. Pairs whose ratio is a target are measured next to each other in every repeat:
the sync and the async save, and the same-layout and resharded loads (twice each, in the order ABBA, BAAB
on the next repeat), so that a burst of load on a shared machine hits both sides of a ratio alike.

What an async save costs the training loop is timed where the loop feels it, while the writer works: the save
is submitted as `megalite train` does, then AdamW steps run (each followed by a collective, as a real step's
gradient reduction, through which the ranks agree to stop) until the save has committed; the same number of
in-place steps without a save runs beside it, the order alternated between repeats. The cost of a repeat is
the difference (blocked time included): the row `megalite async save: cost to the loop`.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from ..checkpoint.tree import resolve
from ..checkpoint.manifest import read as read_manifest

from . import (CACHE_HOW, StreamTable, drop_page_cache, du, fmt_bytes, read_file, resident_bytes, rss_mib, spread,
               table, track_rss, write_file)

BLOCK, VOCAB = 1024, 256
VS_DCP = {"megalite save": "DCP save", "gather + torch.save": "DCP save",
          "megalite async save: blocked": "DCP async_save: blocked",
          "megalite async save: until commit": "DCP async_save: until done",
          "megalite async save, copied: blocked": "DCP async_save: blocked",
          "megalite async save, copied: until commit": "DCP async_save: until done",
          "megalite load": "DCP load", "megalite load, resharded": "DCP load", "torch.load (rank 0)": "DCP load",
          "megalite convert": "dcp_to_torch_save"}


def layouts(world: int) -> tuple[tuple, Optional[tuple]]:
    """(save layout, resharded-load layout): tp=2 x pp=world/2, loaded back at tp=world (or pp=2)."""
    if world == 1:
        return (1, 1, 1), None
    if world % 2:
        from ..config import ConfigError
        raise ConfigError(f"bench ckpt: --world {world} must be 1 or even (layout tp=2 x pp=world/2)")
    return (2, world // 2, 1), ((world, 1, 1) if world > 2 else (1, 2, 1))


def model_config(size_mb: float, world: int) -> dict:
    """A GPT whose weights + two AdamW moments (12 bytes per parameter) come closest to size_mb."""
    n_head = math.lcm(4, world)
    n_layer = max(4, world // 2)
    step = math.lcm(64, n_head)
    best = min(range(step, 16384 + 1, step), key=lambda c: abs(
        12 * (n_layer * (12 * c * c + 13 * c) + (VOCAB + BLOCK + 2) * c) - size_mb * 2**20))
    return dict(n_layer=n_layer, n_head=n_head, n_embd=best, block_size=BLOCK, vocab_size=VOCAB, dropout=0.0)


def _state(mcfg, layout, seed: int):
    """This rank's GPTStage slice (random weights) and a ShardedAdamW with non-zero moments."""
    import torch
    from ..model import GPTStage
    from ..parallel.data import ShardedAdamW
    from ..parallel.grid import Layout, ParallelGrid
    grid = ParallelGrid.create(Layout(*layout))
    model = GPTStage(mcfg, grid)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
    opt = ShardedAdamW(sorted(model.global_parameters(), key=lambda x: x[0]), grid.tp, grid.dp, zero1=False)
    for m in opt.exp_avg.values():
        m.normal_(0.0, 1e-3, generator=g)
    for v in opt.exp_avg_sq.values():
        v.uniform_(0.0, 1e-6, generator=g)
    return grid, model, opt


PROBE_TRIES, PROBE_TOL = 4, 0.10
PROBE_RULE = (f"each repeat writes, then reads, the probe files until two in a row of that repeat agree within "
              f"{PROBE_TOL:.0%} (at most {PROBE_TRIES} each); the fastest probe row's median GB/s is the reference")


def stable(runs: list) -> bool:
    """The last two timings of a probe agree within PROBE_TOL."""
    return len(runs) == 2 and abs(runs[0]["s"] - runs[1]["s"]) <= PROBE_TOL * min(runs[0]["s"], runs[1]["s"])


def probe_until_stable(once, rows: list, rec: dict, agree=lambda steady: steady) -> int:
    """PROBE_RULE: call `once()` (one probe of each row in `rows`) until the last two timings of every row,
    both taken in this call, are `stable` (at most PROBE_TRIES); `agree` makes the ranks decide alike. A
    timing of an earlier repeat never counts: its files were written anew since. Returns the tries made."""
    for t in range(PROBE_TRIES):
        once()
        if t and agree(all(stable(rec[r][-2:]) for r in rows)):
            return t + 1
    return PROBE_TRIES


ASYNC_COST = "megalite async save: cost to the loop"  # per repeat: blocked + (steps while it writes - as many plain)
DURING = "AdamW steps while an async save writes"  # from the submit to the first step after its commit
PLAIN = "AdamW steps, as many, no save"  # the same count of in-place steps, side by side
WAIT_S = 0.05  # a step of the waiting loop: its host thread sleeps, as one waits on its GPU, then all-reduces
WAIT_COST = "megalite async save: waiting loop's cost"  # as ASYNC_COST, for steps that wait (page cache)
WAIT_COST_DIRECT = "megalite async, O_DIRECT: waiting loop's cost"  # the same, files written O_DIRECT
NO_RATE = (ASYNC_COST, DURING, PLAIN, WAIT_COST, WAIT_COST_DIRECT)  # loop times, not bytes moved: no GB/s


def _rated(op: str) -> bool:
    """Whether an operation moves its bytes in the time it is timed (a GB/s means something): not a blocked
    time, an optimizer step or the loop's time around an async save."""
    return not (op.endswith("blocked") or op.startswith("AdamW") or op in NO_RATE)


SCALING_PAIRS = [("megalite save", "DCP save"), ("megalite async save: until commit", "DCP async_save: until done"),
                 ("megalite async save: blocked", "DCP async_save: blocked"), (ASYNC_COST, "megalite save"),
                 (WAIT_COST, "megalite save"), (WAIT_COST_DIRECT, "megalite save"),
                 ("megalite load", "DCP load"), ("megalite load, resharded", "DCP load"),
                 ("megalite load, resharded", "megalite load"), ("megalite convert", "dcp_to_torch_save")]


LIVE = (["operation", "repeat", "s", "GB/s", "peak RSS MiB (+growth)"], [45, 6, 7, 6, 22])


def live_table(log=print) -> StreamTable:
    """The table each measurement is printed to as it is made (flushed: the bench is long)."""
    def say(line):
        log(line)
        sys.stdout.flush()
    return StreamTable(*LIVE, log=say)


def live_row(t: StreamTable, repeat: int, op: str, r: dict, nbytes) -> None:
    gbs = nbytes / r["s"] / 1e9 if nbytes and r["s"] > 0 and _rated(op) else None
    t.row([op, repeat, f"{r['s']:.3f}", None if gbs is None else f"{gbs:.3f}", f"{r['rss']:.0f} (+{r['extra']:.0f})"])


def _worker(rank: int, world: int, tmp: str, o: dict) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from ..checkpoint import AsyncSaver, global_named as _named, load_checkpoint, save_checkpoint
    from ..checkpoint.tree import MODEL_FILE
    from ..checkpoint.plan import collect
    from ..config import ModelConfig
    root, mcfg, cfgd = Path(o["root"]), ModelConfig(**o["model"]), {"model": o["model"]}
    grid, model, opt = _state(mcfg, o["save_layout"], rank)
    other = _state(mcfg, o["reshard_layout"], 100 + rank) if o["reshard_layout"] else None
    dcp_pg = dist.new_group(backend="gloo")  # DCP's background thread must not share the default group
    pay = collect(_named(model), opt, grid, {})
    sd = {f"rank{rank}/{f}/{k}": t for f, ts in pay.files.items() for k, t in ts.items()}
    rec, nbytes, rss_after, how, resident = {}, {}, {}, ["none"], []
    live, repeat = (live_table() if rank == 0 else None), [0]

    def reduce_max(values):
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    t = torch.tensor([sum(x.numel() * x.element_size() for x in sd.values())], dtype=torch.float64)
    dist.all_reduce(t)
    total = int(t.item())

    def clear(*paths):
        if rank == 0:
            for p in paths:
                shutil.rmtree(p, ignore_errors=True)
                p.mkdir(parents=True)
        dist.barrier()

    def timed(op, fn, size=None, cold=None, only0=False, after=None, done=None):
        if rank == 0:
            os.sync()  # no writeback of an earlier operation (or discards of deleted files) left to compete
            if cold is not None:
                how[0] = drop_page_cache([cold])
                resident.append(resident_bytes([cold]))
        dist.barrier()
        mem = track_rss()
        t0 = time.perf_counter()
        if not only0 or rank == 0:
            fn()
        t1 = time.perf_counter()
        if after:
            after()  # async: the commit, after the caller got control back
        t2 = time.perf_counter()
        dist.barrier()
        t3 = time.perf_counter()
        blocked, finish, peak, extra = reduce_max([t1 - t0, t2 - t0, *mem()])
        ops = [(op, t3 - t0)] if after is None else [(op + ": blocked", blocked), (done, finish)]
        for name, secs in ops:
            rec.setdefault(name, []).append({"s": secs, "rss": peak, "extra": extra})
            if rank == 0:
                nbytes[name] = size() if callable(size) else size
                live_row(live, repeat[0], name, rec[name][-1], nbytes[name])

    flag = torch.zeros(1)

    def sync(more: bool) -> bool:
        """The loop's per-step collective (a real step all-reduces its gradients): do the ranks step again?"""
        flag.fill_(1.0 if more else 0.0)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() > 0

    def plain_steps(k: int) -> list:
        """k in-place AdamW steps, each followed by the loop's collective; after each, the wall time and this
        process's CPU time (all its threads) since the first began (cumulative)."""
        t0, c0, out = time.perf_counter(), time.process_time(), []
        for _ in range(k):
            opt.step(1e-6)
            sync(True)
            out.append((time.perf_counter() - t0, time.process_time() - c0))
        return out

    def steps_during_save(i: int) -> tuple:
        """An async save submitted as `megalite train` does, then AdamW steps until it has committed (polled
        after each step; all ranks agree through the step's collective). (blocked s, steps, s in all, CPU s
        of this process in all: the loop's and the writer thread's)."""
        t0, c0 = time.perf_counter(), time.process_time()
        save_checkpoint(root / "ml_loop", i + 1, model, opt, grid, config=cfgd, saver=saver)
        blocked, k = time.perf_counter() - t0, 0
        while True:
            opt.step(1e-6)  # the first step after the save: out of place (the writer holds the tensors)
            k += 1
            saver.poll()
            if not sync(saver.thread is not None):
                return blocked, k, time.perf_counter() - t0, time.process_time() - c0

    def loop_cost(i: int, k_guess: int) -> int:
        """What an async save costs the loop: blocked + (the steps that run while its writer works - as many
        in-place steps without a save), the two sides side by side, their order alternated between repeats.
        The plain side goes first with the last repeat's count; if the save then took more steps, the extra
        plain steps run right after it (each plain step is timed, so any count's time is known)."""
        clear(root / "ml_loop")
        opt.step(1e-6)  # untimed: takes the hold of the async rows before (it writes out of place), so the
        # plain side's first step is in place as in a loop that has no save in flight
        first = "save" if i % 2 == 0 or not k_guess else "plain"
        got = {}
        for side in ((first, "plain") if first == "save" else ("plain", "save")):
            if rank == 0:
                os.sync()
            dist.barrier()
            mem = track_rss()
            if side == "save":
                got["save"] = steps_during_save(i)
            else:
                got["plain"] = plain_steps(got["save"][1] if "save" in got else k_guess)
            got[side + " rss"] = mem()
        blocked, k, during, cpu = got["save"]
        plain = got["plain"]
        if len(plain) < k:
            dist.barrier()
            more = plain_steps(k - len(plain))
            plain = plain + [(plain[-1][0] + w, plain[-1][1] + c) for w, c in more]
        # every rank stepped k times (the collective): the slowest rank's times are the loop's; the CPU the
        # save added (its writer thread, the out-of-place step) is summed over the ranks
        added = torch.tensor([cpu - plain[k - 1][1]], dtype=torch.float64)
        dist.all_reduce(added)
        blocked, during, plain_k, peak_s, extra_s, peak_p, extra_p = reduce_max(
            [blocked, during, plain[k - 1][0], *got["save rss"], *got["plain rss"]])
        for name, secs, peak, extra in ((DURING, during, peak_s, extra_s), (PLAIN, plain_k, peak_p, extra_p),
                                        (ASYNC_COST, during - plain_k, peak_s, extra_s)):
            rec.setdefault(name, []).append({"s": secs, "rss": peak, "extra": extra, "steps": k, "blocked": blocked,
                                             "cpu_added": added.item()})
            if rank == 0:
                nbytes[name] = du(root / "ml_loop")
                live_row(live, repeat[0], name, rec[name][-1], nbytes[name])
        return k

    def waiting_cost(i: int, name: str, direct: bool) -> None:
        """What an async save costs a loop whose steps wait (WAIT_S asleep, as a host thread waits on its GPU,
        then the step's all-reduce): blocked + (the steps until its commit - as many steps without a save, run
        right after it). The loop leaves the cores idle, so what it feels is not the writers' CPU but what their
        writes do to its threads: with the page cache, a large save's copies and writeback stall them; with
        `direct`, the files go around it (checkpoint.direct_io)."""
        def wait_step() -> bool:
            """One step of the waiting loop; then, as the training loop does, the background save is polled and
            the step's collective says whether it is still writing on any rank."""
            time.sleep(WAIT_S)
            saver.poll()
            return sync(saver.thread is not None)

        clear(root / "ml_wait")
        dist.barrier()
        mem, t0 = track_rss(), time.perf_counter()
        save_checkpoint(root / "ml_wait", i + 1, model, opt, grid, config=cfgd, saver=saver, direct=direct)
        blocked, k = time.perf_counter() - t0, 1
        while wait_step():
            k += 1
        during, (peak, extra) = time.perf_counter() - t0, mem()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(k):
            wait_step()
        blocked, during, plain, peak, extra = reduce_max([blocked, during, time.perf_counter() - t0, peak, extra])
        rec.setdefault(name, []).append({"s": during - plain, "rss": peak, "extra": extra, "steps": k,
                                         "blocked": blocked})
        if rank == 0:
            nbytes[name] = du(root / "ml_wait")
            live_row(live, repeat[0], name, rec[name][-1], nbytes[name])

    k_last = [0]
    saver, copier = AsyncSaver(), AsyncSaver(zero_copy=False)  # copier: the path of device/torch.optim tensors
    saver.reserve(pay, opt)  # as `megalite train` does at start-up: no save and no step pays the allocation
    copier.reserve(pay)
    for _, p in model.global_parameters():  # gradients for the optimizer-step rows
        p.grad = torch.full_like(p, 1e-3)
    clear(root / "disk")
    if rank == 0:  # untimed: the first big write of a run is often much slower than the next ones
        write_file(root / "disk" / "warm-up.bin", total)
    for i in range(o["repeats"]):
        repeat[0] = i + 1
        disk = root / "disk"
        clear(disk, root / "ml", root / "ml_async", root / "ml_copy", root / "ml_loop", root / "dcp", root / "dcp_async",
              root / "ts")
        def writes():
            timed("disk write, 1 stream", lambda: write_file(disk / "one.bin", total), total, only0=True)
            if world > 1:
                timed(f"disk write, {world} streams", lambda: write_file(disk / f"par{rank}.bin", total // world),
                      total)

        def reads():
            timed("disk read, 1 stream", lambda: read_file(disk / "one.bin"), total, cold=disk, only0=True)
            if world > 1:
                timed(f"disk read, {world} streams", lambda: read_file(disk / f"par{rank}.bin"), total, cold=disk)

        def agree(steady: bool) -> bool:  # every rank decides alike (their own clocks differ)
            return reduce_max([0.0 if steady else 1.0])[0] == 0.0

        streams = [1] + ([world] if world > 1 else [])  # the probes until stable (PROBE_RULE): the references
        probe_until_stable(writes, [f"disk write, {n} stream{'s' * (n > 1)}" for n in streams], rec, agree)
        probe_until_stable(reads, [f"disk read, {n} stream{'s' * (n > 1)}" for n in streams], rec, agree)
        clear(disk)
        timed("megalite save", lambda: save_checkpoint(root / "ml", i + 1, model, opt, grid, config=cfgd),
              lambda: du(root / "ml"))
        timed("megalite async save", lambda: save_checkpoint(root / "ml_async", i + 1, model, opt, grid,
                                                             config=cfgd, saver=saver),
              lambda: du(root / "ml_async"), after=saver.wait, done="megalite async save: until commit")
        timed("megalite async save, copied", lambda: save_checkpoint(
            root / "ml_copy", i + 1, model, opt, grid, config=cfgd, saver=copier),
              lambda: du(root / "ml_copy"), after=copier.wait, done="megalite async save, copied: until commit")
        k_last[0] = loop_cost(i, k_last[0])
        for name, direct in ((WAIT_COST, False), (WAIT_COST_DIRECT, True))[::1 if i % 2 == 0 else -1]:
            waiting_cost(i, name, direct)
        opt.step(1e-6)  # untimed: takes the waiting rows' hold, so the in-place step row below is in place
        # What the zero-copy snapshot moves into the training loop: the first step after a held save writes
        # out of place (into the spare set) instead of in place. Measured next to each other.
        for held in ((False, True) if i % 2 == 0 else (True, False)):
            if held:  # what an async save at this point holds (the same tensors `saver` held above)
                opt.hold(saver.held_keys(collect(_named(model), opt, grid, {}), opt))
            timed("AdamW step, out of place (after async save)" if held else "AdamW step, in place",
                  lambda: opt.step(1e-6))
        loads = [("megalite load", lambda: load_checkpoint(root / "ml", model, opt, grid, model_config=o["model"]))]
        if other:
            loads.append(("megalite load, resharded", lambda: load_checkpoint(
                root / "ml", other[1], other[2], other[0], model_config=o["model"])))
            loads = loads + loads[::-1] if i % 2 == 0 else loads[::-1] + loads  # ABBA, then BAAB
        for op, fn in loads:
            timed(op, fn, lambda: du(root / "ml"), cold=root / "ml")
        timed("DCP save", lambda: dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(root / "dcp"))),
              lambda: du(root / "dcp"))
        timed("DCP load", lambda: dcp.load(sd, storage_reader=dcp.FileSystemReader(str(root / "dcp"))),
              lambda: du(root / "dcp"), cold=root / "dcp")
        fut = []
        timed("DCP async_save", lambda: fut.append(dcp.async_save(
            sd, storage_writer=dcp.FileSystemWriter(str(root / "dcp_async")), process_group=dcp_pg)),
              lambda: du(root / "dcp_async"),
              after=lambda: getattr(fut[-1], "upload_completion", fut[-1]).result(), done="DCP async_save: until done")

        def gather_save():
            out = [None] * world if rank == 0 else None
            dist.gather_object(sd, out, dst=0)
            if rank == 0:
                merged = {k: v for d in out for k, v in d.items()}
                with open(root / "ts" / "all.pt", "wb") as f:
                    torch.save(merged, f)
                    f.flush()
                    os.fsync(f.fileno())

        timed("gather + torch.save", gather_save, lambda: du(root / "ts"))
        timed("torch.load (rank 0)", lambda: torch.load(root / "ts" / "all.pt"), lambda: du(root / "ts"),
              cold=root / "ts", only0=True)
    for label, kw in (("megalite save", {}), ("megalite async save", {"saver": saver})):
        rss_after[label] = [reduce_max([rss_mib()])[0]]  # then after each of `repeats` saves in a row
        for i in range(o["repeats"]):
            clear(root / "ml")
            save_checkpoint(root / "ml", 100 + i, model, opt, grid, config=cfgd, **kw)
            saver.wait()
            rss_after[label].append(reduce_max([rss_mib()])[0])
    clear(root / "dcp_model")
    dcp.save({f"rank{rank}/{k}": t for k, t in pay.files[MODEL_FILE].items()},
             storage_writer=dcp.FileSystemWriter(str(root / "dcp_model")))  # the input of dcp_to_torch_save
    if rank == 0:
        (Path(tmp) / "result.json").write_text(json.dumps(
            {"rec": rec, "bytes": nbytes, "cache": how[0], "rss_after": rss_after, "total": total, "world": world,
             "resident": resident}))


_CONVERT = r"""
import json, os, sys, time
from megalite.bench import sample_rss, track_rss
kind, src, out = sys.argv[1:4]
if kind == "megalite convert":
    from megalite.convert import convert
    run = lambda: convert(src, out, force=True, quiet=True)
else:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    def run():  # fsync too, as megalite convert does, so both times are durable writes
        dcp_to_torch_save(src, out)
        fd = os.open(out, os.O_RDONLY); os.fsync(fd); os.close(fd)
mem, stop = track_rss(), sample_rss()  # growth over the RSS after imports, not their peak
t0 = time.perf_counter(); run(); dt = time.perf_counter() - t0
peak, extra = mem()
print(json.dumps({"s": dt, "rss": peak, "extra": extra, "base": peak - extra, **stop()}))
"""


def _convert(root: Path, repeats: int, rec: dict, nbytes: dict, live: StreamTable) -> None:
    """Each conversion in a fresh interpreter, cold cache, so its VmHWM is the conversion's own."""
    out = root / "conv"
    out.mkdir(exist_ok=True)
    both = [("megalite convert", root / "ml", out / "model.safetensors"),
            ("dcp_to_torch_save", root / "dcp_model", out / "model.pt")]
    for i in range(repeats):
        for kind, src, dst in both[::1 if i % 2 == 0 else -1]:  # alternate which goes first
            os.sync()
            drop_page_cache([src])
            r = subprocess.run([sys.executable, "-c", _CONVERT, kind, str(src), str(dst)], capture_output=True,
                               text=True)
            if r.returncode:
                raise RuntimeError(f"bench ckpt: {kind} failed:\n{r.stderr[-3000:]}")
            rec.setdefault(kind, []).append(json.loads(r.stdout.strip().splitlines()[-1]))
            nbytes[kind] = dst.stat().st_size
            live_row(live, i + 1, kind, rec[kind][-1], nbytes[kind])
            dst.unlink()


def _io_kind(op: str) -> Optional[str]:
    """Which disk bandwidth an operation is held against (conversions both read and write: neither)."""
    if op in ("megalite convert", "dcp_to_torch_save") or not _rated(op):
        return None
    if "load" in op or op.startswith("disk read"):
        return "read"
    return "write"


def _rows(rec: dict, nbytes: dict) -> list[dict]:
    rows = {}
    for op, runs in rec.items():
        med, lo, hi = spread([r["s"] for r in runs])
        b = nbytes.get(op)
        rows[op] = {"op": op, "bytes": b, "median_s": med, "min_s": lo, "max_s": hi,
                    "gb_s": (b / med / 1e9) if b and med > 0 and _rated(op) else None,
                    # memory compared only as each row's own growth (its peak over the RSS before it, per
                    # measurement): a peak across rows would charge one row's leftovers to the next
                    "growth_mib": spread([r["extra"] for r in runs])}
    best = {k: max((r["gb_s"] for op, r in rows.items() if op.startswith(f"disk {k}")), default=None)
            for k in ("write", "read")}
    for op, r in rows.items():
        ref = rows.get(VS_DCP.get(op, ""))
        r["vs_dcp"] = r["median_s"] / ref["median_s"] if ref else None
        kind = _io_kind(op)
        r["of_disk"] = r["gb_s"] / best[kind] if kind and r["gb_s"] and best[kind] else None
        # above 100%: faster than the best probe, said so (the page cache was not cold, or the probe unlucky)
        r["over"] = bool(r["of_disk"] and r["of_disk"] > 1.0)
    order = ["disk", "megalite save", "DCP save", "gather", "megalite async", "DCP async", "megalite load",
             "DCP load", "torch.load", "AdamW", "megalite convert", "dcp_to"]
    # the loop's cost last: the line a reader looks for after the table's operations
    last = (ASYNC_COST, WAIT_COST, WAIT_COST_DIRECT)
    return sorted(rows.values(), key=lambda r: len(order) if r["op"] in last else next(
        i for i, p in enumerate(order) if r["op"].startswith(p)))


def paired(rec: dict, op: str, ref: str) -> tuple[float, float, float]:
    """(median of op / median of ref, min and max of the ratios of the measurements made together)."""
    a, b = [r["s"] for r in rec[op]], [r["s"] for r in rec[ref]]
    pairs = [x / y for x, y in zip(a, b)]
    return spread(a)[0] / spread(b)[0], min(pairs), max(pairs)


def format_rows(rows: list[dict]) -> str:
    def f(x, spec):
        return None if x is None else format(x, spec)
    return table(["operation", "bytes", "median s (min-max)", "GB/s", "RSS growth MiB (max)", "vs DCP",
                  "of disk"],
                 [[r["op"], fmt_bytes(r["bytes"]), f"{r['median_s']:.3f} ({r['min_s']:.3f}-{r['max_s']:.3f})",
                   f(r["gb_s"], ".3f"), f"+{r['growth_mib'][0]:.0f} (+{r['growth_mib'][2]:.0f})",
                   f(r["vs_dcp"], ".2f") and f"{r['vs_dcp']:.2f}x",
                   f(r["of_disk"], ".0%") and f"{r['of_disk']:.0%}" + ("!" if r["over"] else "")] for r in rows])


def bench_ckpt(size_mb: float = 1024, world: int = 4, repeats: int = 3, dir: Optional[str] = None,
               log=print) -> list[dict]:
    """Run every measurement; print the table (via `log`) and return its rows."""
    from ..testing import run_parallel
    from ..parallel.grid import Layout
    save_layout, reshard_layout = layouts(world)
    mcfg = model_config(size_mb, world)
    for lay in filter(None, (save_layout, reshard_layout)):
        Layout(*lay).validate(mcfg, "bench ckpt: layout ")
    if dir is not None:
        Path(dir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="megalite-bench-ckpt-", dir=dir))
    try:  # removed whatever happens, from the first line printed on (a closed pipe fails there)
        log(f"bench ckpt: {world} gloo ranks, {repeats} repeat(s); each measurement as it is made (max over "
            f"ranks), then the summary:")
        sys.stdout.flush()
        opts = {"root": str(root), "model": mcfg, "save_layout": save_layout, "reshard_layout": reshard_layout,
                "repeats": repeats}
        run_parallel(_worker, world, tmp_dir=root / "run", args=(opts,))
        res = json.loads((root / "run" / "result.json").read_text())
        rec, nbytes = res["rec"], res["bytes"]
        log("conversions to one file, each in a fresh interpreter:")
        _convert(root, repeats, rec, nbytes, live_table(log))
        man = read_manifest(resolve(root / "ml"))
        largest = max(e.nbytes for e in man.model.values())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = _rows(rec, nbytes)
    by = {r["op"]: r for r in rows}
    lay = "tp={} pp={} dp={}"
    log(f"bench ckpt: GPT n_layer={mcfg['n_layer']} n_embd={mcfg['n_embd']} n_head={mcfg['n_head']}, "
        f"model + AdamW moments {fmt_bytes(res['total'])} over {world} gloo ranks, saved at "
        f"{lay.format(*save_layout)}" + (f", resharded load at {lay.format(*reshard_layout)}" if reshard_layout
                                         else "") + f", {repeats} repeat(s); largest tensor {fmt_bytes(largest)}")
    log(format_rows(rows))
    worst = max((x for x in res["resident"] if x is not None), default=None)
    check = "" if worst is None else f"; fincore after eviction: {worst} bytes of the files still resident (worst case)"
    log("vs DCP: median time over the DCP counterpart's; of disk: GB/s over the faster disk probe's GB/s "
        "(same direction, medians); RSS growth: each measurement's peak over the RSS before it, median (max)")
    log(f"disk probe: {PROBE_RULE}")
    over = [r["op"] for r in rows if r["over"] and not r["op"].startswith("disk")]
    if over:
        log(f"of disk above 100% (marked !) for {', '.join(over)}: faster than the best probe, so the probe "
            f"of the same direction was slowed by other load (or, for a read, pages were still cached); those rows are "
            f"not a disk figure")
    log(f"page cache: {CACHE_HOW[res['cache']]}{check}")
    for op, xs in res["rss_after"].items():
        log(f"RSS of the largest rank before -> after each of {repeats} '{op}' in a row: {xs[0]:.0f} -> "
            f"{', '.join(f'{x:.0f}' for x in xs[1:])} MiB")
    for op, what in (("megalite async save: blocked", "async blocked / sync save"),
                     ("megalite async save, copied: blocked", "async blocked with a staging copy / sync save")):
        if op in by:
            r, lo, hi = paired(rec, op, "megalite save")
            log(f"{what}: {r:.1%} (ratio of medians; {lo:.1%}-{hi:.1%} in the pairs measured together)")
    if "AdamW step, in place" in by and "megalite async save: blocked" in by:
        r, lo, hi = paired(rec, "AdamW step, out of place (after async save)", "AdamW step, in place")
        log(f"the step after an async save (out of place) / an in-place step: {r:.2f}x (ratio of medians; "
            f"{lo:.2f}-{hi:.2f}x in the pairs measured together)")
    if ASYNC_COST in by:
        runs = rec[ASYNC_COST]
        blocked, steps = spread([r["blocked"] for r in runs])[0], spread([r["steps"] for r in runs])[0]
        r, lo, hi = paired(rec, ASYNC_COST, "megalite save")
        log(f"what an async save costs the training loop: blocked {blocked:.3f} s + the {steps:g} AdamW steps that "
            f"ran while it wrote, over as many in-place steps without a save ({by[DURING]['median_s']:.3f} s "
            f"against {by[PLAIN]['median_s']:.3f} s, the blocked time included) = {by[ASYNC_COST]['median_s']:.3f} "
            f"s = {r:.1%} of the sync save (medians over {len(runs)} repeats, the two sides side by side; "
            f"{lo:.1%}-{hi:.1%} per repeat)")
        cpu, cores = spread([r["cpu_added"] for r in runs])[0], len(os.sched_getaffinity(0))
        log(f"CPU time the async save added to the {res['world']} ranks' processes: {cpu:.3f} s (median over repeats: "
            f"their writer threads' CRC32C, copies into the page cache and commit, and the out-of-place step; "
            f"the steps' own CPU subtracted); where the loop keeps all {cores} cores busy that is "
            f"{cpu / cores:.3f} s of its time = {cpu / cores / by['megalite save']['median_s']:.1%} of the sync save "
            f"(steadier than the wall-time row under other load, which it does not count)")
    waits = [(n, how) for n, how in ((WAIT_COST, "through the page cache"), (WAIT_COST_DIRECT, "with O_DIRECT"))
             if n in by]
    if waits:
        parts = []
        for n, how in waits:
            r, lo, hi = paired(rec, n, "megalite save")
            parts.append(f"{how} {r:.1%} ({lo:.1%}-{hi:.1%} per repeat)")
        log(f"what an async save costs a loop that waits ({WAIT_S * 1000:.0f} ms asleep per step, as a host thread "
            f"waits on its GPU, then the all-reduce; blocked + the steps until its commit, over as many without a "
            f"save): {', '.join(parts)} of the sync save (medians over repeats)")
    if "megalite load, resharded" in by:
        r, lo, hi = paired(rec, "megalite load, resharded", "megalite load")
        log(f"resharded / same-layout load: {r:.2f}x (ratio of medians over {len(rec['megalite load'])} loads "
            f"each, interleaved; {lo:.2f}-{hi:.2f}x in the pairs measured together)")
    for kind in ("megalite convert", "dcp_to_torch_save"):
        r = rec[kind][-1]
        log(f"{kind}: peak RSS {max(x['rss'] for x in rec[kind]):.0f} MiB = {r['base']:.0f} MiB after imports "
            f"+ {max(x['extra'] for x in rec[kind]):.0f} MiB; of which anonymous memory +"
            f"{max(x['anon'] for x in rec[kind]):.0f} MiB, mapped file pages +"
            f"{max(x['file'] for x in rec[kind]):.0f} MiB (largest tensor {fmt_bytes(largest)})")
    return rows
