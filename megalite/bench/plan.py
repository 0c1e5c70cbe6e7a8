"""`megalite bench plan`: the checkpoint's write plan, manifest and validation for a model and layout this
machine could never run (GPT-3 175B at 16,384 ranks), with no tensors.

Each pipeline stage's parameters come from the real model built on the meta device (so their partition
tags are the ones training uses, not a copy of them); then, for every rank of the layout, the real write
plan (`checkpoint.plan.plan_writes`) and the records a save produces (`checkpoint.plan.add`), every
rank's report as the commit gathers it to rank 0, the typed manifest (`checkpoint.manifest.build`), and
what `manifest.write` does with it on rank 0: serialise it, parse it back with `Manifest.from_json` (the
full validation every reader runs: every field, every slice's file, exact tiling), and the JSON text that
would be written. Checksums are placeholders with the real count (one CRC32 per 1 MiB block of every
slice); file sizes are the tensors' bytes.

`--cp N` plans a context-parallel layout (tp x cp x pp x dp ranks; the cp ranks of a stage write disjoint
shares of it, cut over dp x cp). With `--reshard-to TP,PP,DP[,CP]` it also plans the resume at another layout: for every destination rank, which
source files it opens and how many bytes it reads, following `checkpoint.read.SliceReader.read`'s rules
(a region of a box stored at the same tp size reads only the overlapping ranges of its pieces; a region of
another box reads, of each stored slice or piece, the ranges `reshard.read_ranges` says: the runs of the
overlap, or its span; with ZeRO-1 only over the rows that hold the rank's flat range).
"""
from __future__ import annotations

import bisect
import json
import math
import pickle
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from ..parallel.partition import Box
from ..checkpoint.manifest import BLOCK_BYTES
from ..checkpoint.read import read_ranges
from . import StreamTable, fmt_bytes


@dataclass
class PlanRow:
    layout: str
    ranks: int
    files: int
    slices: int
    manifest_bytes: int
    plan_s: float
    rank_plan_s: float
    manifest_s: float
    write_max: int
    write_mean: float
    gather_bytes: int
    gather_msgs: int
    problems: int


def stage_tensors(model: dict, tp: int, pp: int, vpp: int = 1) -> list[list]:
    """[(global name, Partition)] per pipeline stage, read from the real model built on the meta device.

    vpp > 1 (interleaved virtual stages): stage s holds the layer chunks s, s + pp, s + 2 pp, ... of
    pp * vpp contiguous chunks (Megatron's placement)."""
    from ..config import ModelConfig
    from ..model import GPTStage
    from ..parallel.grid import Axis, Coord, Layout, ParallelGrid
    from ..parallel.pipeline import partition_layers
    from ..parallel.partition import partition_of
    cfg = ModelConfig(**model)
    layout = Layout(tp, pp, 1)
    chunks = partition_layers(cfg.n_layer, pp * vpp)
    out = []
    for s in range(pp):
        rank = layout.rank_of(Coord(0, s, 0))
        one = Axis(1, 0)
        grid = ParallelGrid(layout, rank, Axis(tp, 0), Axis(pp, s), one, one, one)
        layers = [i for c in range(s, pp * vpp, pp) for i in chunks[c]]
        with torch.device("meta"):
            stage = GPTStage(cfg, grid, layers=layers)
        out.append([(name, partition_of(p)) for name, p in stage.global_parameters()])
    return out


def one_rank_plan_s(stages: list, layout) -> float:
    """Seconds one rank spends planning its writes at every save (the largest stage, uncached)."""
    from ..checkpoint.plan import plan_writes
    from ..parallel.grid import Coord
    s = max(range(len(stages)), key=lambda i: len(stages[i]))
    t0 = time.process_time()
    plan_writes(stages[s], Coord(0, s, 0), layout)
    return time.process_time() - t0


def _reports(stages: list, layout) -> tuple[list, list]:
    """Every rank's report as `commit.write_rank` returns it (placeholder checksums), and its bytes written."""
    from ..checkpoint import manifest as mf
    from ..checkpoint.tree import MODEL_FILE, OPTIM_FILE, STATE_FILE, coord_dir
    from ..checkpoint.plan import Payload, add, plan_writes
    fp32 = torch.empty((), device="meta")
    parts = [dict(s) for s in stages]
    reports, written = [], []
    for c in layout.coords():
        items = plan_writes(stages[c.pp], c, layout)
        pay = Payload(files={MODEL_FILE: {}, OPTIM_FILE: {}})
        sizes = dict.fromkeys(pay.files, 0)
        for it in items:
            add(pay, it, parts[c.pp][it.name], fp32)
        rel = coord_dir(c, layout.cp)
        tensors = []
        for proto, it in pay.records:
            n = 4 * ((it.flat[1] - it.flat[0]) if it.flat else it.box.numel)
            sizes[it.file] += n
            crcs = ("00000000",) * mf.n_blocks(n, mf.BLOCK_BYTES)
            tensors.append((proto, mf.SliceRef(f"{rel}/{it.file}", it.key, it.box, it.flat, crcs)))
        files = {f"{rel}/{f}": mf.FileRecord(n, "00000000") for f, n in sizes.items()}
        files[f"{rel}/{STATE_FILE}"] = mf.FileRecord(0, "00000000")
        reports.append(mf.RankReport(files, tensors))
        written.append(sum(sizes.values()))
    return reports, written


