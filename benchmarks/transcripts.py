"""Docs that cannot drift: every command block of README.md and docs/*.md is run, every transcript compared.

A fenced block is marked by an HTML comment on the line before it (GitHub does not show it):

    <!-- transcript: SESSION [mode=table] [measured=COMMIT,DATE] [needs=cuda] -->   a ```console block:
          `$ command` lines, each followed by what it printed (stdout; also stderr when it ends in `2>&1`)
    <!-- run: SESSION -->                 a ```bash or ```python block whose commands run in SESSION (output not shown)
    <!-- tested-by: tests/F.py::TEST ... (why) -->   a block that named test exercises (it needs hardware or hosts
          the suite has not, or the test reads the block itself)
    <!-- fragment: WHY -->               a ```python block that is part of a program, not one (names it uses come
          from around it); WHY says so and where the whole is tested. The only python blocks not run

Every other ```python block runs as its own script in a fresh interpreter (as `python3 BLOCK.py`, nothing
imported for it): a `run:` block in its session's folder (forked from a zygote that imported only torch:
`Scripts`), a pytest block (one that defines `test_*`) under
`python3 -m pytest` (tests/test_docs.py), the rest by the test that names it. Before any run, every name a
non-fragment block reads must be bound in the block itself or be a builtin (`undefined_names`, a symtable
walk): an import the reader would need is never supplied by the code around the check.

The blocks of a session run in one scratch folder, in document order (README.md, then docs/*.md by name).
`python3 -m benchmarks.transcripts --write` runs them as written and rewrites each transcript's output;
sessions whose transcripts carry `measured=` are measurements kept with their commit and date, rewritten only
when named (`--write bench-ckpt`). The test suite runs the same commands small (the SMALL tables below:
config files shrunk, arguments replaced) and compares the *shape* of every output line with the document's:
numbers (and lists of them), byte units and the value words of VALUES are masked, whitespace is collapsed.
mode=exact (the default): the two sequences of shapes are equal once repeated consecutive lines are taken as
one (a 150-step run logs more lines like the one before than a 12-step run). mode=table (a benchmark's
output, shown in part): each kind of line the block shows appears in the output after the kind before it.
The output of a command in FREE (sampled text) is only required to be non-empty.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!--\s*(transcript|run|tested-by|fragment):\s*([^\n]*?)\s*-->\n```(\w*)\n(.*?)^```$", re.M | re.S)
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
COMMAND_LANGS = ("bash", "sh", "console", "python")  # a fenced block in one of these must carry a marker

# ---------------------------------------------------------------- the small runs
# config files of the session's copy of configs/, shrunk: {file: {key: value}} (keys are unique in each file)
WALK_SMALL = {"steps": 9, "log_interval": 1, "eval_interval": 3, "interval": 3, "n_embd": 32, "block_size": 32}
SMALL_CONFIGS = {
    "walk": {"tiny-cpu.toml": WALK_SMALL},
    "demo": {"tiny-cpu.toml": {**WALK_SMALL, "steps": 3}},
    "train": {"tiny-cpu.toml": {**WALK_SMALL, "steps": 3}},
    "ft": {"tiny-cpu.toml": {"log_interval": 1, "eval_interval": 3, "interval": 3}},
    "small": {"small-cpu.toml": {"steps": 4, "log_interval": 1, "eval_interval": 2, "interval": 2, "n_embd": 32,
                                 "block_size": 32, "eval_batches": 1}},
}
# (session, pattern, replacement) applied to each command of the session in a small run
SMALL_ARGS = [
    ("walk", r"--train\.steps=200\b", "--train.steps=12"),
    ("walk", r"--max-new-tokens \d+", "--max-new-tokens 16"),
    ("ft", r"--train\.steps=100\b", "--train.steps=6"),
    ("small", r"--train\.stop_at_step=500\b", "--train.stop_at_step=2"),
    ("small", r"--nproc-per-node 8\b", "--nproc-per-node 4"),  # (2,2,1) then (1,4,1): half the processes
    ("small", r"--max-new-tokens \d+", "--max-new-tokens 16"),
    ("bench-ckpt", r"^megalite bench ckpt$", "megalite bench ckpt --size-mb 8 --world 2 --repeats 1"),
    ("bench-ckpt", r"^megalite bench ckpt --sizes \S+ --repeats \d+$",
     "megalite bench ckpt --sizes 4,8 --world 2 --repeats 1"),
    ("bench-train", r"^megalite bench train$", "megalite bench train --steps 2 --nproc 2 --n-embd 32 "
                                               "--block-size 32 --rounds 1 --pairs 2 --bubble-wait-ms 2 --cp-seq 32"),
    ("bench-plan", r"^megalite bench plan", "megalite bench plan --n-layer 4 --n-embd 64 --n-head 4 "
                                           "--vocab-size 256 --block-size 32 --tp 2 --pp 2 --dp 1,2,4 "
                                           "--reshard-to 1,4,2"),
    ("bench-plan", r"--reshard-to \S+", "--reshard-to 1,4,2"),
    ("bench-prepare", r"--size-mb \S+ --rounds \d+", "--size-mb 0.3 --vocab-size 300 --rounds 2"),
    ("bench-generate", r"--new-tokens \d+ --rounds \d+", "--n-layer 2 --n-embd 192 --vocab-size 512 --new-tokens 4 "
                                                          "--rounds 2"),
    ("bench-documents", r"^megalite bench documents.*$", "megalite bench documents --size-mb 0.3 --vocab-size 300 "
                                                          "--n-layer 2 --n-embd 32 --block-size 64 --steps 2 --rounds 2"),
    ("gpu-dry", r"--dry-run$", "--dry-run --window 0.5"),
    ("gpu", r"--window \S+", "--window 5"),
    ("stress", r"--trials \d+", "--trials 1 --steps 8 --seed 11 --width 32"),
]
# (session, pattern): a line a small run prints only because it is small, left out before comparing
SMALL_ONLY = [
    # the split checkpoint records train.steps = 100 (the default), so 6 steps instead of 100 re-span the LR
    ("ft", r"^megalite: train\.steps 100 -> 6: the cosine LR schedule now spans"),
]
FREE = re.compile(r"^megalite generate\b|\.generate\(")  # sampled text: any non-empty output will do
VALUES = ("NOT met", "met", "yes", "NO", "on", "off", "-", "cpu", "cuda", "ok")  # a paired bench's goal verdict is a value
NOTES_TEXT_CHARS = 60_000  # the fine-tune session's my-notes.txt: the start of the stdlib's argparse.py


@dataclass
class Block:
    file: str           # relative to ROOT
    line: int           # 1-based line of the opening fence
    kind: str           # transcript | run | tested-by
    arg: str            # the session, or the tests and why
    attrs: dict
    lang: str
    body: str
    span: tuple         # (start, end) of the body in the file's text

    @property
    def session(self) -> str:
        return self.arg.split()[0]

    def commands(self) -> list:
        """(command, the output shown after it) for a console block; (command, None) for a bash block."""
        if self.lang == "console":
            out, cur = [], None
            for ln in self.body.split("\n"):
                if ln.startswith("$ "):
                    cur = (ln[2:], [])
                    out.append(cur)
                elif cur is not None:
                    cur[1].append(ln)
            return out
        if self.lang in ("bash", "sh"):
            joined = re.sub(r"\\\n\s*", "", self.body)
            return [(re.sub(r"\s+#\s.*$", "", ln.strip()), None) for ln in joined.split("\n")
                    if ln.strip() and not ln.lstrip().startswith("#")]
        return []


def doc_files(root: Path = ROOT) -> list:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def blocks(root: Path = ROOT) -> list:
    out = []
    for path in doc_files(root):
        text = path.read_text(encoding="utf-8")
        for m in MARKER.finditer(text):
            words = m[2].split()
            attrs = dict(w.split("=", 1) for w in words[1:] if "=" in w) if m[1] in ("transcript", "run") else {}
            out.append(Block(str(path.relative_to(root)), text.count("\n", 0, m.start()) + 2, m[1], m[2], attrs,
                             m[3], m[4], (m.start(4), m.end(4))))
    return out


def unmarked(root: Path = ROOT) -> list:
    """(file, line, language) of every command block without a marker."""
    out = []
    for path in doc_files(root):
        text = path.read_text(encoding="utf-8")
        marked = {m.start(3) - 3 for m in MARKER.finditer(text)}
        for m in FENCE.finditer(text):
            if m[1] in COMMAND_LANGS and m.start() not in marked:
                out.append((str(path.relative_to(root)), text.count("\n", 0, m.start()) + 1, m[1]))
    return out


def undefined_names(source: str, filename: str = "<block>") -> list:
    """Names the code reads that nothing in it binds and that are not builtins, sorted: what a reader pasting
    the block into an empty file would get a NameError for (an import left out, a variable from elsewhere)."""
    import builtins
    import symtable
    top = symtable.symtable(source, filename, "exec")
    bound = set(dir(builtins)) | {"__name__", "__file__", "__doc__", "__builtins__", "__spec__", "__loader__"}
    bound |= {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    missing = set()

    def walk(table, is_top):
        for sym in table.get_symbols():
            if not sym.is_referenced():
                continue
            if is_top and not (sym.is_assigned() or sym.is_imported()) or not is_top and sym.is_global():
                missing.add(sym.get_name())
        for child in table.get_children():
            walk(child, False)

    walk(top, True)
    return sorted(missing - bound)


def python_blocks(root: Path = ROOT) -> list:
    """Every ```python block of README.md and docs/*.md with its marker (fragments included)."""
    return [b for b in blocks(root) if b.lang == "python"]


def run_script(body: str, work: Path, name: str, root: Path = ROOT, timeout: float = 600, pytest: bool = False,
               keep: bool = False) -> tuple:
    """(exit code, printed text, the names it left) of a python block run as its own script in a fresh
    interpreter, in `work`: `python3 NAME.py` (`python3 -m pytest NAME.py` with `pytest`). With `keep`, the
    plain values the script left at module level (numbers, strings, tensors, lists and dicts of them) come
    back, saved by torch after the script ended and read with torch.load(weights_only=True)."""
    work.mkdir(parents=True, exist_ok=True)
    script = work / f"{name}.py"
    script.write_text(body, encoding="utf-8")
    if pytest:
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(work),
                "-o", "addopts=", str(script)]
    elif keep:  # the script runs exactly as `python3 NAME.py` would (its own module namespace), then is read
        argv = [sys.executable, "-c", _KEEP, str(script), str(work / f"{name}.kept.pt")]
    else:
        argv = [sys.executable, str(script)]
    p = subprocess.run(argv, cwd=work, env=_env(root), timeout=timeout, text=True, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT)
    kept = {}
    if keep and p.returncode == 0:
        import torch
        kept = torch.load(work / f"{name}.kept.pt", weights_only=True)
        (work / f"{name}.kept.pt").unlink()
    return p.returncode, p.stdout, kept


class Scripts:
    """Python blocks run as scripts, each in a fresh interpreter forked from one that has imported torch and
    nothing else (a zygote, as run_parallel's fork server): each block gets a new process with an empty
    `__main__` namespace, its own working folder and argv, as `python3 BLOCK.py` would, while `import torch`
    (~2 s, most of a block's start) is paid once per session instead of once per block. What the zygote
    imported is exactly what any block's own `import torch` loads, so a block that forgets an import still
    fails (the name is unbound; a submodule torch does not import by itself is not there either)."""

    def __init__(self, root: Path = ROOT):
        self.root, self.proc = root, None

    def run(self, body: str, work: Path, name: str, keep: bool = False, timeout: float = 600) -> tuple:
        """(exit code, printed text, the plain values it left when `keep`), as run_script."""
        import json
        import select
        if self.proc is None:
            self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE], env=_env(self.root), text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        script, log, kept_at = work / f"{name}.py", work / f"{name}.log", work / f"{name}.kept.pt"
        script.write_text(body, encoding="utf-8")
        self.proc.stdin.write(json.dumps({"script": str(script), "cwd": str(work), "log": str(log),
                                          "keep": str(kept_at) if keep else ""}) + "\n")
        self.proc.stdin.flush()
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            self.close()
            return 124, f"timed out after {timeout:g} s", {}
        rc = json.loads(self.proc.stdout.readline() or '{"rc": 1}')["rc"]
        text = log.read_text(errors="replace")
        kept = {}
        if keep and rc == 0:
            import torch
            kept = torch.load(kept_at, weights_only=True)
        for p in (script, log, kept_at):
            p.unlink(missing_ok=True)
        return rc, text, kept

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


_ZYGOTE = """import json, os, runpy, sys, traceback
import torch  # what every block that uses torch imports first; nothing else is loaded here
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.chdir(req["cwd"])
            sys.argv = [req["script"]]
            sys.path[0] = os.path.dirname(req["script"])
            ns = runpy.run_path(req["script"], run_name="__main__")
            if req["keep"]:
                def plain(v):
                    if isinstance(v, (bool, int, float, str, torch.Tensor)):
                        return True
                    if isinstance(v, (list, tuple)):
                        return all(map(plain, v))
                    return isinstance(v, dict) and all(isinstance(k, str) and plain(x) for k, x in v.items())
                torch.save({k: v for k, v in ns.items() if not k.startswith("_") and plain(v)}, req["keep"])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
"""


_KEEP = """import runpy, sys
ns = runpy.run_path(sys.argv[1], run_name="__main__")
import torch
def plain(v):
    if isinstance(v, (bool, int, float, str, torch.Tensor)):
        return True
    if isinstance(v, (list, tuple)):
        return all(map(plain, v))
    return isinstance(v, dict) and all(isinstance(k, str) and plain(x) for k, x in v.items())
torch.save({k: v for k, v in ns.items() if not k.startswith("_") and plain(v)}, sys.argv[2])
"""


def session_blocks(name: str, root: Path = ROOT) -> list:
    return [b for b in blocks(root) if b.kind in ("transcript", "run") and b.session == name]


# ---------------------------------------------------------------- shapes
_NUM = re.compile(r"(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?")
_LIST = re.compile(r"#(?:\s*(?:,|/|x|->|-)\s*#)+")
_SIGN = re.compile(r"(?<![\w#])[-+]#")
_UNIT = re.compile(r"# ?(?:B|KiB|MiB|GiB|TiB|bytes)\b")
_VALUE = re.compile(r"(?<![\w-])(?:" + "|".join(re.escape(v) for v in VALUES) + r")(?![\w-])")


def shape(line: str) -> str:
    """A line with its numbers, lists of numbers, byte units and value words masked, whitespace collapsed."""
    s = _NUM.sub("#", line)
    s = s.replace("#%!", "#%")  # bench ckpt marks a share above 100% of the disk probe: a value, not a shape
    s = _LIST.sub("#", s)
    s = _SIGN.sub("#", s)
    s = _UNIT.sub("#B", s)
    s = re.sub(r"-{2,}", "--", s)
    s = _VALUE.sub("~", s)
    return " ".join(s.split())


def _runs(lines: list) -> list:
    out = []
    for s in map(shape, lines):
        if not out or out[-1] != s:
            out.append(s)
    while out and out[-1] == "":
        out.pop()
    return out


def _distinct(lines: list) -> list:
    seen, out = set(), []
    for s in map(shape, lines):
        if s and s not in seen:
            seen.add(s)
            out.append(s)
    return out


def small_only(session: str, printed: list) -> list:
    pats = [re.compile(p) for name, p in SMALL_ONLY if name == session]
    return [ln for ln in printed if not any(p.search(ln) for p in pats)]


def compare(shown: list, printed: list, mode: str = "exact", command: str = "") -> list:
    """Problems (one line each) between the lines a document shows and the lines a run printed."""
    if FREE.search(command):
        return [] if "".join(printed).strip() else [f"`{command}` printed nothing"]
    if mode == "table":
        want, have, i = _distinct(shown), [shape(ln) for ln in printed], 0
        for w in want:  # each shown kind of line, found after the one before it
            while i < len(have) and have[i] != w:
                i += 1
            if i == len(have):
                return [f"`{command}`: the shown line '{w}' is not printed (in this order)"]
            i += 1
        return []
    want, have = _runs(shown), _runs(printed)
    for k, (w, h) in enumerate(zip(want, have)):
        if w != h:
            return [f"`{command}`: line {k + 1} of its output has the shape '{h}', the document shows '{w}'"]
    if len(want) != len(have):
        extra = have[len(want):] if len(have) > len(want) else want[len(have):]
        what = "printed but not shown" if len(have) > len(want) else "shown but not printed"
        return [f"`{command}`: {what}: '{extra[0]}'"]
    return []


def excerpt(shown: list, printed: list) -> list:
    """The part of `printed` a table-mode transcript shows: from the first line shaped like its first line, on
    while the lines keep shapes it shows."""
    kinds = {shape(s) for s in shown}
    start = next((k for k, ln in enumerate(printed) if shape(ln) == shape(shown[0])), len(printed))
    end = start
    while end < len(printed) and shape(printed[end]) in kinds:
        end += 1
    return printed[start:end]


def check(session: str, runner, root: Path = ROOT) -> list:
    """Problems between the session's transcripts and the output of `runner(small command)`, for tests that run
    the commands their own way (each distinct command once)."""
    outs, problems = {}, []
    for b in session_blocks(session, root):
        for shown_cmd, shown in b.commands():
            cmd = small_command(session, shown_cmd)
            if cmd not in outs:
                outs[cmd] = runner(cmd)
            if shown is not None:
                problems += [f"{b.file}:{b.line}: {p}" for p in compare(
                    shown, small_only(session, outs[cmd].splitlines()), b.attrs.get("mode", "exact"), shown_cmd)]
    return problems


# ---------------------------------------------------------------- running a session
def small_command(session: str, cmd: str) -> str:
    for name, pat, rep in SMALL_ARGS:
        if name == session:
            cmd = re.sub(pat, rep, cmd)
    return cmd


def notes_text() -> str:
    src = Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"
    return src.read_text(encoding="utf-8")[:NOTES_TEXT_CHARS]


def setup(session: str, work: Path, small: bool, root: Path = ROOT) -> None:
    """The session's scratch folder: a copy of configs/ (and launch/), shrunk for a small run."""
    work.mkdir(parents=True, exist_ok=True)
    for folder in ("configs", "launch"):
        shutil.copytree(root / folder, work / folder, dirs_exist_ok=True)
    if session == "ft":
        (work / "my-notes.txt").write_text(notes_text(), encoding="utf-8")
    if small:
        for name, keys in SMALL_CONFIGS.get(session, {}).items():
            path = work / "configs" / name
            text = path.read_text()
            for key, value in keys.items():
                text, n = re.subn(rf"^{key} = .*$", f"{key} = {value}", text, flags=re.M)
                assert n == 1, f"{name}: key '{key}' not found once"
            path.write_text(text)


def _env(root: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "GROUP_RANK"):
        env.pop(k, None)
    return env


@contextlib.contextmanager
def _cwd(path: Path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def run_command(cmd: str, work: Path, root: Path = ROOT, timeout: float = 900) -> tuple:
    """(exit code, printed text) of one shown command, run in `work`. `megalite ...` and `python3 -c ...` run in
    this process (the same code without an interpreter start each); `torchrun` is started as
    `python -m torch.distributed.run --standalone` unless the command names a rendezvous; the rest goes to bash."""
    both = cmd.endswith(" 2>&1")
    plain = cmd[: -len(" 2>&1")] if both else cmd
    argv = shlex.split(plain, comments=True) if not re.search(r"[;|&<>`$]", plain) else None
    if argv and argv[0] == "megalite":
        from megalite.cli import main
        buf = io.StringIO()
        with _cwd(work), contextlib.redirect_stdout(buf), \
                (contextlib.redirect_stderr(buf) if both else contextlib.nullcontext()):
            try:
                rc = main(argv[1:])
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
        return rc, buf.getvalue()
    if argv and argv[:2] in (["python3", "-c"], ["python", "-c"]):
        buf = io.StringIO()
        with _cwd(work), contextlib.redirect_stdout(buf):
            exec(compile(argv[2], f"<{cmd[:40]}>", "exec"), {"__name__": "__main__"})
        return 0, buf.getvalue()
    if re.match(r"torchrun ", plain) and "--rdzv" not in plain and "--standalone" not in plain:
        cmd = f"{shlex.quote(sys.executable)} -m torch.distributed.run --standalone " + cmd[len("torchrun "):]
    p = subprocess.run(["bash", "-c", cmd], cwd=work, env=_env(root), timeout=timeout, text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return p.returncode, p.stdout


@dataclass
class Result:
    """What a session printed, per block: [(the command as run, exit code, printed text)], and the namespace
    each python block left."""
    session: str
    work: Path
    small: bool
    runs: dict = field(default_factory=dict)        # block index in session_blocks -> list of (cmd, rc, text)
    namespaces: dict = field(default_factory=dict)  # python block index -> the plain values its script left

    def problems(self, root: Path = ROOT) -> list:
        out = []
        for i, b in enumerate(session_blocks(self.session, root)):
            if b.lang == "python":
                out += [f"{b.file}:{b.line}: the python block exited with {rc}:\n{text[-2000:]}"
                        for _, rc, text in self.runs.get(i, []) if rc != 0]
                continue
            for (shown_cmd, shown), (cmd, rc, text) in zip(b.commands(), self.runs.get(i, [])):
                where = f"{b.file}:{b.line}"
                if rc != 0 and not cmd.endswith("2>&1"):
                    out.append(f"{where}: `{cmd}` exited with {rc}:\n{text[-2000:]}")
                elif shown is not None:
                    printed = small_only(self.session, text.splitlines()) if self.small else text.splitlines()
                    out += [f"{where}: {p}" for p in compare(shown, printed, b.attrs.get("mode", "exact"), shown_cmd)]
        return out


def run_session(session: str, work: Path, small: bool = True, root: Path = ROOT, log=None) -> Result:
    """Run every block of `session` in `work` (set up here), in document order."""
    setup(session, work, small, root)
    scripts = Scripts(root)
    try:
        return _run_blocks(session, work, small, root, log, scripts)
    finally:
        scripts.close()


def _run_blocks(session, work, small, root, log, scripts) -> Result:
    res = Result(session, work, small)
    for i, b in enumerate(session_blocks(session, root)):
        if b.lang == "python":  # its own script in a fresh interpreter: nothing of this process leaks in
            t0 = time.perf_counter()
            rc, text, res.namespaces[i] = scripts.run(b.body, work, f".block-{Path(b.file).stem}-{b.line}",
                                                      keep=True)
            if log:
                log(f"[{session}] {time.perf_counter() - t0:5.1f} s  python block {b.file}:{b.line}")
            res.runs[i] = [(f"python3 {b.file}:{b.line}", rc, text)]
            if rc != 0:
                return res
            continue
        res.runs[i] = []
        for shown_cmd, _ in b.commands():
            cmd = small_command(session, shown_cmd) if small else shown_cmd
            t0 = time.perf_counter()
            rc, text = run_command(cmd, work, root)
            for folder in {str(work.resolve()), str(work)}:  # paths a command made absolute, as the reader's
                text = text.replace(folder + os.sep, "")
            if log:
                log(f"[{session}] {time.perf_counter() - t0:5.1f} s  $ {cmd}")
            res.runs[i].append((cmd, rc, text))
            if rc != 0 and not cmd.endswith("2>&1"):
                return res  # what follows depends on it
    return res


# ---------------------------------------------------------------- rewriting the documents
def pinned(session: str, root: Path = ROOT) -> bool:
    return any("measured" in b.attrs for b in session_blocks(session, root))


def write(res: Result, root: Path = ROOT) -> list:
    """Put a full run's output into every transcript of its session; a measured one gets HEAD and today's date."""
    changed = []
    stamp = None
    if pinned(res.session, root):
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                              capture_output=True).stdout.strip()
        stamp = f"{head},{datetime.date.today().isoformat()}"
    edits: dict = {}
    for i, b in enumerate(session_blocks(res.session, root)):
        if b.kind != "transcript" or i not in res.runs:
            continue
        lines = []
        for (shown_cmd, shown), (_, _, text) in zip(b.commands(), res.runs[i]):
            printed = [ln.rstrip() for ln in text.rstrip("\n").split("\n")] if text.strip() else []
            if b.attrs.get("mode") == "table" and shown:
                printed = excerpt(shown, printed)
            lines += [f"$ {shown_cmd}", *printed]
        edits.setdefault(b.file, []).append((b, "\n".join(lines) + "\n"))
    for file, items in edits.items():
        path = root / file
        text = path.read_text(encoding="utf-8")
        for b, body in sorted(items, key=lambda x: -x[0].span[0]):
            text = text[: b.span[0]] + body + text[b.span[1]:]
            if stamp:
                head_end = text.rfind("-->", 0, b.span[0])
                head_start = text.rfind("<!--", 0, head_end)
                marker = re.sub(r"measured=\S+", f"measured={stamp}", text[head_start:head_end])
                text = text[:head_start] + marker + text[head_end:]
        path.write_text(text, encoding="utf-8")
        changed.append(file)
    return changed


