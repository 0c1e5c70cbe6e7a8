#!/usr/bin/env bash
# The main demo, on CPU: train a tiny GPT on 8 processes at (tp, pp, dp) = (2, 2, 2) with sharded
# checkpoints, look at the checkpoint, convert it to one file, and sample from that file.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# torchrun forwards SIGTERM/SIGINT (Ctrl-C, a preemption) to the workers, which checkpoint after the step in
# progress, and SIGKILLs them after its shutdown timeout (torch's default: 30 s). A slow step + a save can
# take longer, so give them 120 s unless you set TORCH_ELASTIC_SHUTDOWN_TIMEOUT yourself; the workers read the
# same variable and warn (once) when a step + a save would not fit (docs/checkpointing.md: "Stopping in time").
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-120}"
RUN=${RUN:-runs/demo}
# Nothing is deleted: an earlier $RUN (a previous demo, with whatever you or the docs' commands wrote into it)
# is moved aside to $RUN.old-<time>; remove those yourself when you no longer want them.
if [ -e "$RUN" ] || [ -L "$RUN" ]; then
    aside="$RUN.old-$(date +%Y%m%d-%H%M%S)"
    mv "$RUN" "$aside"
    echo "demo: moved the earlier $RUN aside to $aside (nothing is deleted; rm -rf it yourself when done)"
fi
# `megalite torchrun` is torchrun (its own agent) whose Ctrl-C ends with megalite's stop line, no traceback
python3 -m megalite torchrun --standalone --nproc-per-node 8 -m megalite train --config configs/tiny-cpu.toml \
    --parallel.tp=2 --parallel.pp=2 --parallel.dp=2 \
    --train.out_dir="$RUN" --checkpoint.dir="$RUN/checkpoints" "$@"
python3 -m megalite inspect "$RUN/checkpoints" --tree
python3 -m megalite verify "$RUN/checkpoints"
python3 -m megalite convert "$RUN/checkpoints" --out "$RUN/model.safetensors"
echo "--- a sample: 60 new tokens after 'def ' (the model's block_size is 64)"
echo "    150 steps of a 0.2M-parameter byte model (a minute of CPU) learn which bytes are common and little"
echo "    more: expect runs of letters and spaces, not Python yet; configs/small-cpu.toml (docs/training.md)"
echo "    learns visibly in ten minutes, and launch/demo-bpe.sh trains a byte and a BPE model side by side"
python3 -m megalite generate --model "$RUN/model.safetensors" --prompt "def " --max-new-tokens 60 --top-k 20 --seed 1
