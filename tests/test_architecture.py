"""The package's shape, read from its source: no import cycles between modules or between folders (imports
inside functions count), every folder on its floor (no import runs back up), the core never reaches the
benchmarks of `megalite bench`, the test helpers or the CLI, the product imports nothing of benchmarks/ or
tests/, and every user-error class derives from base.errors.MegaliteError.

`python3 tests/test_architecture.py` prints the import graph (one line per module: what it imports) and its
cycles; `--core` prints only the core's edges; `--floors` prints the folder-level graph, floor by floor.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import sys
from pathlib import Path


PACKAGE = Path(__file__).resolve().parent.parent / "megalite"

# Import cycles tolerated for now, each the set of modules of one strongly connected component: none. A cycle
# that appears, or a listed one that has gone, fails the test.
KNOWN_CYCLES: list[frozenset] = []

# Above the core: the core (everything else) never imports these, not even lazily inside a function.
NOT_CORE = ("megalite.cli", "megalite.__main__", "megalite.testing", "megalite.bench")

# The floors of the house, read at the scale of folders: a folder of megalite/ (base, parallel, ...) is one node,
# a module loose at the top of the package is one node. Every import runs from a higher floor to a lower one;
# nodes on one floor import nothing of each other. `megalite` (the package's __init__) hands names on lazily and
# imports nothing when it is loaded: floor 0.
FLOORS = {
    "megalite": 0,
    "base": 1,                                  # torch-free: errors, jsonio, faults, fs
    "parallel": 2,                              # the grid, the process group, the parallel layers
    "models": 2,                                # the family specs: data plus a few functions (no family above)
    "attention": 2,                             # which kernel runs a masked attention core (sdpa, flex)
    "config": 3, "tokenizer": 3,                # tokenizer: reads tokenizers, opens no checkpoint
    "model": 4, "checkpoint": 4,                # checkpoint/: the format's engine (and which tokenizer it carries)
    "data": 6, "convert": 6,
    "run": 7, "generate": 7,                    # the training run and its policies
    "testing": 8,
    "bench": 9,                                 # what a user measures: `megalite bench ...`
    "cli": 10,
    "__main__": 11,
}
MAX_TOP_MODULES = 8  # modules loose at the top of megalite/ (its __init__ aside)

# Outside the product: nothing in megalite/ imports these, not even lazily.
OUTSIDE = ("benchmarks", "tests")

# Exceptions defined outside errors.py that are not user errors, and why.
NOT_USER_ERRORS = {
    "megalite.testing.RankFailed": "a failing test's report (an AssertionError), raised by the test helper",
    "megalite.convert.unpickle.RefusedGlobal": "internal to the reader: always caught and re-raised as a "
                                                "ConvertError naming the file",
}


# ---------------------------------------------------------------- the graph, from the source
def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute name `from <level dots><module> import ...` means inside `importer`."""
    if level == 0:
        return module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, from every import statement in it (at module level or inside
    a function: a lazy import still runs and still closes a circle), relative imports resolved, plus calls that
    import a literal name (`importlib.import_module`, a bare `import_module`, `__import__`: `_dynamic_import`).
    A package whose `__init__` exports names lazily (an `_EXPORTS` table read by a module `__getattr__`) imports
    their modules only when a name is asked for: `from megalite import init_distributed` is an edge to the
    module that defines it, `from megalite import __version__` is not."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in files.items()}
    exports = {name: _exports(tree) for name, tree in trees.items() if files[name].name == "__init__.py"}
    top = root.name
    graph: dict[str, set[str]] = {}
    for name, tree in trees.items():
        is_package = files[name].name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node.level, node.module)
                # `from . import sibling` imports the sibling module; the package itself is already importing
                if node.module is not None or not all(f"{base}.{a.name}" in files for a in node.names):
                    targets.add(base)
                for a in node.names:  # `from pkg import x`: x may be a module, a lazy export or a plain name
                    targets |= {f"{base}.{a.name}", exports.get(base, {}).get(a.name, "")}
            elif (dynamic := _dynamic_import(node, name, is_package)) is not None:
                targets.add(dynamic)
        graph[name] = {t for t in targets if t in files and t != name and t.split(".")[0] == top}
    return graph