def sessions(root: Path = ROOT) -> list:
    out = []
    for b in blocks(root):
        if b.kind in ("transcript", "run") and b.session not in out:
            out.append(b.session)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.transcripts", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="examples:\n  python3 -m benchmarks.transcripts --write\n"
                                        "  python3 -m benchmarks.transcripts --check walk ft")
    ap.add_argument("sessions", nargs="*", help="sessions to run (default: --write every unmeasured one, "
                                                "--check all)")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--write", action="store_true", help="run as written and rewrite the transcripts")
    what.add_argument("--check", action="store_true", help="run small and compare shapes, as the tests do")
    what.add_argument("--list", action="store_true", help="list the sessions and their blocks")
    ap.add_argument("--keep", type=Path, help="run in this folder (kept) instead of a temporary one")
    a = ap.parse_args(argv)
    if a.list:
        for name in sessions():
            print(f"{name}{' (measured)' if pinned(name) else ''}: " +
                  ", ".join(f"{b.file}:{b.line}" for b in session_blocks(name)))
        return 0
    names = a.sessions or [s for s in sessions() if a.check or not pinned(s)]
    bad = 0
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"transcript-{name}-") as tmp:
            work = (a.keep / name) if a.keep else Path(tmp)
            res = run_session(name, work, small=a.check, log=lambda s: print(s, file=sys.stderr, flush=True))
            problems = res.problems()
            if a.write:
                failed = [p for p in problems if " exited with " in p]
                if failed:
                    print("\n".join(failed))
                    bad += 1
                    continue
                print(f"{name}: rewrote {', '.join(write(res)) or 'nothing'}")
            else:
                print("\n".join(problems) if problems else f"{name}: every shown line has its shape")
                bad += bool(problems)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
