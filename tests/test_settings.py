"""Discoverable settings (issue: the first hour, round two): every config field documented and listed by
`megalite train --help`, `megalite config show` printing the resolved config as TOML that loads back,
parallel.dp inferred from the world size, auto_prepare limited to the default path, an honest ETA."""
import dataclasses
import sys

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from helpers import cli, one_line_error
from megalite import cli as megalite_cli
from megalite.config import (DEFAULT_DATA_PATH, DOCS, Config, ConfigError, fields, help_text, load_config,
                             resolve, validate)
from megalite.data import DataError


def _all_fields() -> set:
    return {f"{s.name}.{f.name.rstrip('_')}" for s in dataclasses.fields(Config)
            for f in dataclasses.fields(s.type if not isinstance(s.type, str) else getattr(Config(), s.name))}


def test_every_field_has_one_line_of_doc_and_no_doc_is_stale():
    assert set(DOCS) == _all_fields()
    for dotted, typ, default, doc in fields():
        assert doc and "\n" not in doc, dotted
        assert typ in ("int", "float", "bool", "str", "dict", "list"), (dotted, typ)  # dict, list: TOML inline


def test_train_help_lists_every_field_with_type_and_default(tmp_path):
    r = cli("train", "--help", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for dotted, typ, default, doc in fields():
        line = next((ln for ln in r.stdout.splitlines() if ln.strip().startswith(f"--{dotted}=")), None)
        assert line is not None, f"--{dotted} missing from `megalite train --help`"
        assert typ.upper() in line and doc in line, line
        shown = (str(default).lower() if isinstance(default, bool) else f'"{default}"' if isinstance(default, str)
                 else repr(default))
        assert line.endswith(f"(default: {shown})"), line


def test_config_show_prints_the_resolved_config_as_toml_that_loads_back(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert megalite_cli.main(["config", "show", "--parallel.tp=2", "--parallel.pp=2", "--train.lr=2e-3",
                              "--train.out_dir=runs/a \"quoted\" \\ path", "--train.global_batch_size=32"]) == 0
    text = capsys.readouterr().out
    shown = Config.from_dict(tomllib.loads(text))
    assert shown.parallel.dp == 2  # inferred: 8 / (2 * 2)
    assert shown.train.lr == 2e-3 and shown.train.out_dir == 'runs/a "quoted" \\ path'
    expected = validate(resolve(load_config(None, ["--parallel.tp=2", "--parallel.pp=2", "--train.lr=2e-3",
                                           "--train.out_dir=runs/a \"quoted\" \\ path",
                                           "--train.global_batch_size=32"]), 8), 8)
    assert shown == expected
    p = tmp_path / "shown.toml"
    p.write_text(text)
    assert validate(resolve(load_config(p), 8), 8) == expected  # the printed file is a config file


def test_config_show_bad_override_is_one_line(tmp_path):
    line = one_line_error(cli("config", "show", "--train.lr=fast", cwd=tmp_path))
    assert "train.lr" in line and "float" in line


@pytest.mark.parametrize("tp,pp,world,dp", [(2, 2, 8, 2), (1, 1, 4, 4), (4, 2, 8, 1), (1, 2, 2, 1)])
def test_dp_is_inferred_from_the_world_size(tp, pp, world, dp):
    cfg = load_config(None, [f"--parallel.tp={tp}", f"--parallel.pp={pp}", "--train.global_batch_size=16",
                             "--train.micro_batch_size=2"])
    assert cfg.parallel.dp == 0
    assert validate(resolve(cfg, world), world).parallel.dp == dp


def test_dp_inference_errors_name_the_field_and_the_world():
    cfg = load_config(None, ["--parallel.tp=4"])
    with pytest.raises(ConfigError, match=r"parallel\.dp .*world size 6 .*parallel\.tp\*pp = 4\*1"):
        validate(resolve(cfg, 6), 6)
    cfg = load_config(None, ["--parallel.tp=2", "--parallel.dp=2"])  # explicit dp still has to agree
    with pytest.raises(ConfigError, match=r"world size 8"):
        validate(resolve(cfg, 8), 8)


def test_auto_prepare_builds_only_the_default_path(tmp_path, monkeypatch):
    from megalite.run.train import prepare_data
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["--data.auto_prepare=true", "--data.path=data/stdlb.bin"])  # a typo
    with pytest.raises(DataError, match=r"data\.path: token file 'data/stdlb\.bin' does not exist .*"
                                        r"only the default corpus"):
        prepare_data(cfg, 0)
    assert not (tmp_path / "data").exists()  # nothing was built for the typo
    cfg = load_config(None, ["--data.auto_prepare=false", "--data.path=nope.bin"])
    prepare_data(cfg, 0)  # without auto_prepare the dataset itself reports the missing file
    assert not (tmp_path / "nope.bin").exists()
    assert Config().data.path == DEFAULT_DATA_PATH


def test_mistyped_data_path_on_the_command_line_is_one_line(tmp_path, tiny_toml):
    line = one_line_error(cli("train", "--config", tiny_toml, "--data.auto_prepare=true",
                              f"--data.path={tmp_path}/typo.bin", cwd=tmp_path))
    assert "data.path" in line and "typo.bin" in line and "only the default corpus" in line
    assert not (tmp_path / "typo.bin").exists() and not (tmp_path / "data").exists()


def test_eta_ignores_the_first_step():
    from megalite.run.runlog import step_line as _log_line
    rec = {"step": 1, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100.0, "ms_per_step": 9000.0}
    assert "ETA after step 2" in _log_line(rec, 100, 0.0, 0)
    rec["step"] = 11  # 10 steps after the first took 20 s: 89 steps left at 2 s each
    assert "ETA 2m58s" in _log_line(rec, 100, 20.0, 10)


def test_help_text_is_what_train_help_shows():
    """`train --help` ends with every config field (help_text), computed only when the help is printed: the
    parser every command builds does not list the fields (a `convert` never enters config.py for them)."""
    train = megalite_cli.build_parser()._subparsers._group_actions[0].choices["train"]
    assert help_text() not in (train.epilog or "") and help_text() in train.format_help()


def test_shipped_configs_validate_at_the_layouts_readme_runs():
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    for name, layouts in (("tiny-cpu.toml", [(2, 2, 8), (1, 4, 4), (1, 1, 1)]),
                          ("small-cpu.toml", [(2, 2, 8), (1, 4, 8), (1, 1, 1)]),
                          ("gpt2-124m.toml", [(1, 1, 8), (1, 1, 1)])):
        for tp, pp, world in layouts:
            cfg = load_config(root / "configs" / name, [f"--parallel.tp={tp}", f"--parallel.pp={pp}"])
            cfg = validate(resolve(cfg, world), world)
            assert cfg.parallel.dp == world // (tp * pp), (name, tp, pp)
            assert cfg.checkpoint.dir == f"{cfg.train.out_dir}/checkpoints"
