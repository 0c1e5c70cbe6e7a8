"""Every file a reader of megalite opens goes through base/fs's safe open (issue 42, item 5): a FIFO, a device or a
socket is refused at open (O_NONBLOCK, then the regular-file check), never waited on; a symlink to a regular
file is followed where the user named the path or a Hugging Face cache links it (its snapshots are links into
its blobs).

    the scan           no open of a file in the package outside base/fs.py (builtin open for reading, Path.read_*,
                       os.open, and the libraries that open by name: numpy, torch, safetensors, pyarrow, zipfile,
                       tokenizers, transformers), but through an fs opener; a short allow-list, each entry justified
    a FIFO per reader  one per class of reader (tokenizer files, chat templates and generation_config.json, DCP's
                       index and chunks, Megatron's files, jsonl / parquet / text / chat corpora, TOML and JSON
                       configs, token files and masks, metrics.jsonl, a folder transformers reads): refused in one
                       line naming the file, within a second (a hang is cut by SIGALRM), nothing written

Planted for the commit that added this: base/corpus.py's jsonl reader back on `open(path, "rb")` -> the scan names
megalite/base/corpus.py and the jsonl FIFO case fails (SIGALRM: the reader waited on the FIFO).
"""
from __future__ import annotations

import ast
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from megalite.base.errors import MegaliteError

ROOT = Path(__file__).resolve().parents[1] / "megalite"

# ---------------------------------------------------------------- the scan
# a library function that opens the file named by its first argument
BY_NAME = {"memmap", "fromfile", "load", "safe_open", "ParquetFile", "read_table", "ZipFile", "from_file",
           "from_pretrained"}
# base/fs's openers (and the checks that stand for one before a library reads a folder itself)
FS_OPENERS = {"open_read", "open_regular", "read_all", "by_descriptor", "open_safetensors", "special_entries_refused"}
# (file, call) -> why it is no reader of a user's file
ALLOWED = {
    ("megalite/base/fs.py", "*"): "the safe open itself",
    ("megalite/testing.py", "read_text"): "a rank's stack dump that run_parallel's worker wrote itself",
    ("megalite/convert/dcp.py", "load"): "torch.load of a window of a descriptor DcpFolder._open took from open_regular",
    ("megalite/convert/dcp.py", "ZipFile"): "a window of a descriptor DcpFolder._open took from open_regular",
    ("megalite/cli.py", "os.open"): "os.devnull opened for writing (stdout's reader is gone)",
    ("megalite/bench/__init__.py", "open"): "/proc/self/status and the benchmark's own files in its temporary folder",
    ("megalite/bench/__init__.py", "os.open"): "the benchmark's own files (fsync, drop from the page cache)",
    ("megalite/bench/ckpt.py", "load"): "torch.load of all.pt the benchmark wrote a line before",
    ("megalite/bench/ckpt.py", "os.open"): "an fsync of the benchmark's own output",
    ("megalite/bench/ckpt.py", "read_text"): "result.json the benchmark's own run wrote",
    ("megalite/bench/prepare.py", "fromfile"): "the token file `prepare` wrote a line before",
    ("megalite/bench/generate.py", "from_pretrained"): "the model folder the benchmark saved in its temporary folder",
    **{(f"megalite/bench/{f}.py", c): "the JSON result the benchmark's own workers wrote in its temporary folder"
       for f in ("llama", "memory", "features", "context", "train") for c in ("open", "load")},
}


def _call_name(node: ast.Call) -> str:
    f = node.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        if isinstance(f.value, ast.Name) and f.value.id == "os" and f.attr == "open":
            return "os.open"
        return f.attr
    return ""


def _mode(node: ast.Call) -> str:
    mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"), None)
    return mode.value if isinstance(mode, ast.Constant) and isinstance(mode.value, str) else "r"


def _names_in(node) -> set:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _calls_in(node) -> set:
    return {_call_name(n) for n in ast.walk(node) if isinstance(n, ast.Call)}


def _safe_names(fn) -> set:
    """Names a function binds from an fs opener (or from a name so bound): `with open_read(p) as f`,
    `fd = open_regular(...)`, `proc = f"/proc/self/fd/{fd}"`."""
    safe, changed = set(), True
    while changed:
        changed = False
        for n in ast.walk(fn):
            pairs = []
            if isinstance(n, ast.Assign):
                pairs = [(t, n.value) for t in n.targets]
            elif isinstance(n, (ast.With, ast.AsyncWith)):
                pairs = [(i.optional_vars, i.context_expr) for i in n.items if i.optional_vars is not None]
            for target, value in pairs:
                if _calls_in(value) & FS_OPENERS or _names_in(value) & safe:
                    new = _names_in(target) - safe
                    if new:
                        safe |= new
                        changed = True
    return safe


