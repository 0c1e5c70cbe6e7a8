"""Per-rank state as JSON: RNG states (python, numpy, torch CPU, CUDA) with no pickle anywhere."""
from __future__ import annotations

import base64
import json
import random

import numpy as np
import torch


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


def seed_everything(seed: int, grid) -> None:
    """tp ranks share a stream (dropout on the replicated residual must agree); pp/dp ranks differ."""
    s = seed + 1000 * grid.coord.pp + grid.coord.dp
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)


def dumps_json(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))
