"""A torchrun worker for test_error_contract_torchrun.py: runs several `megalite` commands, one after the other,
through megalite.cli.main on every rank of a real torchrun job (so each case costs no launch of its own),
and records per rank each case's exit code, stdout, stderr and the process's OS thread count before the first
case and after this one. The last case is run as the process itself (`raise SystemExit(main(...))`), so
torchrun reports its real exit code per worker.

    torchrun --nproc-per-node 2 tests/torchrun_matrix.py CASES.json RESULTS_DIR

A case is an argv list (every rank runs it) or {"0": argv, "1": argv, ...}: each rank its own command line
(two hosts with different config files or overrides).
"""
import contextlib
import io
import json
import os
import sys
import traceback
from pathlib import Path

from megalite.cli import main

cases, results = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
rank = int(os.environ["RANK"])
got = []
threads = lambda: len(os.listdir("/proc/self/task"))  # noqa: E731 - this process's OS threads (gloo's too)
base = threads()  # before any case: each case's (base, threads after it) is recorded
cases = [c[str(rank)] if isinstance(c, dict) else c for c in cases]
for i, argv in enumerate(cases[:-1]):
    # each case joins a fresh process group: a store namespace of its own (train.py keys it by this variable)
    os.environ["TORCHELASTIC_RESTART_COUNT"] = f"matrix-{i}"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except BaseException:  # noqa: BLE001 - a bug: recorded with its traceback, the test fails on it
            rc = "uncaught"
            err.write(traceback.format_exc())
    got.append({"argv": argv, "rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue(),
                "threads": (base, threads())})
(results / f"rank{rank}.json").write_text(json.dumps(got))
os.environ["TORCHELASTIC_RESTART_COUNT"] = f"matrix-{len(cases) - 1}"
raise SystemExit(main(cases[-1]))
