"""Leftover edges of the CLI: a reader that closes the pipe early (`megalite inspect CKPT | head -1`), a symlink
planted at the converter's temporary name, and a --config / --model / data.path that exists but is not a
regular file."""
from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file

import helpers as H
import megalite.cli as cli
from megalite.checkpoint.stream import StreamingWriter
from megalite.convert import convert


def _closed_reader(*args) -> subprocess.CompletedProcess:
    """`megalite ARGS` whose stdout reader is gone before it writes a byte (a `| head -1` that already exited)."""
    p = subprocess.Popen([*H.MEGALITE, *map(str, args)], env=H.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    p.wait(timeout=H.CLI_TIMEOUT)
    return subprocess.CompletedProcess(args, p.returncode, "", err)


def test_a_reader_that_closes_the_pipe_early_ends_the_command_quietly(run111):
    r = _closed_reader("inspect", run111["ckpt"])  # was: "megalite inspect: error: Broken pipe", exit 2
    assert r.returncode == 1 and r.stderr == "", (r.returncode, r.stderr)


def test_a_broken_pipe_that_is_not_stdout_is_not_hidden(monkeypatch, capsys):
    def boom(args, rest):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")  # e.g. a socket; stdout is fine

    monkeypatch.setattr(cli, "_cmd_config", boom)
    with pytest.raises(BrokenPipeError):
        cli.main(["config", "show"])


def test_convert_never_writes_through_a_symlink_at_its_temporary_name(tmp_path, run111):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "model.safetensors"
    (tmp_path / "model.safetensors.tmp-megalite").symlink_to(victim)
    convert(run111["ckpt"], out, quiet=True)
    assert victim.read_text() == "precious"
    assert not os.path.lexists(tmp_path / "model.safetensors.tmp-megalite") and not out.is_symlink()
    assert "wte.weight" in load_file(str(out))
    # the HF folder: a symlink to a folder of the user's at the temporary name is unlinked, not filled or emptied
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    (tmp_path / "hf.tmp-megalite").symlink_to(tmp_path / "mine")
    convert(run111["ckpt"], tmp_path / "hf", fmt="hf-gpt2", quiet=True)
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]
    assert (tmp_path / "hf" / "model.safetensors").is_file() and not os.path.lexists(tmp_path / "hf.tmp-megalite")
    # and should one be planted between that unlink and the open, the writer refuses it (O_NOFOLLOW)
    link = tmp_path / "late.tmp-megalite"
    link.symlink_to(victim)
    with pytest.raises(OSError) as e:
        StreamingWriter(link, [("x", [2], torch.float32)], {}, checksum=False)
    assert e.value.errno == errno.ELOOP and victim.read_text() == "precious"


@pytest.mark.parametrize("kind", ["chardev", "fifo", "broken-symlink", "folder"])
def test_a_path_that_is_not_a_regular_file_is_named_for_what_it_is(tmp_path, capsys, kind, token_file):
    path = {"chardev": "/dev/null", "fifo": tmp_path / "fifo", "broken-symlink": tmp_path / "broken",
            "folder": tmp_path}[kind]
    what = {"chardev": "is a character device", "fifo": "is a named pipe (FIFO)",
            "broken-symlink": f"is a broken symlink to '{tmp_path / 'gone'}'", "folder": "is a folder"}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "broken-symlink":
        path.symlink_to(tmp_path / "gone")
    cfg = H.CKPT.toml(tmp_path / "ok.toml", token_file)
    runs = [(["train", "--config", path], "train", f"--config: '{path}' {what}, expected a TOML file"),
            (["config", "show", "--config", path], "config", f"--config: '{path}' {what}")]
    if kind != "folder":  # a folder is read as an HF GPT-2 model folder / refused by data checks of its own
        runs += [(["generate", "--model", path], "generate", f"model '{path}' {what}, expected a safetensors file"),
                 (["train", "--config", cfg, f"--data.path={path}", f"--train.out_dir={tmp_path / 'out'}"], "train",
                  f"data.path: '{path}' {what}, expected a token file")]
    for argv, command, fragment in runs:
        capsys.readouterr()
        rc = cli.main([str(a) for a in argv])
        out, err = capsys.readouterr()
        lines = err.splitlines()
        assert rc == 2 and out == "" and len(lines) == 1, (argv, rc, out, err)
        assert lines[0].startswith(f"megalite {command}: error: ") and fragment in lines[0], (fragment, lines[0])
    assert not (tmp_path / "out").exists()
