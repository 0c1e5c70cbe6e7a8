"""state.json, the per-coordinate state (typed: StepState), and the RNG states it carries, with no pickle.

    {"step": 200, "tokens_seen": 204800, "rng": {"python": [...], "numpy": [...], "torch_cpu": "<base64>",
     "cuda": "<base64>"} or null, "data": {"batch_index": 200}, "scheduler": {...} or null}

`rng` is null after `split` and `reshard` (a coordinate of a new layout has no stream of its own: resuming
re-seeds from (seed, step)). `scheduler` repeats the manifest's (which is what a load restores).
"""
from __future__ import annotations

import base64
import json
import random
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..config import MAX_COUNT
from ..base.errors import CheckpointError
from ..base.jsonio import loads
from .manifest import short


@dataclass(frozen=True)
class StepState:
    step: int
    tokens_seen: int
    data: dict  # the sampler's position
    rng: Optional[dict] = None  # capture_rng()'s states; None: re-seed on resume
    scheduler: Optional[dict] = None  # the LR scheduler's state_dict (save_checkpoint(scheduler=...))

    @classmethod
    def capture(cls, step: int, tokens_seen: int, data: dict, scheduler: Optional[dict] = None) -> "StepState":
        """This process's state now (a live save)."""
        return cls(step, tokens_seen, data, capture_rng(), scheduler)

    def to_json(self) -> bytes:
        """The file's bytes (compact JSON, fields in this order: the same state gives the same bytes)."""
        return dumps_json({"step": self.step, "tokens_seen": self.tokens_seen, "rng": self.rng,
                           "data": self.data, "scheduler": self.scheduler}).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> "StepState":
        """Parse and check the file's bytes; a one-line CheckpointError names `where` and the field."""
        d = loads(data, where, CheckpointError)
        if not isinstance(d, dict):
            raise CheckpointError(f"{where} is not a JSON object")
        for key in ("step", "tokens_seen"):
            v = d.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COUNT:
                raise CheckpointError(f"{where}: field '{key}' is {short(v)}, expected an integer >= 0 and "
                                      f"<= {MAX_COUNT}")
        for key, optional in (("data", False), ("scheduler", True)):
            v = d.get(key)
            if not isinstance(v, dict) and not (optional and v is None):
                raise CheckpointError(f"{where}: field '{key}' is {short(v)}, expected an object"
                                      + (" or null" if optional else ""))
        return cls(d["step"], d["tokens_seen"], d["data"], d.get("rng"), d.get("scheduler"))

    def restore_rng(self, where: str) -> bool:
        """Put the saved RNG states back; False when there are none (re-seed instead)."""
        if self.rng is None:
            return False
        try:
            restore_rng(self.rng)
        except (KeyError, TypeError, ValueError, IndexError, OverflowError, RuntimeError) as e:
            raise CheckpointError(f"{where} has an unusable 'rng' state ({type(e).__name__}: {e})") from None
        return True


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def capture_rng() -> dict:
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out = {"python": [version, list(mt), gauss],
           "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
           "torch_cpu": _b64(torch.get_rng_state())}
    if torch.cuda.is_available():
        out["cuda"] = _b64(torch.cuda.get_rng_state())
    return out


def restore_rng(state: dict) -> None:
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch_cpu"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_unb64(state["cuda"]))


def dumps_json(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))
