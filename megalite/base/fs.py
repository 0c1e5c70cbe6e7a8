"""Files on disk: every file-safety rule of megalite, in one place (checkpoints, converter outputs, the run
folder, token files, tokenizer folders). The run lock is lock.py's, on top of this module.

    write_new(path, data)           a new plain file holding `data`, fsynced; never through what was at `path`
    replace_atomically(path, data)  `path` replaced by a file holding `data` (write_new of a temporary name,
                                    fsync, rename over, fsync the folder): readers see the old or the new
    open_read(path), read_all(path) an existing regular file read, never through a symlink (follow=True: a
                                    path the user named, which may be a link, but still a regular file)
    by_descriptor(path)             the same file as a name a library that opens by name is given (safetensors,
                                    pyarrow, tokenizers): /proc/self/fd/N of the descriptor checked
    special_entries_refused(folder) a folder a library reads itself (transformers' from_pretrained) holds no
                                    FIFO, device or socket

Every reader of megalite opens through these (tests/test_safe_open.py scans the package for any other open).
    open_append(path)               a regular file of its folder appended to (metrics.jsonl, errors.log): never
                                    through a symlink, never a FIFO or device, never a name shared by hard links
    fsync_dir, unlink_quietly, remove_tree
    path_kind(p), kind_of(st)       what is at a path, for a message ('a named pipe (FIFO)', 'a broken symlink ...')
    what_is(path)                   the same, never following a symlink: 'a symbolic link to ...' (an output's path)
    linked(path, parents)           `path`, or one of its nearest folders, is a symbolic link (refused, never read)
    regular_or_absent(path, what)   the lstat of a file we will append to or move: nothing, or a regular file
    folder_or_absent(path, what, e) the same for a folder another library writes into: nothing, or a real folder
    move_aside(path)                an earlier output renamed out of the way (`<dir>.old-<time>`,
                                    `<stem>.<time><suffix>`); nothing is ever deleted
    replace_output(tmp, out)        a finished output moved into place; the old one removed only after
    output_refusal(out, sources)    why a command must not write `out` (the current folder, `/`, a source)
    identity(path), folder_locked   what is at a path now (to see another writer's output appear), and a lock
                                    on a folder held while outputs are moved into it (one writer at a time)

What is refused (a symlink, a FIFO or device, a folder where a file is expected) is an UnsafeFileError (an
OSError too) naming the path and what is there; a FIFO or a device is refused at open, never read from, so
nothing blocks on one.

Every fsync'd small file of a checkpoint (state.json, manifest.json, `latest`, the start-up write probe)
goes through `write_new` or `replace_atomically`; the safetensors files are streamed (stream.py) with the same
no-follow opener. What is planted at a path we write (a symlink, a stale temporary file) is unlinked,
never followed: O_CREAT | O_EXCL | O_NOFOLLOW.
"""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

from .errors import UnsafeFileError

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


def kind_of(st: os.stat_result) -> str:
    """What a stat result describes, for a message: 'a folder', 'a named pipe (FIFO)', ..."""
    for test, what in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket")):
        if test(st.st_mode):
            return what
    return "not a regular file"


def what_is(path: Path) -> str:
    """What is at `path`, for a message, never following it: "a symbolic link to 'TARGET'", or kind_of its lstat."""
    st = os.lstat(path)
    return f"a symbolic link to '{os.readlink(path)}'" if stat.S_ISLNK(st.st_mode) else kind_of(st)


def open_regular(path, flags: int, follow: bool = False) -> int:
    """A descriptor of the regular file at `path`, opened with `flags` (O_NONBLOCK added: opening a FIFO
    never waits for its other end; it does nothing to a regular file). A symlink at `path` (unless `follow`),
    a FIFO, a device or a folder is refused with an UnsafeFileError naming it."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | (0 if follow else NOFOLLOW), 0o644)
    except OSError as e:
        if not follow and e.errno == errno.ELOOP and os.path.islink(path):
            raise UnsafeFileError(f"{path} is a symbolic link (to '{os.readlink(path)}'); megalite opens the files it "
                                  f"manages only as regular files of their folder, never through a link: remove "
                                  f"it", errno.ELOOP) from None
        if e.errno in (errno.EISDIR, errno.ENXIO, errno.ENODEV):  # a folder; a FIFO with no reader; a device
            try:
                what = kind_of(os.stat(path) if follow else os.lstat(path))
            except OSError:
                raise e from None
            raise UnsafeFileError(f"{path} is {what}, not a regular file", errno.EINVAL) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafeFileError(f"{path} is {kind_of(st)}, not a regular file", errno.EINVAL)
    return fd


def _regular(path, flags: int) -> int:
    """open()'s opener: `open_regular` without following a symlink."""
    return open_regular(path, flags)


