"""Every error a user can fix, in one family: the CLI prints one line and exits 2 (README: the error contract).

    MegaliteError                  the base; `shared`: every rank raises it alike (only rank 0 prints it)
      ConfigError                  a config field or a command-line flag (always shared: every rank parses the same)
        LayoutError                a (tp, pp, dp[, cp]) layout that does not fit
      DataError                    a token file or a corpus
      CheckpointError              a checkpoint folder, file or field
        ConvertError               converter input (a model file, a foreign checkpoint, an output path)
      MetricsError                 a metrics.jsonl file
      NonFiniteError               a NaN/inf loss or gradient norm (train.on_nonfinite = "stop"; always shared)
      StartupError                 another rank's start-up error, raised here too (or ranks that disagree)
      PeerLostError                another rank died while this one talked to it (a collective on a closed socket)
      UnsafeFileError              a file megalite manages is a symlink, a special file or shared by hard links
                                   (also an OSError: code that handles a failed open handles this too)

OSError (a full or read-only disk, a missing file) is the one outside user error the CLI also reports in one
line. Anything else is a bug and keeps its traceback. This module imports nothing of megalite's, so every
module can raise these without an import circle.
"""
from __future__ import annotations


class MegaliteError(Exception):
    """A user error: the message is one line naming the file or field and what was expected.

    `shared` says whether every rank raises this same error (a config every rank parsed, a decision rank 0
    broadcast): the CLI then prints it on rank 0 only. Set it at construction (`shared=True`) or, for an
    error first raised on one rank and then agreed by all, with `everywhere()`."""

    shared_by_default = False

    def __init__(self, *args, shared: bool | None = None):
        super().__init__(*args)
        self.shared = self.shared_by_default if shared is None else shared

    def everywhere(self) -> "MegaliteError":
        """Mark this error as raised alike on every rank; returns it (`raise err.everywhere()`)."""
        self.shared = True
        return self


class ConfigError(MegaliteError, ValueError):
    """A bad configuration value or flag. The message is one line naming the field."""
    shared_by_default = True


class LayoutError(ConfigError):
    """An invalid layout; the message is one line naming the field as the caller spells it."""


class DataError(MegaliteError, ValueError):
    """A data problem the user can fix; the message is one line naming the cause."""


class CheckpointError(MegaliteError, RuntimeError):
    """A checkpoint problem: the message is one line naming the file or field and what was expected."""


class ConvertError(CheckpointError):
    """Bad converter input: one line naming the path or flag and what was expected."""


class MetricsError(MegaliteError, ValueError):
    """A metrics file that is not one JSON object per line; the message names the file and the line."""


class NonFiniteError(MegaliteError, RuntimeError):
    """The loss or gradient norm of a step is NaN or inf (train.on_nonfinite = "stop"); one line naming the
    step. Every rank raises it alike: loss and norm are global numbers every rank holds."""
    shared_by_default = True


class StartupError(MegaliteError, RuntimeError):
    """Another rank's start-up error, raised here too so that every rank stops alike."""
    shared_by_default = True


class PeerLostError(MegaliteError, RuntimeError):
    """Another rank of the job died (killed, crashed) while this one talked to it: this rank's collective failed
    on a closed connection. One line; the dead rank's own line, or the launcher's summary, names the cause."""


class UnsafeFileError(MegaliteError, OSError):
    """A file megalite opens (to read its own state, or to append to) is not a regular file of its folder: a
    symlink (it would read or write elsewhere), a FIFO or device (a read would block or never end), or, for a
    file it appends to, a name shared by hard links with another file (the append would change that one too).
    The message is one line naming the path and what was found; `errno` is ELOOP for a symlink, else EINVAL
    (what the open of a non-regular file would have said)."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.errno = code


USER_ERRORS = (MegaliteError, OSError)  # what the CLI reports in one line (exit 2)


def is_shared(e: BaseException) -> bool:
    """Whether every rank raises this error alike (so only rank 0 should print it)."""
    return bool(getattr(e, "shared", False))


def one_line(e: BaseException) -> str:
    """The error as the one line the CLI prints: an OSError as `strerror: 'filename'`, others' text with
    every run of whitespace (newlines included) made one space."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: '{e.filename}'" if e.filename else e.strerror
    return " ".join(str(e).split())
