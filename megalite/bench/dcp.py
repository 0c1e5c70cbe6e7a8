"""`megalite bench dcp`: a PyTorch DCP checkpoint (~300 MB, saved by 2 gloo ranks as torchtitan does: DTensor
shards plus a train state) converted to one file by `megalite convert` and by torch's own
`dcp_to_torch_save`, side by side in one run.

Each conversion runs in a fresh interpreter on a cold page cache (the checkpoint's pages evicted), the two
alternating which goes first; both end with an fsync. Reported per tool: time, throughput, peak RSS (VmHWM)
and its growth over the interpreter after imports, split into anonymous memory and mapped file pages; then
the ratios megalite / dcp_to_torch_save of the medians, with the range of the ratios of the pairs measured
together.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from . import drop_page_cache, du, fmt_bytes, spread, table
from .ckpt import _CONVERT, live_row, live_table, paired

WIDTH = 512  # a GPT block of width C holds 12 C^2 parameters: (3C, C), (C, C), (4C, C), (C, 4C)
TOOLS = ("megalite convert", "dcp_to_torch_save")


def shapes(size_mb: float) -> dict:
    """GPT-shaped fp32 tensors adding up to about size_mb (at least one block)."""
    C = WIDTH
    per_block = 12 * C * C * 4
    out = {"tok_embeddings.weight": (8192, C)}
    for i in range(max(1, round((size_mb * 2**20 - 8192 * C * 4) / per_block))):
        out.update({f"layers.{i}.attention.wqkv.weight": (3 * C, C), f"layers.{i}.attention.wo.weight": (C, C),
                    f"layers.{i}.feed_forward.w1.weight": (4 * C, C), f"layers.{i}.feed_forward.w2.weight": (C, 4 * C),
                    f"layers.{i}.attention_norm.weight": (C,)})
    return out


def _save(rank: int, world: int, tmp: str, out: str, size_mb: float) -> None:
    """Each rank saves its dim-0 shard of every tensor as a DTensor; the train state is a bytes entry."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    mesh = init_device_mesh("cpu", (world,))
    sd = {}
    for i, (name, shape) in enumerate(shapes(size_mb).items()):
        full = torch.randn(shape, generator=torch.Generator().manual_seed(i))
        sd[f"model.{name}"] = DTensor.from_local(full.chunk(world, 0)[rank].contiguous(), mesh, [Shard(0)],
                                                 run_check=False)
    sd["train_state"] = {"step": 100, "tokens_seen": 123456}
    dcp.save(sd, checkpoint_id=out)


def bench_dcp(size_mb: float = 300, repeats: int = 3, dir: Optional[str] = None, log=print) -> list[dict]:
    """Make the DCP checkpoint, convert it `repeats` times with each tool, print the table; return its rows."""
    from ..testing import run_parallel
    if dir is not None:
        Path(dir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="megalite-bench-dcp-", dir=dir))
    rec: dict = {}
    try:
        src = root / "dcp"
        run_parallel(_save, 2, root / "rdzv", args=(str(src), size_mb))
        nbytes = du(src)
        largest = max(shapes(size_mb).values(), key=lambda s: s[0] * (s[1] if len(s) > 1 else 1))
        log(f"bench dcp: a {fmt_bytes(nbytes)} DCP checkpoint ({len(shapes(size_mb))} tensors as DTensor shards of "
            f"2 gloo ranks + a train state), {repeats} repeat(s), each conversion in a fresh interpreter, cold cache:")
        live = live_table(log)
        outs = {TOOLS[0]: root / "out.safetensors", TOOLS[1]: root / "out.pt"}
        for i in range(repeats):
            for kind in TOOLS[::1 if i % 2 == 0 else -1]:  # alternate which goes first
                os.sync()
                drop_page_cache([src])
                r = subprocess.run([sys.executable, "-c", _CONVERT, kind, str(src), str(outs[kind])],
                                   capture_output=True, text=True)
                if r.returncode:
                    raise RuntimeError(f"bench dcp: {kind} failed:\n{r.stderr[-3000:]}")
                rec.setdefault(kind, []).append(json.loads(r.stdout.strip().splitlines()[-1]))
                live_row(live, i + 1, kind, rec[kind][-1], nbytes)
                outs[kind].unlink()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for kind in TOOLS:
        med, lo, hi = spread([r["s"] for r in rec[kind]])
        rows.append({"op": kind, "bytes": nbytes, "median_s": med, "min_s": lo, "max_s": hi, "gb_s": nbytes / med / 1e9,
                     "peak_rss_mib": max(r["rss"] for r in rec[kind]), "extra_mib": max(r["extra"] for r in rec[kind]),
                     "anon_mib": max(r["anon"] for r in rec[kind]), "file_mib": max(r["file"] for r in rec[kind])})
    log(table(["operation", "checkpoint", "median s (min-max)", "GB/s", "peak RSS MiB (+growth)",
               "anonymous +MiB", "mapped file +MiB"],
              [[r["op"], fmt_bytes(nbytes), f"{r['median_s']:.3f} ({r['min_s']:.3f}-{r['max_s']:.3f})",
                f"{r['gb_s']:.3f}", f"{r['peak_rss_mib']:.0f} (+{r['extra_mib']:.0f})", f"{r['anon_mib']:.0f}",
                f"{r['file_mib']:.0f}"] for r in rows]))
    t, lo, hi = paired(rec, TOOLS[0], TOOLS[1])
    ours, theirs = rows
    log(f"megalite convert / dcp_to_torch_save: time {t:.2f}x (ratio of medians; {lo:.2f}-{hi:.2f}x in the pairs "
        f"measured together); peak RSS growth {ours['extra_mib']:.0f} / {theirs['extra_mib']:.0f} MiB = "
        f"{ours['extra_mib'] / max(theirs['extra_mib'], 1e-9):.2f}x; largest tensor "
        f"{fmt_bytes(4 * largest[0] * (largest[1] if len(largest) > 1 else 1))}")
    return rows
