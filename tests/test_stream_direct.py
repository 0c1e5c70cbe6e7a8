"""StreamingWriter's O_DIRECT mode (what `megalite convert` writes with): the same bytes as the page-cache path,
the fallbacks where a file system refuses O_DIRECT, and a disk that fills up mid-file leaving nothing behind."""
from __future__ import annotations

import builtins
import errno
import fcntl
import os
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import megalite.checkpoint.stream as stream
from megalite.checkpoint.stream import ALIGN, StreamingWriter, block_crcs, raw_bytes
from megalite.convert import convert

CHUNK = 4 * ALIGN  # small bounce buffers: a few-hundred-KiB file crosses many of them

# sizes chosen to land on and around the chunk and block boundaries: an empty tensor, a tensor bigger than two
# buffers, a tail that is and one that is not a multiple of ALIGN
CASES = {"mixed": [("a", [3, 5], torch.float32), ("empty", [0, 4], torch.float32), ("big", [2 * CHUNK // 4 + 7],
          torch.float32), ("h", [33], torch.bfloat16), ("z", [CHUNK // 2 - 3], torch.float16)],
         "header only": [("e", [0], torch.float32)],
         "one buffer exactly": [("x", [CHUNK // 4], torch.float32)]}


def _tensors(specs):
    g = torch.Generator().manual_seed(0)
    return [(n, torch.randn(shape, generator=g).to(dtype)) for n, shape, dtype in specs]


def _write(path: Path, specs, direct: bool, seen=None) -> list:
    """Write `specs`' tensors; append to `seen` whether the file was opened with O_DIRECT and still had it
    after its last write (a tail the disk refused would have dropped it)."""
    w = StreamingWriter(path, specs, {"format": "pt"}, block=1000, direct=direct)
    opened = bool(fcntl.fcntl(w.f.fileno(), fcntl.F_GETFL) & os.O_DIRECT)
    crcs = [w.write(n, t) for n, t in _tensors(specs)]
    w.close()
    if seen is not None:
        seen.append((opened, w.sink is not None and w.sink.direct))
    return crcs


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(stream, "BOUNCE", CHUNK)


@pytest.fixture(params=["disk", "tmpfs"])
def where(request, tmp_path):
    """A folder on the test disk and one on tmpfs (which refused O_DIRECT before Linux 6.6 and takes it since)."""
    if request.param == "disk":
        yield tmp_path
        return
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    d = Path("/dev/shm") / f"megalite-test-{uuid.uuid4().hex}"
    d.mkdir()
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


@pytest.mark.parametrize("case", CASES)
def test_direct_writes_the_same_bytes_and_checksums(where, case):
    specs, seen = CASES[case], []
    a, b = where / "buffered.safetensors", where / "direct.safetensors"
    crcs_a, crcs_b = _write(a, specs, False), _write(b, specs, True, seen)
    assert b.read_bytes() == a.read_bytes()
    # the checksums are of the tensors' bytes (as the buffered path computes them), not of the bounce buffers
    assert crcs_b == crcs_a == [block_crcs(raw_bytes(t), 1000) for _, t in _tensors(specs)]
    assert all(torch.equal(load_file(str(b))[n], t) for n, t in _tensors(specs))
    if not str(where).startswith("/dev/shm"):
        assert seen == [(True, True)], "the test disk takes O_DIRECT: the direct path itself must be what ran"


def test_o_direct_refused_at_open_falls_back_to_the_page_cache(tmp_path, monkeypatch):
    real = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))  # what tmpfs said before Linux 6.6
        return real(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    specs, seen = CASES["mixed"], []
    _write(tmp_path / "a", specs, False)
    _write(tmp_path / "b", specs, True, seen)
    assert seen == [(False, False)]
    assert (tmp_path / "b").read_bytes() == (tmp_path / "a").read_bytes()


class _Fails:
    """A file whose write fails as `plan` says, call by call: "einval" / "enospc" raise, "half" stores half
    of what it is given (aligned) and returns that count, "zero" stores nothing and returns 0, None writes."""

    def __init__(self, f, plan):
        self._f, self.plan, self.flags = f, list(plan), []

    def write(self, data):
        self.flags.append(fcntl.fcntl(self._f.fileno(), fcntl.F_GETFL))  # the file's flags at each write
        what = self.plan.pop(0) if self.plan else None
        if what == "einval":
            raise OSError(errno.EINVAL, "Invalid argument")
        if what == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device")
        if what == "half":
            return self._f.write(memoryview(data)[: len(data) // 2 // ALIGN * ALIGN])
        if what == "zero":
            return 0
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)


@pytest.fixture
def failing_open(monkeypatch):
    """failing_open(plan): the next file opened for writing with O_DIRECT behaves as _Fails(plan)."""
    real, made = builtins.open, []

    def arm(plan):
        def fake(file, mode="r", *args, **kwargs):
            f = real(file, mode, *args, **kwargs)
            if "w" in mode and not made and fcntl.fcntl(f.fileno(), fcntl.F_GETFL) & os.O_DIRECT:
                made.append(_Fails(f, plan))
                return made[-1]
            return f
        monkeypatch.setattr(builtins, "open", fake)
        return made
    return arm


def test_o_direct_refused_at_the_first_write_drops_the_flag_and_writes_the_same_bytes(tmp_path, failing_open):
    specs = CASES["mixed"]
    _write(tmp_path / "a", specs, False)
    made = failing_open(["einval"])  # as a file system that takes the flag at open, then refuses the I/O
    _write(tmp_path / "b", specs, True)
    flags = made[0].flags
    assert len(flags) > 2 and flags[0] & os.O_DIRECT and not any(f & os.O_DIRECT for f in flags[1:])
    assert (tmp_path / "b").read_bytes() == (tmp_path / "a").read_bytes()


def test_einval_after_bytes_were_written_is_an_error_not_a_fallback(tmp_path, failing_open):
    failing_open([None, "einval"])
    w = StreamingWriter(tmp_path / "b", CASES["mixed"], {}, direct=True)
    with pytest.raises(OSError) as e:
        for n, t in _tensors(CASES["mixed"]):
            w.write(n, t)
        w.close()
    w.abort()
    assert e.value.errno == errno.EINVAL and not (tmp_path / "b").exists()


@pytest.mark.parametrize("plan", [["half", "enospc"], ["half", "zero"], [None, "enospc"]],
                         ids=["short-then-ENOSPC", "short-then-nothing", "ENOSPC-mid-file"])
def test_a_disk_filling_up_mid_convert_leaves_no_partial_output(tmp_path, run111, failing_open, plan):
    """The converter writes to a temporary name and renames: the old output stays whole, no temp file stays."""
    out = tmp_path / "model.safetensors"
    convert(run111["ckpt"], out, quiet=True)
    good = out.read_bytes()
    assert len(good) > 3 * CHUNK  # the failure lands mid-file, after whole chunks went to the disk
    made = failing_open(plan)
    with pytest.raises(OSError) as e:
        convert(run111["ckpt"], out, force=True, quiet=True)
    assert made, "the converter did not open its output with O_DIRECT"
    assert e.value.errno == errno.ENOSPC, e.value
    assert out.read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
