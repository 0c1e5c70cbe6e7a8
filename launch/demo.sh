#!/usr/bin/env bash
# The main demo: a small 3D-parallel training run on 8 CPU processes, (tp, pp, dp) = (2, 2, 2).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
RUN=${RUN:-runs/demo}
torchrun --standalone --nproc-per-node 8 -m megalite train --config configs/tiny-cpu.toml \
    --parallel.tp=2 --parallel.pp=2 --parallel.dp=2 --train.out_dir="$RUN" "$@"
