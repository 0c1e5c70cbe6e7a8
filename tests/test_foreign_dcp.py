"""PyTorch DCP in and out: `megalite convert DCP_FOLDER` (every tensor under its stored name and dtype, bytes
entries listed and skipped, no pickle of the checkpoint's run) and `megalite convert CKPT --format dcp`
(DCP's pickle-free Hugging Face storage format, read back by torch.distributed.checkpoint itself).

Outside references: the tensors that were saved, `dcp_to_torch_save` (torch's own converter) and `dcp.load`
with HuggingFaceStorageReader into full and DTensor-sharded state dicts. Hostile inputs: a `.metadata` whose
pickle would run os.system (armed: plain pickle.load runs it), chunks past their file's end, '../x' and
symlinked paths, a truncated .distcp, an armed pickle inside a chunk, storage extensions, bad tiling.
"""
from __future__ import annotations

import copy
import dataclasses
import io
import json
import os
import pickle
import re
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file

from megalite.convert import ConvertError, convert, model_partitions, split
from megalite.convert import unpickle
from megalite.testing import run_parallel
from helpers import cli_in_process as cli  # `megalite ARGS` in this process

MiB = 2**20




def full_tensors() -> dict:
    """What the 2-rank job saves, as full tensors: fp32/bf16 matrices, an int64 vector, a 0-dim step."""
    g = torch.Generator().manual_seed(3)
    return {"model.wte": torch.randn(10, 6, generator=g), "model.blocks.0.w": torch.randn(4, 8, generator=g),
            "model.norm": torch.randn(6, generator=g).to(torch.bfloat16),
            "model.ids": torch.arange(7, dtype=torch.int64), "optim.step": torch.tensor(12.0)}


def _save_sharded(rank, world, tmp, out):
    """A torchtitan-style save: DTensors sharded over 2 ranks (dim 0, dim 1, replicated), plus train state."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    mesh = init_device_mesh("cpu", (world,))
    full = full_tensors()
    place = {"model.wte": Shard(0), "model.blocks.0.w": Shard(1), "model.norm": Replicate()}
    sd = {}
    for k, t in full.items():
        if k in place:
            p = place[k]
            local = t if isinstance(p, Replicate) else t.chunk(world, dim=p.dim)[rank].contiguous()
            sd[k] = DTensor.from_local(local, mesh, [p], run_check=False)
        else:
            sd[k] = t
    sd["train_state"] = {"step": 12, "note": "bytes entry"}
    dcp.save(sd, checkpoint_id=out)


@pytest.fixture(scope="module")
def sharded_dcp(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("dcp_sharded")
    run_parallel(_save_sharded, 2, d / "rdzv", args=(str(d / "ck"),))
    return d / "ck"


def plain_dcp(folder: Path) -> Path:
    """A one-process DCP checkpoint (each tensor one chunk) that a test may damage."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({**full_tensors(), "train_state": {"step": 12}}, checkpoint_id=folder)
    return folder


