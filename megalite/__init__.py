"""megalite: a small, readable, Megatron-style 3D-parallel GPT trainer with rank-coded sharded checkpoints."""
__version__ = "0.1.0"
