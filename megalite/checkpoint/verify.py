"""`megalite verify`, `megalite inspect` and `inspect --tree`: check a whole checkpoint as the loader would,
without loading it (`verify`: every check of validate.py, for `megalite verify`, resume=auto's choice and the
commit's `recover`, which moves in an interrupted re-save only if it verifies); describe it.

`verify` runs the same manifest parser (every field, paths, dtypes, exact tiling, the manifest's checksum),
the same file checks (no symlinks, sizes, header checksums and well-formed headers), the same key/dtype/shape
checks, and every checksum block of every slice, every state.json and the tokenizer.json. So a checkpoint
`verify` calls intact is one every loader accepts, and any checkpoint problem a loader would refuse, `verify`
reports.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ..base.errors import CheckpointError
from ..parallel.grid import Coord
from ..parallel.pipeline import stage_of
from .validate import check_key, read_origin, read_state, read_tokenizer
from .manifest import FORMAT_VERSION, read
from .read import SliceReader
from .tree import MANIFEST, MODEL_FILE, OPTIM_FILE, coord_dir, parse_coord_dir, resolve

__all__ = ["verify", "complete", "inspect", "tree"]


def _stage_layers(man: dict) -> dict[int, list[int]]:
    """The global layer ids each pipeline stage holds, read from the partition tags' placement."""
    n_layer = man.model_config.get("n_layer")
    vpp = man.config.get("parallel", {}).get("vpp", 1)  # virtual stages: a rank holds vpp chunks
    out = defaultdict(set)
    for entry in man.model.values():
        placement = entry.partition.placement
        if placement.startswith("layer.") and n_layer:
            out[stage_of(placement, n_layer, man.layout.pp, vpp)].add(int(placement.split(".", 1)[1]))
    return {pp: sorted(ls) for pp, ls in out.items()}


def _span(layers: list[int]) -> str:
    """Sorted layer ids as ranges: "0-3", or "0-1,4-5" for the chunks of an interleaved (vpp) stage."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" for a, b in runs) if runs else "-"


def inspect(path) -> str:
    """A table: step, layout, and per coordinate the layers it holds, tensors and bytes."""
    step = resolve(path)
    man = read(step)
    per = defaultdict(lambda: {"tensors": 0, "model": 0, "optim": 0, "other": 0})
    for rel, rec in man.files.items():
        coord, fname = rel.split("/", 1)
        key = "model" if fname == MODEL_FILE else "optim" if fname == OPTIM_FILE else "other"
        per[coord][key] += rec.bytes
    layers = _stage_layers(man)
    w = 16 if man.layout.cp == 1 else 21  # tp00-cp00-pp00-dp00 with cp > 1
    dtypes = defaultdict(int)
    for entry in man.tensors():
        dtypes[entry.dtype] += 1
        for sl in entry.slices:
            per[sl.file.split("/", 1)[0]]["tensors"] += 1
    lines = [f"checkpoint {step}",
             f"step {man.step}  tokens {man.tokens_seen:,}  layout {man.layout} "
             f"zero1={'on' if man.zero1 else 'off'}  format v{FORMAT_VERSION}  "
             f"megalite {man.info.get('megalite_version')}  torch {man.info.get('torch_version')}",
             f"{len(man.model)} model tensors, {len(man.optimizer_state)} optimizer tensors "
             f"({', '.join(f'{n} {d}' for d, n in sorted(dtypes.items()))})",
             "",
             f"{'coordinate':<{w}}{'layers':<12}{'tensors':>8}{'model':>12}{'optimizer':>12}{'total':>12}"]
    total = 0
    for coord in sorted(per):
        d = per[coord]
        span = _span(layers.get(parse_coord_dir(coord).pp, []))
        t = d["model"] + d["optim"] + d["other"]
        total += t
        lines.append(f"{coord:<{w}}{span:<12}{d['tensors']:>8}{_h(d['model']):>12}{_h(d['optim']):>12}{_h(t):>12}")
    lines.append(f"{'total':<{w}}{'':<12}{'':>8}{'':>12}{'':>12}{_h(total):>12}")
    return "\n".join(lines)


def _h(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def tree(path) -> str:
    """The rank-coded tree drawn as the grid: one row per (pipeline stage, tp rank), one column per dp
    replica (per (dp, cp) pair with context parallelism); each cell is the coordinate folder, its global rank,
    and the bytes it holds."""
    step = resolve(path)
    man = read(step)
    layout, cp = man.layout, man.layout.cp
    size = defaultdict(int)
    for rel, rec in man.files.items():
        size[rel.split("/", 1)[0]] += rec.bytes
    layers = _stage_layers(man)
    cell = 34 if cp == 1 else 39
    columns = [(d, k) for d in range(layout.dp) for k in range(cp)]
    if cp == 1:
        head = f"tp={layout.tp} pp={layout.pp} dp={layout.dp}; rank = tp + {layout.tp}*(dp + {layout.dp}*pp)"
    else:
        head = (f"tp={layout.tp} cp={cp} pp={layout.pp} dp={layout.dp}; "
                f"rank = tp + {layout.tp}*(cp + {cp}*(dp + {layout.dp}*pp))")
    lines = [f"{step}  ({head})",
             " " * 22 + "".join(f"{f'dp{d}' + (f' cp{k}' if cp > 1 else ''):<{cell}}" for d, k in columns)]
    for p in range(layout.pp):
        label = f"pp{p} layers {_span(layers.get(p, []))}"
        for t in range(layout.tp):
            row = f"{label if t == 0 else '':<22}"
            for d, k in columns:
                c = Coord(t, p, d, k)
                rel = coord_dir(c, cp)
                row += f"{rel + '  r' + str(layout.rank_of(c)) + '  ' + _h(size[rel]):<{cell}}"
            lines.append(row.rstrip())
    return "\n".join(lines)


def verify(path) -> tuple[Path, list[str]]:
    """Every problem, one line each: the manifest, then per coordinate, per file and per tensor slice (every
    block of its bytes read and checked)."""
    try:
        step = resolve(path)
        man = read(step)
    except CheckpointError as e:
        return Path(path), [str(e)]
    problems = []
    for c in man.layout.coords():
        rel = coord_dir(c, man.layout.cp)
        if not (step / rel).is_dir():
            problems.append(f"{step.name}: folder {rel}/ is missing (layout {man.layout} expects it)")
            continue
        try:
            read_state(step, man, c)
        except CheckpointError as e:
            problems.append(str(e))
    try:
        read_tokenizer(step, man)
        read_origin(step, man)
    except CheckpointError as e:
        problems.append(str(e))
    reader = SliceReader(step, man)
    bad_files = set()
    for rel in man.files:
        if rel.endswith(".safetensors"):
            try:
                reader.header(rel)
            except CheckpointError as e:
                problems.append(str(e))
                bad_files.add(rel)
    for entry in man.tensors():
        for sl in entry.slices:
            if sl.file in bad_files:
                continue
            try:
                check_key(step, reader.header(sl.file)[0], entry, sl)
                reader.read_stored(entry, sl)  # all its blocks, checked
            except CheckpointError as e:
                problems.append(str(e))
    return step, problems


def complete(folder: Path) -> bool:
    """A step folder with a manifest that verifies (what the commit's `recover` may move into place)."""
    return (folder / MANIFEST).is_file() and not verify(folder)[1]