def _regular_follow(path, flags: int) -> int:
    return open_regular(path, flags, follow=True)


def open_read(path: Path, buffering: int = -1, follow: bool = False):
    """`path` opened for reading ('rb'): a regular file (never a FIFO, a device or a folder), never reached
    through a symlink at `path` unless `follow` (a path the user named: a config, a token file, a model).
    Callers that name a symlink in their own error check for it first; this makes the open itself safe."""
    return open(path, "rb", buffering=buffering, opener=_regular_follow if follow else _regular)


def read_all(path: Path, limit: Optional[int] = None, follow: bool = False) -> bytes:
    """The bytes of a regular file (open_read), at most `limit` of them when given."""
    with open_read(path, follow=follow) as f:
        return f.read() if limit is None else f.read(limit)


@contextmanager
def by_descriptor(path, follow: bool = True) -> Iterator[str]:
    """A name for the regular file at `path` for a library that opens files by name (safetensors, pyarrow,
    tokenizers' BPE files): /proc/self/fd/N of a descriptor `open_regular` took, so what was checked is what the
    library reads (`path` itself, after the check, where there is no /proc). The descriptor is closed after the
    body; a library's own descriptor or memory map outlives it."""
    fd = open_regular(path, os.O_RDONLY, follow=follow)
    try:
        proc = f"/proc/self/fd/{fd}"
        yield proc if os.path.exists(proc) else str(path)
    finally:
        os.close(fd)


def special_entries_refused(folder) -> None:
    """An UnsafeFileError naming the first FIFO, device or socket in `folder` (links followed, as a library
    reading the folder follows them): run before a library that reads a folder by itself (transformers'
    from_pretrained reads tokenizer_config.json, chat templates, generation_config.json by name), which would
    block on a FIFO. A broken link is left to the library (it names what it misses)."""
    for p in sorted(Path(folder).iterdir()):
        try:
            st = os.stat(p)
        except FileNotFoundError:
            continue
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            raise UnsafeFileError(f"{p} is {kind_of(st)}, not a regular file", errno.EINVAL)


def open_append(path: Path, log: Optional[Callable[[str], None]] = None):
    """`path` opened for appending text (created if missing): a regular file of its folder, never through a
    symlink, never a FIFO or device. A file that shares its data with other names (hard links: a run folder
    copied with `cp -al`) is first made this name's own (copied, then renamed over it; the other names keep
    theirs), so an append never changes another run's record; `log` says so."""
    path = Path(path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    fd = open_regular(path, flags)
    links = os.fstat(fd).st_nlink
    if links > 1:
        os.close(fd)
        replace_atomically(path, read_all(path), tmp=path.with_name(f".{path.name}.unshare"))
        fd = open_regular(path, flags)
        if log is not None:
            log(f"megalite: {path} had {links} hard links (a copy made with `cp -al`?): this run appends to a "
                f"copy of its own; the other names keep theirs unchanged")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)  # blocking writes again
    return open(fd, "a", encoding="utf-8")


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


def replace_output(tmp: Path, out: Path) -> None:
    """Move a finished temporary output (a file or a folder) into place at `out`; an old output there is
    removed only after the move (a symlink at `out` is replaced itself, never followed). If the move fails, the
    temporary output is removed and the old output is where it was. The folder is fsynced after."""
    tmp, out = Path(tmp), Path(out)
    try:
        if os.path.lexists(out):
            old = out.with_name(out.name + ".old-megalite")
            remove_tree(old)
            os.replace(out, old)
            try:
                os.replace(tmp, out)
            except BaseException:
                os.replace(old, out)
                raise
            remove_tree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        remove_tree(tmp)
        raise
    fsync_dir(out.parent)


