"""The checkpoint engine's seams, in one process (a tiny nn.Module and torch.optim.SGD with momentum, no launch):
state.json's bytes are the documented compact JSON and its typed owner refuses a field of the wrong type; the
optimizer's owner refuses what is not an optimizer; the safe opener refuses a FIFO and a symlink instead of
blocking on or following it; and the package imports nothing of the training loop."""
import ast
import errno
import json
import os
import threading
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from helpers import resign
from megalite.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from megalite.base.fs import open_read
from megalite.checkpoint.verify import verify
from megalite.parallel.grid import ParallelGrid

STATE = "tp00-pp00-dp00/state.json"


def _saved(tmp_path: Path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(2, 8)).sum().backward()
    opt.step()
    grid = ParallelGrid.single()
    step = save_checkpoint(tmp_path / "ck", 1, net, opt, grid, tokens_seen=64, data_state={"batch_index": 1})
    return net, opt, grid, step


def test_state_json_is_compact_json_with_the_documented_fields_in_order(tmp_path):
    _, _, _, step = _saved(tmp_path)
    raw = (step / STATE).read_bytes()
    d = json.loads(raw)
    assert list(d) == ["step", "tokens_seen", "rng", "data", "scheduler"]
    assert (d["step"], d["tokens_seen"], d["data"], d["scheduler"]) == (1, 64, {"batch_index": 1}, None)
    assert set(d["rng"]) >= {"python", "numpy", "torch_cpu"}
    assert raw == json.dumps(d, separators=(",", ":")).encode()  # the reference: json's own compact form


@pytest.mark.parametrize("field,value,expected", [("step", "3", "an integer >= 0"),
                                                  ("tokens_seen", -1, "an integer >= 0"),
                                                  ("data", [1], "an object"),
                                                  ("scheduler", 5, "an object or null")])
def test_a_state_json_field_of_the_wrong_type_is_refused_by_load_and_verify(tmp_path, field, value, expected):
    """Checksums made to agree (resign): what is tested is StepState.from_json's own check, one line naming
    the file and the field, raised before any parameter changes."""
    net, opt, grid, step = _saved(tmp_path)
    d = json.loads((step / STATE).read_text())
    d[field] = value
    (step / STATE).write_text(json.dumps(d, separators=(",", ":")))
    resign(step, STATE)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    changed = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(step, net, opt, grid)
    msg = str(e.value)
    assert STATE in msg and f"field '{field}'" in msg and expected in msg and "\n" not in msg, msg
    assert all(torch.equal(p, c) for p, c in zip(net.parameters(), changed))  # nothing loaded
    problems = verify(step)[1]
    assert len(problems) == 1 and f"field '{field}'" in problems[0], problems


def test_an_object_that_is_not_an_optimizer_is_refused_in_one_line_before_anything_is_written(tmp_path):
    net = nn.Linear(4, 4)
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(tmp_path / "ck", 1, net, object(), ParallelGrid.single())
    msg = str(e.value)
    assert "ShardedAdamW, a torch.optim.Optimizer or None" in msg and "builtins.object" in msg, msg
    assert not (tmp_path / "ck").exists()


