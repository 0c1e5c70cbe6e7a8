"""`python -m megalite` and `torchrun -m megalite`: the CLI, once the package Python found is known to be megalite.

A folder named `megalite` with no `__init__.py` in the working directory (a clone of this repository, run
from the folder that holds it) comes first on sys.path and is imported as an empty namespace package in
place of the installed megalite; the CLI would then fail on its first import ("cannot import name
'__version__'"). Say what happened and what to do instead, in one line (from rank 0), exit 2.
"""
import os
import sys


def _shadowed() -> str:
    pkg = sys.modules.get(__package__ or "megalite")
    if getattr(pkg, "__file__", None) is not None:
        return ""
    where = " and ".join(f"'{p}'" for p in getattr(pkg, "__path__", [])) or "a folder named megalite"
    return (f"megalite: error: Python imported the folder {where} as the package 'megalite' (a folder of that name "
            f"in the working directory comes first on sys.path and hides the installed megalite); run the command "
            f"from another folder (e.g. cd into the clone) or rename that folder")


if _shadowed():
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank finds the same folder: one line, rank 0's
        print(_shadowed(), file=sys.stderr, flush=True)
    raise SystemExit(2)

from .cli import main  # noqa: E402

raise SystemExit(main())
