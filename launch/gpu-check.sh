#!/usr/bin/env bash
# One short check of a GPU machine (about 8 minutes on one GPU): the bf16 matmul rate, GPT-2-124M
# (configs/gpt2-124m.toml) at (1,1,1) in bf16 for a timed window (tokens/s, MFU), synchronous and
# asynchronous checkpoints from GPU memory loaded back, verified and converted; exit 1 on any mismatch.
#
# Usage: launch/gpu-check.sh [--dry-run] [--window SECONDS] [--dir FOLDER] [--config TOML]
#   --dry-run   the same steps on the CPU with a tiny model, in seconds (the test suite runs this)
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="${REPO_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "${PYTHON:-python3}" -m megalite.bench.gpu_check "$@"
