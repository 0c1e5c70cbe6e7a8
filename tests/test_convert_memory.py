"""Streaming: `megalite convert` holds about one tensor at a time, never the whole model.

Measured as the peak *anonymous* RSS of the convert process (sampled from /proc/PID/status), compared with
a process that only imports the same modules. ru_maxrss is not used for the bound: it counts the pages of
the memory-mapped shard files that were read (file-backed and reclaimable), which grow with the model
even when the heap holds one tensor.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import helpers as H
from megalite.convert import model_partitions, split

MiB = 2**20
BIG = dict(n_layer=10, n_head=8, n_embd=512, block_size=16, vocab_size=256, dropout=0.0)


def peak_anon_kib(cmd: list[str], timeout: float = 120) -> tuple[int, int]:
    """(peak RssAnon in KiB, exit code) of a child, sampled every ~2 ms until it exits."""
    p = subprocess.Popen(cmd, env=H.env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak, t0 = 0, time.monotonic()
    try:
        while p.poll() is None:
            try:
                status = Path(f"/proc/{p.pid}/status").read_text()
            except (FileNotFoundError, ProcessLookupError):
                break
            m = re.search(r"^RssAnon:\s+(\d+) kB", status, re.M)
            if m:
                peak = max(peak, int(m[1]))
            if time.monotonic() - t0 > timeout:
                p.kill()
                pytest.fail(f"{cmd} ran longer than {timeout}s")
            time.sleep(0.002)
    finally:
        _, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err.decode(errors="replace")[-3000:]
    return peak, p.returncode


@pytest.mark.skipif(not Path("/proc/self/status").exists() or "RssAnon" not in Path("/proc/self/status").read_text(),
                    reason="needs Linux /proc/PID/status RssAnon")
def test_convert_streams_one_tensor_at_a_time(tmp_path):
    parts = model_partitions(BIG)
    shapes = {n: p.global_shape for n, p in sorted(parts.items())}
    model_bytes = sum(math.prod(s) * 4 for s in shapes.values())
    largest = max(math.prod(s) * 4 for s in shapes.values())
    limit = 4 * largest + 32 * MiB
    assert model_bytes > 2 * limit  # the bound can tell streaming from holding the model
    g = torch.Generator().manual_seed(0)
    src = tmp_path / "big.safetensors"
    save_file({n: torch.randn(s, generator=g) for n, s in shapes.items()}, str(src),
              metadata={"format": "pt", "megalite.model_config": json.dumps(BIG, sort_keys=True)})
    split(src, tmp_path / "ck", 2, 3, 1, quiet=True)  # tp slices and pipeline stages to reassemble
    out = tmp_path / "out.safetensors"

    base, _ = peak_anon_kib([sys.executable, "-c", "import time, torch, safetensors, einops, megalite.cli, "
                            "megalite.convert; time.sleep(0.5)"])
    conv, _ = peak_anon_kib([sys.executable, "-m", "megalite", "convert", str(tmp_path / "ck"), "--out", str(out),
                             "--quiet"])
    growth = (conv - base) * 1024
    assert growth < limit, (f"convert peak anonymous RSS {conv / 1024:.0f} MiB vs {base / 1024:.0f} MiB for the "
                            f"imports: +{growth / MiB:.0f} MiB for a {model_bytes / MiB:.0f} MiB model "
                            f"(largest tensor {largest / MiB:.0f} MiB, allowed +{limit / MiB:.0f} MiB)")
    # and the file is right
    with safe_open(str(out), framework="pt") as a, safe_open(str(src), framework="pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for k in a.keys():
            assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k
