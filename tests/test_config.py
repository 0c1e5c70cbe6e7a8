"""Config loading, overrides and validation: every bad value is one ConfigError line naming the field."""
import pytest

from helpers import cli, one_line_error
from megalite.config import Config, ConfigError, load_config, num_microbatches, resolve, validate

TOML = """
[model]
n_layer = 2
n_head = 4
n_embd = 32
block_size = 16
dropout = 0.1

[parallel]
tp = 2
schedule = "afab"
zero1 = true

[train]
lr = 1          # an int is fine for a float field
out_dir = "runs/x"

[checkpoint]
async = true
keep_last = 3
"""


@pytest.fixture
def toml_file(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(TOML)
    return p


def test_defaults():
    cfg = load_config(None)
    assert cfg == Config()
    validate(resolve(cfg, world_size=1), world_size=1)
    assert num_microbatches(cfg) == cfg.train.global_batch_size // cfg.train.micro_batch_size


def test_load_toml(toml_file):
    cfg = load_config(toml_file)
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.block_size) == (2, 4, 32, 16)
    assert cfg.model.dropout == 0.1
    assert cfg.model.vocab_size == 256  # untouched keys keep their defaults
    assert cfg.parallel.tp == 2 and cfg.parallel.schedule == "afab" and cfg.parallel.zero1 is True
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.train.out_dir == "runs/x"
    assert cfg.checkpoint.async_ is True and cfg.checkpoint.keep_last == 3
    d = cfg.to_dict()
    assert d["checkpoint"]["async"] is True and "async_" not in d["checkpoint"]
    assert Config.from_dict(d) == cfg  # round trip


def test_overrides_coerce_types(toml_file):
    cfg = load_config(toml_file, ["--model.n_layer=6", "--train.lr=2e-4", "--parallel.zero1=false",
                                  "--parallel.schedule=1f1b", "--train.out_dir=runs/y=z", "model.n_head=8",
                                  "--checkpoint.async=off", "--train.min_lr=0", "--data.auto_prepare=yes"])
    assert cfg.model.n_layer == 6 and type(cfg.model.n_layer) is int
    assert cfg.train.lr == 2e-4 and type(cfg.train.lr) is float
    assert cfg.parallel.zero1 is False
    assert cfg.parallel.schedule == "1f1b"
    assert cfg.train.out_dir == "runs/y=z"  # only the first '=' separates key from value
    assert cfg.model.n_head == 8
    assert cfg.checkpoint.async_ is False
    assert cfg.train.min_lr == 0.0 and type(cfg.train.min_lr) is float
    assert cfg.data.auto_prepare is True
    for text, want in [("true", True), ("1", True), ("on", True), ("TRUE", True), ("0", False), ("no", False)]:
        assert load_config(None, [f"--parallel.zero1={text}"]).parallel.zero1 is want
    # later overrides win; overrides beat the file
    assert load_config(toml_file, ["--parallel.tp=4", "--parallel.tp=1"]).parallel.tp == 1


