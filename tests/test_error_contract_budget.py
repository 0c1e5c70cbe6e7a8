"""The error contract, round four (issue 29, items 1-3), in the matrix style of test_error_contract.py: files
from elsewhere are read within a budget (megalite/limits.py), no user file is lost, nothing is written outside
the run folder. Each crafted input is one line on stderr, exit 2, no traceback, nothing written or moved.

The inputs attack each bound, not one example: the largest claim a field can hold (a memo index of 2**32 - 1,
2**31 - 1 layers, a shape of 2**62 elements) and a second just past the bound. Those that would cost memory,
time or a crash without their bound (SIGSEGV on nested tuples, gigabytes from a memo index, a DEFLATE record,
a layer count, text without a space) also run in one subprocess that measures each case's peak resident memory
(VmHWM, reset before each case) against BUDGET_MIB over the memory it had before the case.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import helpers as H
from test_error_contract import _snapshot, assert_one_line, run_cli, world  # noqa: F401
from test_error_contract_files import GUARD_S, _blocked  # noqa: F401

BUDGET_MIB = 192  # what a refused input may cost beyond the process's memory before it: the bombs claim >= 250
BOMB = 250 << 20  # bytes a DEFLATE record inflates to


# ---------------------------------------------------------------- crafted foreign checkpoints
def _plain_dcp(folder: Path) -> Path:
    import torch.distributed.checkpoint as dcp
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model.wte": torch.randn(10, 6, generator=g), "model.b": torch.randn(4, generator=g),
                  "train_state": {"step": 1}}, checkpoint_id=folder)
    return folder


def _md(folder: Path):
    return pickle.loads((folder / ".metadata").read_bytes())  # our own file, just written by dcp.save


def _dcp(edit=None, raw=None):
    """A DCP folder at <case>/dcp whose .metadata is edited (`edit(md)`), or its pickle bytes (`raw(bytes)`)."""
    def setup(w, case):
        d = _plain_dcp(case / "dcp")
        if edit is not None:
            md = _md(d)
            edit(md, d)
            (d / ".metadata").write_bytes(pickle.dumps(md, protocol=2))  # no frames: bytes may be spliced
        if raw is not None:
            (d / ".metadata").write_bytes(raw((d / ".metadata").read_bytes()))
    return setup


def _storage(md, fqn: str):
    return next((k, v) for k, v in md.storage_data.items() if k.fqn == fqn)


def _set_storage(**change):
    def edit(md, d):
        import dataclasses
        k, v = _storage(md, "model.wte")
        md.storage_data[k] = dataclasses.replace(v, **change)
    return edit


def _memo_index(index: int):
    """A LONG_BINPUT of `index` right after the protocol opcode (memoizes None, then pops it)."""
    return lambda data: data[:2] + b"N" + b"r" + index.to_bytes(4, "little") + b"0" + data[2:]


PLACEHOLDER = "NESTED_HERE_0123"


def _nested_key(depth: int):
    """A state_dict_metadata key that is `depth` nested 1-tuples: the unpickler hashes it (a dict key) at load,
    which recurses in C without a guard."""
    def edit(md, d):
        md.state_dict_metadata[PLACEHOLDER] = md.state_dict_metadata["model.b"]
    marker = b"X" + len(PLACEHOLDER).to_bytes(4, "little") + PLACEHOLDER.encode()

    def setup(w, case):
        _dcp(edit)(w, case)
        p = case / "dcp" / ".metadata"
        data = p.read_bytes()
        assert data.count(marker) == 1
        p.write_bytes(data.replace(marker, b")" + b"\x85" * depth))  # EMPTY_TUPLE, then TUPLE1 x depth
    return setup


def _huge_shape(md, d):
    """model.b declared (2**31, 2**31) with one chunk of that size over its 16 stored bytes."""
    e = md.state_dict_metadata["model.b"]
    e.size = torch.Size([2**31, 2**31])
    e.chunks[0].sizes = torch.Size([2**31, 2**31])
    e.chunks[0].offsets = torch.Size([0, 0])
    k, v = _storage(md, "model.b")
    del md.storage_data[k]
    import dataclasses
    md.storage_data[dataclasses.replace(k, offset=torch.Size([0, 0]))] = v


def _deflate_chunk(md, d):
    """model.wte's bytes replaced by a torch.save archive whose data record is DEFLATE-compressed and inflates
    to BOMB bytes (its index still says a (10, 6) float32 tensor)."""
    buf = io.BytesIO()
    torch.save(torch.zeros(10, 6), buf)
    out = io.BytesIO()  # the record compressed as zipfile streams it: the test never holds BOMB bytes
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, zipfile.ZipFile(out, "w") as z:
        for info in src.infolist():
            if info.filename.endswith("/data/0"):
                zi = zipfile.ZipInfo(info.filename)
                zi.compress_type = zipfile.ZIP_DEFLATED
                with z.open(zi, "w", force_zip64=True) as f:
                    f.write(src.read(info))
                    zeros = bytes(1 << 20)
                    for _ in range(BOMB >> 20):
                        f.write(zeros)
            else:
                z.writestr(info, src.read(info))
    (d / "bomb.distcp").write_bytes(out.getvalue())
    _set_storage(relative_path="bomb.distcp", offset=0, length=len(out.getvalue()))(md, d)


def _surrogate_name(md, d):
    md.state_dict_metadata["model.\udcff"] = md.state_dict_metadata.pop("model.b")
    k, v = _storage(md, "model.b")
    del md.storage_data[k]
    import dataclasses
    md.storage_data[dataclasses.replace(k, fqn="model.\udcff")] = v


def _unhashable_fqn(md, d):
    k, v = _storage(md, "model.b")
    k.__dict__["fqn"] = ["model", "b"]  # a frozen dataclass: set as pickle would


def _megatron(layers: int = 2, common=None, latest=None, meta=None, **args):
    """A Megatron-LM torch_dist folder at <case>/mg: metadata.json, common.pt (its args) and a DCP index with
    the word embeddings and one stacked decoder.layers tensor of `layers` layers (all a budget check reads)."""
    def setup(w, case):
        sys.path.insert(0, str(Path(__file__).parent))
        try:
            from megatron_ref import megatron_args
        finally:
            sys.path.pop(0)
        root = case / "mg"
        step = root / "iter_0000010"
        step.mkdir(parents=True)
        import torch.distributed.checkpoint as dcp
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"embedding.word_embeddings.weight": torch.zeros(8, 16),
                      "decoder.layers.self_attention.linear_qkv.weight": torch.zeros(layers, 48, 16)},
                     checkpoint_id=step)
        (step / "metadata.json").write_text(meta if meta is not None else json.dumps({"sharded_backend": "torch_dist"}))
        a = megatron_args(**{**dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=64,
                                    kv_channels=4, num_query_groups=4, max_position_embeddings=8), **args})
        if common is not None:
            common(step / "common.pt", a)
        else:
            torch.save({"args": a, "iteration": 10}, step / "common.pt")
        (root / "latest_checkpointed_iteration.txt").write_text(latest if latest is not None else "10")
    return setup


def _compressed_common(path: Path, args) -> None:
    """common.pt whose data.pkl is DEFLATE-compressed and inflates to BOMB bytes (a STOP, then zeros)."""
    buf = io.BytesIO()
    torch.save({"args": args}, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, zipfile.ZipFile(path, "w") as z:
        for info in src.infolist():
            if info.filename.endswith("/data.pkl"):
                zi = zipfile.ZipInfo(info.filename)
                zi.compress_type = zipfile.ZIP_DEFLATED
                with z.open(zi, "w", force_zip64=True) as f:
                    f.write(src.read(info))
                    zeros = bytes(1 << 20)
                    for _ in range(BOMB >> 20):
                        f.write(zeros)
            else:
                z.writestr(info, src.read(info))


def _hf(**change):
    def setup(w, case):
        shutil.copytree(w["hf"], case / "hf")
        cfg = json.loads((case / "hf" / "config.json").read_text())
        cfg.update(change)
        (case / "hf" / "config.json").write_text(json.dumps(cfg))
    return setup


def _hf_text(text: str):
    def setup(w, case):
        shutil.copytree(w["hf"], case / "hf")
        (case / "hf" / "config.json").write_text(text)
    return setup


def _nested_json(depth: int) -> str:
    return "[" * depth + "]" * depth


def _write(**files):
    def setup(w, case):
        for name, text in files.items():
            (case / name).parent.mkdir(parents=True, exist_ok=True)
            (case / name).write_text(text)
    return setup


def _word_level(w, case):
    from tokenizers import Tokenizer, models, pre_tokenizers
    t = Tokenizer(models.WordLevel(vocab={"a": 0, "b": 1}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    (case / "tok.json").write_text(t.to_str())
    (case / "a.txt").write_text("a b c\n")


def _bpe_holes(top: int):
    def setup(w, case):
        from tokenizers import Tokenizer, models
        vocab = {chr(c): i for i, c in enumerate(range(97, 123))}
        vocab["ab"] = 26
        d = json.loads(Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")])).to_str())
        d["model"]["vocab"]["ab"] = top  # edited as text: the library walks every id up to the largest to write it
        (case / "tok.json").write_text(json.dumps(d))
        (case / "a.txt").write_text("ab ab\n")
    return setup


def _bpe(**files):
    """A tiny BPE tokenizer folder at <case>/tok (trained here), and `files`."""
    def setup(w, case):
        from megalite.tokenizer import train_bpe, write_hf_folder
        (case / "tok").mkdir()
        write_hf_folder(train_bpe(["some text, some more text " * 50], 300), case / "tok", None)
        _write(**files)(w, case)
    return setup


def _no_space_text(mib: int):
    """A BPE tokenizer (trained here, tiny) and `mib` MiB of lower-case letters without any word boundary."""
    def setup(w, case):
        import random
        from megalite.tokenizer import train_bpe, write_hf_folder
        rng = random.Random(0)
        words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 7))) for _ in range(500)]
        tok = train_bpe([" ".join(rng.choice(words) for _ in range(5000))], 320)
        (case / "tok").mkdir()
        write_hf_folder(tok, case / "tok", None)
        letters = "abcdefghijklmnopqrstuvwxyz"
        chunk = "".join(rng.choice(letters) for _ in range(1 << 16))
        (case / "long.txt").write_text(chunk * (mib << 4))
    return setup


def _token_json_padded(spaces: int):
    """The world's token file with its .json padded by `spaces` spaces (still valid JSON): past the budget."""
    def setup(w, case):
        shutil.copy(w["tokens"], case / "t.bin")
        (case / "t.json").write_text(w["tokens"].with_suffix(".json").read_text() + " " * spaces)
    return setup