def validate(d: dict) -> list[str]:
    """What every reader checks (`Manifest.from_json`): the first problem, or nothing."""
    from ..checkpoint import manifest as mf
    from ..base.errors import CheckpointError
    try:
        mf.Manifest.from_json(d, "bench plan")
    except CheckpointError as e:
        return [str(e)]
    return []


def gather_to_rank0(reports: list, layout) -> tuple[int, int]:
    """(bytes, messages) rank 0 receives in the commit's two-level gather (`commit._gather`): the pickled
    reports of the other ranks of stage 0, then the merged part of every other stage from its leader."""
    from ..checkpoint.manifest import RankReport
    leaders = layout.leader_ranks()  # reports are in rank order (layout.coords())
    stages = [layout.stage_ranks(layout.coord_of(r)) for r in leaders]
    first = sum(len(pickle.dumps(reports[r])) for r in stages[0][1:])
    parts = sum(len(pickle.dumps(RankReport.merged([reports[r] for r in members]))) for members in stages[1:])
    return first + parts, len(stages[0]) - 1 + len(leaders) - 1


def _name(layout) -> str:
    return f"{layout.tp},{layout.pp},{layout.dp}" + (f" cp{layout.cp}" if layout.cp > 1 else "")


def plan_layout(model: dict, tp: int, pp: int, dp: int, vpp: int = 1, zero1: bool = False,
                cp: int = 1) -> tuple[PlanRow, object]:
    from ..checkpoint import manifest as mf
    from ..parallel.grid import Layout
    layout = Layout(tp, pp, dp, cp)
    stages = stage_tensors(model, tp, pp, vpp)
    rank_s = one_rank_plan_s(stages, layout)
    t0 = time.process_time()
    reports, written = _reports(stages, layout)
    t1 = time.process_time()
    meta = mf.step_meta(0, layout, {"model": model}, zero1=zero1)
    man = mf.build(meta, reports)
    d = man.to_json()  # as manifest.write: serialise, parse back (the readers' validation), write the text
    text = mf.dumps(d)
    problems = validate(json.loads(text))
    t2 = time.process_time()
    gathered, msgs = gather_to_rank0(reports, layout)
    slices = sum(len(e.slices) for e in man.tensors())
    row = PlanRow(_name(layout) + (f" vpp{vpp}" if vpp > 1 else ""), layout.world_size, len(man.files),
                  slices, len(text), t1 - t0, rank_s, t2 - t1, max(written), statistics.fmean(written), gathered,
                  msgs, len(problems))
    return row, man


# ---------------------------------------------------------------- resharding: what each destination reads
def _piece_index(entry) -> dict:
    """Per stored box of a TensorEntry: its slices, ZeRO-1 pieces sorted by flat start (for range lookups)."""
    by_box = defaultdict(list)
    for sl in entry.slices:
        by_box[sl.box].append(sl)
    for sls in by_box.values():
        sls.sort(key=lambda s: (s.flat or (0, 0))[0])
    return by_box


def reads_for(index: dict, box, flat) -> list[tuple[str, int]]:
    """(file, bytes) a load reads for region `box` (elements flat[0]:flat[1] of it with ZeRO-1),
    following SliceReader.read (fp32)."""
    box = Box(box)
    if flat is not None and flat[0] >= flat[1]:
        return []
    same = index.get(box)
    if same and (flat is not None or same[0].flat is not None):  # _read_same_box: the overlapping ranges
        return _overlaps(same, *(flat or (0, box.numel)), box.numel)
    if same:
        return [(same[0].file, 4 * box.numel)]
    need = box if flat is None else box.rows_holding(*flat)
    out = []
    for sbox, sls in index.items():
        inter = sbox.intersect(need)
        if inter is None:
            continue
        for lo, hi in read_ranges(inter, sbox, 4, BLOCK_BYTES):  # read_stored / _read_span: runs or the span
            out += _overlaps(sls, lo, hi, sbox.numel)
    return out