def raw_opens(path: Path, rel: str) -> list[str]:
    """'file:line call' for each open in `path` that goes around base/fs."""
    tree = ast.parse(path.read_text())
    found = []
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    scope = {}
    for fn in functions:  # innermost function wins: walked outer first, inner later
        for n in ast.walk(fn):
            scope[id(n)] = fn
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _call_name(node)
        if (rel, "*") in ALLOWED or (rel, name) in ALLOWED:
            continue
        fn = scope.get(id(node))
        if name == "open" and isinstance(node.func, ast.Name):
            raw = not any(c in _mode(node) for c in "wax")  # reading (writers are not this rule's)
        elif name in ("read_text", "read_bytes", "os.open") or (name == "open" and not node.args):  # Path.open()
            raw = True
        elif name in BY_NAME and node.args:
            first = node.args[0]
            raw = not (_calls_in(first) & FS_OPENERS or (fn is not None and _names_in(first) & _safe_names(fn)))
            if name == "from_pretrained":  # a folder the library reads by itself: checked for FIFOs first
                raw = fn is None or "special_entries_refused" not in _calls_in(fn)
            owner = getattr(node.func.value, "id", "") if isinstance(node.func, ast.Attribute) else ""
            if name == "load" and owner not in ("json", "tomllib", "np", "numpy", "torch", "pickle"):
                raw = False  # unpickle.load of bytes already read: no file
        else:
            raw = False
        if raw:
            found.append(f"{rel}:{node.lineno} {name}")
    return sorted(found, key=lambda f: int(f.split(":")[1].split(" ")[0]))


def test_no_reader_opens_a_file_outside_base_fs():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        found += raw_opens(path, str(path.relative_to(ROOT.parent)))
    assert not found, "opens around base/fs's safe open (route them through open_read / read_all / " \
                      "by_descriptor, or justify them in ALLOWED):\n" + "\n".join(found)


def test_the_scan_sees_a_raw_open(tmp_path):
    """The scan's own check: each shape of a raw read is found, each routed one is not."""
    bad = tmp_path / "bad.py"
    bad.write_text("import numpy as np, json\nfrom pathlib import Path\n"
                   "def a(p):\n    with open(p, 'rb') as f:\n        return f.read()\n"
                   "def b(p):\n    return Path(p).read_bytes()\n"
                   "def c(p):\n    return np.memmap(p, mode='r')\n"
                   "def d(p):\n    with open(p) as f:\n        return json.load(f)\n"
                   "def e(p):\n    with open_read(p) as f:\n        return np.memmap(f, mode='r')\n"
                   "def g(p):\n    with by_descriptor(p) as name:\n        return safe_open(name)\n"
                   "def h(p):\n    with open(p, 'wb', opener=no_follow) as f:\n        f.write(b'')\n")
    got = [line.split(" ")[1] for line in raw_opens(bad, "x.py")]
    assert got == ["open", "read_bytes", "memmap", "open", "load"], got


# ---------------------------------------------------------------- a FIFO in each reader's place
class Blocked(Exception):
    """The reader waited on the FIFO (SIGALRM cut it)."""


def _blocked(signum, frame):
    raise Blocked("the reader blocked on the FIFO")


def _listing(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_size if p.is_file() else None) for p in folder.rglob("*")}