CONVERT = ["convert", "{case}/dcp", "--out", "{case}/out.safetensors"]
MEGATRON = ["convert", "{case}/mg", "--out", "{case}/out.safetensors"]
HF = ["split", "{case}/hf", "--tp", "1", "--pp", "1", "--dp", "1", "--out", "{case}/o"]
T = ["train", "--config", "{toml}", "--train.out_dir={case}/run", "--checkpoint.dir={case}/newck",
     "--train.tensorboard=true"]

# id, argv, fragments of the one stderr line, setup, in the budget subprocess too
CASES = [
    # DCP .metadata: the pickle's own claims (limits.check_pickle), then its fields
    ("dcp-memo-index-2**32-1", CONVERT, [".metadata", "memo index 4294967295"], _dcp(raw=_memo_index(2**32 - 1)), 1),
    ("dcp-memo-index-2**25", CONVERT, [".metadata", "memo index 33554432"], _dcp(raw=_memo_index(2**25)), 1),
    ("dcp-key-nested-10**6", CONVERT, [".metadata", "nests containers more than 64 deep"], _nested_key(10**6), 1),
    ("dcp-key-nested-65", CONVERT, [".metadata", "more than 64 deep"], _nested_key(65), 1),
    ("dcp-length-4000-digits", CONVERT, [".metadata", "integer of 1,662 bytes"],
     _dcp(_set_storage(length=10**4000)), 0),
    ("dcp-length-2**63", CONVERT, [".metadata", "storage_data['model.wte'].length", "[0, 9223372036854775807]"],
     _dcp(_set_storage(length=2**63)), 0),
    ("dcp-shape-2**62-elements", CONVERT, [".metadata", "model.b", "needs 18,446,744,073,709,551,616 bytes",
                                           "records only"], _dcp(_huge_shape), 1),
    ("dcp-length-past-the-file", CONVERT, [".distcp", "end past the file's"],
     _dcp(_set_storage(length=2**40)), 0),
    ("dcp-deflate-chunk", CONVERT, ["bomb.distcp", "is compressed", "262,144,240 bytes inflated"],
     _dcp(_deflate_chunk), 1),
    ("dcp-name-lone-surrogate", CONVERT, [".metadata", "not valid Unicode text", "surrogates not allowed"],
     _dcp(_surrogate_name), 0),
    ("dcp-fqn-unhashable", CONVERT, [".metadata", "fqn is list", "expected a tensor name"], _dcp(_unhashable_fqn), 0),
    # Megatron-LM: the iteration file, metadata.json, common.pt, the arguments against the tensors
    ("megatron-latest-superscript", MEGATRON, ["latest_checkpointed_iteration.txt", "'²'"], _megatron(latest="²"), 0),
    ("megatron-latest-5000-digits", MEGATRON, ["latest_checkpointed_iteration.txt", "more than the 4,096 megalite reads"],
     _megatron(latest="9" * 5000), 0),
    ("megatron-latest-13-digits", MEGATRON, ["latest_checkpointed_iteration.txt", "at most 12 digits"],
     _megatron(latest="1" * 13), 0),
    ("megatron-metadata-nested", MEGATRON, ["metadata.json", "nested more than 64"],
     _megatron(meta=_nested_json(10**5)), 0),
    ("megatron-num-layers-2**31-1", MEGATRON, ["args.num_layers = 2147483647", "holds 2 layers"],
     _megatron(num_layers=2**31 - 1), 1),
    ("megatron-num-layers-3", MEGATRON, ["args.num_layers = 3", "holds 2 layers"], _megatron(num_layers=3), 1),
    ("megatron-num-layers-2**31", MEGATRON, ["num_layers = 2147483648", "[1, 2147483647]"],
     _megatron(num_layers=2**31), 0),
    ("megatron-num-layers-str", MEGATRON, ["num_layers = '2'", "expected an integer"], _megatron(num_layers="2"), 0),
    ("megatron-eps-inf", MEGATRON, ["layernorm_epsilon = inf", "finite positive"],
     _megatron(layernorm_epsilon=float("inf")), 0),
    ("megatron-eps-400-digits", MEGATRON, ["common.pt", "integer of 167 bytes"],
     _megatron(layernorm_epsilon=10**400), 0),
    ("megatron-position-list", MEGATRON, ["position_embedding_type = ['rope']"],
     _megatron(position_embedding_type=["rope"]), 0),
    ("megatron-common-deflate", MEGATRON, ["common.pt", "data.pkl is compressed"],
     _megatron(common=_compressed_common), 1),
    # HF config.json against model.safetensors
    ("hf-n-layer-2**31-1", HF, ["config.json", "n_layer = 2147483647", "holds 2"], _hf(n_layer=2**31 - 1), 1),
    ("hf-n-layer-3", HF, ["config.json", "n_layer = 3", "holds 2"], _hf(n_layer=3), 1),
    ("hf-n-positions-2**31-1", HF, ["n_positions = 2147483647", "rows of wpe.weight"], _hf(n_positions=2**31 - 1), 1),
    ("hf-n-embd-other", HF, ["n_embd = 64", "columns of wte.weight"], _hf(n_embd=64), 0),
    ("hf-config-nested", HF, ["config.json", "nested more than 64"], _hf_text(_nested_json(10**5)), 0),
    ("hf-config-over-budget", HF, ["config.json", "more than the 16,777,216"], _hf_text(" " * (17 << 20)), 0),
    # tokenizers from elsewhere
    ("tokenizer-json-nested", ["prepare", "{case}/a.txt", "--tokenizer", "{case}/tok.json", "--out", "{case}/t.bin"],
     ["tok.json", "nested more than 64"], _write(**{"tok.json": _nested_json(10**5), "a.txt": "x\n"}), 0),
    ("vocab-json-nested", ["prepare", "{case}/a.txt", "--tokenizer", "{case}/g/vocab.json", "--out",
                           "{case}/t.bin"], ["vocab.json", "nested more than 64"],
     _write(**{"g/vocab.json": _nested_json(100), "g/merges.txt": "#version: 0.2\n", "a.txt": "x\n"}), 0),
    ("tokenizer-unk-not-in-vocab", ["prepare", "{case}/a.txt", "--tokenizer", "{case}/tok.json", "--out",
                                    "{case}/t.bin"], ["tok.json", "unk_token = '[UNK]' is not in its vocabulary"],
     _word_level, 0),
    ("tokenizer-ids-past-2**31", ["prepare", "{case}/a.txt", "--tokenizer", "{case}/tok.json", "--out",
                                  "{case}/t.bin"], ["tok.json", "largest token id is 2,147,483,647", "27 ids"],
     _bpe_holes(2**31 - 1), 0),
    ("tokenizer-ids-past-the-holes", ["prepare", "{case}/a.txt", "--tokenizer", "{case}/tok.json", "--out",
                                      "{case}/t.bin"], ["largest token id is 1,079", "27 ids"], _bpe_holes(1079), 0),
    ("train-token-json-over-budget", [*T, "--data.path={case}/t.bin"], ["t.json", "more than the 16,777,216"],
     _token_json_padded(17 << 20)),
    # item 3: nothing outside the run folder
    ("train-tensorboard-symlink", T, ["tensorboard", "symbolic link", "remove it"],
     lambda w, case: ((case / "run").mkdir(), (case / "run" / "tensorboard").symlink_to(case.parent))),
    ("train-wandb-symlink", [*T, "--train.wandb=true"], ["wandb", "symbolic link", "W&B", "remove it"],
     lambda w, case: ((case / "run").mkdir(), (case / "run" / "wandb").symlink_to(case.parent))),
    ("train-tensorboard-file", T, ["tensorboard", "a regular file", "real folder"],
     lambda w, case: ((case / "run").mkdir(), (case / "run" / "tensorboard").write_text("mine\n"))),
    # item 2: outputs that would replace a user's file
    ("prepare-tokenizer-copy-exists", ["prepare", "{case}/a.txt", "--tokenizer", "{case}/tok", "--out",
                                       "{case}/x.bin"], ["x.tokenizer.json", "tokenizer copy beside --out",
                                                         "already exists"],
     _bpe(**{"a.txt": "some text\n", "x.tokenizer.json": "my own notes\n"})),
    ("prepare-force-tokenizer-copy-not-ours", ["prepare", "{case}/a.txt", "--tokenizer", "{case}/tok", "--out",
                                               "{case}/x.bin", "--force"], ["x.tokenizer.json", "symbolic link"],
     lambda w, case: (_bpe(**{"a.txt": "some text\n"})(w, case), (case / "x.tokenizer.json").symlink_to(w["victim"]))),
    ("tokenizer-train-force-over-a-users-folder", ["tokenizer", "train", "{case}/a.txt", "--vocab-size", "300",
                                                   "--out", "{case}/mine", "--force"],
     ["mine", "not a tokenizer folder", "notes.txt"],
     _write(**{"a.txt": "some text\n", "mine/notes.txt": "keep me\n", "mine/tokenizer.json": "{}"})),
    ("tokenizer-train-force-over-a-symlink", ["tokenizer", "train", "{case}/a.txt", "--vocab-size", "300", "--out",
                                              "{case}/mine", "--force"], ["mine", "symbolic link"],
     lambda w, case: (_write(**{"a.txt": "some text\n"})(w, case), (case / "mine").symlink_to(w["dir"]))),
]
CASES = [c if len(c) == 5 else (*c, 0) for c in CASES]


