"""Parallelism, one file per axis: grid (coordinates and groups), tensor (tp), pipeline (pp), data (dp)."""
