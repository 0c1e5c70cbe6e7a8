#!/usr/bin/env bash
# Train across several machines: run this once on every node.
#
# Usage: NNODES=2 RDZV_ENDPOINT=node0:29500 launch/multinode.sh [megalite train args...]
#
# Environment:
#   NNODES          number of machines (required; defaults to $SLURM_NNODES under SLURM)
#   RDZV_ENDPOINT   host:port of the c10d rendezvous, normally the first node
#                   (required; or set MASTER_ADDR and optionally MASTER_PORT, default 29500)
#   RDZV_ID         job id shared by all nodes (default: megalite)
#   NODE_RANK       a label for this node in the start-up line (default: $SLURM_NODEID); the c10d
#                   rendezvous assigns the real node ranks in arrival order
#   NPROC_PER_NODE  processes per node (default: GPU count, or 8 CPU processes)
#   OMP_NUM_THREADS threads per CPU process (default 1, CPU only)
#   MAX_RESTARTS    torchrun restarts on failure (default 0)
#   TORCH_ELASTIC_SHUTDOWN_TIMEOUT  seconds from SIGTERM/SIGINT to SIGKILL (default 120)
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# A fresh store per restart attempt, so that a replacement host can join survivors that restarted
# (docs/training.md: "Running on a cluster"; pytorch/pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
export PYTHONPATH="${REPO_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
# torchrun forwards SIGTERM/SIGINT (Ctrl-C, a preemption) to the workers, which checkpoint after the step in
# progress, and SIGKILLs them after its shutdown timeout (torch's default: 30 s). A slow step + a save can
# take longer, so give them 120 s unless you set TORCH_ELASTIC_SHUTDOWN_TIMEOUT yourself; the workers read the
# same variable and warn (once) when a step + a save would not fit (docs/checkpointing.md: "Stopping in time").
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-120}"

NNODES="${NNODES:-${SLURM_NNODES:-}}"
if [[ -z "${NNODES}" ]]; then
    echo "multinode.sh: set NNODES to the number of machines" >&2
    exit 2
fi
if [[ -z "${RDZV_ENDPOINT:-}" && -n "${MASTER_ADDR:-}" ]]; then
    RDZV_ENDPOINT="${MASTER_ADDR}:${MASTER_PORT:-29500}"
fi
if [[ -z "${RDZV_ENDPOINT:-}" ]]; then
    echo "multinode.sh: set RDZV_ENDPOINT=host:port (the first node) or MASTER_ADDR" >&2
    exit 2
fi
RDZV_ID="${RDZV_ID:-megalite}"
NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-}}"

GPUS=0
if command -v nvidia-smi >/dev/null 2>&1; then
    GPUS="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
fi
if [[ "${GPUS:-0}" -gt 0 ]]; then
    NPROC_PER_NODE="${NPROC_PER_NODE:-${GPUS}}"
else
    NPROC_PER_NODE="${NPROC_PER_NODE:-8}"
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi

# torchrun itself, through `megalite torchrun`: the same agent and arguments, but Ctrl-C or SIGTERM ends with
# megalite's stop line (exit 128 + signal) rather than the agent's SignalException traceback (docs/training.md).
TORCHRUN=(python3 -m megalite torchrun)
# With the c10d rendezvous torchrun assigns node ranks itself in arrival order and warns that --node-rank
# "will be ignored", so it is not passed; NODE_RANK only names this node in the line below.

echo "multinode.sh: $(hostname) node_rank=${NODE_RANK:-auto} nnodes=${NNODES}" \
     "nproc_per_node=${NPROC_PER_NODE} rdzv=${RDZV_ENDPOINT} id=${RDZV_ID}" >&2
exec "${TORCHRUN[@]}" --nnodes "${NNODES}" --nproc-per-node "${NPROC_PER_NODE}" \
    --rdzv-backend c10d --rdzv-endpoint "${RDZV_ENDPOINT}" --rdzv-id "${RDZV_ID}" \
    --max-restarts "${MAX_RESTARTS:-0}" \
    -m megalite train "$@"
