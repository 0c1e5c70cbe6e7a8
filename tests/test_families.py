"""The families as specs (megalite/models/): Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm before rotary, a
head width of its own), Mistral (sliding-window attention) and YaRN rope scaling, each against transformers' own
class with the same weights, through every axis against the single process, and with planted bugs that the tests
and `convert --check` must catch. Also the spec rule: a family's name appears in the product only in its spec
file and the registry.

One 8-process launch runs every layout in sequence; the references run in this process.
"""
import ast
import dataclasses
import inspect
import json
import textwrap
from pathlib import Path

import pytest
import torch

import helpers as H
from test_llama_layouts import _worker  # runs named layouts in sequence, saves rank 0's history
from megalite import models
from megalite.base.errors import ConvertError
from megalite.convert import convert, split
from megalite.generate import load_model
from megalite.testing import gather_full_model, run_parallel

transformers = pytest.importorskip("transformers")
IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}

# (family, transformers class, config keys): tiny models, 2 layers, width 64, 4 heads
CASES = {
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen2-tied-mqa": ("Qwen2Config", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen2-yarn": ("Qwen2Config", dict(num_key_value_heads=2, rope_scaling=dict(YARN), rope_theta=1e6)),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
    "qwen3-tied": ("Qwen3Config", dict(num_key_value_heads=4, head_dim=16, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=5)),
    "mistral-no-window": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=None)),
}


def hf_folder(path: Path, case: str) -> Path:
    """A transformers folder of `case`, saved by transformers itself, random weights with norms and biases
    perturbed (a norm of ones or a bias of zeros would hide a dropped or misplaced one)."""
    cls, keys = CASES[case]
    cfg = getattr(transformers, cls)(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64, **keys)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else (0.3 if p.dim() == 1 else 0.2) * noise)
    model.save_pretrained(path)
    return path


def hf_logits(folder: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(IDS).logits


def _close(theirs, mine) -> float:
    d = (theirs - mine).abs().max().item()
    assert d <= 1e-5 * (1 + theirs.abs().max().item()), d
    return d


@pytest.mark.parametrize("case", list(CASES))
def test_each_family_equals_transformers_both_ways(tmp_path, case, capsys):
    """Import (with --check) -> megalite's logits = transformers' (1e-5 relative); export -> transformers' logits
    on the export = the original's; split at tp = 2 -> convert --format hf -> the same."""
    folder = hf_folder(tmp_path / "hf", case)
    f = convert(folder, tmp_path / "m.safetensors")
    assert "check:" in capsys.readouterr().err
    theirs = hf_logits(folder)
    d = _close(theirs, load_model(f)(IDS).detach())
    step = split(folder, tmp_path / "ck", 2, 1, 1, quiet=True)
    out = convert(step, tmp_path / "back", fmt="hf", quiet=True)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == models.spec(case.split("-")[0]).hf.model_type
    d2 = _close(theirs, hf_logits(out))
    print(f"{case}: megalite vs transformers {d:.2e}; split tp=2 -> hf vs the original {d2:.2e}")


def test_generate_greedy_equals_transformers(tmp_path):
    """megalite generate --temperature 0 on a Mistral folder (window 5 < the sequence) gives transformers' greedy
    ids."""
    from megalite.generate import generate
    folder = hf_folder(tmp_path / "hf", "mistral")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    prompt = IDS[:1, :6]
    want = model.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)[0, 6:].tolist()
    got = generate(load_model(folder), prompt[0].tolist(), 10, temperature=0.0)
    assert list(got)[-10:] == want


# ---------------------------------------------------------------- planted bugs: the tests and --check catch each
def _mutated(func, *pairs: str):
    """`func` recompiled from its source with each `old` of the (old, new) pairs replaced by `new` (in its own
    module's namespace)."""
    src = textwrap.dedent(inspect.getsource(func))
    for old, new in zip(pairs[::2], pairs[1::2]):
        assert old in src, (func, old)
        src = src.replace(old, new)
    ns = dict(vars(inspect.getmodule(func)))
    exec(compile(src, f"<planted {func.__name__}>", "exec"), ns)
    return ns[func.__name__]


def _plants():
    from megalite import model as M
    from megalite.parallel import context as C
    heads = M.CausalSelfAttention.heads
    return {
        "qkv-bias-dropped": ("qwen2", M.CausalSelfAttention, "heads",
                             _mutated(heads, "qkv = [t + m.bias for t, m in zip(qkv, lin)]", "pass")),
        "qk-norm-after-rope": ("qwen3", M.CausalSelfAttention, "heads", _mutated(
            heads, "q, k = self.q_norm(q), self.k_norm(k)", "pass",
            "return rotate(q, cos, sin), rotate(k, cos, sin), v",
            "return self.q_norm(rotate(q, cos, sin)), self.k_norm(rotate(k, cos, sin)), v")),
        "window-off-by-one": ("mistral", M, "_attention_core",
                              _mutated(M._attention_core, "< window)", "<= window)")),
        "yarn-attention-factor-ignored": ("qwen2-yarn", M, "rope_attention_factor", lambda cfg: 1.0),
        "ring-window-off-by-one": ("mistral", C._Blocks, "visible",
                                   _mutated(C._Blocks.visible, "(dist < self.window)", "(dist <= self.window)")),
    }


