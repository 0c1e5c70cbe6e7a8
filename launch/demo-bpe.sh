#!/usr/bin/env bash
# "A demo that learns", twice, side by side: configs/small-cpu.toml on byte tokens and its BPE twin
# configs/small-cpu-bpe.toml on a 2,048-id byte-level BPE that this script trains on the same text (the
# default corpus), each on NPROC processes at (tp, pp) = (2, 2); then a sample from each and their
# validation loss in bits per byte, the one scale a byte model and a BPE model share (docs/tokenizers.md).
# About 2 x 10 minutes on a 2-core laptop. Extra arguments go to both `megalite train` runs.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-120}"  # see launch/demo.sh
NPROC=${NPROC:-8}
TOK=data/stdlib-bpe-2k
[ -f data/stdlib.bin ] || python3 -m megalite prepare --out data/stdlib.bin
[ -f "$TOK/tokenizer.json" ] || python3 -m megalite tokenizer train --vocab-size 2048 --out "$TOK"
[ -f data/stdlib-bpe.bin ] || python3 -m megalite prepare --tokenizer "$TOK" --out data/stdlib-bpe.bin
for twin in byte:configs/small-cpu.toml bpe:configs/small-cpu-bpe.toml; do
    run=runs/demo-${twin%%:*}
    if [ -e "$run" ] || [ -L "$run" ]; then  # never deleted: moved aside, as launch/demo.sh does
        aside="$run.old-$(date +%Y%m%d-%H%M%S)"
        mv "$run" "$aside"
        echo "demo: moved the earlier $run aside to $aside (nothing is deleted; rm -rf it yourself when done)"
    fi
    torchrun --standalone --nproc-per-node "$NPROC" -m megalite train --config "${twin#*:}" \
        --parallel.tp=2 --parallel.pp=2 --train.out_dir="$run" --checkpoint.dir="$run/checkpoints" "$@"
done
for kind in byte bpe; do
    echo "--- runs/demo-$kind: 120 new tokens after 'def ' (block_size 128), temperature 0.8, top-k 20"
    python3 -m megalite generate --model "runs/demo-$kind/checkpoints" --prompt "def " --max-new-tokens 120 \
        --top-k 20 --seed 1
done
python3 - <<'PY'
import json
for kind in ("byte", "bpe"):
    last = [json.loads(line) for line in open(f"runs/demo-{kind}/metrics.jsonl") if '"val_bpb"' in line][-1]
    print(f"{kind:>4}: step {last['step']}: validation {last['val_loss']:.4f} nats/token = "
          f"{last['val_bpb']:.3f} bits/byte")
PY
