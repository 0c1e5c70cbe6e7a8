"""Files on disk: the one durable writer and the one safe opener of the checkpoint engine and the converter.

    write_new(path, data)           a new plain file holding `data`, fsynced; never through what was at `path`
    replace_atomically(path, data)  `path` replaced by a file holding `data` (write_new of a temporary name,
                                    fsync, rename over, fsync the folder): readers see the old or the new
    open_read(path), read_all(path) an existing regular file read, never through a symlink
    fsync_dir, unlink_quietly, remove_tree

Every fsync'd small file of a checkpoint (state.json, manifest.json, `latest`, the start-up write probe)
goes through `write_new` or `replace_atomically`; the safetensors files are streamed (stream.py) with the same
no-follow opener. What is planted at a path we write (a symlink, a stale temporary file) is unlinked,
never followed: O_CREAT | O_EXCL | O_NOFOLLOW.
"""
from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path
from typing import Optional

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def write_new(path: Path, data: bytes) -> None:
    """Create `path` as a new plain file holding `data`, fsynced. Whatever was at `path` (a stale temp file,
    a symlink planted there) is unlinked first, never followed. On failure nothing is left at `path`."""
    unlink_quietly(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        unlink_quietly(path)
        raise
    os.close(fd)


def replace_atomically(path: Path, data: bytes, tmp: Optional[Path] = None) -> None:
    """Replace `path` atomically by a file holding `data`: write_new(`tmp`) (default `.<name>.tmp` beside it),
    os.replace, fsync the folder. On failure the temporary file is removed and `path` is untouched."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp") if tmp is None else Path(tmp)
    write_new(tmp, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        raise
    fsync_dir(path.parent)


def no_follow(path, flags: int) -> int:
    """open()'s opener that refuses to go through a symlink at the last component (ELOOP)."""
    return os.open(path, flags | NOFOLLOW, 0o644)


def _regular(path, flags: int) -> int:
    """no_follow, for reading, of a regular file only: a FIFO or a device is refused (EINVAL) instead of
    blocking or streaming forever (O_NONBLOCK has no effect on a regular file's reads)."""
    fd = no_follow(path, flags | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return fd


def open_read(path: Path, buffering: int = -1):
    """`path` opened for reading ('rb'): a regular file, never reached through a symlink at `path` (ELOOP).
    Callers that name a symlink in their own error check for it first; this makes the open itself safe."""
    return open(path, "rb", buffering=buffering, opener=_regular)


def read_all(path: Path, limit: Optional[int] = None) -> bytes:
    """The bytes of a regular file (open_read), at most `limit` of them when given."""
    with open_read(path) as f:
        return f.read() if limit is None else f.read(limit)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quietly(path: Path) -> None:
    """Remove a file or a symlink (never what it points to); nothing there is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_tree(path: Path) -> None:
    """Remove a folder this project created; a symlink is unlinked, never followed."""
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        unlink_quietly(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)
