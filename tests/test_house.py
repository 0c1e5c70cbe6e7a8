"""The house kept clean, read from the repository (nothing run): no binary or archive tracked by git (a wheel
committed by accident came back once after being deleted), no function of the package that nothing names, and
the commands the documents show name only tools a user of megalite has."""
from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------- binaries and archives
ARCHIVES = (".whl", ".zip", ".tar", ".gz", ".tgz", ".bz2", ".xz", ".zst", ".7z", ".egg", ".jar", ".pt", ".pth",
            ".bin", ".safetensors", ".parquet", ".npy", ".npz", ".pkl", ".so", ".pyc")
# binaries a page shows, each named by the page that shows it
SHOWN = {"docs/small-cpu-loss.png": "docs/training.md"}


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


def binaries_and_archives(paths: list[str], root: Path = ROOT) -> list[str]:
    """Every path with an archive's or a build artefact's suffix, or whose first 8 KiB hold a NUL byte (a binary),
    apart from the images of SHOWN, each shown by its page."""
    bad = []
    for rel in paths:
        p = root / rel
        if not p.is_file() or p.is_symlink():
            continue
        if rel in SHOWN and Path(rel).name in (root / SHOWN[rel]).read_text():
            continue
        with open(p, "rb") as f:
            head = f.read(8192)
        if rel.lower().endswith(ARCHIVES) or b"\0" in head:
            bad.append(rel)
    return bad


def test_no_binary_or_archive_is_tracked():
    found = binaries_and_archives(tracked())
    assert not found, f"binaries or archives tracked by git (git rm --cached them; build outputs stay out): {found}"


def test_the_check_finds_a_wheel_and_a_binary_but_not_text(tmp_path):
    (tmp_path / "pyflakes-4.1.0-py2.py3-none-any.whl").write_bytes(b"PK\x03\x04 text-looking")  # by its suffix
    (tmp_path / "blob").write_bytes(b"ELF\0\0\0")
    (tmp_path / "notes.md").write_text("plain text\n")
    assert binaries_and_archives(["pyflakes-4.1.0-py2.py3-none-any.whl", "blob", "notes.md"], tmp_path) == \
        ["pyflakes-4.1.0-py2.py3-none-any.whl", "blob"]


# ---------------------------------------------------------------- functions referenced nowhere
# methods a library calls by name (never named in our own source)
CALLED_BY_NAME = {"find_class", "persistent_load"}  # pickle.Unpickler's hooks (convert/unpickle.py)


def unreferenced(package: Path = ROOT / "megalite", text_roots=("megalite", "tests", "benchmarks", "launch", "docs"),
                 root: Path = ROOT) -> list[str]:
    """Every function, method and class defined in `package` whose name occurs nowhere else, as a whole word, in
    the source, tests, benchmarks, launch scripts or documents (dunder methods and CALLED_BY_NAME aside)."""
    texts = [p.read_text() for d in text_roots for p in (root / d).rglob("*") if p.is_file()
             and p.suffix in (".py", ".md", ".sh", ".sbatch", ".toml")]
    texts += [(root / f).read_text() for f in ("README.md", "pyproject.toml") if (root / f).is_file()]
    words: dict[str, int] = {}
    for t in texts:
        for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", t):
            words[w] = words.get(w, 0) + 1
    out = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                n = node.name
                if (n.startswith("__") and n.endswith("__")) or n in CALLED_BY_NAME:
                    continue
                if words.get(n, 0) <= 1:  # its own definition only
                    out.append(f"{path.relative_to(root)}:{node.lineno}: {n}")
    return out


def test_every_function_of_the_package_is_named_somewhere():
    found = unreferenced()
    assert not found, "defined but named nowhere (remove them, or use them):\n" + "\n".join(found)


def test_the_scan_finds_a_planted_orphan(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("def used():\n    pass\n\n\ndef orphan_x():\n    used()\n")
    assert unreferenced(tmp_path / "pkg", ("pkg",), tmp_path) == ["pkg/m.py:5: orphan_x"]


# ---------------------------------------------------------------- the tools the documents name
# what a user has after README's install (and a shell): megalite itself, Python, pip, torchrun, the launch
# scripts, and the CLIs of the extras (tensorboard, wandb, transformers)
USER_TOOLS = {"megalite", "python", "python3", "pip", "torchrun", "bash", "sh", "sbatch", "srun", "export", "cd",
              "ls", "cat", "cmp", "cp", "diff", "git", "tensorboard", "wandb", "transformers", "head", "tail", "du", "echo", "kill", "env"}


def doc_commands(root: Path = ROOT) -> list[tuple[str, str, str]]:
    """(page, first word, line) for every line of a fenced block in README.md and docs/*.md whose first word
    (after a `$ ` prompt) is a program on PATH or follows a `$ ` prompt, continuation lines and Python, TOML and
    JSON blocks skipped."""
    out = []
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for lang, block in re.findall(r"^```([a-z]*)\n(.*?)^```", page.read_text(), re.S | re.M):
            if lang in ("python", "toml", "json"):
                continue
            cont = False
            for line in block.splitlines():
                s, was_cont = line.strip(), cont
                cont = s.endswith("\\")
                if was_cont or not s:
                    continue
                prompted = s.startswith("$ ")
                if lang == "console" and not prompted:
                    continue  # a console block's other lines are what the commands print
                word = (s[2:] if prompted else s).split()[0]
                if "=" in word and not prompted:
                    continue
                word = word.split("=")[-1] if "=" in word else word
                if prompted or shutil.which(word):
                    out.append((page.name, word, s))
    return out


def test_the_documents_name_only_tools_a_user_has():
    launch = {p.name for p in (ROOT / "launch").iterdir()}
    bad = [f"{page}: {line}" for page, word, line in doc_commands()
           if word not in USER_TOOLS and Path(word).name not in launch and not word.startswith(("./", "launch/"))]
    assert not bad, "commands of tools a user does not have:\n" + "\n".join(bad)


@pytest.mark.parametrize("line, found", [("$ farm-studio walk x", True), ("megalite verify ckpt", False)])
def test_the_tool_check_reads_a_prompted_line(tmp_path, line, found):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(f"# x\n\n```text\n{line}\n```\n")
    words = [w for _, w, _ in doc_commands(tmp_path) if w not in USER_TOOLS]
    assert bool(words) == found, words