def _dynamic_import(node: ast.AST, importer: str, is_package: bool) -> str | None:
    """The absolute module a call imports by a literal name, however it is spelt: `importlib.import_module("m")`,
    a bare `import_module("m")` (from importlib), `__import__("m")`, and a relative
    `import_module(".m", __package__)` resolved against the importer; None for any other node."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
        return None
    func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
    if func not in ("import_module", "__import__"):
        return None
    target = node.args[0].value
    if func == "import_module" and target.startswith("."):
        rel = target.lstrip(".")
        return _resolve(importer, is_package, len(target) - len(rel), rel or None)
    return target


def _exports(tree: ast.Module) -> dict[str, str]:
    """A package `__init__`'s lazy export table: `_EXPORTS = {"name": "module", ...}`."""
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets)
                and isinstance(node.value, ast.Dict)):
            return {k.value: v.value for k, v in zip(node.value.keys, node.value.values)
                    if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)}
    return {}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as one closed path through
    it (m1 -> m2 -> ... -> m1), smallest first."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(_closed_path(graph, set(comp)))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out, key=lambda c: (len(c), c))


def _closed_path(graph, comp: set) -> list[str]:
    """A path that starts at the component's first module and visits every module of it, back to the start
    (found by breadth-first search between consecutive members)."""
    order = sorted(comp)
    path = [order[0]]
    for target in order[1:] + [order[0]]:
        if target in path[:-1] and target != order[0]:
            continue
        path += _shortest(graph, path[-1], target, comp)[1:]
    return path


