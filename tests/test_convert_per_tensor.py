"""A convert's cost per tensor stays flat as the tensors grow: a foreign model's specs (shape and dtype of every
tensor) are built once, not once per tensor asked (that was quadratic: a 2-layer torchtitan convert entered
convert/torchtitan.py 1,231 times, `stored` 966 of them; ~0.5 M calls at 70B). Counted, then timed, on a
source of 10**3 .. 10**5 one-element tensors (no file read), through the loop a convert runs (`Source.stream`).
Planted: `specs` a plain property again: 1,001 asks per tensor at 1,000 tensors."""
import gc
import time
from types import SimpleNamespace

import pytest
import torch

from megalite.convert.common import ForeignModel, Progress


class Many(ForeignModel):
    """A foreign model of n one-element tensors, counting how often it is asked where a tensor is stored."""

    def __init__(self, n: int):
        self.where, self.asked = "many", 0
        self.shapes = {f"t{i}": (1,) for i in range(n)}
        self.ck = SimpleNamespace(tensors={f"s{i}": SimpleNamespace(dtype=torch.float32) for i in range(n)})
        self.one = torch.zeros(1)

    def stored(self, name: str) -> str:
        self.asked += 1
        return "s" + name[1:]

    def get(self, name: str) -> torch.Tensor:
        return self.one


def convert_loop(src: Many) -> float:
    """Seconds per tensor of the convert's loop: every tensor streamed as a sink writes them (`--dtype bf16`:
    each tensor's stored dtype asked of `specs`)."""
    t0 = time.perf_counter()
    n = sum(1 for _ in src.stream(torch.bfloat16, Progress("many", len(src.shapes), 0, quiet=True)))
    return (time.perf_counter() - t0) / n


def test_where_each_tensor_is_stored_is_asked_once():
    src = Many(1_000)
    convert_loop(src)
    assert src.asked == 1_000, f"{src.asked / 1_000:.1f} asks per tensor for 1,000 tensors (specs rebuilt per tensor?)"


def per_tensor_s(n: int) -> float:
    """Seconds per tensor of what a convert asks of a source for each tensor (its spec: shape, stored dtype)."""
    src = Many(n)
    gc.disable()  # the collector's passes over 1e5 new objects are not the convert's cost
    try:
        t0 = time.perf_counter()
        for name in src.shapes:
            assert src.specs[name].dtype is torch.float32
        took = time.perf_counter() - t0
    finally:
        gc.enable()
    assert src.asked == n, f"{src.asked / n:.1f} asks per tensor"  # before a planted quadratic reaches 1e5
    return took / n


def test_convert_time_per_tensor_is_flat_from_1e3_to_1e5_tensors():
    per = {n: min(per_tensor_s(n) for _ in range(3)) for n in (1_000, 10_000, 100_000)}
    print("per tensor: " + ", ".join(f"{n:.0e} tensors {s * 1e6:.2f} us" for n, s in per.items()))
    # flat within what caches and a loaded machine do (measured 0.7, 4-6, 5-6 us); quadratic would be 10,000x
    assert per[100_000] < 20 * per[1_000] + 10e-6 and per[100_000] < 3 * per[10_000] + 5e-6, per