def st_tensors(path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


# ---------------------------------------------------------------- DCP in
def test_sharded_dcp_to_one_file_matches_the_saved_tensors_and_dcp_to_torch_save(tmp_path, sharded_dcp):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    rc, out, err = cli("convert", sharded_dcp, "--out", tmp_path / "all.safetensors")
    assert rc == 0, err
    assert "skipped 2 non-tensor entries (bytes, never unpickled): train_state." in err
    got = st_tensors(tmp_path / "all.safetensors")
    want = full_tensors()
    assert list(got) and sorted(got) == sorted(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    # torch's own converter on the same folder (it unpickles everything; fine for our own test data)
    dcp_to_torch_save(sharded_dcp, tmp_path / "ref.pt")
    ref = torch.load(tmp_path / "ref.pt", weights_only=False)
    for k in want:
        assert torch.equal(got[k], ref[k]), k
    with safe_open(str(tmp_path / "all.safetensors"), framework="pt") as f:
        assert sorted(json.loads(f.metadata()["megalite.skipped"])) == ["train_state.note", "train_state.step"]
    # --dtype casts the floating tensors only
    convert(sharded_dcp, tmp_path / "bf16.safetensors", dtype="bf16", quiet=True)
    b = st_tensors(tmp_path / "bf16.safetensors")
    assert b["model.wte"].dtype == torch.bfloat16 and b["model.ids"].dtype == torch.int64


def test_dcp_to_dcp_hf_storage_is_read_back_by_dcp(tmp_path, sharded_dcp):
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    convert(sharded_dcp, tmp_path / "hfdcp", fmt="dcp", quiet=True)
    want = full_tensors()
    sd = {k: torch.zeros_like(v) for k, v in want.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=HuggingFaceStorageReader(str(tmp_path / "hfdcp")))
    for k, t in want.items():
        assert torch.equal(sd[k], t), k


def test_region_reads_only_the_chunks_it_needs(sharded_dcp, monkeypatch):
    from megalite.convert.dcp import DcpFolder
    ck = DcpFolder(sharded_dcp)
    assert [len(ck.tensors[k].chunks) for k in ("model.wte", "model.blocks.0.w")] == [2, 2]
    loads = []
    real = ck._chunk
    monkeypatch.setattr(ck, "_chunk", lambda t, c: loads.append(c.offsets) or real(t, c))
    assert torch.equal(ck.read("model.wte", ((6, 9), (1, 4))), full_tensors()["model.wte"][6:9, 1:4])
    assert loads == [(5, 0)]  # rows 6-8 live in rank 1's chunk only
    loads.clear()
    assert torch.equal(ck.read("model.wte", ((4, 6), (0, 6))), full_tensors()["model.wte"][4:6])
    assert sorted(loads) == [(0, 0), (5, 0)]


def test_chunks_listed_out_of_order_come_back_in_place(tmp_path, sharded_dcp):
    """A .metadata may list a tensor's chunks in any order (nothing in DCP's format sorts them): the rows of a
    row-sharded tensor and the columns of a column-sharded one land at their offsets, as DCP's own loader
    puts them, whatever the listing order."""
    d = tmp_path / "ck"
    shutil.copytree(sharded_dcp, d)
    md = _metadata(d)
    for name in ("model.wte", "model.blocks.0.w"):
        md.state_dict_metadata[name].chunks.reverse()
    _write_metadata(d, md)
    assert [c.offsets[0] for c in _metadata(d).state_dict_metadata["model.wte"].chunks] == [5, 0]
    convert(d, tmp_path / "all.safetensors", quiet=True)
    got, want = st_tensors(tmp_path / "all.safetensors"), full_tensors()
    theirs = {k: torch.zeros_like(want[k]) for k in ("model.wte", "model.blocks.0.w")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(theirs, checkpoint_id=d)  # DCP's own reading of the reordered listing
    for k, t in theirs.items():
        assert torch.equal(t, want[k]) and torch.equal(got[k], want[k]), k


# ---------------------------------------------------------------- hostile and broken input
class Armed:
    """Unpickling this runs `touch MARKER` (through os.system)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _metadata(folder: Path):
    with open(folder / ".metadata", "rb") as f:
        return pickle.load(f)  # our own file, written by dcp.save above


def _write_metadata(folder: Path, md) -> None:
    (folder / ".metadata").write_bytes(pickle.dumps(md))


def _storage(md, fqn: str):
    return next((k, v) for k, v in md.storage_data.items() if k.fqn == fqn)


def _foreign_global(d: Path, marker: Path):
    md = _metadata(d)
    md.planner_data = Armed(marker)
    _write_metadata(d, md)


def _past_end(d: Path, marker: Path):
    md = _metadata(d)
    k, v = _storage(md, "model.wte")
    md.storage_data[k] = dataclasses.replace(v, length=v.length + (d / v.relative_path).stat().st_size)
    _write_metadata(d, md)


def _short_range(d: Path, marker: Path):
    """The recorded range ends 64 bytes before the blob does: the reader must not read past it."""
    md = _metadata(d)
    k, v = _storage(md, "model.wte")
    md.storage_data[k] = dataclasses.replace(v, length=v.length - 64)
    _write_metadata(d, md)


def _dotdot(d: Path, marker: Path):
    md = _metadata(d)
    k, v = _storage(md, "model.wte")
    md.storage_data[k] = dataclasses.replace(v, relative_path="../x")
    _write_metadata(d, md)


def _symlink_out(d: Path, marker: Path):
    md = _metadata(d)
    k, v = _storage(md, "model.wte")
    outside = d.parent / "outside.distcp"
    shutil.copy(d / v.relative_path, outside)
    (d / "link.distcp").symlink_to(outside)
    md.storage_data[k] = dataclasses.replace(v, relative_path="link.distcp")
    _write_metadata(d, md)


def _truncated(d: Path, marker: Path):
    f = next(d.glob("*.distcp"))
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _armed_chunk(d: Path, marker: Path):
    """The bytes of one chunk replaced by a torch.save of an object whose unpickling runs os.system."""
    md = _metadata(d)
    k, v = _storage(md, "model.wte")
    buf = io.BytesIO()
    torch.save({"x": Armed(marker)}, buf)
    f = d / v.relative_path
    start = f.stat().st_size
    with open(f, "ab") as fh:
        fh.write(buf.getvalue())
    md.storage_data[k] = dataclasses.replace(v, offset=start, length=len(buf.getvalue()))
    _write_metadata(d, md)


def _extension(d: Path, marker: Path):
    md = _metadata(d)
    k, v = _storage(md, "model.wte")
    md.storage_data[k] = dataclasses.replace(v, transform_descriptors=["stream_zstd"])
    _write_metadata(d, md)


def _overlap(d: Path, marker: Path):
    md = _metadata(d)
    e = md.state_dict_metadata["model.wte"]
    e.chunks.append(copy.deepcopy(e.chunks[0]))
    _write_metadata(d, md)


def _garbage(d: Path, marker: Path):
    (d / ".metadata").write_bytes(b"\x80\x04not a pickle at all" * 3)


BAD = {"foreign global": (_foreign_global, r"the pickle names 'posix\.system', which is not one of the classes"),
       "past the end": (_past_end, r"model\.wte.* end past the file's \d+ bytes"),
       "short range": (_short_range, r"bytes \d+-\d+ \(chunk \[0, 0\] of 'model\.wte'\) are not a tensor that"),
       "dotdot": (_dotdot, r"relative_path = '\.\./x' points outside the checkpoint folder"),
       "symlink": (_symlink_out, r"chunk file 'link\.distcp' resolves to .*outside\.distcp, outside the checkpoint"),
       "truncated": (_truncated, r"(end past the file's \d+ bytes|are not a tensor that torch\.load)"),
       "armed chunk": (_armed_chunk, r"are not a tensor that torch\.load\(weights_only=True\) reads"),
       "extension": (_extension, r"storage extension\(s\) \['stream_zstd'\]"),
       "overlap": (_overlap, r"tensor 'model\.wte': its 2 chunk\(s\) hold 120 elements, the tensor .* has 60"),
       "garbage": (_garbage, r"\.metadata: not a readable DCP index")}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_dcp_is_one_line_and_nothing_is_written_or_run(tmp_path, case):
    damage, pattern = BAD[case]
    src = plain_dcp(tmp_path / "src")
    marker = tmp_path / "PWNED"
    damage(src, marker)
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    rc, stdout, err = cli("convert", src, "--out", out)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("megalite convert: error: "), err
    assert re.search(pattern, lines[0]), lines[0]
    assert list(out.parent.iterdir()) == [], "something was written next to --out"
    assert not marker.exists(), "the pickle ran"
    # a good output already there survives a failed --force
    out.write_bytes(b"good")
    assert cli("convert", src, "--out", out, "--force")[0] == 2 and out.read_bytes() == b"good"


def test_the_armed_metadata_really_runs_under_plain_pickle(tmp_path):
    """The foreign-global case is armed: plain pickle.load (what torch's FileSystemReader does) runs it."""
    src = plain_dcp(tmp_path / "src")
    marker = tmp_path / "PWNED"
    _foreign_global(src, marker)
    with open(src / ".metadata", "rb") as f:
        pickle.load(f)  # our own payload: `touch` in tmp_path
    assert marker.exists()


@pytest.mark.parametrize("opcodes", ["GLOBAL (protocol 0)", "INST", "STACK_GLOBAL", "EXT1", "persistent id"])
def test_the_unpickler_refuses_every_way_of_naming_a_callable(tmp_path, opcodes):
    import copyreg
    marker = tmp_path / "PWNED"
    cmd = f"touch {marker}".encode()
    arg = b"X" + len(cmd).to_bytes(4, "little") + cmd  # BINUNICODE
    data = {"GLOBAL (protocol 0)": b"cposix\nsystem\n(S'" + cmd + b"'\ntR.",
            "INST": b"(S'" + cmd + b"'\niposix\nsystem\n.",
            "STACK_GLOBAL": pickle.dumps(Armed(marker), protocol=4),
            "EXT1": b"\x80\x02\x82\xf0" + arg + b"\x85R.",  # the extension registry's code 240
            "persistent id": b"\x80\x02X\x03\x00\x00\x00abcQ."}[opcodes]
    copyreg.add_extension("posix", "system", 240)  # an attacker would need it registered; we grant that
    try:
        with pytest.raises(Exception) as e:
            unpickle.load(data, unpickle.DCP_METADATA)
    finally:
        copyreg.remove_extension("posix", "system", 240)
    assert isinstance(e.value, (unpickle.RefusedGlobal, pickle.UnpicklingError))
    if not opcodes.startswith("persistent"):
        assert e.value.name == "posix.system"
    assert not marker.exists()


def test_source_and_format_errors_are_one_line(tmp_path, sharded_dcp):
    cases = [(["--from", "megatron"], r"--from megatron: .* has no metadata\.json"),
             (["--format", "hf-gpt2"], r"--format hf-gpt2: .* is a plain DCP checkpoint"),
             (["--vocab-size", "5"], r"--vocab-size: only for a Megatron checkpoint"),
             (["--from", "zarr"], r"--from 'zarr': expected one of megalite, dcp, megatron")]
    for extra, pattern in cases:
        rc, _, err = cli("convert", sharded_dcp, "--out", tmp_path / "x", *extra)
        assert rc == 2 and len(err.strip().splitlines()) == 1 and re.search(pattern, err), (extra, err)
        assert not (tmp_path / "x").exists()
    rc, _, err = cli("convert", tmp_path, "--from", "dcp", "--out", tmp_path / "y")
    assert rc == 2 and "--from dcp:" in err and "has no .metadata" in err


# ---------------------------------------------------------------- DCP out
SMALL = dict(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=40, dropout=0.0)


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory) -> Path:
    """A (2,2,1) megalite checkpoint of random weights (split of a made-up model file: no training)."""
    d = tmp_path_factory.mktemp("dcp_out")
    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(p.global_shape, generator=g) for n, p in model_partitions(SMALL).items()}
    save_file(tensors, str(d / "model.safetensors"),
              metadata={"format": "pt", "megalite.model_config": json.dumps(SMALL, sort_keys=True)})
    return split(d / "model.safetensors", d / "ck", 2, 2, 1, quiet=True).parent


def _load_sharded(rank, world, tmp, folder, full_path):
    """torchtitan's view: each rank holds DTensor shards of the model and asks DCP to fill them."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    mesh = init_device_mesh("cpu", (world,))
    full = st_tensors(full_path)
    sd = {k: DTensor.from_local(torch.zeros_like(v.chunk(world, 0)[rank]), mesh, [Shard(0)], run_check=False)
          for k, v in full.items() if v.dim() and v.shape[0] % world == 0}
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(folder))
    for k, v in sd.items():
        assert torch.equal(v.to_local(), full[k].chunk(world, 0)[rank]), k
    dist.barrier()


def test_megalite_to_dcp_loads_back_whole_and_sharded(tmp_path, small_ckpt):
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    rc, out, err = cli("convert", small_ckpt, "--format", "dcp", "--out", tmp_path / "dcp")
    assert rc == 0, err
    assert sorted(p.name for p in (tmp_path / "dcp").iterdir()) == ["model-00001-of-00001.safetensors",
                                                                     "model.safetensors.index.json"]
    ref = convert(small_ckpt, tmp_path / "ref.safetensors", quiet=True)
    want = st_tensors(ref)
    sd = {k: torch.zeros_like(v) for k, v in want.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=HuggingFaceStorageReader(str(tmp_path / "dcp")))
    assert sorted(sd) == sorted(model_partitions(SMALL))
    for k, v in want.items():
        assert torch.equal(sd[k], v), k
    index = json.loads((tmp_path / "dcp" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(want)
    run_parallel(_load_sharded, 2, tmp_path / "rdzv", args=(str(tmp_path / "dcp"), str(ref)))


# ---------------------------------------------------------------- bounded memory
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc/PID/status RssAnon")
def test_dcp_convert_streams_one_tensor_at_a_time(tmp_path):
    from test_convert_memory import peak_anon_kib
    n, rows, cols = 24, 1024, 1024  # 24 tensors of 4 MiB, each saved as two chunks
    g = torch.Generator().manual_seed(1)
    sd = {f"w{i}": torch.randn(rows, cols, generator=g) for i in range(n)}
    model_bytes, largest = n * rows * cols * 4, rows * cols * 4
    src = tmp_path / "dcp"
    src.mkdir()
    halves = {f"w{i}": [t[: rows // 2].clone(), t[rows // 2:].clone()] for i, t in enumerate(sd.values())}
    _save_two_chunk_dcp(src, halves, rows, cols)
    limit = 2 * largest + 32 * MiB  # a tensor being assembled + one chunk + writer buffers
    assert model_bytes > 2 * limit
    base, _ = peak_anon_kib([sys.executable, "-c", "import time, torch, safetensors, einops, megalite.cli, "
                            "megalite.convert; time.sleep(0.5)"])
    out = tmp_path / "out.safetensors"
    conv, _ = peak_anon_kib([sys.executable, "-m", "megalite", "convert", str(src), "--out", str(out), "--quiet"])
    growth = (conv - base) * 1024
    assert growth < limit, (f"DCP convert: +{growth / MiB:.0f} MiB anonymous memory for a {model_bytes / MiB:.0f} "
                            f"MiB checkpoint (largest tensor {largest / MiB:.0f} MiB, allowed +{limit / MiB:.0f})")
    got = st_tensors(out)
    for k, t in sd.items():
        assert torch.equal(got[k], t), k


def _save_two_chunk_dcp(folder: Path, halves: dict, rows: int, cols: int) -> None:
    """A DCP folder as two ranks write it (row halves of every tensor in __0_0 / __1_0), built with DCP's
    own metadata classes and torch.save blobs, without a process group."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)
    entries, storage = {}, {}
    for r in range(2):
        with open(folder / f"__{r}_0.distcp", "wb") as f:
            for name, parts in halves.items():
                off = torch.Size([r * rows // 2, 0])
                start = f.tell()
                torch.save(parts[r], f)
                storage[MetadataIndex(name, off)] = _StorageInfo(f"__{r}_0.distcp", start, f.tell() - start)
    for name in halves:
        chunks = [ChunkStorageMetadata(torch.Size([r * rows // 2, 0]), torch.Size([rows // 2, cols]))
                  for r in range(2)]
        entries[name] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([rows, cols]),
                                              chunks)
    (folder / ".metadata").write_bytes(pickle.dumps(Metadata(entries, storage_data=storage)))


def test_tiling_is_checked():
    from megalite.convert.dcp import Chunk, TensorInfo, _check_tiling
    c = lambda off, size: Chunk(off, size, "f", 0, 1)  # noqa: E731
    _check_tiling(TensorInfo("t", torch.float32, (10, 6), [c((0, 0), (4, 6)), c((4, 0), (6, 6))]), "t")
    with pytest.raises(ConvertError, match=r"chunks at \(0, 0\)|chunks at \[0, 0\] and \[4, 0\] overlap"):
        _check_tiling(TensorInfo("t", torch.float32, (10, 6), [c((0, 0), (6, 6)), c((4, 0), (4, 6))]), "t")
    with pytest.raises(ConvertError, match=r"hold 24 elements, the tensor of size \[10, 6\] has 60"):
        _check_tiling(TensorInfo("t", torch.float32, (10, 6), [c((0, 0), (4, 6))]), "t")
    with pytest.raises(ConvertError, match=r"reaches past the tensor's size"):
        _check_tiling(TensorInfo("t", torch.float32, (10, 6), [c((0, 0), (4, 6)), c((4, 0), (7, 6))]), "t")


def test_a_chunk_window_reads_exactly_its_range(tmp_path):
    from megalite.convert.dcp import _Window
    f = tmp_path / "f"
    f.write_bytes(bytes(range(40)))
    fd = os.open(f, os.O_RDONLY)
    try:
        w = io.BufferedReader(_Window(fd, 10, 5))
        assert w.read() == bytes(range(10, 15)) and w.read(3) == b""
        assert w.seek(0, io.SEEK_END) == 5 and w.seek(2) == 2 and w.read(10) == bytes(range(12, 15))
    finally:
        os.close(fd)
