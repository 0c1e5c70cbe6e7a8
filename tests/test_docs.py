"""README.md and docs/*.md: every command block runs, every transcript has the shape the code prints today,
links resolve, measured tables name their commit; the walkthrough (moved here from test_first_hour), the demo
script, the json+safetensors recipe on a (2,2,2) ZeRO-1 checkpoint, the HF snippet, and the interleaved
warm-up table against megatron-core. How the runs are made small: benchmarks/transcripts.py, docs/design.md."""
import ast
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from megalite.run import metrics
from benchmarks import transcripts as T

ROOT = Path(__file__).resolve().parents[1]
# pages other branches of this round write; a link to one is allowed before it lands
PENDING = set()


# ---------------------------------------------------------------- the documents themselves (no runs)
def test_every_command_block_carries_a_marker():
    assert T.unmarked() == [], "a bash/console/python block without <!-- transcript|run|tested-by: ... -->"


def test_every_session_is_known_to_a_test():
    """Each session is run by some test (here, or test_reference / test_bench / test_bench_plan / test_gpu_check /
    test_faults for the ones those files already launch)."""
    sources = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    for name in T.sessions():
        assert re.search(rf"""(run_session|check|_documented)\(\s*["']{re.escape(name)}["']""", sources), name


def test_tested_by_names_tests_that_exist():
    for b in T.blocks():
        if b.kind not in ("tested-by", "fragment"):
            continue
        names = re.findall(r"(tests/\S+\.py)::(\w+)", b.arg)
        assert names or b.kind == "fragment", f"{b.file}:{b.line}: tested-by names no test"
        for path, test in names:
            tree = ast.parse((ROOT / path).read_text())
            assert test in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, (b.file, path, test)


def test_every_python_block_is_whole_or_a_fragment_that_says_why():
    """A reader pastes a block into an empty file: every name it reads is bound in it (an import the page left
    out was once supplied by the test file around the check); the exceptions are marked fragments, with why."""
    found = T.python_blocks()
    assert len(found) >= 8
    for b in found:
        where = f"{b.file}:{b.line}"
        if b.kind == "fragment":
            assert len(b.arg.split()) >= 4, f"{where}: a fragment says why it is one"
            continue
        assert T.undefined_names(b.body) == [], f"{where}: reads names the block never binds"


def test_undefined_names_finds_a_missing_import_and_a_variable_from_elsewhere():
    assert T.undefined_names("import torch\nx = torch.ones(2)\nprint(len(x))") == []
    assert T.undefined_names("def f():\n    return torch.zeros(1)\n") == ["torch"]  # read only when called
    assert T.undefined_names("state = model.state_dict()\n") == ["model"]
    assert T.undefined_names("class A:\n    y = np.pi\n    def g(self, a=F):\n        return [a for _ in z]\n") \
        == ["F", "np", "z"]
    assert T.undefined_names("import os.path\nfor i in range(3):\n    j = i\nprint(os, j, [k for k in 'ab'])") == []


def test_each_script_gets_a_fresh_interpreter_forked_from_one_that_imported_torch(tmp_path):
    """T.Scripts (the session runner's python blocks): a forgotten import fails as in `python3 BLOCK.py`, nothing
    one block binds or sets reaches the next, the working folder is the block's, the values come back."""
    scripts = T.Scripts()
    try:
        rc, out, _ = scripts.run("x = torch.ones(1)\n", tmp_path, "a")
        assert rc == 1 and "NameError: name 'torch' is not defined" in out, out
        rc, out, kept = scripts.run("import colorsys, os, torch\ntorch.manual_seed(7)\n"
                                    "secret = 1\nprint(os.getcwd())\nt = torch.rand(2)\n", tmp_path, "b", keep=True)
        assert rc == 0 and out.strip() == str(tmp_path) and kept["secret"] == 1, out
        assert torch.equal(kept["t"], torch.rand(2, generator=torch.Generator().manual_seed(7)))
        rc, out, kept = scripts.run("import sys, torch\nseen = ['secret' in globals(), 'colorsys' in sys.modules]\n"
                                    "t = torch.rand(2)\n", tmp_path, "c", keep=True)
        assert rc == 0 and kept["seen"] == [False, False], (out, kept)  # b's import stayed in b
        assert not torch.equal(kept["t"], torch.rand(2, generator=torch.Generator().manual_seed(7)))  # b's seed
        assert scripts.run("raise SystemExit(3)\n", tmp_path, "d")[0] == 3
        assert sorted(p.name for p in tmp_path.iterdir()) == []  # its files are removed
    finally:
        scripts.close()


