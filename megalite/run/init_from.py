"""train.init_from: a fresh run that starts from a model (a transformers folder, a megalite model file, or a
megalite checkpoint's weights without its run state), at any layout, with a fresh optimizer and LR schedule.

    adopt(cfg)         before the config is checked: the source's [model] section becomes the run's; a model
                       key the config file or command line set to another value is refused, every one named
                       in one line with both values (dropout, a training setting, stays the user's)
    load(tr, path)     after start-up, when no checkpoint of this run was resumed: each rank reads its own region
                       of every tensor from the source (convert's Source interface: regions, never the layout the
                       source was saved in), and the run carries the source's origin (base/origin.py) on into its
                       checkpoints; the source's tokenizer must be the token file's

Outside models: torchtitan's `checkpoint.initial_load_path` (weights only, a run's own checkpoints take
precedence) and transformers' `from_pretrained`, which also takes the config from the folder.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..base.errors import ConfigError, DataError, MegaliteError
from ..base.origin import Origin
from ..config import TRAINING_ONLY, Config
from ..convert.sources import open_source
from ..parallel.partition import partition_of, tp_box, valid_view


def source(path: str, what: str = "train.init_from"):
    """convert's Source at `path`, which must name a model; a problem is said as `what` (the setting or flag)."""
    try:
        src = open_source(path)
    except MegaliteError as e:  # ConvertError, DataError: said as the setting that named the path
        raise ConfigError(f"{what}: {e}") from None
    if src.model is None:
        raise ConfigError(f"{what} = '{path}': names no model (a plain DCP folder); convert it first")
    return src


def adopt(cfg: Config) -> None:
    """cfg.model := the source's [model] section, in place (see the module docstring)."""
    path = cfg.train.init_from
    if not path:
        return
    m = source(path).model
    clash = [f"model.{k} = {getattr(cfg.model, k)!r} but {path} has {v!r}" for k, v in m.items()
             if f"model.{k}" in cfg.named and k not in TRAINING_ONLY and getattr(cfg.model, k) != v]
    if clash:
        raise ConfigError(f"train.init_from: {'; '.join(clash)} (the model comes from train.init_from: leave "
                          f"these keys out of the config and the command line)")
    for k, v in m.items():
        if not (k in TRAINING_ONLY and f"model.{k}" in cfg.named):
            setattr(cfg.model, k, v)


def load(tr, path: str, what: str = "train.init_from") -> Optional[Origin]:
    """Fill this rank's parameters from the source at `path` (each its own region, cast to the parameter's
    dtype); returns the source's origin, which the run's checkpoints carry. `what`: who named the path, in errors
    (`megalite eval`: --model)."""
    src = source(path, what)
    tok = src.tokenizer()
    if tok is not None and tr.tokenizer is not None and tok.sha256 != tr.tokenizer.sha256:
        raise DataError(f"{what}: {path} carries a tokenizer ({tok.kind}, vocab {tok.vocab_size}, sha256 "
                        f"{tok.sha256[:12]}) that is not the one of data.path '{tr.cfg.data.path}' "
                        f"({tr.tokenizer.kind}, vocab {tr.tokenizer.vocab_size}, sha256 {tr.tokenizer.sha256[:12]}); "
                        f"prepare the data with the model's own: megalite prepare FILES --tokenizer {path} --out X.bin")
    c, L = tr.grid.coord, tr.grid.layout
    for name, p in tr.params:  # every name and shape first: a mismatch fails before any parameter changed
        spec, want = src.specs.get(name), list(partition_of(p).global_shape)
        if spec is None or list(spec.shape) != want:
            got = "no such tensor" if spec is None else f"shape {list(spec.shape)}"
            raise ConfigError(f"{what}: {path} has {got} for '{name}', the model needs {want}")
    chunks = getattr(tr.grads, "weights", None) or {}  # ZeRO-3 (parallel/zero.py): a chunk of each, held there
    with torch.no_grad():
        for name, p in tr.params:
            part = partition_of(p)
            box = tp_box(part, c.tp, L.tp)
            region = src.read(name, tuple(box)).reshape(box.shape)
            if name in chunks:  # elements range[name] of the valid local tensor, flattened
                a, b = tr.grads.range[name]
                chunks[name].copy_(region.reshape(-1)[a:b])
            else:
                valid_view(p.data, part, c.tp, L.tp).copy_(region)
    return src.origin()
