"""How a benchmark's costs grow with size: `bench ckpt --sizes 128,512,1024` (and `bench dcp --sizes ...`).

Each size is a whole run of the bench (its own rows, medians over its repeats); this module turns the runs
into one table: seconds per GiB of each operation at each size for megalite and its peer, the ratio
megalite / peer per size, and a least-squares fit t = fixed + per_GiB * GiB for the operations named in
`fit` (two sizes or more). A constant s/GiB across sizes means the cost is all per byte; a fixed part shows
as s/GiB falling with size.
"""
from __future__ import annotations

from . import table

GIB = 2**30
DISTINCT = 0.05  # sizes whose bytes differ by less than this share of the largest cannot be fitted apart


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares t = a + b * x over (x, t) points: (a, b). One point: (0, t / x)."""
    if len(points) == 1:
        x, t = points[0]
        return 0.0, t / x
    n = len(points)
    mx, mt = sum(x for x, _ in points) / n, sum(t for _, t in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:  # every size moved the same bytes (a bench rounds small sizes up to its smallest model)
        return 0.0, mt / mx
    b = sum((x - mx) * (t - mt) for x, t in points) / sxx
    return mt - b * mx, b


def scaling_lines(runs: dict, pairs: list[tuple[str, str]], fit: list[str]) -> list[str]:
    """`runs`: {size in MiB: the bench's rows (dicts with op, bytes, median_s)}. Returns the lines to print."""
    sizes = sorted(runs)
    by = {mb: {r["op"]: r for r in runs[mb]} for mb in sizes}

    def per_gib(r):
        return r["median_s"] / (r["bytes"] / GIB) if r and r.get("bytes") else None

    rows = []  # one row per operation and size: the table's shape does not depend on how many sizes
    for ours, peer in pairs:
        for mb in sizes:
            if ours not in by[mb]:
                continue
            a, b = per_gib(by[mb].get(ours)), per_gib(by[mb].get(peer))
            rows.append([f"{ours} | {peer}", f"{mb:g}", None if a is None else f"{a:.3f}",
                         None if b is None else f"{b:.3f}", None if a is None or b is None else f"{a / b:.2f}x"])
    out = [f"scaling over {', '.join(f'{mb:g}' for mb in sizes)} MiB: seconds per GiB (median time over the "
           f"bytes it moved), megalite | its peer, ratio = megalite / peer at that size",
           table(["operation | peer", "MiB", "s/GiB", "peer s/GiB", "ratio"], rows)]
    for op in fit:
        pts = [(by[mb][op]["bytes"] / GIB, by[mb][op]["median_s"]) for mb in sizes if op in by[mb]]
        if not pts:
            continue
        xs = [x for x, _ in pts]
        if max(xs) - min(xs) > DISTINCT * max(xs):
            a, b = fit_line(pts)
            out.append(f"{op}: {a:.3f} s fixed + {b:.3f} s/GiB (least squares over {len(pts)} sizes)")
        elif len(pts) > 1:  # a line through (nearly) one x is noise: said, never printed as a fit
            out.append(f"{op}: no fixed + per-GiB fit: every size moved about the same bytes "
                       f"({', '.join(f'{x * 1024:.2f}' for x in xs)} MiB; the bench rounds a size to the nearest "
                       f"model it can build, at least its smallest): ask for sizes further apart")
    return out
