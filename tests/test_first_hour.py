"""What a new user meets first: --help with examples, --version, progress, plot, and README command 2 = CI.
(The README walkthrough runs in tests/test_docs.py, with every other command of the documents.)"""
import re
import runpy
import sys
from pathlib import Path

import pytest

from helpers import cli, run
from megalite import __version__
from megalite.cli import build_parser
from megalite.cli import main as megalite_main
from megalite.convert import Progress

ROOT = Path(__file__).resolve().parents[1]
SUBCOMMANDS = sorted(build_parser()._subparsers._group_actions[0].choices)


def test_every_subcommand_has_help_with_an_example(monkeypatch, capsys):
    """`megalite CMD --help` for every CMD, each run as `python -m megalite CMD --help` runs it (the package's
    __main__ with that argv), all in this process: a subprocess apiece cost ~2 s of `import torch` each. The
    subprocess entry point itself is covered by test_version and test_settings' `megalite train --help`."""
    assert {"train", "prepare", "inspect", "verify", "convert", "split", "reshard", "generate", "plot",
            "bench"} <= set(SUBCOMMANDS)
    assert "stress" not in SUBCOMMANDS  # a development tool: `python -m benchmarks stress ckpt`, from a checkout
    for cmd in SUBCOMMANDS:
        monkeypatch.setattr(sys, "argv", ["megalite", cmd, "--help"])
        with pytest.raises(SystemExit) as done:
            runpy.run_module("megalite", run_name="__main__", alter_sys=True)
        out, err = capsys.readouterr()
        assert done.value.code == 0, (cmd, err)
        assert re.search(r"examples?:\n\s+(megalite|torchrun) ", out), f"`megalite {cmd} --help` has no example"


def test_version():
    r = cli("--version", cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == f"megalite {__version__}"


def test_progress_lines_and_quiet(capsys):
    p = Progress("convert", 3, 3 * 2**30, every_s=0.0)
    for _ in range(3):
        p.step(2**30)
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == "convert: 3/3 tensors, 3.00/3.00 GiB" and len(lines) == 3
    q = Progress("convert", 3, 3, quiet=True, every_s=0.0)
    for _ in range(3):
        q.step(1)
    assert capsys.readouterr().err == ""


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    import json
    for name, scale in (("a", 1.0), ("b", 0.9)):
        d = tmp_path / name
        d.mkdir()
        rows = [{"step": s, "loss": scale * 5 / s, "lr": 1e-3 * s, **({"val_loss": 6 / s} if s % 5 == 0 else {})}
                for s in range(1, 11)]
        rows.insert(6, {"event": "resume", "step": 6, "layout": "tp=1 pp=4 dp=1", "from": "x"})
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "loss.png"
    r = cli("plot", tmp_path / "a", tmp_path / "b", "--out", out, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image
    img = matplotlib.image.imread(str(out))
    assert img.shape[0] > 100 and img.shape[1] > 100 and img.std() > 0.01  # a drawn chart, not a blank page
    r = cli("plot", tmp_path / "missing", "--out", tmp_path / "x.png", cwd=ROOT)
    assert r.returncode == 2 and "metrics.jsonl" in r.stderr and not (tmp_path / "x.png").exists()


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text().split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in readme.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2, "README.md must open with exactly two commands"
    assert commands[1] in (ROOT / ".ci" / "run").read_text().splitlines()


# ---------------------------------------------------------------- first-hour friction (issue 23)
# `python -m megalite` as an editable install (`pip install -e CLONE`) runs it: the package is found by a finder
# that setuptools puts on sys.meta_path after the path finder, so a folder named megalite without an
# __init__.py in the working directory (sys.path[0] = '' under -m and -c) is found first, as a namespace package.
EDITABLE_MAIN = f"""
import importlib.machinery, runpy, sys
class EditableFinder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "megalite" or name.startswith("megalite."):
            return importlib.machinery.PathFinder.find_spec(name, ["/".join([{str(ROOT)!r}, *name.split(".")[:-1]])])
sys.meta_path.insert(sys.meta_path.index(importlib.machinery.PathFinder) + 1, EditableFinder)
runpy.run_module("megalite", run_name="__main__", alter_sys=True)
"""


def test_a_folder_named_megalite_in_the_working_directory_is_named_in_one_line(tmp_path):
    clone = tmp_path / "megalite"  # a clone of the repository, run from the folder that holds it
    (clone / "megalite").mkdir(parents=True)
    (clone / "pyproject.toml").write_text("[project]\nname = 'megalite'\n")
    no_path = {"PYTHONPATH": ""}  # the package must come from the finder, as it does for an editable install
    r = run([sys.executable, "-c", EDITABLE_MAIN, "--version"], cwd=tmp_path, extra_env=no_path)
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("megalite: error: "), r.stderr
    assert f"the folder '{clone}' as the package 'megalite'" in r.stderr and "cd into the clone" in r.stderr
    assert "cannot import name" not in r.stderr
    (tmp_path / "elsewhere").mkdir()  # the same command from another folder runs (the finder itself works)
    r = run([sys.executable, "-c", EDITABLE_MAIN, "--version"], cwd=tmp_path / "elsewhere", extra_env=no_path)
    assert r.returncode == 0 and r.stdout.strip() == f"megalite {__version__}", r.stderr


def test_missing_default_corpus_names_auto_prepare(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no data/stdlib.bin here
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert megalite_main(["train", "--train.steps=1", f"--train.out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err == ("megalite train: error: data.path: token file 'data/stdlib.bin' does not exist: add "
                   "--data.auto_prepare=true to build the default corpus there from the Python standard library's "
                   "sources, or point --data.path at a file `megalite prepare FILES --out PATH` wrote\n"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing was created


def test_generate_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        megalite_main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for want in ("--max-new-tokens MAX_NEW_TOKENS tokens to sample (default: 200)", "(default: 0.8)",
                 "0: all of them (default: 0)", "seed of the sampling (default: 0)", "(default: a newline)"):
        assert want in out, (want, out)
