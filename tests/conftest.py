"""Shared fixtures: the token files, the tiny config (as a Config or a TOML file), in-process training of a
reference, and the converter tests' training runs, built once per session. Plain functions are in helpers.py."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import helpers as H
from megalite.config import Config


# ---------------------------------------------------------------- token files
@pytest.fixture(scope="session")
def token_file(tmp_path_factory) -> Path:
    """~60 KB of stdlib source as byte tokens (the training, checkpoint and fault tests)."""
    return H.make_token_file(tmp_path_factory.mktemp("tokens"), H.stdlib_text())


@pytest.fixture(scope="session")
def convert_tokens(tmp_path_factory) -> Path:
    """~50 KB of synthetic text as byte tokens (the converter tests)."""
    return H.make_token_file(tmp_path_factory.mktemp("convert_tokens"), H.synthetic_text())


@pytest.fixture(scope="session")
def bpe_docs(tmp_path_factory) -> tuple:
    """~1,300 documents of 1 to 8 words (~5-40 tokens each) as one BPE token file with an end-of-text token
    (the document-packing tests): (path, vocab size)."""
    paths, vocab = H.document_corpora(tmp_path_factory.mktemp("docs"))
    return paths[0], vocab


# ---------------------------------------------------------------- read-only inputs of the bad-input tests
@pytest.fixture(scope="session")
def inputs_world(tmp_path_factory, token_file) -> dict:
    """One folder of read-only inputs, trained once per session for the bad-input and error-contract tests
    (each snapshots the folder to check that a refused command touched none of it): a tiny config, token
    files (a normal one and one of 44 tokens), a checkpoint (step 1) of the tiny model (n_layer=2, n_head=4),
    its model file and HF folder, an empty folder, a random file and a file that must not change."""
    import os
    from megalite.convert import convert
    from megalite.data import prepare
    d = tmp_path_factory.mktemp("inputs-world")
    toml = H.CKPT.toml(d / "tiny.toml", token_file, model={"n_layer": 2})
    (d / "small.txt").write_text("0123456789\n" * 4)  # 44 byte tokens: 40 for train, 4 for val
    prepare([d / "small.txt"], d / "small.bin", log=lambda *a: None)
    H.train_in_process(H.CKPT.config(token_file, d / "run", **{"model.n_layer": 2, "train.steps": 1,
                                                                "checkpoint.dir": str(d / "ckpt")}))
    convert(d / "ckpt", d / "model.safetensors", quiet=True)
    convert(d / "ckpt", d / "hf", fmt="hf-gpt2", quiet=True)
    (d / "empty").mkdir()
    (d / "random.bin").write_bytes(os.urandom(300))
    (d / "victim.txt").write_text("must not change\n")
    return {"toml": toml, "tokens": Path(token_file), "small": d / "small.bin", "ckpt": d / "ckpt",
            "model": d / "model.safetensors", "hf": d / "hf", "empty": d / "empty", "random": d / "random.bin",
            "victim": d / "victim.txt", "dir": d}


# ---------------------------------------------------------------- the tiny config
@pytest.fixture
def tiny_config(token_file, tmp_path):
    """make(**{"section.key": value}) -> a tiny Config (H.TINY) on the shared token file, out_dir in tmp."""

    def make(**overrides) -> Config:
        return H.TINY.config(token_file, tmp_path / "run", **overrides)

    return make


@pytest.fixture
def tiny_toml(token_file, tmp_path) -> Path:
    """The tiny config as a TOML file (for the CLI / torchrun tests)."""
    return H.TINY.toml(tmp_path / "tiny.toml", token_file, tmp_path / "run")


@pytest.fixture
def train_single():
    """Train a config in this process (a world of one, single-threaded like the workers); return
    {"history": per-step metrics, "loss": per-step losses, "params": full params, "grads": full grads of
    the last step}."""

    def run(cfg: Config):
        from megalite.testing import gather_full_model
        tr = H.train_in_process(cfg)
        return {"history": tr.history, "loss": [r["loss"] for r in tr.history],
                "params": gather_full_model(tr.params, tr.grid),
                "grads": gather_full_model(H.grads_of(tr.params), tr.grid)}

    return run


# ---------------------------------------------------------------- the converter tests' runs (H.CONVERT)
@pytest.fixture(scope="session")
def run111(tmp_path_factory, convert_tokens) -> dict:
    """(1,1,1) in-process, steps=10, stopped after step 5 with a checkpoint."""
    d = tmp_path_factory.mktemp("convert_trained_111")
    cfg = H.CONVERT.config(convert_tokens, d / "run", **{"train.stop_at_step": 5, "checkpoint.dir": str(d / "ckpt")})
    losses = [r["loss"] for r in H.train_in_process(cfg).history]
    return {"ckpt": d / "ckpt", "losses": losses, "dir": d}


@pytest.fixture(scope="session")
def model_file(tmp_path_factory, run111) -> Path:
    """The (1,1,1) checkpoint converted to one fp32 megalite file."""
    from megalite.convert import convert
    return convert(run111["ckpt"], tmp_path_factory.mktemp("convert_model_file") / "model.safetensors", quiet=True)


ZERO1_222 = {"parallel.tp": 2, "parallel.pp": 2, "parallel.dp": 2, "parallel.zero1": True}


@pytest.fixture(scope="session")
def run222(tmp_path_factory, convert_tokens) -> dict:
    """(2,2,2) zero1 under torchrun (8 procs), 10 steps, saving step 5 while it trains on (checkpoint.interval=5):
    one launch gives both the uninterrupted reference and the step-5 checkpoint that resumed runs must continue
    from (a stopped run, train.stop_at_step under torchrun, is test_checkpoint_faults' and test_checkpoint_resume's)."""
    d = tmp_path_factory.mktemp("convert_run_222")
    toml = H.CONVERT.toml(d / "tiny.toml", convert_tokens)
    recs = H.torchrun_train(8, toml, d / "run", **ZERO1_222,
                            **{"checkpoint.dir": d / "ckpt-all", "checkpoint.interval": 5})
    H.copy_step(d / "ckpt-all" / "step_00000005", d / "ckpt")  # a root whose `latest` is step 5
    return {"ckpt": d / "ckpt", "toml": toml, "metrics": recs, "dir": d}


@pytest.fixture(scope="session")
def run222_stop5(run222) -> dict:
    """The (2,2,2) run's step-5 checkpoint (a root whose latest is step 5) and its first 5 steps' metrics."""
    return {**run222, "metrics": run222["metrics"][:5]}


@pytest.fixture(scope="session")
def run222_full(run222) -> list[dict]:
    """The uninterrupted 10-step (2,2,2) zero1 run's metrics (the reference for resumed runs)."""
    return run222["metrics"]