def _overlaps(pieces: list, a: int, b: int, numel: int) -> list[tuple[str, int]]:
    """(file, bytes) of elements [a, b) of a box stored as `pieces` (sorted by flat start)."""
    starts = [(s.flat or (0, 0))[0] for s in pieces]
    out = []
    for sl in pieces[max(0, bisect.bisect_right(starts, a) - 1):]:
        pa, pb = sl.flat or (0, numel)
        if pa >= b:
            break
        if min(b, pb) > max(a, pa):
            out.append((sl.file, 4 * (min(b, pb) - max(a, pa))))
    return out


def plan_reshard(man: dict, model: dict, tp: int, pp: int, dp: int, vpp: int = 1, zero1: bool = False,
                 cp: int = 1) -> dict:
    """Per destination rank of layout (tp, pp, dp, cp): source files opened and bytes read, as load_into does."""
    from ..parallel.data import dp_pieces
    from ..parallel.grid import Layout
    from ..parallel.partition import tp_box
    layout = Layout(tp, pp, dp, cp)
    stages = stage_tensors(model, tp, pp, vpp)
    index = {e.name: _piece_index(e) for e in man.tensors()}
    t0 = time.process_time()
    files, nbytes, needed = [], [], []
    same_on_dp: dict = {}  # (tp, pp) -> reads that do not depend on the dp/cp rank (weights; moments without zero1)
    for c in layout.coords():
        tensors = stages[c.pp]
        boxes = {name: tp_box(part, c.tp, tp) for name, part in tensors}
        if (c.tp, c.pp) not in same_on_dp:
            kinds = ("model",) if zero1 else ("model", "exp_avg", "exp_avg_sq")
            same_on_dp[c.tp, c.pp] = [r for name, _ in tensors for k in kinds
                                      for r in reads_for(index[name if k == "model" else f"{name}.{k}"], boxes[name], None)]
        reads = list(same_on_dp[c.tp, c.pp])
        need = sum(12 * b.numel for b in boxes.values())  # its weights and its two moments
        if zero1:
            pieces = dp_pieces([(n, boxes[n].numel, bool(p.tied_to)) for n, p in tensors], layout.replica(c),
                               layout.replicas)
            need -= sum(8 * (b.numel - (pieces[n][1] - pieces[n][0])) for n, b in boxes.items())
            for name, _ in tensors:
                for moment in ("exp_avg", "exp_avg_sq"):
                    reads += reads_for(index[f"{name}.{moment}"], boxes[name], pieces[name])
        files.append(len({f for f, _ in reads}))
        nbytes.append(sum(b for _, b in reads))
        needed.append(need)
    return {"layout": _name(layout), "ranks": layout.world_size, "files_max": max(files),
            "files_mean": statistics.fmean(files), "bytes_max": max(nbytes), "bytes_mean": statistics.fmean(nbytes),
            "read_over_needed_max": max(b / n for b, n in zip(nbytes, needed)),
            "seconds": time.process_time() - t0}


def bench_plan(n_layer: int, n_embd: int, n_head: int, vocab_size: int, tp: int, pp: int, dp: list[int],
               vpp: int = 1, zero1: bool = False, block_size: int = 2048, reshard_to=None, log=print,
               cp: int = 1) -> list:
    """One table line per layout (one per value of dp); with reshard_to (tp, pp, dp[, cp]), the destination
    reads of the last."""
    model = {"n_layer": n_layer, "n_head": n_head, "n_embd": n_embd, "block_size": block_size,
             "vocab_size": vocab_size, "dropout": 0.0}
    n_params = sum(math.prod(p.global_shape) for s in stage_tensors(model, 1, 1) for _, p in s if not p.tied_to)
    log(f"bench plan: GPT n_layer={n_layer} n_embd={n_embd} n_head={n_head} vocab={vocab_size} "
        f"block={block_size} ({n_params:,} parameters, fp32 weights + AdamW moments = "
        f"{fmt_bytes(12 * n_params)}), zero1 {'on' if zero1 else 'off'}, vpp {vpp}"
        + (f", cp {cp} (ranks = tp x cp x pp x dp)" if cp > 1 else "") + "; no tensors, one process")
    out = StreamTable(["tp,pp,dp", "ranks", "files", "slices", "manifest", "plan s", "1 rank s",
                       "manifest+validate s", "write/rank max", "mean", "max/mean", "gather to rank 0", "msgs",
                       "problems"], [8, 6, 6, 7, 10, 6, 8, 19, 14, 10, 8, 16, 6, 8], log=log)
    rows, man = [], None
    for d in dp:
        row, man = plan_layout(model, tp, pp, d, vpp, zero1, cp)
        rows.append(row)
        out.row([row.layout, f"{row.ranks:,}", f"{row.files:,}", f"{row.slices:,}", fmt_bytes(row.manifest_bytes),
                 f"{row.plan_s:.2f}", f"{row.rank_plan_s:.3f}", f"{row.manifest_s:.2f}", fmt_bytes(row.write_max),
                 fmt_bytes(row.write_mean), f"{row.write_max / row.write_mean:.2f}" if row.write_mean else "-",
                 fmt_bytes(row.gather_bytes), f"{row.gather_msgs:,}", row.problems])
    if len(rows) > 1:
        a, b = rows[0], rows[-1]
        grow = (b.plan_s + b.manifest_s) / (a.plan_s + a.manifest_s)
        log(f"growth {a.ranks:,} -> {b.ranks:,} ranks ({b.ranks / a.ranks:.0f}x): plan+manifest+validate "
            f"{grow:.1f}x, manifest bytes {b.manifest_bytes / a.manifest_bytes:.1f}x, "
            f"gather bytes {b.gather_bytes / max(1, a.gather_bytes):.1f}x")
    out = {"rows": rows}
    if reshard_to:
        t, p, d, *c = reshard_to
        r = plan_reshard(man, model, t, p, d, vpp=1, zero1=zero1, cp=c[0] if c else 1)
        src = rows[-1]
        log(f"\nresume {src.layout} (zero1 {'on' if zero1 else 'off'}) at {r['layout']}: per destination rank "
            f"({r['ranks']:,}), source files opened max {r['files_max']} / mean {r['files_mean']:.1f} "
            f"(of {src.files:,}); bytes read max {fmt_bytes(r['bytes_max'])} / mean {fmt_bytes(r['bytes_mean'])}; "
            f"read / the rank's own weights + moments: max {r['read_over_needed_max']:.2f}x "
            f"({r['seconds']:.1f} s to plan)")
        out["reshard"] = r
    return out