def _shortest(graph, a: str, b: str, within: set) -> list[str]:
    prev, frontier = {a: None}, [a]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w in within and w not in prev:
                    prev[w] = v
                    nxt.append(w)
                if w == b and v is not None:
                    path = [b, v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return path[::-1]
        frontier = nxt
    raise AssertionError(f"{b} is not reachable from {a}")


def is_core(module: str) -> bool:
    return not any(module == n or module.startswith(n + ".") for n in NOT_CORE)


def forbidden_paths(graph: dict[str, set[str]]) -> list[list[str]]:
    """For each core module that reaches a non-core one: the import path that gets there."""
    out = []
    for start in sorted(m for m in graph if is_core(m)):
        prev, frontier = {start: None}, [start]
        while frontier:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w in prev:
                        continue
                    prev[w] = v
                    if not is_core(w):
                        path = [w]
                        while prev[path[-1]] is not None:
                            path.append(prev[path[-1]])
                        out.append(path[::-1])
                        nxt = frontier = []
                        break
                    nxt.append(w)
                if not frontier:
                    break
            frontier = nxt
    return out


def render(graph: dict[str, set[str]], only_core: bool = False) -> str:
    mods = [m for m in sorted(graph) if is_core(m) or not only_core]
    short = lambda m: m.removeprefix("megalite.") if m != "megalite" else "megalite"  # noqa: E731
    lines = [f"{short(m):<28} -> {', '.join(short(t) for t in sorted(graph[m]) if is_core(t) or not only_core)}"
             for m in mods]
    found = cycles(graph)
    lines.append(f"{len(graph)} modules, {sum(len(v) for v in graph.values())} import edges, {len(found)} cycle(s)")
    lines += ["cycle: " + " -> ".join(short(m) for m in c) for c in found]
    return "\n".join(lines)


def node_of(module: str) -> str:
    """The folder-level node of a module: `megalite.checkpoint.api` -> checkpoint, `megalite.cli` -> cli."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """{node: the nodes it imports}, from the module graph (so lazy imports count)."""
    out: dict[str, set[str]] = {node_of(m): set() for m in graph}
    for a, targets in graph.items():
        out[node_of(a)] |= {node_of(b) for b in targets if node_of(b) != node_of(a)}
    return out


def arrows_back_up(graph: dict[str, set[str]], floors: dict = FLOORS) -> list[str]:
    """Every module import that does not run down: from a node to one on its own floor or above (or a node that
    has no floor)."""
    out = []
    for a in sorted(graph):
        for b in sorted(graph[a]):
            na, nb = node_of(a), node_of(b)
            if na == nb:
                continue
            if na not in floors or nb not in floors:
                out.append(f"{a} -> {b}: {na if na not in floors else nb} has no floor in FLOORS")
            elif floors[nb] >= floors[na]:
                out.append(f"{a} (floor {floors[na]}) -> {b} (floor {floors[nb]})")
    return out


def imports_outside(root: Path = PACKAGE) -> list[str]:
    """Every import in the package of a top-level name in OUTSIDE (benchmarks, tests), lazy ones included."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            elif (dyn := _dynamic_import(node, module_name(path, root), path.name == "__init__.py")) is not None:
                names = [dyn]
            out += [f"{module_name(path, root)}: {n}" for n in names if n.split(".")[0] in OUTSIDE]
    return out


def render_floors(graph: dict[str, set[str]]) -> str:
    fg = folder_graph(graph)
    lines = [f"floor {FLOORS.get(n, '?'):>2}  {n:<12} -> {', '.join(sorted(fg[n], key=lambda x: -FLOORS.get(x, 99)))}"
             for n in sorted(fg, key=lambda n: (-FLOORS.get(n, 99), n))]
    lines.append(f"{len(fg)} nodes, {sum(len(v) for v in fg.values())} edges, {len(cycles(fg))} circle(s), "
                 f"{len(arrows_back_up(graph))} import(s) back up")
    return "\n".join(lines)


# ---------------------------------------------------------------- the tests
def test_no_import_cycles_apart_from_the_known_ones():
    graph = import_graph()
    found = cycles(graph)
    unknown = [c for c in found if frozenset(c) not in KNOWN_CYCLES]
    assert not unknown, "import cycle(s):\n" + "\n".join(" -> ".join(c) for c in unknown)
    gone = [sorted(k) for k in KNOWN_CYCLES if k not in {frozenset(c) for c in found}]
    assert not gone, f"KNOWN_CYCLES lists cycles that no longer exist (remove them): {gone}"


def test_the_core_never_imports_tools_testing_or_cli():
    paths = forbidden_paths(import_graph())
    assert not paths, "the core reaches what is not the product:\n" + "\n".join(" -> ".join(p) for p in paths)


def test_no_circle_between_folders():
    found = cycles(folder_graph(import_graph()))
    assert not found, "folder circle(s), lazy imports included:\n" + "\n".join(" -> ".join(c) for c in found)


def test_every_import_runs_down_the_floors():
    back = arrows_back_up(import_graph())
    assert not back, "imports that run back up (or a node without a floor in FLOORS):\n" + "\n".join(back)


def test_the_product_imports_nothing_outside_the_package():
    found = imports_outside()
    assert not found, "the product imports a development tool or a test:\n" + "\n".join(found)


def test_few_modules_loose_at_the_top():
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_MODULES, f"{len(top)} modules loose at the top of megalite/ " \
                                        f"(at most {MAX_TOP_MODULES}): {top}"
    tools = [p.name for p in PACKAGE.rglob("*.py") if p.stem in ("stress", "simcluster", "transcripts", "phases")]
    assert not tools, f"development tools inside the package (their place is benchmarks/): {tools}"


def test_every_user_error_derives_from_megalite_error():
    from megalite.base.errors import MegaliteError
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        if name in ("megalite.__main__",):
            continue
        mod = importlib.import_module(name)
        for cls_name, cls in inspect.getmembers(mod, inspect.isclass):
            if cls.__module__ != name or not issubclass(cls, BaseException) or name == "megalite.base.errors":
                continue
            if not issubclass(cls, MegaliteError) and f"{name}.{cls_name}" not in NOT_USER_ERRORS:
                wrong.append(f"{name}.{cls_name}({', '.join(b.__name__ for b in cls.__bases__)})")
    assert not wrong, f"error classes outside the errors.MegaliteError family: {wrong}"


# Rank-agreement collectives (Python objects gathered or broadcast) have one owner, parallel/agree.py; where
# another module calls one itself, and why.
OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list")
OWN_OBJECT_COLLECTIVES = {
    "megalite.bench.ckpt": "the measured baseline 'gather + torch.save' (what a plain DCP user would write)",
}


def object_collectives_outside_agree(root: Path = PACKAGE) -> list[str]:
    """Every call of a torch.distributed object collective outside parallel/agree.py (and OWN_OBJECT_COLLECTIVES)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        name = module_name(path, root)
        if name.endswith(".parallel.agree") or name in OWN_OBJECT_COLLECTIVES:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) \
                    in OBJECT_COLLECTIVES:
                out.append(f"{name}:{node.lineno}: {ast.unparse(node.func)}")
    return out


def test_rank_agreement_collectives_are_asked_of_agree():
    found = object_collectives_outside_agree()
    assert not found, "object collectives outside parallel/agree.py (ask agree.everyone, gather_to_first, " \
                      "bcast_object):\n" + "\n".join(found)


# ---------------------------------------------------------------- the checker itself, on crafted packages
def _package(tmp_path, files: dict[str, str]) -> Path:
    root = tmp_path / "megalite"
    for rel, text in {"__init__.py": "", **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_checker_finds_a_lazy_circle_through_a_relative_import(tmp_path):
    root = _package(tmp_path, {"a.py": "from .sub import b\n",
                               "sub/__init__.py": "",
                               "sub/b.py": "def f():\n    from .. import c\n",
                               "c.py": "import megalite.a\n",
                               "d.py": "from .c import x\n"})
    graph = import_graph(root)
    assert graph["megalite.sub.b"] == {"megalite.c"}  # `from .. import c`: the module c, not the package
    assert cycles(graph) == [["megalite.a", "megalite.sub.b", "megalite.c", "megalite.a"]]


def test_the_checker_finds_the_core_reaching_a_tool(tmp_path):
    root = _package(tmp_path, {"train.py": "def f():\n    from .data import g\n",
                               "data.py": "import importlib\nimportlib.import_module('megalite.bench.x')\n",
                               "bench/__init__.py": "", "bench/x.py": "from ..train import f\n",
                               "cli.py": "from .train import f\n"})
    assert forbidden_paths(import_graph(root)) == [["megalite.data", "megalite.bench.x"],
                                                   ["megalite.train", "megalite.data", "megalite.bench.x"]]


def test_the_checker_finds_a_folder_circle_and_an_arrow_back_up(tmp_path):
    root = _package(tmp_path, {"base/__init__.py": "", "base/fs.py": "def f():\n    from ..run import train\n",
                               "run/__init__.py": "", "run/train.py": "from ..base import fs\n",
                               "cli.py": "import benchmarks.stress\n"})
    graph = import_graph(root)
    assert cycles(folder_graph(graph)) == [["base", "run", "base"]]
    assert arrows_back_up(graph, {"base": 1, "run": 6, "cli": 9, "megalite": 0}) == [
        "megalite.base.fs (floor 1) -> megalite.run (floor 6)", "megalite.base.fs (floor 1) -> megalite.run.train (floor 6)"]
    assert imports_outside(root) == ["megalite.cli: benchmarks.stress"]


def test_the_checker_sees_every_spelling_of_a_lazy_import(tmp_path):
    root = _package(tmp_path, {"base/__init__.py": "", "run/__init__.py": "", "run/train.py": "",
                               "run/plot.py": "", "run/schedule.py": "",
                               "base/fs.py": "def f():\n    from importlib import import_module\n"
                                             "    import_module('megalite.run.train')\n",
                               "base/lock.py": "def f():\n    return __import__('megalite.run.plot')\n",
                               "base/jsonio.py": "def f():\n    import importlib\n"
                                                 "    importlib.import_module('..run.schedule', __package__)\n",
                               "cli.py": "def f():\n    __import__('benchmarks.stress')\n",
                               "data.py": "def f():\n    from importlib import import_module\n"
                                          "    import_module('tests.helpers')\n"})
    graph = import_graph(root)
    assert graph["megalite.base.fs"] == {"megalite.run.train"}
    assert graph["megalite.base.lock"] == {"megalite.run.plot"}
    assert graph["megalite.base.jsonio"] == {"megalite.run.schedule"}
    assert len(arrows_back_up(graph, {"base": 1, "run": 7, "cli": 10, "data": 6, "megalite": 0})) == 3
    assert imports_outside(root) == ["megalite.cli: benchmarks.stress", "megalite.data: tests.helpers"]


if __name__ == "__main__":
    print(render_floors(import_graph()) if "--floors" in sys.argv else
          render(import_graph(), only_core="--core" in sys.argv))