@pytest.mark.parametrize("plant", ["qkv-bias-dropped", "qk-norm-after-rope", "window-off-by-one",
                                   "yarn-attention-factor-ignored"])
def test_a_planted_bug_fails_the_comparison_and_check(tmp_path, monkeypatch, plant):
    case, owner, attr, bad = _plants()[plant]
    folder = hf_folder(tmp_path / "hf", case)
    monkeypatch.setattr(owner, attr, bad)
    with pytest.raises(ConvertError, match=r"--check: .*logits differ"):
        convert(folder, tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()
    f = convert(folder, tmp_path / "m.safetensors", check=False, quiet=True)
    with pytest.raises(AssertionError):
        _close(hf_logits(folder), load_model(f)(IDS).detach())


# ---------------------------------------------------------------- every axis against the single process
WINDOW = {"model.arch": "mistral", "model.n_kv_head": 2, "model.sliding_window": 5}  # < the 16-token sequence
QWEN3 = {"model.arch": "qwen3", "model.n_kv_head": 2, "model.head_size": 16, "model.rope_theta": 1e6}
QWEN2 = {"model.arch": "qwen2", "model.n_kv_head": 1, "model.tie_embeddings": True}  # tp 2 > its one kv head
QWEN2_YARN = {"model.arch": "qwen2", "model.n_kv_head": 2, "model.rope_scaling": dict(YARN)}
STEPS = {"train.steps": 3}
MICRO4 = {"train.micro_batch_size": 4}
A = {"parallel.tp": 2, "parallel.pp": 2, "parallel.dp": 2, "parallel.sp": True, "parallel.vpp": 2,
     "train.recompute": "selective", "parallel.zero1": True, **MICRO4}
CP2 = {"parallel.cp": 2, "parallel.tp": 2, "parallel.dp": 2, "train.recompute": "full", **MICRO4}
CP4 = {"parallel.cp": 4, "parallel.tp": 2, "train.micro_batch_size": 8}


def test_new_families_every_axis_equals_single_process(tmp_path, token_file):
    """tp > kv heads with sp and pp (Qwen2, tied), (2,2,2) + sp + vpp + ZeRO-1 and a resume at cp = 2 (Qwen3),
    the window crossing the ring's blocks at cp = 2 and 4 and through pp with vpp (Mistral), YaRN under cp:
    losses per step within 1e-5 relative of the single process, parameters within 1e-4."""
    ckpt = tmp_path / "ckpt"
    runs = [
        ("qwen2", {**QWEN2, "parallel.tp": 2, "parallel.pp": 2, "parallel.dp": 2, "parallel.sp": True, **MICRO4}),
        ("qwen3", {**QWEN3, **A, "checkpoint.dir": str(ckpt), "checkpoint.interval": 2}),
        ("qwen3_resume_cp", {**QWEN3, **CP2, "checkpoint.resume": f"{ckpt}/step_00000002"}),
        ("mistral_cp2", {**WINDOW, **CP2}),
        ("mistral_cp4", {**WINDOW, **CP4}),
        ("mistral_pp", {**WINDOW, **A}),
        ("yarn_cp", {**QWEN2_YARN, **CP2}),
    ]
    run_parallel(_worker, 8, tmp_path / "rdzv8", args=(token_file, tmp_path, runs))
    refs = {}
    for family, keys in (("qwen2", QWEN2), ("qwen3", QWEN3), ("mistral", WINDOW), ("yarn", QWEN2_YARN)):
        tr = H.train_in_process(H.TINY.config(token_file, tmp_path / f"single-{family}", **{**STEPS, **keys}))
        refs[family] = {"history": tr.history, "params": gather_full_model(tr.params, tr.grid)}
    failures = []
    for name, _ in runs:
        run, ref = torch.load(tmp_path / f"{name}.pt"), refs[name.split("_")[0]]
        first = 3 if "resume" in name else 1
        got = {r["step"]: r["loss"] for r in run["history"]}
        want = {r["step"]: r["loss"] for r in ref["history"] if r["step"] >= first}
        assert got.keys() == want.keys(), name
        worst = max(abs(got[k] - w) / abs(w) for k, w in want.items())
        perr, pname = max((H.rel_err(run["params"][k], ref["params"][k]), k) for k in ref["params"])
        berr, bname = max((H.rel_err(run["params"][k], ref["params"][k]), k) for k in ref["params"]
                          if not k.endswith(".bias"))
        print(f"{name}: loss relative error {worst:.2e}, parameters {perr:.2e} ({pname}), weights {berr:.2e}")
        # Qwen2's q/k/v biases start at zero: AdamW's normalised step turns the reduction-order noise of their
        # near-zero gradients into a larger relative difference than a weight's (1e-3 for them, 1e-4 for the rest)
        if worst > 1e-5 or berr >= 1e-4 or perr >= 1e-3:
            failures.append(f"{name}: loss {worst:.2e}, parameters {perr:.2e} ({pname}), weights {berr:.2e}")
    assert not failures, failures


def test_ring_window_matches_the_single_process_mask():
    """Ring attention's sliding window at cp = 1 (one block, the masked diagonal) against SDPA with transformers'
    mask, forward and gradients; a planted off-by-one in the ring's block mask fails."""
    from megalite.parallel.context import ring_attention
    from megalite.parallel.grid import Axis
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 12, 8, generator=g, requires_grad=True) for _ in range(3))
    i = torch.arange(12)
    mask = (i[None] <= i[:, None]) & (i[None] > i[:, None] - 4)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    got = ring_attention(q, k, v, Axis(1, 0), window=4)
    assert torch.allclose(got, want, atol=1e-6)
    gw = torch.autograd.grad(want.square().sum(), (q, k, v))
    gg = torch.autograd.grad(got.square().sum(), (q, k, v))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(gw, gg))