# ---------------------------------------------------------------- what is there, for a refusal that names it
def path_kind(p) -> str:
    """What is at `p`, for an error message about a path that is not the regular file expected: 'a folder',
    'a character device' (/dev/null), 'a named pipe', 'a broken symlink to X', 'missing (no such file)', ..."""
    p = Path(p)
    try:
        st = p.stat()
    except FileNotFoundError:
        return f"a broken symlink to '{os.readlink(p)}'" if p.is_symlink() else "a path that does not exist"
    except OSError as e:
        return f"not readable ({e.strerror})"
    return kind_of(st)


def linked(path: Path, parents: int = 0) -> bool:
    """Whether `path`, or one of its `parents` nearest folders, is a symbolic link: a file of a checkpoint must
    live in its step folder, never be reached through a link to somewhere else."""
    path = Path(path)
    return any(p.is_symlink() for p in [path, *list(path.parents)[:parents]])


def regular_or_absent(path: Path, what: str) -> Optional[os.stat_result]:
    """The lstat of `path` (None if nothing is there); an UnsafeFileError naming `what` if something other than a
    regular file is there (a symlink, a FIFO, a folder): a file megalite appends to or moves aside is its own."""
    return _own_or_absent(path, what, stat.S_ISREG, "the run's own file (a regular file)")


def folder_or_absent(path: Path, what: str, expected: str) -> Optional[os.stat_result]:
    """As regular_or_absent, for a folder another library writes into (TensorBoard's, W&B's): nothing, or a real
    folder; a symlink (the library would write through it), a file or a FIFO is refused, `expected` saying what
    belongs there."""
    return _own_or_absent(path, what, stat.S_ISDIR, expected)


def _own_or_absent(path: Path, what: str, ok, expected: str) -> Optional[os.stat_result]:
    path = Path(path)
    st = os.lstat(path) if os.path.lexists(path) else None
    if st is not None and not ok(st.st_mode):
        raise UnsafeFileError(f"{what}: {path} is {what_is(path)}, expected {expected}; megalite never writes "
                              f"through it: remove it", errno.ELOOP if stat.S_ISLNK(st.st_mode) else errno.EINVAL)
    return st


def move_aside(path: Path) -> Path:
    """Rename an earlier output out of the way, never deleting it: a folder to `<name>.old-<time>`, a file to
    `<stem>.<time><suffix>` (metrics.jsonl -> metrics.20261204-170000.jsonl). Returns the new path."""
    path, now = Path(path), time.strftime("%Y%m%d-%H%M%S")
    aside = (path.with_name(f"{path.name}.old-{now}") if path.is_dir() and not path.is_symlink()
             else path.with_name(f"{path.stem}.{now}{path.suffix}"))
    os.rename(path, aside)
    return aside


def output_refusal(out: Path, sources: Iterable[Path] = ()) -> str:
    """Why a command must not write (and perhaps replace) `out`, or '' if it may: a name that is no name ('',
    '.', '..'), the current folder or one holding it, a source of the command, inside one or holding one."""
    given = Path(out)
    if given.name in ("", ".", ".."):
        return f"--out '{given}': expected the path of a new file or folder, not '{given}'"
    out = given.resolve()
    if out == Path.cwd() or out in Path.cwd().parents:
        return f"--out {out}: refusing to replace a folder that holds the current directory"
    for src in sources:
        src = Path(src).resolve()
        if out == src or src in out.parents:
            return f"--out {out}: refusing to write into the source checkpoint {src}"
        if out in src.parents:
            return f"--out {out}: refusing to replace a folder that contains the source {src}"
    return ""


def identity(path: Path) -> Optional[tuple]:
    """What is at `path` (not following a symlink), as (device, inode, size, mtime in ns, mode), or None:
    two writers of one output each note it when they start, and the second to finish sees it changed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode


@contextmanager
def folder_locked(folder: Path) -> Iterator[None]:
    """An exclusive flock on `folder` itself (no file is created), held while a writer checks that its output
    is still as it found it and moves its new one into place: two megalite writers of one folder commit one
    after the other, so the second sees the first's output (and is refused) instead of silently replacing it."""
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