def _case(tmp_path, world, setup):
    case = tmp_path / "case"
    case.mkdir()
    if setup is not None:
        setup(world, case)
    return case


@pytest.mark.parametrize("name,argv,fragments,setup,heavy", [pytest.param(*c, id=c[0]) for c in CASES
                                                              if not c[4]])
def test_crafted_input_is_refused_in_one_line_and_writes_nothing(tmp_path, world, capsys, monkeypatch, name, argv,
                                                                 fragments, setup, heavy):
    import signal
    case = _case(tmp_path, world, setup)
    paths = {k: str(v) for k, v in world.items()} | {"case": str(case)}
    args = [a.format(**paths) for a in argv]
    before, world_before = _snapshot(case), _snapshot(world["dir"])
    monkeypatch.chdir(case)
    old = signal.signal(signal.SIGALRM, _blocked)
    signal.alarm(GUARD_S)
    try:
        rc, out, err = run_cli(args, capsys)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert_one_line(rc, out, err, args[0], [f.format(**paths) for f in fragments])
    assert _snapshot(case) == before, "the command wrote, moved or left something"
    assert _snapshot(world["dir"]) == world_before, "the command touched its inputs (a symlink's target?)"


# ---------------------------------------------------------------- within a memory budget, in a subprocess
RUNNER = r"""
import json, os, resource, signal, sys, io, contextlib
from megalite.cli import main
import megalite.convert, megalite.data, megalite.tokenizer, safetensors.torch  # imported before the baseline

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) << 10

def alarm(*a):
    raise TimeoutError("still running after 60 s")
signal.signal(signal.SIGALRM, alarm)
results = []
for name, argv, cwd in json.loads(sys.argv[1]):
    os.chdir(cwd)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = status("VmRSS")
    err, out = io.StringIO(), io.StringIO()
    signal.alarm(60)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = main(argv)
    except BaseException as e:
        rc = f"{type(e).__name__}: {e}"
    signal.alarm(0)
    results.append([name, rc, err.getvalue(), out.getvalue(), (status("VmHWM") - base) >> 20])
    print(json.dumps(results[-1]), flush=True)
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc (VmHWM reset)")
def test_inputs_that_cost_without_their_bound_are_refused_within_a_memory_budget(tmp_path, world):
    """Each heavy case in one subprocess (its imports done first): rc 2, the one line, and a peak resident memory
    at most BUDGET_MIB above what the process held before it. Without the bounds these cost 0.5 to 64 GB, a
    SIGSEGV, or minutes."""
    heavy = [c for c in CASES if c[4]] + [
        ("prepare-2-mib-without-a-space", ["prepare", "{case}/long.txt", "--tokenizer", "{case}/tok", "--out",
                                           "{case}/t.bin"], None, _no_space_text(2), 1)]
    only = os.environ.get("MEGALITE_BUDGET_ONLY")  # a substring: one case, when planting a bug by hand
    heavy = [c for c in heavy if not only or only in c[0]]
    jobs = []
    for name, argv, fragments, setup, _ in heavy:
        case = tmp_path / name
        case.mkdir()
        setup(world, case)
        paths = {k: str(v) for k, v in world.items()} | {"case": str(case)}
        jobs.append([name, [a.format(**paths) for a in argv], str(case)])
    p = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(jobs)], env=H.env(), capture_output=True,
                       text=True, timeout=900)
    got = {r[0]: r[1:] for r in map(json.loads, p.stdout.splitlines())}
    assert len(got) == len(heavy), (p.stdout[-3000:], p.stderr[-3000:])
    for name, argv, fragments, _, _ in heavy:
        rc, err, out, peak = got[name]
        print(f"{name}: exit {rc}, peak {peak} MiB over the memory before it")  # pytest -s: the figures
        if fragments is None:  # prepare: it succeeds, within the budget, and says where it had to cut
            assert rc == 0 and "WARNING" in out and "without a space" in out, (name, rc, err, out)
        else:
            lines = err.splitlines()
            assert rc == 2 and len(lines) == 1, (name, rc, err[-2000:])
            assert all(f in lines[0] for f in fragments), (name, fragments, lines[0])
        assert peak <= BUDGET_MIB, f"{name}: {peak} MiB over the memory before it (budget {BUDGET_MIB})"


def test_prepare_without_spaces_gives_the_ids_of_the_whole_text_where_it_has_word_boundaries(tmp_path):
    """A text without whitespace but with ASCII letter/digit/punctuation boundaries (minified JSON, base64) is
    cut only there: the same ids as encoding it whole (the tokenizers library is the reference); a run with no
    boundary at all is cut at FORCED_CUT x piece_chars, never inside a special token."""
    import random
    from megalite.tokenizer import FORCED_CUT, EOT, read_text_pieces, train_bpe
    rng = random.Random(1)
    words = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 6))) for _ in range(300)]
    tok = train_bpe([" ".join(rng.choice(words) for _ in range(4000)) + " x1.y+z/w'q"], 350)
    alphabet = "abcdefgh0123456789+/=.,:;'\"{}[]"
    text = "".join(rng.choice(alphabet) for _ in range(60000)).replace("{", EOT)
    (tmp_path / "t.txt").write_text(text)
    forced = []
    pieces = list(read_text_pieces(tmp_path / "t.txt", piece_chars=1024, specials=tok.specials(),
                                   on_forced_cut=forced.append))
    assert "".join(pieces) == text and len(pieces) > 20 and not forced
    assert [i for p in pieces for i in tok.encode(p)] == tok.backend.encode(text).ids
    run = "ab" * 5000 + EOT + "ab" * 5000
    (tmp_path / "r.txt").write_text(run)
    pieces = list(read_text_pieces(tmp_path / "r.txt", piece_chars=1024, specials=(EOT,), on_forced_cut=forced.append))
    assert "".join(pieces) == run and forced and max(map(len, pieces)) <= FORCED_CUT * 1024
    assert not any(EOT[1:] in p and EOT not in p for p in pieces)  # the special token never cut


def test_a_huge_temperature_samples_the_real_vocabulary_uniformly(world):
    """--temperature 1e308 is inf in float32: padding rows' -inf / inf was NaN (a traceback). The limit of a
    huge temperature is the uniform distribution over the real ids (torch.multinomial on equal weights is the
    reference): every draw is a real id, and the draws spread over the vocabulary."""
    from megalite.generate import generate, load_model
    model = load_model(world["model"])
    model.real_vocab = 200  # as a model with padding rows beyond its tokenizer's 200 ids
    ids = generate(model, [1, 2], max_new_tokens=300, temperature=1e308, seed=0, warn=lambda m: None)[2:]
    assert all(0 <= i < 200 for i in ids) and len(set(ids)) > 100


# ---------------------------------------------------------------- item 2: no user file lost
def test_two_prepare_runs_to_one_out_the_second_to_finish_is_refused(tmp_path, monkeypatch):
    """Two writers of one --out: the first to finish wins; the second, finding what it did not see at its start,
    is refused in one line and leaves no temporary file; the first's token file is intact."""
    import megalite.data as D
    from megalite.data import TokenDataset, prepare
    from megalite.base.errors import DataError
    (tmp_path / "a.txt").write_text("first writer's text\n")
    (tmp_path / "b.txt").write_text("second\n")
    out = tmp_path / "t.bin"
    real = D._commit

    def slow_commit(o, temps, found):  # the other writer finishes while this one is at its last step
        monkeypatch.setattr(D, "_commit", real)
        prepare([tmp_path / "a.txt"], out, log=lambda *a: None, force=True)
        real(o, temps, found)

    for force in (False, True):  # with --force too: the second to finish never replaces the first's file
        monkeypatch.setattr(D, "_commit", slow_commit)
        with pytest.raises(DataError, match=r"t\.bin' was written by another process while this one ran"):
            prepare([tmp_path / "b.txt"], out, log=lambda *a: None, force=force)
        assert bytes(TokenDataset(out, "train", 0.0).tokens.astype("uint8")) == b"first writer's text\n"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "t.bin", "t.json"]