def test_every_pytest_block_passes_as_its_own_file(tmp_path):
    """docs/testing.md's examples are test files: each runs as its own file under `python3 -m pytest` in a fresh
    interpreter (two at a time), so the page's imports are the only ones it gets."""
    from concurrent.futures import ThreadPoolExecutor
    found = [b for b in T.python_blocks() if b.kind != "fragment" and re.search(r"^def test_", b.body, re.M)]
    assert [b.file for b in found] == ["docs/testing.md", "docs/testing.md"]
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda ib: T.run_script(ib[1].body, tmp_path / str(ib[0]), f"test_block_{ib[0]}",
                                                     pytest=True), enumerate(found)))
    for b, (rc, out, _) in zip(found, runs):
        assert rc == 0 and re.search(r"\b\d+ passed\b", out), f"{b.file}:{b.line}:\n{out[-3000:]}"


def test_output_shown_without_a_run_has_the_shape_a_run_prints():
    """A console block the suite does not run (its test reads it) shows a line such as `prepare: wrote ...`,
    `data: ...` or `step 1/40 | ...` that a checked transcript also shows: it must have the shape of one of
    those (a line that changed since the block was written is then found: docs/parallelism.md's prepare line)."""
    def shape(line):  # paths masked too: runs/long/ckpt and runs/walk/ckpt are the same kind of line
        return re.sub(r"'?[\w.#-]*/[\w./#-]*'?", "PATH", T.shape(line))

    def key(line):  # a message line (`prepare: wrote`, `data: PATH`) or a step line, by its first two words
        words = shape(line).split()
        return " ".join(words[:2]) if words and (words[0].endswith(":") or words[0] == "step") else None

    checked = {}
    for b in T.blocks():
        if b.kind == "transcript" and "measured" not in b.attrs:
            for _, shown in b.commands():
                for line in shown or []:
                    if key(line) and not line.startswith("megalite:"):  # megalite: lines differ by layout
                        checked.setdefault(key(line), set()).add(shape(line))
    stale, looked = [], 0
    for b in T.blocks():
        if b.kind != "tested-by" or b.lang != "console":
            continue
        for _, shown in b.commands():
            for line in shown or []:
                if key(line) in checked:
                    looked += 1
                    if shape(line) not in checked[key(line)]:
                        stale.append(f"{b.file}:{b.line}: {line}")
    assert looked >= 5 and stale == []


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_and_anchors_resolve():
    anchors = {}
    for path in T.doc_files():
        text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
        anchors[path.resolve()] = {_slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}
    bad = []
    for path in T.doc_files():
        text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"https?:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path.resolve()
            rel = str(dest.relative_to(ROOT)) if dest.is_relative_to(ROOT) else str(dest)
            if not dest.exists():
                if rel not in PENDING:
                    bad.append(f"{path.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors.get(dest, set()):
                bad.append(f"{path.name}: {target} (no such heading)")
    assert bad == []


def what_is_where_missing(readme: str) -> list:
    """Every file README.md's "What is where" tree names (x.py, x.sh, x.toml, a/b.py) that is not where the tree
    puts it: a name in a folder's row or the rows under it is a file of that folder (or of its parent)."""
    block = re.search(r"^## What is where\n.*?^```text\n(.*?)^```", readme, re.M | re.S).group(1)
    missing, top, sub = [], None, None
    for line in block.splitlines():
        head = re.match(r"( *)([\w.-]+/)", line)
        if head and len(head.group(1)) == 0:
            top, sub = head.group(2).rstrip("/"), None
        elif head and len(head.group(1)) == 2:
            sub = head.group(2).rstrip("/")
        for name in re.findall(r"(?<![\w/.-])([\w./-]*[\w-]\.(?:py|sh|sbatch|toml))\b", line):
            places = [ROOT / name] if "/" in name else [ROOT / top / (sub or "") / name, ROOT / top / name]
            if not any(p.is_file() for p in places):
                missing.append(f"{name} (under {top}/{sub + '/' if sub else ''})")
    return missing


def test_every_file_the_readme_tree_names_exists():
    assert what_is_where_missing((ROOT / "README.md").read_text()) == []


def test_measured_transcripts_name_their_commit_and_date_in_the_text():
    git = (ROOT / ".git").exists() and subprocess.run(["git", "--version"], capture_output=True).returncode == 0
    for b in T.blocks():
        if "measured" not in b.attrs:
            continue
        commit, date = b.attrs["measured"].split(",")
        assert re.fullmatch(r"[0-9a-f]{7,40}", commit) and re.fullmatch(r"\d{4}-\d\d-\d\d", date), b.attrs
        text = (ROOT / b.file).read_text().split("\n")
        before = " ".join(text[max(0, b.line - 12): b.line - 2])  # the paragraph above the marker
        assert f"`{commit}`" in before and date in before, f"{b.file}:{b.line}: the text does not say {commit}, {date}"
        if git:
            assert subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT).returncode == 0, commit


