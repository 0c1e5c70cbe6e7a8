"""Plain helpers shared by the tests (the fixtures that use them live in conftest.py): token files, the tiny
config as a Config or a TOML file, training in this process, running `megalite` in a subprocess or under
torchrun, one-line CLI errors, metrics, and comparing checkpoint trees."""
from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch

from megalite.config import Config

TIMEOUT = 180  # seconds for one training launch
CLI_TIMEOUT = 120  # seconds for any other `megalite` command
TORCHRUN_TIMEOUT = 240  # seconds for a launch of 4-8 processes that must succeed
MEGATRON_REF = Path(__file__).with_name("megatron_ref.py")  # megatron-core run as an outside reference
TORCHTITAN_REF = Path(__file__).with_name("torchtitan_ref.py")  # torchtitan run as an outside reference

MEGALITE = [sys.executable, "-m", "megalite"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# what a launcher sets for its workers: a test started under one must not hand its rank to the commands it runs
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                 "TORCHELASTIC_RUN_ID")


# ---------------------------------------------------------------- data
def stdlib_text(n: int = 60_000) -> str:
    """~60 KB of deterministic text: the start of a stdlib module's source."""
    src = Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"
    return src.read_text(encoding="utf-8")[:n]


def synthetic_text(n: int = 50_000) -> str:
    """~50 KB of deterministic, varied English-and-code-like text written here (no external files)."""
    words = ("the model splits every tensor across ranks and the converter puts it back together one slice "
             "at a time def return class import for while if else print yield lambda pipeline stage tensor "
             "parallel data optimizer moment checkpoint manifest shard layout resume gradient loss step "
             "batch token vocabulary embedding attention head layer norm residual projection").split()
    out, i, x = [], 0, 12345
    while sum(len(s) for s in out) < n:
        x = (1103515245 * x + 12345) % 2**31
        w = words[x % len(words)]
        i += 1
        out.append(w + ("\n" if i % 13 == 0 else ". " if i % 7 == 0 else " "))
    return "".join(out)[:n]


def make_token_file(folder: Path, text: str) -> Path:
    """folder/corpus.txt holding `text`, prepared into folder/tokens.bin (10% validation)."""
    from megalite.data import prepare
    folder = Path(folder)
    (folder / "corpus.txt").write_text(text, encoding="utf-8")
    prepare([folder / "corpus.txt"], folder / "tokens.bin", val_fraction=0.1, log=lambda *a: None)
    return folder / "tokens.bin"


def document_corpora(folder: Path, parts: int = 1, words: int = 40000, vocab: int = 300) -> tuple[list, int]:
    """`parts` BPE token files of documents (jsonl records of 1 to 8 words, ~5-40 tokens each, cut in turn from
    synthetic text) made by one 300-id BPE with an end-of-text token: ([paths], the tokenizer's vocab size)."""
    import numpy as np
    from megalite.data import prepare
    from megalite.tokenizer import train_bpe
    text = synthetic_text(words).split()
    rng = np.random.default_rng(0)
    lines, at, k = [[] for _ in range(parts)], 0, 0
    while at < len(text) - 40:  # document k goes to file k mod parts
        n = int(rng.integers(1, 9))
        lines[k % parts].append(json.dumps({"text": " ".join(text[at:at + n])}))
        at, k = at + n, k + 1
    tok = train_bpe([" ".join(text)], vocab)
    paths = []
    for k, part in enumerate(lines):
        (folder / f"docs{k}.jsonl").write_text("\n".join(part) + "\n")
        prepare([folder / f"docs{k}.jsonl"], folder / f"docs{k}.bin", tokenizer=tok, log=lambda *a: None)
        paths.append(folder / f"docs{k}.bin")
    return paths, tok.vocab_size