def test_ring_window_planted_off_by_one_fails(monkeypatch):
    from megalite.parallel.grid import Axis
    from megalite.parallel import context as C
    _, owner, attr, bad = _plants()["ring-window-off-by-one"]
    monkeypatch.setattr(owner, attr, bad)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 8, generator=g) for _ in range(3))
    i = torch.arange(12)
    mask = (i[None] <= i[:, None]) & (i[None] > i[:, None] - 4)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert not torch.allclose(C.ring_attention(q, k, v, Axis(1, 0), window=4), want, atol=1e-6)


# ---------------------------------------------------------------- the spec rule
PACKAGE = Path(__file__).resolve().parent.parent / "megalite"
# string constants equal to a family name that name something else (a tokenizer's pre-tokenizer regex)
NOT_A_FAMILY = {("tokenizer.py", "gpt2"), ("cli.py", "gpt2")}


def test_a_family_name_appears_only_in_its_spec_and_the_registry():
    """Outside megalite/models/, no string constant of the product is a family's name (no `arch == "llama"`, no
    table keyed by one); parallel/ does not mention any family at all, even in a comment or a longer string."""
    names = set(models.FAMILIES)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("models/"):
            continue
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Constant) and node.value in names and (path.name, node.value) not in NOT_A_FAMILY:
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
        if rel.startswith("parallel/"):
            found += [f"{rel}: mentions {n!r}" for n in names if n in text.lower()]
    assert not found, "family names outside megalite/models/:\n" + "\n".join(found)


def test_adding_a_family_is_one_spec_file():
    """Every registered spec is a file of megalite/models/ holding its features, keys and transformers table."""
    for name, spec in models.FAMILIES.items():
        assert (PACKAGE / "models" / f"{name}.py").is_file(), name
        assert dataclasses.is_dataclass(spec.features) and spec.hf.model_type and spec.hf.STORED


@pytest.mark.parametrize("name,cls,count,flops", [
    ("qwen2.5-0.5b", "Qwen2Config", 494_032_768, 4_021_161_216),
    ("qwen3-0.6b", "Qwen3Config", 596_049_920, 6_394_871_808)])
def test_published_configs_count_as_transformers(name, cls, count, flops):
    """configs/qwen2.5-0.5b.toml and configs/qwen3-0.6b.toml: transformers' count of the same config (on the meta
    device) = megalite's model's = gpu-check's; FLOPs per token 6N + 12 L (heads x head width) T at T = 4096.
    Each family's tiny CPU config validates at (2,2,2)."""
    from megalite.bench import gpu_check
    from megalite.config import load_config, resolve, validate
    from megalite.model import GPTStage
    from megalite.parallel.grid import ParallelGrid
    cfg = validate(resolve(load_config(PACKAGE.parent / "configs" / f"{name}.toml"), 8), 8)
    m = cfg.model
    hf = getattr(transformers, cls)(vocab_size=m.vocab_size, hidden_size=m.n_embd, intermediate_size=m.ffn_size,
                                    num_hidden_layers=m.n_layer, num_attention_heads=m.n_head,
                                    num_key_value_heads=m.kv_heads, head_dim=m.head_dim, tie_word_embeddings=True)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(hf).num_parameters()
        ours = sum(p.numel() for _, p in GPTStage(m, ParallelGrid.single()).global_parameters())
    assert theirs == ours == gpu_check.n_params(m) == count
    assert gpu_check.flops_per_token(m, 4096) == flops
    for fam in ("qwen2", "qwen3", "mistral"):
        tiny = validate(resolve(load_config(PACKAGE.parent / "configs" / f"{fam}-tiny-cpu.toml"), 8), 8)
        assert (tiny.model.arch, tiny.parallel.tp, tiny.parallel.pp, tiny.parallel.dp) == (fam, 2, 2, 2)
