"""Issue 13's knobs without processes: config validation of sp / vpp / recompute / overlap, the (pp rank, chunk)
placement of every layer under virtual pipeline stages, and the interleaved 1F1B order."""
import pytest

from megalite.config import ConfigError, load_config, validate

GOOD = ["--parallel.tp=2", "--parallel.pp=2", "--parallel.dp=2", "--parallel.sp=true", "--parallel.vpp=2",
        "--parallel.overlap_grad_reduce=true", "--train.recompute=selective", "--train.global_batch_size=16",
        "--train.micro_batch_size=2"]


def test_new_fields_parse_and_validate():
    cfg = validate(load_config(None, GOOD), 8)
    assert (cfg.parallel.sp, cfg.parallel.vpp, cfg.parallel.overlap_grad_reduce, cfg.train.recompute) == \
        (True, 2, True, "selective")
    d = load_config(None, []).to_dict()
    assert (d["parallel"]["sp"], d["parallel"]["vpp"], d["parallel"]["overlap_grad_reduce"],
            d["train"]["recompute"]) == (False, 1, False, "none")


@pytest.mark.parametrize("overrides,world,names", [
    (["--train.recompute=some"], 1, ["train.recompute = 'some'", "'selective'"]),
    (["--parallel.vpp=0"], 1, ["parallel.vpp = 0", "positive"]),
    (["--parallel.vpp=2"], 1, ["parallel.vpp = 2", "parallel.pp >= 2"]),
    (["--parallel.vpp=2", "--parallel.pp=4", "--model.n_layer=6"], 4, ["parallel.pp * parallel.vpp = 4*2",
                                                                       "model.n_layer = 6"]),
    (["--parallel.vpp=2", "--parallel.pp=4", "--model.n_layer=8", "--train.global_batch_size=12",
      "--train.micro_batch_size=2"], 4, ["micro-batches per step (6)", "multiple of parallel.pp = 4"]),
    (["--parallel.sp=true", "--parallel.tp=4", "--model.block_size=30"], 4,
     ["parallel.sp", "model.block_size = 30", "parallel.tp = 4"]),
])
def test_bad_feature_values_are_one_line_errors(overrides, world, names):
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError) as e:
        validate(cfg, world)
    msg = str(e.value)
    assert "\n" not in msg
    for n in names:
        assert n in msg, (n, msg)