def document_reference_loss(hf, batch) -> float:
    """The mean over a packed batch's counted targets of each document's own loss: transformers' model `hf` on
    the document's tokens of the row alone, from position 0."""
    import torch.nn.functional as F
    total = 0.0
    for r in range(batch.x.shape[0]):
        for d in sorted(set(batch.docs[r].tolist()) - {-1}):
            at = batch.docs[r] == d
            with torch.no_grad():
                logits = hf(input_ids=batch.x[r][at][None]).logits[0].float()
            ce = F.cross_entropy(logits, batch.y[r][at], reduction="none")
            total += float((ce * batch.mask[r][at]).sum())
    return total / batch.counted


def _resume_worker(rank, world_size, tmp_dir, first, second):
    from megalite.run.train import train as train_fn
    for cfg, name in ((first, "first"), (second, "second")):
        tr = train_fn(cfg, log=lambda *a: None)
        if rank == 0:
            (Path(tmp_dir) / f"{name}.json").write_text(json.dumps([r["batch_hash"] for r in tr.history]))


def resumed_across_layouts(tokens, tmp_path: Path, base: dict) -> tuple[list, object, list]:
    """The tiny run of `base` (4 steps, checkpoint.dir set) trained in three launches: 2 ranks at dp = 2
    (micro-batch 4) stop at step 2, resume at cp = 2 (micro-batch 8) to step 3, and one process (micro-batch 1)
    finishes: (every step's batch_hash, the last launch's Trainer, its log lines)."""
    from megalite.testing import run_parallel
    first = TINY.config(tokens, tmp_path / "b", **base, **{"train.stop_at_step": 2, "parallel.dp": 2,
                                                           "train.micro_batch_size": 4})
    second = TINY.config(tokens, tmp_path / "b", **base, **{"train.stop_at_step": 3, "parallel.dp": 1,
                                                            "parallel.cp": 2, "train.micro_batch_size": 8})
    run_parallel(_resume_worker, 2, tmp_path, args=(first, second))
    lines = []
    last = train_in_process(TINY.config(tokens, tmp_path / "b", **base, **{"train.micro_batch_size": 1}),
                            log=lines.append)
    got = json.loads((tmp_path / "first.json").read_text()) + json.loads((tmp_path / "second.json").read_text()) \
        + [r["batch_hash"] for r in last.history]
    return got, last, lines


def batch_hashes_by_hand(token_file: Path, seed: int, steps: int, global_batch: int, seq: int,
                         val_fraction: float = 0.1) -> dict:
    """{step: batch_hash} written out from the token file alone, in plain Python integers: batch k is drawn by
    numpy's PCG64([seed, k]) (global_batch start offsets in the train split, the first val_fraction-th of
    tokens held out at the end), each row's inputs and targets hashed per token as docs/training.md defines
    batch_hash. The outside reference for what each step of any layout trained on."""
    import numpy as np
    meta = json.loads(Path(token_file).with_suffix(".json").read_text())
    n = meta["num_tokens"]
    tokens = np.fromfile(token_file, dtype=meta["dtype"])[:n - int(n * val_fraction)].tolist()
    m64 = (1 << 64) - 1

    def mix(z):
        z = (z + 0x9E3779B97F4A7C15) & m64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m64
        return z ^ (z >> 31)

    out = {}
    for k in range(steps):
        rng = np.random.Generator(np.random.PCG64([seed, k]))
        starts = rng.integers(0, len(tokens) - seq - 1, size=global_batch, endpoint=True).tolist()
        total = 0
        for row, s in enumerate(starts):
            ids = tokens[s:s + seq + 1]
            for stream, part in ((0, ids[:-1]), (1, ids[1:])):
                total += sum(mix(mix((row << 32) + pos) ^ (2 * i + stream)) >> 32 for pos, i in enumerate(part))
        out[k + 1] = f"{total % 2**32:08x}"
    return out


# ---------------------------------------------------------------- the tiny config
TINY_MODEL = dict(n_layer=4, n_head=4, n_embd=32, block_size=16, vocab_size=256, dropout=0.0)
TINY_RAW = {
    "model": TINY_MODEL,
    "parallel": dict(tp=1, pp=1, dp=1, schedule="1f1b", zero1=False),
    "train": dict(steps=5, global_batch_size=16, micro_batch_size=2, lr=3e-3, min_lr=3e-4, warmup_steps=2,
                  weight_decay=0.1, grad_clip=1.0, seed=1234, log_interval=1000, eval_interval=1000,
                  eval_batches=1),
    "data": dict(val_fraction=0.1, auto_prepare=False),
    "checkpoint": dict(dir=""),  # tests that want checkpoints name a folder (the default is <out_dir>/checkpoints)
}


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v) if isinstance(v, str) else repr(v)


