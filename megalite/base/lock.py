"""The run lock: one flock on `<checkpoint.dir>/lock`, held by rank 0 for the whole run (a killed run never
leaves it stuck: the kernel releases it with the process), and the one probe that asks whether a live run
holds it (the converter before it replaces a folder, a fresh start before it moves one aside).

    RunLock(path).take()   None, or a sentence saying why the lock could not be taken
    RunLock.release()      let it go (the file stays: an unlocked file is no one's lock)
    held(path)             whether a live process holds the lock at `path` (never waits, never follows)

The lock file is opened like every file megalite manages (fs.open_regular): never through a symlink planted
there (it would overwrite what it points to), never a FIFO or a device; a lock file that shares its inode with
another folder (a root copied with `cp -al`) is that folder's lock, not this one's: it is unlinked and made
afresh before it is taken.
"""
from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path
from typing import Optional

from .errors import UnsafeFileError
from .fs import open_regular, unlink_quietly


def held(path: Path) -> bool:
    """Whether a live process holds the flock at `path`, probed without waiting (LOCK_NB) and without following
    a symlink or opening a FIFO planted there (a lock that is not a regular file is no one's lock)."""
    try:
        fd = open_regular(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing the descriptor releases the probe's own lock
    return False


class RunLock:
    """The lock of one checkpoint folder, taken once and released once."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fd: Optional[int] = None
        self.created = False  # whether take() made the file (a failed start removes it again)

    def take(self) -> Optional[str]:
        """Take the lock and write who holds it into the file; None, or why not (one sentence)."""
        existed = os.path.lexists(self.path)
        try:
            fd = open_regular(self.path, os.O_RDWR | os.O_CREAT)
        except UnsafeFileError as e:
            if e.errno == errno.ELOOP:
                return f"checkpoint.dir: {self.path} is a symlink; refusing to follow it (remove it)"
            return f"checkpoint.dir: {self.path} is not a plain file (remove it)"
        except OSError as e:
            return f"checkpoint.dir: cannot open {self.path} ({e.strerror or e})"
        if os.fstat(fd).st_nlink > 1:  # shared with another root (`cp -al`): that run's lock, not this folder's own
            os.close(fd)
            unlink_quietly(self.path)
            return self.take()
        self.created = self.created or not existed
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            return (f"checkpoint.dir '{self.path.parent}' is in use by another run ({holder} holds {self.path}); "
                    f"point this run at another checkpoint.dir")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        self.fd = fd
        return None

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