def _ints(text: str, flag: str, n: int | None = None) -> list[int]:
    from ..config import ConfigError
    try:
        vals = [int(x) for x in str(text).split(",")]
    except ValueError:
        vals = []
    if not vals or any(v < 1 for v in vals) or (n is not None and len(vals) != n):
        want = f"{n} comma-separated positive integers" if n else "positive integers, comma-separated"
        raise ConfigError(f"{flag} {text!r}: expected {want}")
    return vals


def check_shape(n_layer: int, n_embd: int, n_head: int, vocab_size: int, block_size: int, tp: int, pp: int,
                vpp: int, prefix: str = "--", cp: int = 1) -> None:
    """One-line errors naming the flag, before anything is planned."""
    from ..config import ConfigError
    for name, v in (("n-layer", n_layer), ("n-embd", n_embd), ("n-head", n_head), ("vocab-size", vocab_size),
                    ("block-size", block_size), ("tp", tp), ("pp", pp), ("vpp", vpp), ("cp", cp)):
        if v < 1:
            raise ConfigError(f"{prefix}{name} {v}: must be a positive integer")
    if cp > 1 and block_size % (2 * cp):
        raise ConfigError(f"{prefix}cp {cp}: {prefix}block-size {block_size} is not divisible by 2 x cp = {2 * cp} "
                          f"(each sequence is cut into 2*cp chunks)")
    if n_embd % n_head:
        raise ConfigError(f"{prefix}n-embd {n_embd} is not divisible by {prefix}n-head {n_head}")
    if n_head % tp:
        raise ConfigError(f"{prefix}tp {tp} does not divide {prefix}n-head {n_head}")
    if pp * vpp > n_layer:
        raise ConfigError(f"{prefix}pp {pp} x {prefix}vpp {vpp} is larger than {prefix}n-layer {n_layer} "
                          f"(every virtual stage needs at least one layer)")


def bench_plan_cli(args) -> dict:
    n_layer, n_embd, block = args.n_layer or 96, args.n_embd or 12288, args.block_size or 2048
    vocab = args.vocab_size or 50304  # the flag is shared with bench prepare, whose default differs
    dps = _ints(args.dp, "--dp")
    cp = getattr(args, "cp", 1)
    check_shape(n_layer, n_embd, args.n_head, vocab, block, args.tp, args.pp, args.vpp, cp=cp)
    to = None
    if args.reshard_to:
        to = _ints(args.reshard_to, "--reshard-to", 4 if args.reshard_to.count(",") == 3 else 3)
        check_shape(n_layer, n_embd, args.n_head, vocab, block, to[0], to[1], 1, prefix="--reshard-to ",
                    cp=to[3] if len(to) == 4 else 1)
    return bench_plan(n_layer, n_embd, args.n_head, vocab, args.tp, args.pp, dps, vpp=args.vpp,
                      zero1=args.zero1, block_size=block, reshard_to=to, cp=cp)