class Tiny:
    """The tiny model and run of TINY_RAW with some train keys of its own (see TINY, CKPT, CONVERT)."""

    def __init__(self, **train):
        self.train = train

    def raw(self, tokens, out_dir=None, **sections) -> dict:
        """As a dict on `tokens`; sections={"model": {"dropout": 0.1}} overrides keys."""
        raw = copy.deepcopy(TINY_RAW)
        raw["data"]["path"] = str(tokens)
        if out_dir is not None:
            raw["train"]["out_dir"] = str(out_dir)
        raw["train"].update(self.train)
        for section, values in sections.items():
            raw.setdefault(section, {}).update(values)
        return raw

    def config(self, tokens, out_dir=None, **overrides) -> Config:
        """As a Config; overrides as {"section.key": value}."""
        sections: dict = {}
        for dotted, value in overrides.items():
            section, key = dotted.split(".")
            sections.setdefault(section, {})[key] = value
        return Config.from_dict(self.raw(tokens, out_dir, **sections), source="tiny")

    def toml(self, path: Path, tokens, out_dir=None, **sections) -> Path:
        """As a TOML file at `path` (for the CLI and torchrun); sections as for raw()."""
        lines = []
        for section, values in self.raw(tokens, out_dir, **sections).items():
            lines.append(f"[{section}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
            lines.append("")
        Path(path).write_text("\n".join(lines))
        return Path(path)


TINY = Tiny()  # 5 steps of 16 sequences: the layout and pipeline equivalence tests, e2e
CKPT = Tiny(steps=6, global_batch_size=8)  # the checkpoint and fault tests
CONVERT = Tiny(steps=10, global_batch_size=8, seed=7)  # the converter tests


# ---------------------------------------------------------------- training in this process
def train_in_process(cfg: Config, log=None):
    """megalite.run.train.train(cfg) in this process (a world of one), single-threaded like the workers; the
    Trainer. Logs are dropped unless `log` is given."""
    from megalite.run.train import train as train_fn
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_fn(cfg, log=log or (lambda *a: None))
    finally:
        torch.set_num_threads(threads)


def grads_of(named_params) -> list:
    """(name, grad) pairs whose grads carry their parameter's partition tag (for gather_full_model)."""
    out = []
    for name, p in named_params:
        g = p.grad.detach().clone()
        g.partition = p.partition
        out.append((name, g))
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (or the absolute norm when b is zero)."""
    a, b = a.double(), b.double()
    denom = b.norm().item()
    return (a - b).norm().item() / (denom if denom > 0 else 1.0)


# ---------------------------------------------------------------- subprocesses
def env(extra: dict | None = None) -> dict:
    """The environment of a child: one thread per process, unbuffered output, no launcher variables and
    no injected crash inherited from this process."""
    e = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("MEGALITE_CRASH")}
    e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(extra or {}))
    return e


def run(argv: list, *, cwd=None, timeout: float = CLI_TIMEOUT, text: bool = True,
        extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command to completion with env(), capturing its output."""
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=env(extra_env), capture_output=True, text=text,
                          timeout=timeout)


