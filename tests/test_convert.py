"""The converter, in-process: layout independence of `convert`, `split` round trips, HF GPT-2 export,
generation from a single file, and --dtype. Training runs are conftest.py's session fixtures.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import helpers as H
from megalite.config import ModelConfig
from megalite.checkpoint import manifest as mf
from megalite.checkpoint.tree import resolve
from megalite.checkpoint.verify import verify
from megalite.convert import convert, reshard, split
from megalite.data import BatchSampler, TokenDataset
from megalite.tokenizer import byte_tokenizer
from megalite.generate import generate, load_model, sample_text
from megalite.testing import full_state


def coords_of(man: dict) -> set:
    return {rel.split("/", 1)[0] for rel in man["files"]}


# ---------------------------------------------------------------- 1. layout independence
RESHARD_LAYOUTS = [(2, 1, 1, False), (1, 2, 1, False), (2, 2, 2, False), (4, 2, 1, False), (2, 2, 2, True)]


@pytest.mark.parametrize("tp,pp,dp,zero1", RESHARD_LAYOUTS, ids=lambda v: str(v))
def test_reshard_then_convert_is_bitwise_identical(tmp_path, run111, model_file, tp, pp, dp, zero1):
    src = run111["ckpt"]
    before = H.tree_digest(src)
    out = reshard(src, tmp_path / "ck", tp, pp, dp, zero1=zero1, quiet=True)
    man = mf.read_json(out)
    assert man["layout"] == {"tp": tp, "pp": pp, "dp": dp, "zero1": zero1}
    assert man["step"] == 5 and man["data"] == {"batch_index": 5}
    assert len(coords_of(man)) == tp * pp * dp
    assert verify(out)[1] == []
    # the whole training state travels: every model and optimizer tensor equal to the source's
    a, b = full_state(src), full_state(out)
    assert sorted(a) == sorted(b) and any(k.startswith("optimizer_state/") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    if zero1 and dp > 1:
        assert any("flat" in s for e in man["optimizer_state"].values() for s in e["slices"])
    f = convert(out, tmp_path / "model.safetensors", quiet=True)
    assert f.read_bytes() == model_file.read_bytes()
    assert H.tree_digest(src) == before


def test_reshard_chain_returns_to_the_same_file(tmp_path, run111, model_file):
    """(1,1,1) -> (4,2,1) -> (2,2,2)+zero1 -> (1,3,1) -> convert: still the same bytes."""
    a = reshard(run111["ckpt"], tmp_path / "a", 4, 2, 1, quiet=True)
    b = reshard(a, tmp_path / "b", 2, 2, 2, zero1=True, quiet=True)
    c = reshard(b, tmp_path / "c", 1, 3, 1, quiet=True)
    assert mf.read_json(c)["layout"]["zero1"] is True  # default: as in the source
    assert convert(c, tmp_path / "m.safetensors", quiet=True).read_bytes() == model_file.read_bytes()
    ref, got = full_state(run111["ckpt"]), full_state(c)
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_convert_file_contents(run111, model_file):
    """The file: one tensor per global parameter (no tied copy), fp32, config and partitions in metadata."""
    man = mf.read_json(resolve(run111["ckpt"]))
    f = safe_open(str(model_file), framework="pt")
    meta = f.metadata()
    assert json.loads(meta["megalite.model_config"]) == dataclasses.asdict(ModelConfig(**H.TINY_MODEL))
    assert sorted(f.keys()) == sorted(man["model"])
    assert "lm_head" not in " ".join(f.keys())
    assert json.loads(meta["megalite.partitions"]) == {n: e["partition"] for n, e in man["model"].items()}
    full = full_state(run111["ckpt"])
    for name, e in man["model"].items():
        t = f.get_tensor(name)
        assert t.dtype == torch.float32 and list(t.shape) == e["shape"]
        assert torch.equal(t, full[f"model/{name}"])
    assert len(f.keys()) == 4 * 12 + 4  # wte, wpe, ln_f.{weight,bias} + 12 per block


# ---------------------------------------------------------------- 2. split round trips
SPLIT_LAYOUTS = [(1, 3, 1, False), (4, 3, 1, False), (1, 1, 2, True), (2, 2, 2, True), (2, 4, 1, False),
                 (1, 1, 1, False)]


@pytest.mark.parametrize("tp,pp,dp,zero1", SPLIT_LAYOUTS, ids=lambda v: str(v))
def test_split_then_convert_round_trip(tmp_path, model_file, tp, pp, dp, zero1):
    src_bytes = model_file.read_bytes()
    step = split(model_file, tmp_path / "ck", tp, pp, dp, zero1=zero1, step=3, quiet=True)
    assert step == tmp_path / "ck" / "step_00000003"
    assert resolve(tmp_path / "ck") == step  # `latest` names it
    problems = verify(step)[1]
    assert problems == []
    man = mf.read_json(step)
    assert man["layout"] == {"tp": tp, "pp": pp, "dp": dp, "zero1": zero1}
    assert man["optimizer_state"] == {} and man["step"] == 3
    assert len(coords_of(man)) == tp * pp * dp
    if pp == 3:  # uneven: layers 0,1 | 2 | 3 (earlier stages get the extra layer)
        stages = {}
        for name, e in man["model"].items():
            if name.startswith("blocks."):
                stages.setdefault(int(name.split(".")[1]), set()).update(
                    s["file"].split("/")[0].split("-")[1] for s in e["slices"])
        assert stages == {0: {"pp00"}, 1: {"pp00"}, 2: {"pp01"}, 3: {"pp02"}}
    if tp > 1:  # tp-split tensors really are cut in tp pieces
        assert len(man["model"]["blocks.0.mlp.fc.weight"]["slices"]) == tp
    out = convert(step, tmp_path / "back.safetensors", quiet=True)
    assert out.read_bytes() == src_bytes
    assert model_file.read_bytes() == src_bytes


def test_verify_cli_passes_on_a_split(tmp_path, model_file):
    step = split(model_file, tmp_path / "ck", 4, 3, 1, quiet=True)
    r = H.cli("verify", step)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "complete and intact" in r.stdout


def reference_loss(model_path, tok, batch_index: int) -> float:
    """The loss a single process computes for training batch `batch_index` with the model in the file."""
    model = load_model(model_path)
    ds = TokenDataset(tok, "train")
    s = BatchSampler(ds, H.TINY_MODEL["block_size"], H.CONVERT.train["global_batch_size"], 0, 1,
                     H.CONVERT.train["seed"])
    x, y = s.batch_at(batch_index)
    with torch.no_grad():
        return model(x, y).item()


def test_split_checkpoint_resumes_training_in_process(tmp_path, convert_tokens, run111, model_file):
    step = split(model_file, tmp_path / "ck", 1, 1, 1, quiet=True)
    cfg = H.CONVERT.config(convert_tokens, tmp_path / "run", **{"train.steps": 3, "checkpoint.resume": str(step),
                                                                "checkpoint.dir": str(tmp_path / "ck2")})
    losses = [r["loss"] for r in H.train_in_process(cfg).history]
    assert len(losses) == 3  # started at step 0
    ref = reference_loss(model_file, convert_tokens, 0)
    assert abs(losses[0] - ref) <= 1e-5 * abs(ref)
    assert abs(losses[0] - run111["losses"][0]) > 1e-3  # it did not start from the seed's init
    # the run saved a full checkpoint (now with optimizer state) at step 3
    man = mf.read_json(resolve(tmp_path / "ck2"))
    assert man["step"] == 3 and man["optimizer_state"]


def test_split_checkpoint_resumes_under_torchrun(tmp_path, convert_tokens, model_file):
    """6 processes at (2,3,1) (uneven pipeline: layers 0-1 | 2 | 3) resume the split (weights only: fresh
    optimizer, step 0)."""
    step = split(model_file, tmp_path / "ck", 2, 3, 1, quiet=True)
    toml = H.CONVERT.toml(tmp_path / "tiny.toml", convert_tokens)
    recs = H.torchrun_train(6, toml, tmp_path / "run", **{"parallel.tp": 2, "parallel.pp": 3, "train.steps": 2,
                                                          "checkpoint.resume": step})
    assert [r["step"] for r in recs] == [1, 2]
    ref = reference_loss(model_file, convert_tokens, 0)
    assert abs(recs[0]["loss"] - ref) <= 1e-5 * abs(ref)


# ---------------------------------------------------------------- 4. Hugging Face GPT-2
def test_hf_export_matches_megalite_logits_and_round_trips(tmp_path, run111, model_file):
    transformers = pytest.importorskip("transformers")
    hf_dir = convert(run111["ckpt"], tmp_path / "hf", fmt="hf-gpt2", quiet=True)
    assert sorted(p.name for p in hf_dir.iterdir()) == ["config.json", "generation_config.json",
                                                        "model.safetensors", "tokenizer.json",
                                                        "tokenizer_config.json"]
    cfg = json.loads((hf_dir / "config.json").read_text())
    assert (cfg["n_layer"], cfg["n_head"], cfg["n_embd"], cfg["n_positions"], cfg["vocab_size"]) == (4, 4, 32, 16, 256)
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(hf_dir)).eval()
    ours = load_model(model_file)
    ids = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(ids).logits
        mine = ours(ids)
    assert mine.shape == theirs.shape == (3, 16, 256)
    assert H.rel_err(theirs, mine) < 1e-5, H.rel_err(theirs, mine)
    assert (theirs - mine).abs().max().item() < 1e-4
    # megalite reads the HF folder too
    with torch.no_grad():
        assert torch.equal(load_model(hf_dir)(ids), mine)
    # HF folder -> split -> convert: the original megalite file's tensors and metadata, bit for bit, plus the
    # folder's origin (its tokenizer and generation files, dtype, ids: base/origin.py), which the file did not have
    for tp, pp, dp in [(2, 2, 1), (1, 1, 1)]:
        step = split(hf_dir, tmp_path / f"ck{tp}{pp}{dp}", tp, pp, dp, quiet=True)
        assert verify(step)[1] == []
        back = convert(step, tmp_path / f"back{tp}{pp}{dp}.safetensors", quiet=True)
        with safe_open(back, "pt") as b, safe_open(model_file, "pt") as a:
            meta = b.metadata()
            assert json.loads(meta.pop("megalite.origin"))["dtype"] == "float32" and meta == a.metadata()
            assert list(b.keys()) == list(a.keys()) and all(torch.equal(b.get_tensor(k), a.get_tensor(k))
                                                            for k in a.keys())


def test_hf_export_from_a_parallel_layout_is_identical(tmp_path, run111):
    a = convert(run111["ckpt"], tmp_path / "a", fmt="hf-gpt2", quiet=True)
    ck = reshard(run111["ckpt"], tmp_path / "ck", 4, 2, 2, zero1=True, quiet=True)
    b = convert(ck, tmp_path / "b", fmt="hf-gpt2", quiet=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


# ---------------------------------------------------------------- 5. generate
def test_generate_is_deterministic_and_respects_lengths(model_file):
    model = load_model(model_file)
    ids = byte_tokenizer().encode("the model ")
    a = generate(model, ids, max_new_tokens=12, temperature=0.8, top_k=20, seed=3)
    b = generate(model, ids, max_new_tokens=12, temperature=0.8, top_k=20, seed=3)
    assert a == b
    assert a[:len(ids)] == ids and len(a) == len(ids) + 12
    assert all(0 <= t < 256 for t in a)
    outs = {tuple(generate(model, ids, max_new_tokens=12, temperature=1.0, seed=s)) for s in range(5)}
    assert len(outs) > 1  # the seed matters
    # greedy ignores the seed, and equals a hand-written argmax loop
    g1 = generate(model, ids, max_new_tokens=6, temperature=0, seed=1)
    assert g1 == generate(model, ids, max_new_tokens=6, temperature=0, seed=2)
    x = list(ids)
    with torch.no_grad():
        for _ in range(6):
            x.append(int(model(torch.tensor([x[-16:]]))[0, -1].argmax()))
    assert g1 == x
    # a prompt longer than block_size is cropped, not an error; zero new tokens returns the prompt
    long = byte_tokenizer().encode("x" * 40)
    assert len(generate(model, long, max_new_tokens=5, seed=0)) == 45
    assert generate(model, ids, max_new_tokens=0) == ids


def test_generate_cli_plain_process(model_file):
    text = sample_text(model_file, "def ", max_new_tokens=10, temperature=0.8, top_k=0, seed=1)
    assert text.startswith("def ")
    r = H.run([*H.MEGALITE, "generate", "--model", model_file, "--prompt", "def ", "--max-new-tokens", "10",
               "--seed", "1"], text=False, extra_env={"PYTHONIOENCODING": "utf-8"})
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    assert r.stdout == (text + "\n").encode("utf-8")
    assert b"Traceback" not in r.stderr


# ---------------------------------------------------------------- 6. dtypes
@pytest.mark.parametrize("name,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_dtype_is_the_fp32_file_cast(tmp_path, run111, model_file, name, dtype):
    ref = load_file(str(model_file))
    out = convert(run111["ckpt"], tmp_path / f"m-{name}.safetensors", dtype=name, quiet=True)
    got = load_file(str(out))
    assert list(got) == list(ref)
    for k, t in got.items():
        assert t.dtype == dtype, k
        assert torch.equal(t, ref[k].to(dtype)), k
    with safe_open(str(out), framework="pt") as f, safe_open(str(model_file), framework="pt") as g:
        assert f.metadata() == g.metadata()
    assert out.stat().st_size < model_file.stat().st_size * 0.55
    # a half-precision file is still a model
    m = load_model(out)
    assert torch.equal(dict(m.global_parameters())["wte.weight"], ref["wte.weight"].to(dtype).float())
    # the same from another layout, and for the HF folder
    ck = reshard(run111["ckpt"], tmp_path / "ck", 2, 2, 1, quiet=True)
    assert convert(ck, tmp_path / "m2.safetensors", dtype=name, quiet=True).read_bytes() == out.read_bytes()
    hf = convert(run111["ckpt"], tmp_path / "hf", dtype=name, fmt="hf-gpt2", quiet=True)
    assert json.loads((hf / "config.json").read_text())["torch_dtype"] == {"bf16": "bfloat16", "fp16": "float16"}[name]
    assert all(t.dtype == dtype for t in load_file(str(hf / "model.safetensors")).values())


def test_convert_cli_dtype_matches_in_process(tmp_path, run111):
    want = convert(run111["ckpt"], tmp_path / "a.safetensors", dtype="fp16", quiet=True)
    r = H.cli("convert", run111["ckpt"], "--out", tmp_path / "b.safetensors", "--dtype", "fp16")
    assert r.returncode == 0, r.stderr
    assert "convert: wrote" in r.stdout
    assert (tmp_path / "b.safetensors").read_bytes() == want.read_bytes()