def test_tokenizer_train_force_replaces_only_its_own_folder_and_two_runs_do_not_race(tmp_path, capsys, monkeypatch):
    """--force replaces a folder `tokenizer train` wrote (recognised by its files and tokenizer_config.json); of
    two runs to one --out, the one finishing second is refused and the first's folder kept."""
    import megalite.tokenizer as Tk
    from megalite.base.errors import DataError
    (tmp_path / "a.txt").write_text("hello world, hello tokens\n" * 20)
    out = tmp_path / "tok"
    for _ in range(2):  # the second over the first's folder: it is ours, --force replaces it
        rc, _, err = run_cli(["tokenizer", "train", tmp_path / "a.txt", "--vocab-size", "300", "--out", out,
                              "--force", "--quiet"], capsys)
        assert rc == 0, err
    assert Tk.not_our_folder(out) == ""
    real = Tk.write_hf_folder

    def other_run_finishes_first(tok, folder, max_length):
        real(tok, folder, max_length)
        shutil.rmtree(out)
        out.mkdir()
        real(tok, out, max_length)
        (out / "the-other-run").write_text("")

    monkeypatch.setattr(Tk, "write_hf_folder", other_run_finishes_first)
    with pytest.raises(DataError, match=r"tok' was written by another process while this one trained"):
        Tk.train_folder([tmp_path / "a.txt"], 300, out, force=True, quiet=True)
    assert (out / "the-other-run").exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_the_demo_moves_an_earlier_run_aside_and_deletes_nothing(tmp_path):
    """launch/demo.sh once began with `rm -rf runs/demo`, deleting what the docs' converting commands wrote
    there. Now an earlier folder is moved aside, whole (the launcher stubbed: nothing trains)."""
    from test_stop_in_time import REPO, _fake_tools
    tools = _fake_tools(tmp_path / "bin")
    run = tmp_path / "demo"
    (run / "converted").mkdir(parents=True)
    (run / "converted" / "mine.safetensors").write_text("a user's file\n")
    env = {**os.environ, "PATH": f"{tools}:{os.environ['PATH']}", "RUN": str(run)}
    p = subprocess.run(["bash", str(REPO / "launch" / "demo.sh")], env=env, capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    aside = [q for q in tmp_path.iterdir() if q.name.startswith("demo.old-")]
    assert len(aside) == 1 and (aside[0] / "converted" / "mine.safetensors").read_text() == "a user's file\n", \
        (p.stdout, p.stderr)
    assert "moved the earlier" in p.stdout and "nothing is deleted" in p.stdout


def test_a_vocabulary_with_ids_past_uint16_is_stored_as_uint32(tmp_path):
    """A tokenizer listing 40,001 ids whose largest is 65,540: its size is the largest id + 1 (the count said
    uint16, and id 65,540 failed to fit), so prepare stores uint32 and reads every id back (the tokenizers
    library's own encode is the reference)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from megalite.data import TokenDataset, prepare
    from megalite.tokenizer import load
    vocab = {f"w{i}": i for i in range(40000)}
    vocab["big"], vocab["[UNK]"] = 65540, 40000
    t = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "tok.json").write_text(t.to_str())
    (tmp_path / "a.txt").write_text("big w1 w39999 big\n")
    assert load(tmp_path / "tok.json").vocab_size == 65541
    meta = prepare([tmp_path / "a.txt"], tmp_path / "t.bin", val_fraction=0.0, tokenizer=tmp_path / "tok.json",
                   log=lambda *a: None)
    assert meta["dtype"] == "uint32"
    ids = [int(i) for i in TokenDataset(tmp_path / "t.bin", "train").tokens]
    assert ids == t.encode("big w1 w39999 big\n").ids == [65540, 1, 39999, 65540]