def _within(seconds: float, fn) -> dict:
    """fn() in a daemon thread: {"value": ...} or {"error": ...}; {} if it is still blocked after `seconds`."""
    got = {}

    def run():
        try:
            got["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            got["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return got


def test_the_safe_opener_refuses_a_symlink_and_a_fifo(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"x")
    (tmp_path / "link").symlink_to(target)
    got = _within(10, lambda: open_read(tmp_path / "link"))
    assert isinstance(got.get("error"), OSError) and got["error"].errno == errno.ELOOP, got
    os.mkfifo(tmp_path / "fifo")
    got = _within(10, lambda: open_read(tmp_path / "fifo"))  # a plain open() blocks until a writer comes
    assert got, "opening a FIFO blocked"
    assert isinstance(got.get("error"), OSError) and got["error"].errno == errno.EINVAL, got


@pytest.mark.parametrize("planted", ["tp00-pp00-dp00/model.safetensors", STATE, "tp00-pp00-dp00"])
def test_a_file_of_the_step_reached_through_a_symlink_is_refused_by_load_and_verify(tmp_path, planted):
    """A shard, a state.json or a whole coordinate folder replaced by a symlink to an identical copy elsewhere
    (every byte and checksum right): base/fs.linked refuses it in one line naming it, the loader before any
    parameter changes; nothing is read through the link."""
    net, opt, grid, step = _saved(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / Path(planted).name
    os.replace(step / planted, target)
    (step / planted).symlink_to(target)
    before = [p.detach().clone() for p in net.parameters()]
    problems = verify(step)[1]
    assert any("symbolic link" in p and Path(planted).name in p for p in problems), problems
    error = _load_error(step, net, opt, grid)
    assert "symbolic link" in error and "\n" not in error, error
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


def test_a_fifo_planted_as_state_json_is_reported_not_waited_on(tmp_path):
    """verify and load name the file in one line instead of blocking forever on the FIFO's open."""
    net, opt, grid, step = _saved(tmp_path)
    (step / STATE).unlink()
    os.mkfifo(step / STATE)
    got = _within(30, lambda: (verify(step)[1], _load_error(step, net, opt, grid)))
    assert got, "reading a FIFO planted as state.json blocked"
    problems, load_error = got["value"]
    assert any(STATE in p and "not a regular file" in p for p in problems), problems
    assert STATE in load_error and "not a regular file" in load_error, load_error


def _load_error(step, net, opt, grid) -> str:
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(step, net, opt, grid)
    return str(e.value)


# ---------------------------------------------------------------- the package imports nothing of the loop
PACKAGE = Path(__file__).resolve().parent.parent / "megalite"
# megalite.tokenizer: the tokenizer floor sits below checkpoint/ (it opens no checkpoint); checkpoint/validate.py
# reads the tokenizer a checkpoint carries with it (carried_by, issue 42)
ALLOWED = ("megalite.checkpoint", "megalite.base", "megalite.parallel", "megalite.config", "megalite.tokenizer")


def _imports(path: Path) -> set:
    """Every megalite module `path` imports, at module level or inside a function, relative ones resolved."""
    pkg = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(pkg[:len(pkg) - node.level + 1]) if node.level else ""
            mod = ".".join(x for x in (base, node.module) if x)
            out |= {f"{mod}.{a.name}" if mod in ("megalite", "megalite.checkpoint") else mod for a in node.names}
    return {m for m in out if m.split(".")[0] == "megalite"}


def test_the_checkpoint_package_imports_nothing_of_the_training_loop():
    """checkpoint/ is the engine; its policy (megalite/run/ckpt_policy.py), the loop, the model and the tools sit
    above it. What it may import from outside itself: base/ (errors, faults' hooks, fs, jsonio), parallel/ (the
    grid, the partition tag, ZeRO-1's pieces), config (model_architecture: which [model] keys a load compares),
    the tokenizer (the one a checkpoint carries) and the version."""
    outside = {}
    for path in sorted((PACKAGE / "checkpoint").glob("*.py")):
        bad = sorted(m for m in _imports(path) if m != "megalite.__version__" and not m.startswith(ALLOWED))
        if bad:
            outside[path.name] = bad
    assert outside == {}, outside


def test_the_commit_checks_what_every_rank_reported_without_re_reading_it(tmp_path):
    """manifest.reported_problems (the commit's check before it writes the manifest) trusts the reports: every file the
    manifest lists is a regular file of its coordinate's folder at its reported size; a file missing (its rank
    wrote elsewhere), cut short, or reached through a symlink is named in one line each."""
    from megalite.checkpoint.manifest import read, reported_problems
    _, _, _, step = _saved(tmp_path)
    man = read(step)
    assert reported_problems(step, man) == []
    model = "tp00-pp00-dp00/model.safetensors"
    (step / model).write_bytes((step / model).read_bytes()[:-1])
    os.replace(step / STATE, tmp_path / "state.json")
    (step / STATE).symlink_to(tmp_path / "state.json")
    os.unlink(step / "tp00-pp00-dp00/optimizer.safetensors")
    problems = reported_problems(step, man)
    assert len(problems) == 3 and all("\n" not in p for p in problems), problems
    assert any(model in p and "its rank reported" in p for p in problems), problems
    assert any(STATE in p and "symbolic link" in p for p in problems), problems
    assert any("optimizer.safetensors is missing" in p for p in problems), problems


def test_a_save_whose_rank_wrote_elsewhere_is_refused_before_its_manifest(tmp_path, monkeypatch):
    """The commit's manifest (manifest.write) names no file that is not in place: a rank whose file is missing
    where the commit looks (it wrote into another folder) makes the save fail in one line, with no manifest,
    no step folder and no temporary folder left, and `latest` still naming the step before."""
    from megalite.checkpoint import commit
    net, opt, grid, first = _saved(tmp_path)
    real = commit.write_rank

    def elsewhere(folder, pay, rel, direct=False):
        report = real(folder, pay, rel, direct)
        os.unlink(folder / "optimizer.safetensors")
        return report

    monkeypatch.setattr(commit, "write_rank", elsewhere)
    root = first.parent
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(root, 2, net, opt, grid)
    msg = str(e.value)
    assert "\n" not in msg and "optimizer.safetensors is missing" in msg and "same checkpoint.dir" in msg, msg
    assert "step_00000001" in msg  # what `latest` still names
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]
    assert (root / "latest").read_text() == "step_00000001\n"


def test_a_direct_io_save_writes_the_same_bytes_around_the_page_cache(tmp_path, monkeypatch):
    """checkpoint.direct_io: with direct=True every safetensors file of a save, sync or async, is streamed with
    StreamingWriter(direct=True) (O_DIRECT where the file system takes it), and the step is byte for byte the
    buffered save's."""
    import megalite.checkpoint.commit as commit
    from megalite.checkpoint import AsyncSaver
    seen, real = [], commit.StreamingWriter

    def spy(*args, **kwargs):
        seen.append(kwargs.get("direct", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(commit, "StreamingWriter", spy)
    net, opt, grid, buffered = _saved(tmp_path)
    n = len(seen)
    assert n == 2 and not any(seen)  # model.safetensors, optimizer.safetensors
    kw = dict(tokens_seen=64, data_state={"batch_index": 1}, direct=True)
    direct = save_checkpoint(tmp_path / "d", 1, net, opt, grid, **kw)
    saver = AsyncSaver()
    save_checkpoint(tmp_path / "a", 1, net, opt, grid, saver=saver, **kw)
    saver.wait()
    assert seen[n:] == [True] * (2 * n)
    files = sorted(p.relative_to(buffered) for p in buffered.rglob("*") if p.is_file())
    for other in (direct, tmp_path / "a" / buffered.name):
        assert sorted(p.relative_to(other) for p in other.rglob("*") if p.is_file()) == files
        for rel in files:
            assert (other / rel).read_bytes() == (buffered / rel).read_bytes(), rel
        verify(other)


def test_checkpoint_direct_io_is_on_for_gpu_hosts_by_default_and_reaches_every_save(tmp_path, monkeypatch):
    """`auto` writes around the page cache where training runs on GPUs (their host threads wait: see
    docs/performance.md), not on CPUs; on/off force it; anything else is refused in one line; and the
    manager hands its choice to every save it makes."""
    from types import SimpleNamespace
    from megalite.config import Config, ConfigError, resolve, validate
    import megalite.run.ckpt_policy as policy
    cfg = Config()
    for gpu in (True, False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda gpu=gpu: gpu)
        assert policy.direct_io(cfg) is gpu
        for word, want in (("on", True), ("off", False)):
            cfg.checkpoint.direct_io = word
            assert policy.direct_io(cfg) is want
        cfg.checkpoint.direct_io = "auto"
    cfg.checkpoint.direct_io = "yes"
    with pytest.raises(ConfigError, match=r"^checkpoint\.direct_io = 'yes': expected 'auto', 'on' or 'off'$"):
        validate(resolve(cfg, world_size=1), world_size=1)
    cfg.checkpoint.direct_io, cfg.checkpoint.dir = "on", str(tmp_path / "ck")
    got = []
    monkeypatch.setattr(policy, "save_checkpoint", lambda *a, **k: got.append(k["direct"]))
    manager = policy.CheckpointManager(cfg, ParallelGrid.single())
    tr = SimpleNamespace(step=3, model=None, optimizer=None, tokens_seen=0, tokenizer=None, origin=None,
                         sampler=SimpleNamespace(state_dict=lambda: {}))
    manager.save(tr)
    assert got == [True]