def _fifo(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def _dcp(folder: Path) -> Path:
    import torch.distributed.checkpoint as dcp
    dcp.save({"w": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=str(folder), no_dist=True)
    return folder


def _chunk_fifo(tmp):
    folder = _dcp(tmp / "dcp")
    chunk = next(folder.glob("*.distcp"))
    chunk.unlink()
    _fifo(chunk)
    from megalite.convert.dcp import DcpFolder
    return lambda: DcpFolder(folder), chunk.name


def _index_fifo(tmp):
    folder = _dcp(tmp / "dcp")
    (folder / ".metadata").unlink()
    _fifo(folder / ".metadata")
    from megalite.convert.dcp import read_index
    return lambda: read_index(folder), ".metadata"


def _megatron(tmp, fifo: str):
    from megalite.convert import megatron
    if fifo == "latest_checkpointed_iteration.txt":  # a root naming its iteration folder
        _fifo(tmp / "m" / fifo)
        return lambda: megatron.iteration_folder(tmp / "m"), fifo
    step = tmp / "iter_0000010"
    step.mkdir()
    if fifo != "metadata.json":
        (step / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    _fifo(step / fifo)
    return lambda: megatron.read_args(step), fifo


def _in_folder(name, call, *files):
    """A folder holding `files` (name -> text) and a FIFO at `name`; `call(folder)` reads it."""
    def setup(tmp):
        folder = tmp / "f"
        folder.mkdir()
        for fname, text in files:
            (folder / fname).write_text(text)
        _fifo(folder / name)
        return lambda: call(folder), name
    return setup


def _alone(name, call):
    """A FIFO named `name`, read by call(path)."""
    def setup(tmp):
        path = _fifo(tmp / name)
        return lambda: call(path), name
    return setup


def _token_file(tmp, fifo: str):
    from megalite.data import TokenDataset
    import numpy as np
    meta = {"format": "megalite-tokens", "version": 1, "dtype": "uint16", "num_tokens": 8, "val_start": 6,
            "vocab_size": 256}
    from megalite.data import FORMAT, VERSION
    meta.update(format=FORMAT, version=VERSION)
    if fifo == "t.mask.bin":
        meta["loss_mask"] = {"file": "t.mask.bin", "counted": 8}
    np.arange(8, dtype=np.uint16).tofile(tmp / "t.bin")
    (tmp / "t.json").write_text(json.dumps(meta))
    (tmp / fifo).unlink(missing_ok=True)
    _fifo(tmp / fifo)
    return lambda: TokenDataset(tmp / "t.bin", "train"), fifo


def _tokenizer_load(folder):
    from megalite.tokenizer import load
    return load(folder)


def _folder_files(folder):
    from megalite.generate.prompt import folder_files
    return folder_files(folder)


def _origin(folder):
    from megalite.base.origin import Origin
    return Origin.of_folder(folder, {}, None, None)


def _chat_tokenizer(folder):
    from megalite.data.chat import chat_tokenizer
    return chat_tokenizer(folder)


def _records(path):
    from megalite.base.corpus import records
    return list(records(path))


def _pieces(path):
    from megalite.tokenizer import read_text_pieces
    return list(read_text_pieces(path))


def _conversations(path):
    from megalite.data.chat import _conversations
    return list(_conversations([path], "messages"))


def _toml(path):
    from megalite.config import load_config
    return load_config(path)


def _hints(path):
    from megalite.convert import hints as hn
    return hn.merge_config(hn.Hints(), path)


def _hf_folder(folder):
    from megalite.convert.hf import HFFolder
    return HFFolder(folder)


def _metrics(folder):
    from megalite.run.metrics import _lines
    return _lines(folder)


READERS = {
    "tokenizer.json": _in_folder("tokenizer.json", _tokenizer_load),
    "merges.txt": _in_folder("merges.txt", _tokenizer_load, ("vocab.json", '{"a": 0, "b": 1}')),
    "tokenizer_config.json": _in_folder("tokenizer_config.json", _folder_files),
    "chat_template.jinja": _in_folder("chat_template.jinja", _folder_files),
    "generation_config.json": _in_folder("generation_config.json", _origin),
    "a folder transformers reads": _in_folder("tokenizer_config.json", _chat_tokenizer, ("tokenizer.json", "{}")),
    "dcp .metadata": _index_fifo,
    "dcp .distcp": _chunk_fifo,
    "megatron latest": lambda tmp: _megatron(tmp, "latest_checkpointed_iteration.txt"),
    "megatron metadata.json": lambda tmp: _megatron(tmp, "metadata.json"),
    "megatron common.pt": lambda tmp: _megatron(tmp, "common.pt"),
    "jsonl corpus": _alone("c.jsonl", _records),
    "parquet corpus": _alone("c.parquet", _records),
    "text corpus": _alone("c.txt", _pieces),
    "chat corpus": _alone("c.jsonl", _conversations),
    "--config TOML": _alone("c.toml", _toml),
    "convert --config JSON": _alone("config.json", _hints),
    "HF config.json": _in_folder("config.json", _hf_folder),
    "token file .bin": lambda tmp: _token_file(tmp, "t.bin"),
    "token file .json": lambda tmp: _token_file(tmp, "t.json"),
    "loss mask": lambda tmp: _token_file(tmp, "t.mask.bin"),
    "metrics.jsonl": _in_folder("metrics.jsonl", _metrics),
}


@pytest.mark.parametrize("reader", READERS)
def test_a_fifo_in_a_readers_place_is_refused_at_once(tmp_path, reader):
    if reader == "parquet corpus":
        pytest.importorskip("pyarrow")
    if reader == "a folder transformers reads":
        pytest.importorskip("transformers").AutoTokenizer  # imported before the clock starts (seconds)
    call, name = READERS[reader](tmp_path)
    before = _listing(tmp_path)
    old = signal.signal(signal.SIGALRM, _blocked)
    signal.alarm(5)
    t0 = time.monotonic()
    try:
        with pytest.raises((MegaliteError, OSError)) as e:
            call()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    took, msg = time.monotonic() - t0, str(e.value)
    assert took < 1.0, (reader, took)
    assert "\n" not in msg and "named pipe" in msg and name in msg, (reader, msg)
    assert _listing(tmp_path) == before  # nothing written