def test_the_transcripts_command_lists_its_sessions(capsys):
    assert T.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("walk: README.md:") and "\nbench-ckpt (measured): docs/performance.md:" in out


def test_readme_is_a_page_a_reader_finishes():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_shapes_mask_numbers_but_not_words():
    assert T.shape("step    25/150 | loss 3.1297 | 2,615 tok/s | ETA 1m21s") == \
        T.shape("step 3/9 | loss 5.0 | 405 tok/s | ETA 0m00s")
    assert T.shape("tp00-pp01-dp00  r4  316.2 KiB") == T.shape("tp01-pp00-dp01  r12  2.04 GiB")
    assert T.shape("RSS: 1926 -> 1926, 1927, 1927 MiB") == T.shape("RSS: 320 -> 320 MiB")
    assert T.shape("3. async save stall (pinned staging)  3 ms") != T.shape("3. async save stall (held, no copy) 3 ms")
    # a paired bench's verdict depends on the machine's load (CI printed "NOT met" where the docs show "met")
    assert T.shape("x/y: 0.91x (range 0.46-2.28); goal >= 1.0x: NOT met") == T.shape("x/y: 1.3x (range 1-2); goal >= 1.0x: met")
    assert T.shape("NOTE: metered") == "NOTE: metered"  # only the whole words
    assert T.compare(["a 1", "a 2", "b"], ["a 5", "b"]) == []  # repeated lines are one
    assert T.compare(["a 1", "b"], ["a 5", "c"]) != [] and T.compare(["a 1", "b"], ["a 5"]) != []
    assert T.compare(["x 1", "z"], ["w", "x 9", "y", "z"], mode="table") == []  # an excerpt, in order
    assert T.compare(["z", "x 1"], ["w", "x 9", "y", "z"], mode="table") != []  # out of order
    assert T.compare(["x 1", "q"], ["w", "x 9", "y", "z"], mode="table") != []  # not printed


# ---------------------------------------------------------------- the walkthrough and the pages built on it
@pytest.fixture(scope="module")
def walk(tmp_path_factory):
    pytest.importorskip("matplotlib")
    pytest.importorskip("transformers")
    return T.run_session("walk", tmp_path_factory.mktemp("walk"))


def test_readme_walkthrough_runs(walk):
    """The README walkthrough and every block of the pages that use its checkpoint, run small; each printed line
    has the shape shown (the torchrun launches are real; `megalite ...` runs in this process)."""
    assert walk.problems() == []
    cmds = [c for b in T.session_blocks("walk") if b.file == "README.md" for c, _ in b.commands()]
    assert len(cmds) >= 7 and any("megalite convert" in c for c in cmds) and any("--tree" in c for c in cmds)
    w = walk.work
    assert (w / "runs/walk/model.safetensors").is_file()
    assert (w / "runs/walk/loss.png").read_bytes()[:4] == b"\x89PNG"
    assert [r["step"] for r in metrics.read(w / "runs/walk-pp4")] == [10, 11, 12]  # from (2,2,2)'s step 9
    assert [(e["step"], e["layout"]) for e in metrics.events(w / "runs/walk-pp4")] == [(9, "tp=1 pp=4 dp=1")]


def test_the_json_and_safetensors_recipe_reads_a_zero1_checkpoint(walk):
    """docs/checkpoint-format.md's recipe, run on the walkthrough's (2,2,2) ZeRO-1 checkpoint: every model tensor
    equals `megalite convert`'s file, every moment a (1,1,1) `megalite reshard` of it, whose slices are whole."""
    from megalite.cli import main
    (i,) = [i for i, b in enumerate(T.session_blocks("walk")) if b.file == "docs/checkpoint-format.md"
            and b.lang == "python"]
    state = walk.namespaces[i]["state"]  # what the block's own script left, run in a fresh interpreter
    w = walk.work
    step = w / "runs/walk/ckpt" / (w / "runs/walk/ckpt/latest").read_text().strip()
    man = json.loads((step / "manifest.json").read_text())
    assert any("flat" in s for e in man["model"].values() for s in e["slices"]), "no flat piece to read"
    assert man["layout"] == {"tp": 2, "pp": 2, "dp": 2, "zero1": True}
    model = load_file(str(w / "runs/walk/model.safetensors"))
    assert set(model) == set(man["model"])
    for name, t in model.items():
        assert torch.equal(state[name], t), name
    assert main(["reshard", str(step), "--tp", "1", "--pp", "1", "--dp", "1", "--zero1", "off", "--out",
                 str(w / "runs/walk-111"), "--quiet"]) == 0
    one = w / "runs/walk-111" / (w / "runs/walk-111/latest").read_text().strip()
    man1 = json.loads((one / "manifest.json").read_text())
    assert set(man1["optimizer_state"]) == set(man["optimizer_state"]) != set()
    for name, e in man1["optimizer_state"].items():
        (s,) = e["slices"]
        assert "flat" not in s and s["box"] == [[0, n] for n in e["shape"]]
        with safe_open(str(one / s["file"]), "pt") as f:
            assert torch.equal(state[name], f.get_tensor(s["key"]).reshape(e["shape"])), name


