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
    for want in ("--max-new-tokens MAX_NEW_TOKENS tokens to sample (default: 200, or fewer so that prompt + sample "
                 "fit the model's block_size)", "(default: 0.8)",
                 "0: all of them (default: 0)", "seed of the sampling (default: 0)", "(default: a newline)"):
        assert want in out, (want, out)


def test_generate_samples_no_more_than_fits_the_block_by_default(tmp_path, capsys):
    """The default --max-new-tokens: 200, or block_size - prompt tokens when fewer (the README model's block is
    64: 'def ' + 60), so the model sees the whole sample and no context warning is printed."""
    from megalite.generate import default_new_tokens
    assert (default_new_tokens(4, 64), default_new_tokens(4, 1024), default_new_tokens(70, 64)) == (60, 200, 1)
    from helpers import CKPT, make_token_file, stdlib_text, train_in_process
    (tmp_path / "tok").mkdir()
    tokens = make_token_file(tmp_path / "tok", stdlib_text()[:20_000])
    train_in_process(CKPT.config(tokens, tmp_path / "run", **{"model.n_layer": 2, "model.block_size": 32,
                                                              "train.steps": 1, "checkpoint.dir": str(tmp_path / "ck")}))
    assert megalite_main(["generate", "--model", str(tmp_path / "ck"), "--prompt", "def ", "--ids"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and len(out.split()) == 32  # 4 prompt ids + 28 new ones: the block, exactly


def test_a_parallel_layout_without_torchrun_names_the_torchrun_command(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for args, n in ((["--parallel.tp=2"], 2), (["--parallel.tp=2", "--parallel.pp=2", "--parallel.dp=2"], 8)):
        assert megalite_main(["train", *args, f"--train.out_dir={tmp_path / 'run'}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"launch {n} processes with `torchrun --nproc-per-node {n} -m megalite " \
            f"train ...` (the same arguments after `train`)" in err, err
    assert not (tmp_path / "run").exists()


def test_ctrl_c_under_megalite_torchrun_ends_with_megalites_line(tmp_path):
    """Ctrl-C is SIGINT to the terminal's foreground process group: the torchrun agent and its workers. Sent
    so to `megalite torchrun` (torchrun's own agent): the workers finish the step, save it, rank 0 prints the
    stop line; the agent then ends without its SignalException traceback, exit 130 (128 + SIGINT). The
    checkpoint verifies. (Plain torchrun ends the same run with ~25 lines of traceback and exit 1.)"""
    import os
    import signal
    import subprocess
    from helpers import CKPT, env, kill_tree, make_token_file, metrics, stdlib_text, wait_for
    from megalite.checkpoint.verify import verify
    (tmp_path / "tok").mkdir()
    tokens = make_token_file(tmp_path / "tok", stdlib_text()[:40_000])
    toml = CKPT.toml(tmp_path / "tiny.toml", tokens, model={"n_layer": 2})
    out, ck = tmp_path / "out", tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-m", "megalite", "torchrun", "--standalone", "--nproc-per-node", "2",
                             "-m", "megalite", "train", "--config", str(toml), "--parallel.dp=2",
                             "--train.steps=100000", "--train.log_interval=1", f"--train.out_dir={out}",
                             f"--checkpoint.dir={ck}"], env=env(), cwd=tmp_path, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_for(lambda: (out / "metrics.jsonl").exists() and len(metrics(out)) >= 2, 150, 0.05)
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        text, _ = proc.communicate(timeout=150)
    finally:
        kill_tree(proc)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert "Traceback" not in text and "SignalException" not in text, text[-3000:]
    assert re.fullmatch(rf"megalite: stopped by SIGINT at step (\d+)/100000; checkpoint {re.escape(str(ck))}/"
                        rf"step_0*\1; to resume, run the same command again", lines[-1]), text[-3000:]
    assert proc.returncode == 128 + signal.SIGINT, (proc.returncode, text[-3000:])
    assert verify(ck)[1] == []