def cli_in_process(*args) -> tuple[int, str, str]:
    """`megalite ARGS` in this process (no interpreter start): (exit code, stdout, stderr)."""
    import contextlib
    import io
    from megalite.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def cli(*args, cwd=None, timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess:
    """`megalite ARGS` in a plain subprocess (no torchrun)."""
    return run([*MEGALITE, *args], cwd=cwd, timeout=timeout)


def torchrun_cmd(nproc: int, *args, restarts: int | None = None) -> list:
    """`torchrun --standalone --nproc-per-node=N [--max-restarts=R] -m megalite ARGS`."""
    return [*TORCHRUN, "--standalone", f"--nproc-per-node={nproc}",
            *([f"--max-restarts={restarts}"] if restarts is not None else []), "-m", "megalite", *map(str, args)]


def train_cmd(config: Path, *overrides, nproc: int = 1) -> list:
    """`megalite train --config CONFIG OVERRIDES`, under torchrun when nproc > 1."""
    args = ["train", "--config", str(config), *map(str, overrides)]
    return [*MEGALITE, *args] if nproc == 1 else torchrun_cmd(nproc, *args)


def train(config: Path, *overrides, nproc: int = 1, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return run(train_cmd(config, *overrides, nproc=nproc), timeout=timeout)


def popen_train(config: Path, *overrides, nproc: int = 1) -> subprocess.Popen:
    """train() started in the background, stderr merged into stdout."""
    return subprocess.Popen(train_cmd(config, *overrides, nproc=nproc), env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """Assert a command succeeded (showing the ends of its output if not); return it."""
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n" \
                                 f"{proc.stderr[-4000:]}"
    return proc


def torchrun_train(nproc: int, toml: Path, out_dir: Path, **overrides) -> list[dict]:
    """Train under torchrun with `--section.key=value` overrides (bools lowercased), which must succeed;
    return the metrics.jsonl records."""
    flags = [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in overrides.items()]
    ok(train(toml, f"--train.out_dir={out_dir}", *flags, nproc=nproc, timeout=TORCHRUN_TIMEOUT))
    return metrics(out_dir)


def one_line_error(p: subprocess.CompletedProcess, prefix: str | tuple = "megalite", code: int = 2,
                   match: str | None = None) -> str:
    """Assert that a command failed as the CLI promises: exit `code`, no traceback, exactly one (non-blank)
    line on stderr that starts with `prefix` (and contains the regex `match`); return that line."""
    shown = f"{' '.join(map(str, p.args))}\nexit {p.returncode}\n--- stdout\n{p.stdout[-2000:]}\n--- stderr\n" \
            f"{p.stderr[-3000:]}"
    assert "Traceback" not in p.stdout + p.stderr, shown
    assert p.returncode == code, shown
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), shown
    assert lines[0].startswith(prefix), shown
    if match is not None:
        assert re.search(match, lines[0]), f"{match!r} not in {lines[0]!r}"
    return lines[0]


# ---------------------------------------------------------------- metrics
def metrics(out_dir: Path) -> list[dict]:
    """The step records of out_dir/metrics.jsonl as megalite reads them: the last one of each step."""
    from megalite.run.metrics import read
    return read(out_dir)


def metrics_lines(out_dir: Path) -> list[dict]:
    """Every line of out_dir/metrics.jsonl, events and redone steps included."""
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def losses(out_dir: Path) -> list:
    """[(step, loss)] of out_dir/metrics.jsonl."""
    return [(r["step"], r["loss"]) for r in metrics(out_dir)]


# ---------------------------------------------------------------- processes
def children(pid: int) -> list:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(x) for x in out]


def kill_tree(proc: subprocess.Popen) -> None:
    """Clean up a launch that a test left running (its workers first, then torchrun)."""
    if proc.poll() is not None:
        return
    for pid in children(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.kill()
    proc.communicate(timeout=30)


def wait_for(pred, timeout: float, interval: float = 0.002) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return False


# ---------------------------------------------------------------- checkpoint trees
def step_names(root: Path) -> list:
    return sorted(p.name for p in Path(root).iterdir() if p.is_dir() and p.name.startswith("step_"))


def tmp_dirs(root: Path) -> list:
    """The names of the temporary folders (.tmp-*) a save left in a checkpoint root."""
    return sorted(p.name for p in Path(root).glob(".tmp-*")) if Path(root).exists() else []


def coord_files(step: Path) -> dict:
    """{relative path: bytes} of every file in the coordinate folders of one step folder."""
    step = Path(step)
    return {str(f.relative_to(step)): f.read_bytes() for f in sorted(step.glob("*/*")) if f.is_file()}


def copy_step(step: Path, root: Path) -> Path:
    """Copy one committed step folder into a new checkpoint root that names it `latest`."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copytree(step, root / step.name)
    (root / "latest").write_text(step.name + "\n")
    return root / step.name


def tree_digest(root: Path) -> dict:
    """{relative path: sha256} of every file under root (to prove a source was not touched)."""
    root = Path(root)
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def same_file(a: Path, b: Path) -> bool:
    """Byte-equal, or for safetensors: the same keys, dtypes, shapes, metadata and bitwise-equal tensors
    (safetensors writes its metadata map in no fixed order, so equal checkpoints need not be equal bytes)."""
    a, b = Path(a), Path(b)
    if a.read_bytes() == b.read_bytes():
        return True
    if a.suffix != ".safetensors":
        return False
    from safetensors import safe_open
    with safe_open(str(a), framework="pt") as fa, safe_open(str(b), framework="pt") as fb:
        if sorted(fa.keys()) != sorted(fb.keys()) or fa.metadata() != fb.metadata():
            return False
        for k in fa.keys():
            x, y = fa.get_tensor(k), fb.get_tensor(k)
            if x.dtype != y.dtype or x.shape != y.shape or not bool((x.view(-1).view(torch_int(x)) ==
                                                                      y.view(-1).view(torch_int(y))).all()):
                return False
    return True


def torch_int(t):
    """The integer dtype of a float tensor's width, to compare bit patterns (NaN == NaN, -0 != +0)."""
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]


def same_step_files(a: Path, b: Path) -> None:
    """Assert two step folders hold the same coordinate files with the same contents (see same_file)."""
    fa, fb = coord_files(a), coord_files(b)
    assert fa.keys() == fb.keys() and fa, (sorted(fa), sorted(fb))
    differ = [rel for rel in fa if not same_file(Path(a) / rel, Path(b) / rel)]
    assert not differ, f"{a} and {b} differ in {differ}"


def verify_cli(path) -> tuple:
    """`megalite verify PATH` in this process (no interpreter start-up): (exit code, stdout + stderr)."""
    from megalite.cli import main
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = main(["verify", str(path)])
    return rc, buf.getvalue()


# ---------------------------------------------------------------- inside run_parallel workers
def same_on_every_rank(msg, world_size: int) -> None:
    """Assert every rank of the default group holds the same `msg`."""
    import torch.distributed as dist
    msgs = [None] * world_size
    dist.all_gather_object(msgs, msg)
    assert len(set(msgs)) == 1, msgs


def assert_still_at_step_1(root: Path) -> None:
    """After a failed save of step 2 (on every rank): `latest` still names step 1, which is whole and the
    only step, and the failed save left nothing behind."""
    import torch.distributed as dist
    from megalite.checkpoint.tree import committed_steps, read_latest
    from megalite.checkpoint.verify import verify
    dist.barrier()
    assert read_latest(root) == "step_00000001"
    assert committed_steps(root) == [1] and not (Path(root) / "step_00000002").exists()
    assert tmp_dirs(root) == []
    assert verify(root)[1] == []
    dist.barrier()


# ---------------------------------------------------------------- crafted checkpoints
def resign(step: Path, rel: str | None = None) -> None:
    """Make an edit pass the checksums, as a careful adversary would (or a bug that writes consistent
    nonsense): record `rel`'s new size and CRC32C in the manifest and re-sign the manifest, so what a test
    then sees is the field's own validation, not the checksum in front of it (the checksums have their own
    tests in test_checkpoint_integrity.py)."""
    from megalite.checkpoint.manifest import FileRecord, crc32c_file, sign
    man_path = Path(step) / "manifest.json"
    man = json.loads(man_path.read_text())
    if rel is not None:
        path = Path(step) / rel
        man["files"][rel] = FileRecord(path.stat().st_size, crc32c_file(path)).to_json(rel)
    man_path.write_text(json.dumps(sign(man)))
