"""The partition tag is written once, at construction: a second write raises (nanotron's `_set_metadata` is the
model), and every parameter of GPTStage carries, at several layouts, exactly the tags it carried on main at
55f39cd (tests/data/partition_tags_55f39cd.json, written by `python3 tests/test_partition_tag.py --write` on
that commit, before model.py stopped re-tagging)."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from megalite.config import ModelConfig
from megalite.model import GPTStage
from megalite.parallel.grid import Axis, Layout, ParallelGrid
from megalite.parallel.partition import Partition, partition_of, shard, tag

TABLE = Path(__file__).parent / "data" / "partition_tags_55f39cd.json"
# (tp, pp, vpp, tie_embeddings): even and uneven stages, interleaved chunks, a separate LM head
LAYOUTS = [(1, 1, 1, True), (2, 1, 1, False), (1, 2, 1, True), (2, 2, 1, False), (1, 3, 1, True),
           (2, 2, 2, True), (1, 4, 1, True), (1, 2, 2, False)]


def _grid(tp: int, pp: int, pp_rank: int) -> ParallelGrid:
    """A grid for building one stage on tp rank 0: no process group (building a stage needs none)."""
    layout = Layout(tp, pp, 1)
    return ParallelGrid(layout, layout.rank_of((0, pp_rank, 0)), Axis(tp, 0), Axis(pp, pp_rank), Axis(1, 0),
                        Axis(tp * pp, 0), Axis(1 if pp == 1 else 2, 0))


def tags_now() -> dict:
    """{"tp,pp,vpp,tie/stage": {parameter name: its tag as a dict}} for every stage of every layout."""
    out = {}
    for tp, pp, vpp, tie in LAYOUTS:
        cfg = ModelConfig(n_layer=4, n_head=4, n_embd=32, block_size=16, vocab_size=67, tie_embeddings=tie)
        for stage in range(pp):
            model = GPTStage(cfg, _grid(tp, pp, stage), vpp=vpp)
            out[f"{tp},{pp},{vpp},{tie}/{stage}"] = {
                name: {k: list(v) if isinstance(v, tuple) else v
                       for k, v in dataclasses.asdict(partition_of(p)).items()}
                for name, p in model.named_parameters()}
    return out


def fixed_since_main(table: dict) -> dict:
    """main's tags with the one change made on purpose: with untied embeddings (a separate lm_head.weight) main
    tagged the first stage's wte.weight `tied` anyway when pp > 1, and only train.py's check of
    model.tie_embeddings kept it out of the tied all-reduce. finalize.py reads the tag alone, so it says False."""
    for where, params in table.items():
        tie, stage, pp = where.split("/")[0].split(",")[3] == "True", int(where.split("/")[1]), int(where.split(",")[1])
        if not tie and pp > 1 and stage == 0:
            assert params["wte.weight"]["tied"] is True  # what main had
            params["wte.weight"]["tied"] = False
        for tag_ in params.values():  # `units` (GQA's kv heads, issue 32) and `tp_partial` (per-head norms,
            tag_["units"] = 0        # issue 39) came later: 0 and False on every GPT-2 tensor
            tag_["tp_partial"] = False
    return table


def test_every_parameter_of_gptstage_has_the_tags_it_had_on_main():
    want, got = fixed_since_main(json.loads(TABLE.read_text())), tags_now()
    assert got.keys() == want.keys()
    for where in want:
        assert got[where].keys() == want[where].keys(), where
        for name in want[where]:
            assert got[where][name] == want[where][name], f"{where} {name}: {got[where][name]} != {want[where][name]}"


def test_a_second_tag_raises_and_leaves_the_first():
    p = tag(nn.Parameter(torch.zeros(4, 2)), Partition((8, 2), dim=0))
    with pytest.raises(ValueError, match=r"already tagged.*\(8, 2\) split on dim 0"):
        tag(p, Partition((8, 2), dim=0, init="zeros"))
    assert partition_of(p) == Partition((8, 2), dim=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        partition_of(p).init = "zeros"  # the tag itself cannot be edited in place either
    with pytest.raises(ValueError, match="already tagged"):
        shard(p, 0, Axis(1, 0))  # the public way to tag refuses too


if __name__ == "__main__" and "--write" in sys.argv:
    rows = [f"{json.dumps(where)}: {{\n" + ",\n".join(f"  {json.dumps(n)}: {json.dumps(t, sort_keys=True)}"
                                                     for n, t in sorted(params.items())) + "\n}"
            for where, params in tags_now().items()]
    TABLE.write_text("{\n" + ",\n".join(rows) + "\n}\n")  # one line per parameter: a change shows in a diff
    print(f"wrote {TABLE}")
