"""`megalite verify` and `megalite inspect`: check a checkpoint against its manifest; describe it."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ..parallel.grid import Coord, Layout
from . import manifest as mf
from .stream import read_header
from ..parallel.pipeline import stage_of
from .layout import MODEL_FILE, OPTIM_FILE, STATE_FILE, CheckpointError, coord_dir, parse_coord_dir, resolve


def verify(path) -> tuple[Path, list[str]]:
    """Every problem, one line each: files (present, size, checksum), coordinates, tiling, safetensors keys."""
    try:
        step = resolve(path)
        man = mf.read(step)
    except CheckpointError as e:
        return Path(path), [str(e)]
    problems = []
    lay = man["layout"]
    layout = Layout(lay["tp"], lay["pp"], lay["dp"])
    for c in layout.coords():
        rel = coord_dir(c)
        if f"{rel}/{STATE_FILE}" not in man["files"]:
            problems.append(f"{step.name}: coordinate {rel} has no files in the manifest "
                            f"(layout {layout} expects {layout.world_size} coordinates)")
        if not (step / rel).is_dir():
            problems.append(f"{step.name}: folder {rel}/ is missing (layout {layout} expects it)")
    for rel, meta in man["files"].items():
        f = step / rel
        if not f.is_file():
            problems.append(f"{step.name}: file {rel} is missing")
            continue
        size = f.stat().st_size
        if size != meta["bytes"]:
            problems.append(f"{step.name}: file {rel} is {size} bytes, the manifest says {meta['bytes']}")
            continue
        crc = mf.crc32_file(f)
        if crc != meta["crc32"]:
            problems.append(f"{step.name}: file {rel} fails its checksum (crc32 {crc}, manifest {meta['crc32']})")
    for section in ("model", "optimizer_state"):
        for name, entry in man[section].items():
            problems += [f"{step.name}: {p}" for p in mf.tiling_problems(name, entry)]
            for sl in entry["slices"]:
                if sl["file"] not in man["files"]:
                    problems.append(f"{step.name}: tensor '{name}' names file {sl['file']}, which the manifest "
                                    f"does not list")
    problems += _check_keys(step, man)
    return step, problems


def _check_keys(step: Path, man: dict) -> list[str]:
    """Each slice's key is in its file's safetensors header with the shape the manifest gives."""
    want = defaultdict(dict)
    for section in ("model", "optimizer_state"):
        for name, entry in man[section].items():
            for sl in entry["slices"]:
                shape = [sl["flat"][1] - sl["flat"][0]] if "flat" in sl else [b - a for a, b in sl["box"]]
                want[sl["file"]][sl["key"]] = (name, shape)
    problems = []
    for rel, keys in want.items():
        try:
            header, _ = read_header(step / rel)
        except (OSError, ValueError) as e:
            problems.append(f"{step.name}: {rel} has an unreadable safetensors header ({e})")
            continue
        for key, (name, shape) in keys.items():
            if key not in header:
                problems.append(f"{step.name}: tensor '{name}' (key '{key}') is missing from {rel}")
            elif header[key]["shape"] != shape:
                problems.append(f"{step.name}: tensor '{name}' in {rel} has shape {header[key]['shape']}, "
                                f"the manifest says {shape}")
    return problems


def _stage_layers(man: dict) -> dict[int, list[int]]:
    """The global layer ids each pipeline stage holds, read from the partition tags' placement."""
    lay, n_layer = man["layout"], man["config"].get("model", {}).get("n_layer")
    vpp = man["config"].get("parallel", {}).get("vpp", 1)  # virtual stages: a rank holds vpp chunks
    out = defaultdict(set)
    for entry in man["model"].values():
        placement = entry["partition"].get("placement", "")
        if placement.startswith("layer.") and n_layer:
            out[stage_of(placement, n_layer, lay["pp"], vpp)].add(int(placement.split(".", 1)[1]))
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
    man = mf.read(step)
    lay = man["layout"]
    per = defaultdict(lambda: {"tensors": 0, "model": 0, "optim": 0, "other": 0})
    for rel, meta in man["files"].items():
        coord, fname = rel.split("/", 1)
        key = "model" if fname == MODEL_FILE else "optim" if fname == OPTIM_FILE else "other"
        per[coord][key] += meta["bytes"]
    layers = _stage_layers(man)
    for section in ("model", "optimizer_state"):
        for entry in man[section].values():
            for sl in entry["slices"]:
                per[sl["file"].split("/", 1)[0]]["tensors"] += 1
    lines = [f"checkpoint {step}",
             f"step {man['step']}  tokens {man.get('tokens_seen', 0):,}  layout tp={lay['tp']} pp={lay['pp']} "
             f"dp={lay['dp']} zero1={'on' if lay.get('zero1') else 'off'}  format v{man['format_version']}  "
             f"megalite {man.get('megalite_version')}  torch {man.get('torch_version')}",
             f"{len(man['model'])} model tensors, {len(man['optimizer_state'])} optimizer tensors",
             "",
             f"{'coordinate':<16}{'layers':<12}{'tensors':>8}{'model':>12}{'optimizer':>12}{'total':>12}"]
    total = 0
    for coord in sorted(per):
        d = per[coord]
        span = _span(layers.get(parse_coord_dir(coord).pp, []))
        t = d["model"] + d["optim"] + d["other"]
        total += t
        lines.append(f"{coord:<16}{span:<12}{d['tensors']:>8}{_h(d['model']):>12}{_h(d['optim']):>12}{_h(t):>12}")
    lines.append(f"{'total':<16}{'':<12}{'':>8}{'':>12}{'':>12}{_h(total):>12}")
    return "\n".join(lines)


def _h(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def tree(path) -> str:
    """The rank-coded tree drawn as the grid: one row per (pipeline stage, tp rank), one column per dp
    replica; each cell is the coordinate folder, its global rank, and the bytes it holds."""
    step = resolve(path)
    man = mf.read(step)
    lay = man["layout"]
    layout = Layout(lay["tp"], lay["pp"], lay["dp"])
    size = defaultdict(int)
    for rel, meta in man["files"].items():
        size[rel.split("/", 1)[0]] += meta["bytes"]
    layers = _stage_layers(man)
    cell = 34
    lines = [f"{step}  (tp={layout.tp} pp={layout.pp} dp={layout.dp}; rank = tp + {layout.tp}*(dp + {layout.dp}*pp))",
             " " * 22 + "".join(f"{'dp' + str(d):<{cell}}" for d in range(layout.dp))]
    for p in range(layout.pp):
        label = f"pp{p} layers {_span(layers.get(p, []))}"
        for t in range(layout.tp):
            row = f"{label if t == 0 else '':<22}"
            for d in range(layout.dp):
                c = Coord(t, p, d)
                row += f"{coord_dir(c) + '  r' + str(layout.rank_of(c)) + '  ' + _h(size[coord_dir(c)]):<{cell}}"
            lines.append(row.rstrip())
    return "\n".join(lines)
