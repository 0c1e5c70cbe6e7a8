"""train.compile: torch.compile the transformer blocks of this rank's pipeline stage.

Each block is compiled in place (`nn.Module.compile`), so parameter names, the partition tags, checkpoints
and the optimizer see the same module tree as in eager mode. The blocks of a stage share one structure, so
dynamo compiles one graph for training and one for evaluation (no_grad) and reuses them for every block and
micro-batch; the embeddings, the final LayerNorm, the LM head and the vocab-parallel cross-entropy stay eager
(their collectives and custom autograd functions are the pipeline's, not worth a graph break each). The
first step pays the compilation (seconds on a GPU, tens of seconds on a loaded CPU); later steps run the
compiled kernels. Tested equal to eager on the CPU (tests/test_gpu_path.py). ZeRO-3's gather and free hooks
are registered after this and run outside the graph (parallel.zero.eager), so a compiled block sees the gathered
weights as inputs (tests/test_zero.py).
"""
from __future__ import annotations

import torch

from ..base.errors import ConfigError


def compile_blocks(model: torch.nn.Module) -> int:
    """Compile every block of `model` (a GPTStage) in place; return how many were compiled."""
    if not hasattr(torch, "compile"):
        raise ConfigError(f"train.compile = true needs torch.compile (torch >= 2.0), this is torch {torch.__version__}")
    for block in model.blocks.values():
        block.compile()
    return len(model.blocks)
