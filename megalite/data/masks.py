"""Loss masks: which tokens of a token file count as targets, kept beside it as one byte per token.

    OUT.bin        the ids                      OUT.mask.bin   1 where predicting that token counts, else 0
    OUT.json       "loss_mask": {"file": "OUT.mask.bin", "counted": N}

A window [s, s + T] of the ids trains on targets s + 1 .. s + T, so its row of the mask is mask[s + 1 .. s + T].
`prepare --chat` writes one (the assistant's turns count, nothing else); `attach` puts any 0/1 array beside a
token file. The loss is the mean over the counted targets of the whole global batch (run/train.py:
token_weighted_loss), so a masked token's gradient is exactly zero and the loss is the same at every layout.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..base import limits
from ..base.errors import DataError
from ..base.fs import fsync_dir, open_read, path_kind, read_all, write_new
from ..base.jsonio import loads


def mask_path(out: str | Path) -> Path:
    """Where the mask of token file `out` lives: OUT.mask.bin beside it."""
    out = Path(out)
    return out.with_name(out.stem + ".mask.bin")


def attach(out: str | Path, mask) -> dict:
    """Write `mask` (one 0/1 per token of token file `out`) beside it and record it in its .json; return the
    .json's new contents. The mask is written first and the .json replaced last, so a .json that names a mask
    always has it complete."""
    out = Path(out)
    mpath = out.with_suffix(".json")
    meta = loads(read_all(mpath, limits.FILE_BYTES["json"] + 1), str(mpath), DataError, kind="json")
    m = np.asarray(mask)
    if m.ndim != 1 or m.size != meta.get("num_tokens"):
        raise DataError(f"loss mask for '{out}': {m.size} values, expected one per token ({meta.get('num_tokens')})")
    if m.size and (m.min() < 0 or m.max() > 1):
        raise DataError(f"loss mask for '{out}': values must be 0 or 1, found {m.min()}..{m.max()}")
    target = mask_path(out)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    write_new(tmp, m.astype(np.uint8).tobytes())
    os.replace(tmp, target)
    meta["loss_mask"] = {"file": target.name, "counted": int(m.sum())}
    tmp_json = mpath.with_name(f".{mpath.name}.tmp-{os.getpid()}")
    write_new(tmp_json, (json.dumps(meta, indent=2) + "\n").encode("utf-8"))
    os.replace(tmp_json, mpath)
    fsync_dir(out.parent)
    return meta


def open_mask(path: Path, meta: dict, num_tokens: int, what: str):
    """The token file's mask, memory-mapped (uint8, num_tokens), or None when its .json names none; a mask that
    disagrees with its tokens (missing, another size) is one line naming both files."""
    spec = meta.get("loss_mask")
    if spec is None:
        return None
    if not isinstance(spec, dict) or not isinstance(spec.get("file"), str) or "/" in spec["file"]:
        raise DataError(f"{what}: '{path.with_suffix('.json')}' has loss_mask {spec!r}, expected "
                        f"{{\"file\": \"NAME.mask.bin\", \"counted\": N}} naming a file beside it")
    mfile = path.with_name(spec["file"])
    if not mfile.is_file():
        raise DataError(f"{what}: the loss mask '{mfile}' that '{path.with_suffix('.json').name}' names is "
                        f"{path_kind(mfile)}, expected a file of one byte per token")
    size = mfile.stat().st_size
    if size != num_tokens:
        raise DataError(f"{what}: the loss mask '{mfile}' has {size} bytes, but '{path}' holds {num_tokens} tokens "
                        f"(one byte per token): the mask disagrees with its tokens; write it again")
    with open_read(mfile, follow=True) as f:  # the map outlives the descriptor; a FIFO is refused at open
        return np.memmap(f, dtype=np.uint8, mode="r", shape=(num_tokens,))
