"""`python -m benchmarks.alternate [--arch A] [--pairs N]`: megalite's (1,1,1) training step beside its reference
in ONE process, step by step alternately, timed by CPU time (time.process_time, one thread).

The reference is bench.train's PlainGPT with torch.optim.AdamW for gpt2 (table 1), the family's transformers class
for the others (table 9; bench.llama._transformers_step). Both build from the same config (bench train's dims),
draw their own batches and run warm-up steps first; each pair's two steps run back to back, the order
alternating, so a change in machine speed hits both. Printed: the median CPU ms per step of each and the
median of the pairs' ratios (reference / megalite CPU time = megalite / reference tokens/s). On a machine
shared by other jobs this resolves a few % where fresh-process pairs (`megalite bench train`) cannot.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch


def alternate(arch: str = "gpt2", pairs: int = 30, warmup: int = 3, log=print) -> float:
    from megalite.bench.llama import _transformers_step, llama_model
    from megalite.bench.train import _raw, plain_step
    from megalite.config import Config
    from megalite.data import default_corpus_files, prepare
    from megalite.parallel.grid import ParallelGrid
    from megalite.run.train import build, train_step
    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="megalite-alternate-")
    try:
        data = os.path.join(work, "tok.bin")
        prepare(default_corpus_files(max_bytes=300_000), data, log=lambda *a: None)
        o = {"model": dict(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=256, dropout=0.0),
             "data": data, "work": work}
        if arch != "gpt2":
            o["model"] = llama_model(o, arch)
        cfg = Config.from_dict(_raw(o, (1, 1, 1), 4, 16))
        tr = build(cfg, ParallelGrid.single(), torch.device("cpu"))
        steps = {"megalite": lambda: train_step(tr),
                 "reference": plain_step(cfg) if arch == "gpt2" else _transformers_step(cfg)}
        for _ in range(warmup):
            for f in steps.values():
                f()
        cpu = {k: [] for k in steps}
        for i in range(pairs):
            for k in (("megalite", "reference") if i % 2 == 0 else ("reference", "megalite")):
                c0 = time.process_time()
                steps[k]()
                cpu[k].append(time.process_time() - c0)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratio = statistics.median(r / m for m, r in zip(cpu["megalite"], cpu["reference"]))
    ref = "plain PyTorch" if arch == "gpt2" else "transformers"
    log(f"{arch}: CPU ms/step megalite {statistics.median(cpu['megalite']) * 1000:.1f}, {ref} "
        f"{statistics.median(cpu['reference']) * 1000:.1f}; megalite / {ref} tokens/s by CPU time: {ratio:.3f} "
        f"(median of {pairs} alternated pairs of steps; load average {os.getloadavg()[0]:.1f})")
    return ratio


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.alternate", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="gpt2")
    p.add_argument("--pairs", type=int, default=30)
    a = p.parse_args(argv)
    alternate(a.arch, a.pairs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