def _config_error(fn, *names):
    with pytest.raises(ConfigError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and msg.strip() == msg and msg
    for name in names:
        assert name in msg, (name, msg)
    return msg


@pytest.mark.parametrize("overrides,names", [
    (["--modle.n_layer=2"], ["unknown section", "modle"]),
    (["--model.n_layers=2"], ["unknown key", "model.n_layers"]),
    (["--checkpoint.async_=true"], ["unknown key", "checkpoint.async_"]),
    (["--model.n_layer=four"], ["model.n_layer", "int"]),
    (["--model.n_layer=2.5"], ["model.n_layer", "int"]),
    (["--train.lr=fast"], ["train.lr", "float"]),
    (["--parallel.zero1=maybe"], ["parallel.zero1", "bool"]),
    (["--model.n_layer"], ["--section.key=value"]),
    (["--n_layer=3"], ["--section.key=value"]),
])
def test_bad_overrides(overrides, names):
    _config_error(lambda: load_config(None, overrides), *names)


@pytest.mark.parametrize("body,names", [
    ("[modle]\nn_layer = 2\n", ["unknown section", "modle"]),
    ("[train]\nsteps = 10\nlearning_rate = 0.1\n", ["unknown key", "train.learning_rate"]),
    ('[model]\nn_layer = "four"\n', ["model.n_layer", "four", "int"]),
    ("[model]\nn_layer = 2.0\n", ["model.n_layer", "float", "int"]),
    ("[model]\nn_layer = true\n", ["model.n_layer", "bool", "int"]),
    ('[parallel]\nzero1 = "maybe"\n', ["parallel.zero1", "bool"]),
    ('[model]\nn_layer = "4"\n', ["model.n_layer", "str", "int"]),  # TOML values are not re-parsed
    ('[parallel]\nzero1 = "yes"\n', ["parallel.zero1", "str", "bool"]),
    ("[train]\nlr = true\n", ["train.lr", "bool", "float"]),
    ("[train]\nout_dir = 3\n", ["train.out_dir", "str"]),
    ("model = 3\n", ["[model]"]),
    ("[model\nn_layer = 2\n", ["not valid TOML"]),
])
def test_bad_toml(tmp_path, body, names):
    p = tmp_path / "bad.toml"
    p.write_text(body)
    msg = _config_error(lambda: load_config(p), *names)
    assert str(p) in msg


def test_missing_file(tmp_path):
    _config_error(lambda: load_config(tmp_path / "nope.toml"), "nope.toml", "does not exist")


@pytest.mark.parametrize("overrides,world,names", [
    (["--model.n_layer=0"], 1, ["model.n_layer", "positive"]),
    (["--parallel.tp=0"], None, ["parallel.tp", "positive"]),
    (["--parallel.dp=-2"], None, ["parallel.dp", "positive"]),
    (["--train.micro_batch_size=0"], 1, ["train.micro_batch_size", "positive"]),
    (["--train.global_batch_size=-16"], 1, ["train.global_batch_size", "positive"]),
    (["--train.steps=0"], 1, ["train.steps", "positive"]),
    (["--train.lr=-1e-3"], 1, ["train.lr", "negative"]),
    (["--train.warmup_steps=-1"], 1, ["train.warmup_steps", "negative"]),
    (["--checkpoint.keep_last=-1"], 1, ["checkpoint.keep_last", "negative"]),
    (["--parallel.tp=2", "--parallel.pp=2", "--parallel.dp=2"], 4, ["world size 4", "8"]),
    (["--parallel.dp=2"], 1, ["world size 1", "2"]),
    (["--model.n_head=4", "--parallel.tp=3"], 3, ["parallel.tp", "model.n_head"]),
    (["--model.n_embd=30", "--model.n_head=4"], 1, ["model.n_embd", "model.n_head"]),
    (["--model.n_layer=2", "--parallel.pp=4"], 4, ["parallel.pp", "model.n_layer"]),
    (["--train.global_batch_size=12", "--train.micro_batch_size=4", "--parallel.dp=2"], 2,
     ["train.global_batch_size", "micro_batch_size", "parallel.dp"]),
    (["--train.global_batch_size=10", "--train.micro_batch_size=4"], 1, ["train.global_batch_size"]),
    (["--parallel.schedule=gpipe"], 1, ["parallel.schedule", "gpipe"]),
    (["--train.precision=fp16"], 1, ["train.precision"]),
    (["--model.dropout=1.0"], 1, ["model.dropout"]),
    (["--data.val_fraction=1"], 1, ["data.val_fraction"]),  # 0 is the default: the file's own split
    (["--train.min_lr=1", "--train.lr=0.1"], 1, ["train.min_lr", "train.lr"]),
])
def test_validate_errors(overrides, world, names):
    cfg = load_config(None, overrides)  # loading accepts any well-typed value
    _config_error(lambda: validate(resolve(cfg, world), world), *names)


def test_validate_accepts_good_layouts():
    for tp, pp, dp in [(1, 1, 1), (2, 2, 2), (4, 2, 1), (1, 4, 2), (2, 1, 4)]:
        cfg = load_config(None, [f"--parallel.tp={tp}", f"--parallel.pp={pp}", f"--parallel.dp={dp}",
                                 "--train.global_batch_size=16", "--train.micro_batch_size=2"])
        assert validate(resolve(cfg, tp * pp * dp), tp * pp * dp) is cfg
        assert num_microbatches(cfg) == 16 // (2 * dp)


@pytest.mark.parametrize("args,names", [
    (["--parallel.tpp=2"], ["unknown key", "parallel.tpp"]),
    (["--train.steps=ten"], ["train.steps", "int"]),
    (["--parallel.tp=2"], ["world size 1"]),
    (["--model.n_layer"], ["--section.key=value"]),
    (["bogus"], ["bogus"]),
])
def test_cli_config_errors_exit_2_with_one_line(tmp_path, tiny_toml, args, names):
    line = one_line_error(cli("train", "--config", tiny_toml, *args, cwd=tmp_path))
    for name in names:
        assert name in line, (name, line)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing was trained


def test_cli_unknown_subcommand_and_missing_config(tmp_path):
    assert "trian" in one_line_error(cli("trian", cwd=tmp_path))
    assert "missing.toml" in one_line_error(cli("train", "--config", tmp_path / "missing.toml", cwd=tmp_path))


@pytest.mark.parametrize("overrides,world,dp", [
    ([], 1, 1), (["--parallel.tp=2", "--parallel.pp=2"], 8, 2), ([], None, 1),
    (["--checkpoint.resume=", "--parallel.sp=true", "--parallel.tp=2"], 2, 1),
    (["--checkpoint.dir=", "--parallel.dp=2"], 2, 2), (["--checkpoint.resume=", "--parallel.dp=1"], 1, 1)])
def test_validate_only_reads_and_resolve_fills_in_first(overrides, world, dp):
    import copy
    cfg = load_config(None, overrides)
    as_loaded = copy.deepcopy(cfg)
    if cfg.parallel.dp == 0:  # left to the world size: a check of the unresolved config fails
        _config_error(lambda: validate(cfg, world), "parallel.dp = 0")
    else:  # checked as loaded (its checkpoint.dir still says {out_dir}, resume may be ""): it passes
        validate(cfg, world)
    assert cfg == as_loaded  # either way, nothing was written
    resolved = resolve(cfg, world)
    assert resolved is cfg and cfg.parallel.dp == dp
    assert cfg.checkpoint.resume == (as_loaded.checkpoint.resume or "none")
    assert cfg.checkpoint.dir == as_loaded.checkpoint.dir.replace("{out_dir}", cfg.train.out_dir)
    after_resolve = copy.deepcopy(cfg)
    assert validate(cfg, world) is cfg and cfg == after_resolve  # validate wrote nothing
    assert resolve(cfg, world) == after_resolve  # resolving again changes nothing


# ---------------------------------------------------------------- every field does something (issue 21, class 7)
def config_readers(package=None) -> dict:
    """{"section.field": {modules that read it}} from the source of the core (the CLI, the tools and the test
    helper are not the product; config.py's checkers and printers only validate or show a field). A read is
    `<section value>.<field>`, where a section value is `<anything>.<section>` (cfg.train, self.cfg.model), a
    name or attribute assigned one (`t, par = cfg.train, cfg.parallel`, `self.c = cfg.checkpoint`), a parameter
    annotated with the section's class (`t: TrainConfig`), or a section built in place (`ModelConfig(**m)`)."""
    import ast
    import dataclasses
    from pathlib import Path
    import megalite
    from megalite.config import Config
    package = Path(package or Path(megalite.__file__).parent)
    sections = {f.name: f.type if isinstance(f.type, str) else f.type.__name__ for f in dataclasses.fields(Config)}
    by_class = {cls: s for s, cls in sections.items()}
    fields = {s: {f.name for f in dataclasses.fields(getattr(Config(), s))} for s in sections}
    not_core = ("megalite.cli", "megalite.__main__", "megalite.testing", "megalite.bench")
    checkers = {"validate", "check_numbers", "_validate_memory_features", "model_from", "resolve", "to_dict",
                "from_dict", "to_toml", "fields", "help_text", "settings"}
    found = {f"{s}.{f}": set() for s in sections for f in sorted(fields[s])}
    for path in sorted(package.rglob("*.py")):
        mod = ".".join(path.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__")
        if mod.startswith(not_core):
            continue
        tree, alias = ast.parse(path.read_text()), {}

        def section_of(node):
            if isinstance(node, ast.Attribute) and node.attr in sections:
                return node.attr
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in by_class:
                return by_class[node.func.id]
            return alias.get(ast.unparse(node))

        for _ in range(2):  # aliases of aliases
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign):
                    for target in node.targets:
                        pairs = zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple) and isinstance(
                            node.value, ast.Tuple) else [(target, node.value)]
                        alias.update({ast.unparse(t): section_of(v) for t, v in pairs if section_of(v)})
                elif isinstance(node, ast.arg) and node.annotation is not None:
                    cls = ast.unparse(node.annotation).strip("'\"")
                    if cls in by_class:
                        alias[node.arg] = by_class[cls]

        def visit(node, skipped=False):
            skipped = skipped or (mod == "megalite.config" and isinstance(node, ast.FunctionDef)
                                  and node.name in checkers)
            if isinstance(node, ast.Attribute) and not skipped:
                sec = section_of(node.value)
                if sec and node.attr in fields[sec]:
                    found[f"{sec}.{node.attr}"].add(mod)
            for child in ast.iter_child_nodes(node):
                visit(child, skipped)

        visit(tree)
        for cls in ast.walk(tree):  # a section's own properties (ModelConfig.ffn_size reads self.intermediate_size)
            if isinstance(cls, ast.ClassDef) and cls.name in by_class:
                for node in ast.walk(cls):
                    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                            and node.value.id == "self" and node.attr in fields[by_class[cls.name]]):
                        found[f"{by_class[cls.name]}.{node.attr}"].add(mod)
    return found


def test_every_config_field_has_a_reader():
    """A setting that is documented and validated but read by nothing does nothing (data.val_fraction did:
    the split came from the token file). Every field of the config dataclasses is read by the core."""
    found = config_readers()
    unread = sorted(k for k, mods in found.items() if not mods)
    assert not unread, f"config fields that nothing reads: {unread}"
    # the analysis itself: it sees reads through each kind of alias it claims to
    assert "megalite.run.schedule" in found["train.lr"]  # `t: TrainConfig` then t.lr
    assert "megalite.run.ckpt_policy" in found["checkpoint.keep_last"]  # self.c = cfg.checkpoint; self.c.keep_last
    assert "megalite.model" in found["model.n_head"]
    assert "megalite.run.inputs" in found["data.val_fraction"]