def test_the_hugging_face_snippet_gives_megalites_logits(walk):
    (i,) = [i for i, b in enumerate(T.session_blocks("walk")) if b.lang == "python" and "pipeline(" in b.body]
    ns = walk.namespaces[i]
    assert ns["diff"] < 1e-5  # absolute, on logits of a few units: fp32 rounding (docs/converting.md)
    assert ns["ids"].tolist() == [[100, 101, 102, 32]]  # tok("def ").input_ids


# ---------------------------------------------------------------- the other sessions
def test_the_demo_script_runs(tmp_path):
    """README command 1 after its install: `bash launch/demo.sh`, with the tiny config made small."""
    T.setup("demo", tmp_path, small=True)
    rc, out = T.run_command("bash launch/demo.sh", tmp_path)
    assert rc == 0, out[-3000:]
    assert "verify: runs/demo/checkpoints/step_00000003 is complete and intact" in out
    assert (tmp_path / "runs/demo/model.safetensors").is_file()


def test_the_training_commands_run(tmp_path):
    res = T.run_session("train", tmp_path)
    assert res.problems() == []
    printed = {cmd: text for runs in res.runs.values() for cmd, _, text in runs}
    shown = printed["megalite config show --config configs/tiny-cpu.toml --parallel.tp=2"]
    assert "[parallel]" in shown and "\ntp = 2" in shown
    assert [r["step"] for r in metrics.read(tmp_path / "runs/tiny")][-1] == 3


def test_the_small_cpu_demo_runs(tmp_path):
    res = T.run_session("small", tmp_path)  # its transcript (sampled text) only needs to be non-empty
    assert res.problems() == []
    assert [(e["step"], e["layout"]) for e in metrics.events(tmp_path / "runs/small")] == [(2, "tp=1 pp=4 dp=1")]


# ---------------------------------------------------------------- the interleaved schedule's table
def test_interleaved_warmup_table_is_megalites_and_megatron_cores():
    """docs/parallelism.md's table of warm-up forwards: megalite's from interleaved_order equals megatron-core's
    from its own get_pp_rank_microbatches (a stand-in communicator gives it pp and the rank); the last column is
    Megatron's pre-November-2024 rule (m == pp: every rank all forwards first)."""
    from types import SimpleNamespace as NS
    from megalite.parallel.pipeline import interleaved_order
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")

    def ours(pp, r, m, vpp=2):
        kinds = [op[0] for op in interleaved_order(pp, r, m, vpp)]
        first_b = kinds.index(kinds[-1])  # the order ends with a backward
        return first_b if first_b == vpp * m else first_b - 1  # the steady phase opens with a forward

    def theirs(pp, r, m, vpp=2):
        comm = NS(pp_group=NS(size=lambda: pp, rank=lambda: r), virtual_pipeline_model_parallel_size=vpp)
        return schedules.get_pp_rank_microbatches(m, vpp, pp, p2p_communicator=comm)[2]

    text = (ROOT / "docs/parallelism.md").read_text()
    rows = re.findall(r"^\| (\d), (\d) \| ([\d, ]+) \| ([\d, ]+) \| ([\d, ]+) \|$", text, re.M)
    assert len(rows) >= 6
    for pp, m, ranks, shown, before in rows:
        pp, m = int(pp), int(m)
        for r, a, b in zip(*(map(int, x.split(", ")) for x in (ranks, shown, before))):
            assert (ours(pp, r, m), theirs(pp, r, m)) == (a, a), (pp, m, r)
            assert b == (2 * m if m == pp else a), (pp, m, r)  # the pre-November-2024 rule: m == pp all forwards
