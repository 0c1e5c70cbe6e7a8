#!/usr/bin/env bash
# Train on one machine with torchrun.
#
# Usage: launch/local.sh [megalite train args...]
#   e.g. launch/local.sh --config configs/<name>.toml
#
# With NVIDIA GPUs it starts one process per visible GPU; without, 8 CPU
# processes (gloo) with one OpenMP thread each so they don't oversubscribe cores.
# Overrides: NPROC=<processes>, OMP_NUM_THREADS=<threads per process>,
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT=<seconds from Ctrl-C/SIGTERM to SIGKILL> (default 120).
# The repo root is put on PYTHONPATH so this works without `pip install -e .`.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="${REPO_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
# torchrun forwards SIGTERM/SIGINT (Ctrl-C, a preemption) to the workers, which checkpoint after the step in
# progress, and SIGKILLs them after its shutdown timeout (torch's default: 30 s). A slow step + a save can
# take longer, so give them 120 s unless you set TORCH_ELASTIC_SHUTDOWN_TIMEOUT yourself; the workers read the
# same variable and warn (once) when a step + a save would not fit (docs/checkpointing.md: "Stopping in time").
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-120}"

GPUS=0
if command -v nvidia-smi >/dev/null 2>&1; then
    GPUS="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
fi
if [[ "${GPUS:-0}" -gt 0 ]]; then
    NPROC="${NPROC:-${GPUS}}"
else
    NPROC="${NPROC:-8}"
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi

# torchrun itself, through `megalite torchrun`: the same agent and arguments, but Ctrl-C or SIGTERM ends with
# megalite's stop line (exit 128 + signal) rather than the agent's SignalException traceback (docs/training.md).
TORCHRUN=(python3 -m megalite torchrun)

echo "local.sh: ${NPROC} processes (GPUs found: ${GPUS})" >&2
exec "${TORCHRUN[@]}" --standalone --nproc-per-node "${NPROC}" -m megalite train "$@"
