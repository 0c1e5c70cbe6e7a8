"""megalite.testing.assert_round_trip on a module written here, as a user would (docs/testing.md shows the block
between the markers verbatim, and a test below keeps the two the same); on megalite's GPT (the README's
form); and the helper failing when a load drops one tensor."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

# docs/testing.md: begin
import torch
import torch.nn as nn
import torch.nn.functional as F

from megalite.parallel.partition import shard
from megalite.parallel.tensor import copy_to_tp, reduce_from_tp
from megalite.testing import assert_round_trip


class MLP(nn.Module):
    """Megatron's MLP over tp: fc1 split by output rows (column-parallel), fc2 by input columns (row-parallel)."""

    def __init__(self, grid, width=8):
        super().__init__()
        torch.manual_seed(0)  # the whole model from one seed on every rank; shard() keeps this rank's part
        self.tp, self.fc1, self.fc2 = grid.tp, nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        shard(self.fc1.weight, 0, grid.tp)
        shard(self.fc1.bias, 0, grid.tp)
        shard(self.fc2.weight, 1, grid.tp)  # fc2.bias stays whole on every rank: replicated

    def forward(self, x):  # (B, width) -> (B, width)
        h = F.gelu(self.fc1(copy_to_tp(x, self.tp)))  # (B, 4 * width / tp); backward: all-reduce over tp
        return reduce_from_tp(F.linear(h, self.fc2.weight), self.tp) + self.fc2.bias  # the tp partial sums


def build_model(grid):
    return MLP(grid)


def build_adamw(model, grid):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def build_sgd(model, grid):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train_step(model, optimizer, grid, step):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))  # the same batch on every rank
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()
# docs/testing.md: end
# (the page's two tests that follow, test_mlp_with_adamw_saved_at_tp2_loads_at_dp2 and
# test_mlp_with_sgd_momentum_saved_at_dp2_loads_at_tp2, run from the page itself, as their own test file in a
# fresh interpreter: tests/test_docs.py::test_every_pytest_block_passes_as_its_own_file)


DOCS = Path(__file__).resolve().parent.parent / "docs" / "testing.md"


def test_the_docs_show_this_files_example_verbatim():
    """The page's example starts with this file's model, verbatim (its own imports included)."""
    here = Path(__file__).read_text()
    example = here.split("# docs/testing.md: begin\n")[1].split("# docs/testing.md: end\n")[0]
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    assert any(b.startswith(example) for b in blocks), "docs/testing.md no longer shows the example of this file"


class ForgetfulSGD(torch.optim.SGD):
    """A planted bug: loading drops the momentum buffer of the first parameter that has one."""

    def load_state_dict(self, state_dict):
        state_dict["state"].pop(min(state_dict["state"]))
        super().load_state_dict(state_dict)


def build_forgetful_sgd(model, grid):
    return ForgetfulSGD(model.parameters(), lr=0.1, momentum=0.9)


def test_a_load_that_drops_a_tensor_fails_the_round_trip(tmp_path):
    with pytest.raises(AssertionError, match=r"tensor names differ after \(2, 1, 1\) -> \(1, 1, 1\): "
                                             r"\['optimizer_state/fc1\.weight\.optim\.momentum_buffer'\]"):
        assert_round_trip(tmp_path, save_layout=(2, 1, 1), load_layout=(1, 1, 1), model=build_model,
                          optimizer=build_forgetful_sgd)


def test_a_lambda_is_refused_in_one_line(tmp_path):
    with pytest.raises(TypeError, match=r"`optimizer` .*<lambda>.* must be a module-level function"):
        assert_round_trip(tmp_path, (1, 1, 1), (1, 1, 1), model=build_model,
                          optimizer=lambda m, g: torch.optim.SGD(m.parameters(), lr=0.1))
    assert not any(tmp_path.iterdir())  # refused before anything ran


def test_megalite_gpt_tp2_to_pp2_dp2_with_zero1(tmp_path):
    """The README's form: megalite's own GPT, trained by `megalite train`'s step, AdamW moments resharded."""
    assert_round_trip(tmp_path, save_layout=(2, 1, 1), load_layout=(1, 2, 2), zero1=(False, True))
