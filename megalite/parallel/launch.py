"""`megalite torchrun ARGS`: torchrun itself (`torch.distributed.run.main`: its argument parser, rendezvous,
agent, restarts and worker monitoring, unchanged), with one difference in how the agent ends.

On Ctrl-C (or SIGTERM, SIGHUP, SIGQUIT) torchrun's agent forwards the signal to its workers, waits for them
(its shutdown timeout), then re-raises the signal as a `SignalException` that nothing catches: after
megalite's own stop line the terminal gets ~25 lines of the agent's traceback and exit code 1, which reads as a
crash. Here that exception ends the agent quietly with exit code 128 + the signal's number (130 for Ctrl-C,
the shell's convention), so megalite's line ("stopped by SIGINT at step ...; checkpoint ...") is the last one.
A worker that failed (torchrun's `ChildFailedError`, another traceback and a table) ends it in one line naming
the ranks and their exit codes, with the first failed rank's code (128 + the signal for one that was killed,
the shell's convention); each worker has already said why. A number of processes torchrun cannot start
(`--nproc-per-node abc`, `0`) is one line, exit 2, before anything starts.

Nothing else is changed: this is not a launcher of our own, and plain `torchrun` works the same apart from
those last lines (docs/training.md, "Stopping a run").
"""
from __future__ import annotations

import signal
import sys


def torchrun(argv: list[str]) -> int:
    """Run torchrun with `argv` (its own arguments, e.g. `--nproc-per-node 2 -m megalite train ...`); the exit
    code: 0, the first failed worker's code (128 + its signal), or 128 + the signal that stopped the agent."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import determine_local_world_size, parse_args, run
    args = parse_args(argv)  # torchrun's own parser (its usage errors are its own one line, exit 2)
    try:
        n = determine_local_world_size(args.nproc_per_node)
    except ValueError as e:
        n = f"({e})"
    if not isinstance(n, int) or n < 1:  # torchrun would end in a traceback (ValueError, AssertionError)
        print(f"megalite torchrun: error: --nproc-per-node {args.nproc_per_node}: expected a positive number of "
              f"processes, or cpu, gpu or auto {n if isinstance(n, str) else ''}".rstrip(), file=sys.stderr,
              flush=True)
        return 2
    try:
        run(args)
    except SignalException as e:
        # the agent has already sent the signal to every worker and waited for them (its _shutdown)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        print(f"megalite torchrun: {failures(e)} (each worker's own error is above)", file=sys.stderr, flush=True)
        _, first = e.get_first_failure()
        return first.exitcode if 0 < first.exitcode < 256 else 128 - first.exitcode if first.exitcode < 0 else 1
    return 0


def failures(e) -> str:
    """'rank 0 exited with code 2, rank 1 was killed by SIGKILL' for a ChildFailedError."""
    parts = []
    for rank, f in sorted(e.failures.items()):
        if f.exitcode < 0:
            try:
                how = f"was killed by {signal.Signals(-f.exitcode).name}"
            except ValueError:
                how = f"was killed by signal {-f.exitcode}"
        else:
            how = f"exited with code {f.exitcode}"
        parts.append(f"rank {rank} {how}")
    return ", ".join(parts) or "a worker failed"