# ---------------------------------------------------------------- other trainers as outside references
def _reference(tmp_path_factory, script: Path, env_var: str, name: str) -> Path:
    """A reference folder made once per session by `python3 SCRIPT DIR` (env_var=DIR reuses one made earlier:
    the same deterministic files, without the CPU time). Its log is a file, not a pipe: a helper process
    megatron starts cannot hold it."""
    import subprocess
    import sys
    cached = os.environ.get(env_var)
    if cached and (Path(cached) / "done").exists():
        return Path(cached)
    d = tmp_path_factory.mktemp(name)
    with open(d / "log.txt", "w") as log:
        rc = subprocess.run([sys.executable, str(script), str(d)], env=H.env(), stdout=log, stderr=log,
                            timeout=900).returncode
    assert rc == 0 and (d / "done").exists(), (d / "log.txt").read_text()[-5000:]
    return d


@pytest.fixture(scope="session")
def mref(tmp_path_factory) -> Path:
    """megatron-core 0.16's checkpoints, logits, layer outputs and schedule tables (tests/megatron_ref.py)."""
    return _reference(tmp_path_factory, H.MEGATRON_REF, "MEGALITE_MEGATRON_REF", "megatron_ref")


@pytest.fixture(scope="session")
def ttref(tmp_path_factory) -> Path:
    """torchtitan 0.3.0's Llama 3: logits and DCP step folders under each naming (tests/torchtitan_ref.py)."""
    return _reference(tmp_path_factory, H.TORCHTITAN_REF, "MEGALITE_TORCHTITAN_REF", "torchtitan_ref")


# ---------------------------------------------------------------- two workers (README: pytest -n 2)
# With pytest-xdist's --dist loadgroup, every test of a group runs in one worker. A test file is a group (its
# module fixtures are built once), and the files that share an expensive session fixture are one group, so that
# fixture too is built once: the converter's training runs, the bad-input world, and the Megatron and
# torchtitan references.
SHARED_GROUPS = {"inputs_world": "inputs-world", "run111": "converter-runs", "run222": "converter-runs",
                 "model_file": "converter-runs", "run222_stop5": "converter-runs", "run222_full": "converter-runs",
                 "mref": "references", "ttref": "references"}


def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("xdist"):
        return
    by_file: dict = {}
    for item in items:
        group = next((SHARED_GROUPS[f] for f in getattr(item, "fixturenames", ()) if f in SHARED_GROUPS), None)
        if group:
            by_file[item.path] = group
    for item in items:
        item.add_marker(pytest.mark.xdist_group(by_file.get(item.path, item.path.name)))
