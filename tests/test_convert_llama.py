"""transformers both ways for the Llama family, and `convert --check`, against transformers itself.

- A tiny megalite Llama (MHA, GQA, MQA; tied, untied; llama3 rope scaling) exported with `convert --format hf`
  loads with AutoModelForCausalLM.from_pretrained and its logits equal megalite's; pipeline("text-generation")
  runs on the folder as is; above --max-shard-size the weights are shards with model.safetensors.index.json.
- A transformers Llama folder (saved by transformers itself; sharded or not; config.json in 4.x and 5.x form)
  comes in through `split`, `convert` and `generate`; what megalite does not model, and a config.json that
  disagrees with its tensors, is refused in one line with nothing written.
- `--check` refuses a planted wrong rotary layout (interleaved pairs), a GQA head order off by one group and
  swapped gate/up, in the importer and in the exporter; the output is never moved into place.
The weights are drawn large enough (std 0.3) that attention is far from uniform: a scrambled q/k moves the
logits (an untrained model's near-uniform attention would hide it).
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from megalite.base.errors import ConvertError
from megalite.config import ModelConfig
from megalite.convert import convert, open_source, split
from megalite.convert.common import Progress, Source, Spec
from megalite.models.llama import LlamaHF as Llama
from megalite.convert.sink import write
from megalite.generate import load_model
from megalite.model import GPTStage
from megalite.parallel.grid import ParallelGrid

transformers = pytest.importorskip("transformers")
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}


class Memory(Source):
    """A model held in memory, as a Source (the interface any converter input answers)."""

    def __init__(self, m: dict, tensors: dict):
        self.where, self.guards, self.model, self.t = "memory", [], m, tensors
        self.specs = {n: Spec(tuple(t.shape), t.dtype) for n, t in tensors.items()}

    def read(self, name, region=None):
        t = self.t[name]
        return t if region is None else t[tuple(slice(a, b) for a, b in region)]


def llama_file(path, kv: int, tie: bool, scaling=None, seed: int = 0):
    """A megalite Llama file (4 heads, width 32, 2 layers, vocab 256) with weights of std 0.3."""
    m = ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=kv, n_embd=32, block_size=32, vocab_size=256,
                    tie_embeddings=tie, rope_theta=10000.0, rope_scaling=dict(scaling or {}), intermediate_size=64)
    import dataclasses
    g = torch.Generator().manual_seed(seed)
    stage = GPTStage(m, ParallelGrid.single())
    tensors = {}
    for name, p in stage.global_parameters():
        if name in tensors:
            continue
        if p.dim() == 1:  # RMSNorm gains around 1
            tensors[name] = 1 + 0.1 * torch.randn(p.shape, generator=g)
        else:
            tensors[name] = 0.3 * torch.randn(p.shape, generator=g)
    write(Memory(dataclasses.asdict(m), tensors), path, "megalite", torch.float32, Progress("t", 0, 0, True))
    return path


IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


def hf_logits(folder):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(IDS).logits


def ours(path):
    with torch.no_grad():
        return load_model(path)(IDS)


@pytest.fixture(scope="module")
def hf_gqa(tmp_path_factory):
    """A GQA Llama file and its export."""
    d = tmp_path_factory.mktemp("llama_gqa")
    f = llama_file(d / "m.safetensors", 2, False)
    return f, convert(f, d / "hf", fmt="hf", quiet=True)


# ---------------------------------------------------------------- export
@pytest.mark.parametrize("kv,tie,scaling", [(4, False, None), (4, True, None), (2, True, LLAMA3), (1, False, None)],
                         ids=["mha", "mha-tied", "gqa-tied-llama3", "mqa"])
def test_export_loads_in_transformers_with_megalites_logits(tmp_path, kv, tie, scaling, capsys):
    f = llama_file(tmp_path / "m.safetensors", kv, tie, scaling)
    out = convert(f, tmp_path / "hf", fmt="hf")
    assert "check: transformers' forward of the export: largest logit difference" in capsys.readouterr().err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_key_value_heads"] == kv
    assert cfg["tie_word_embeddings"] is tie and cfg["intermediate_size"] == 64 and cfg["rope_theta"] == 10000.0
    assert cfg["rope_scaling"] == scaling
    assert (out / "generation_config.json").is_file()
    theirs, mine = hf_logits(out), ours(f)
    d = (theirs - mine).abs().max().item()
    print(f"llama kv={kv} tied={tie} scaling={bool(scaling)} -> hf: max |d logit| {d:.2e} (logits up to "
          f"{mine.abs().max():.1f})")
    assert d <= 1e-5 * (1 + mine.abs().max().item())


def test_export_above_max_shard_size_is_sharded_with_an_index(tmp_path, hf_gqa):
    f, one = hf_gqa
    out = convert(f, tmp_path / "hf", fmt="hf", max_shard_size=20_000, quiet=True)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    assert not (out / "model.safetensors").exists()
    assert torch.equal(hf_logits(out), hf_logits(one))
    # the sharded folder comes back in: split -> convert gives the same tensors
    step = split(out, tmp_path / "ck", 2, 1, 2, quiet=True)
    back = open_source(convert(step, tmp_path / "back.safetensors", quiet=True))
    src = open_source(f)
    assert all(torch.equal(back.read(n), src.read(n)) for n in src.specs)
    # --force replaces a sharded folder megalite wrote (and only that)
    convert(f, out, fmt="hf", force=True, quiet=True)
    assert (out / "model.safetensors").is_file() and not list(out.glob("model-*-of-*.safetensors"))


def test_pipeline_text_generation_runs_on_the_export(hf_gqa):
    gen = transformers.pipeline("text-generation", model=str(hf_gqa[1]))
    text = gen("ab", max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert text.startswith("ab") and len(text) > 2


# ---------------------------------------------------------------- import
def test_a_transformers_llama_folder_comes_in_through_split_convert_and_generate(tmp_path):
    """Saved by transformers itself (5.x writes rope_parameters; sharded by its own max_shard_size); the 4.x
    form of the same config.json (rope_theta + rope_scaling) reads the same."""
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   rope_theta=500000.0, rope_scaling=dict(LLAMA3), tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if p.dim() == 1 else 0.3 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "hf5", max_shard_size="20KB")
    assert (tmp_path / "hf5" / "model.safetensors.index.json").is_file()
    assert "rope_parameters" in json.loads((tmp_path / "hf5" / "config.json").read_text())
    with torch.no_grad():
        want = model.eval()(IDS).logits
    m = open_source(tmp_path / "hf5").model
    assert (m["arch"], m["n_kv_head"], m["rope_theta"], m["rope_scaling"]) == ("llama", 2, 500000.0, LLAMA3)
    shutil.copytree(tmp_path / "hf5", tmp_path / "hf4")
    c = json.loads((tmp_path / "hf4" / "config.json").read_text())
    rope = c.pop("rope_parameters")
    c["rope_theta"] = rope.pop("rope_theta")
    c["rope_scaling"] = rope
    (tmp_path / "hf4" / "config.json").write_text(json.dumps(c))
    assert open_source(tmp_path / "hf4").model == m
    for folder in ("hf5", "hf4"):
        f = convert(tmp_path / folder, tmp_path / f"{folder}.safetensors", quiet=True)  # --check on: proved
        assert (ours(f) - want).abs().max().item() < 1e-4
        assert (ours(tmp_path / folder) - want).abs().max().item() < 1e-4  # generate reads the folder as is
    step = split(tmp_path / "hf4", tmp_path / "ck", 2, 2, 1, quiet=True)
    assert (ours(step) - want).abs().max().item() < 1e-4


def _edit(folder, **changes):
    c = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    (folder / "config.json").write_text(json.dumps(c))


@pytest.mark.parametrize("changes,pattern", [
    (dict(rope_scaling={"rope_type": "longrope", "factor": 4.0}), r"rope_scaling\.rope_type = \"longrope\" is not "
                                                                   r"supported"),
    (dict(rope_scaling=None, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     r"rope_parameters\.rope_type = \"dynamic\""),
    (dict(sliding_window=4096), r"1 field would change the forward: sliding_window = 4096 is not supported"),
    (dict(attention_bias=True), r"attention_bias = true is not supported"),
    (dict(mlp_bias=True), r"mlp_bias = true is not supported"),
    (dict(num_local_experts=8), r"field 'num_local_experts' is not a LlamaConfig field"),
    (dict(num_key_value_heads=3), r"num_key_value_heads = 3 does not divide num_attention_heads = 4"),
    (dict(num_hidden_layers=3), r"num_hidden_layers = 3, but model.safetensors holds 2"),
    (dict(intermediate_size=96), r"'model.layers.0.mlp.gate_proj.weight' has shape \[64, 32\], but config.json "
                                 r"implies \[96, 32\]"),
    (dict(num_key_value_heads=4), r"'model.layers.0.self_attn.k_proj.weight' has shape \[16, 32\], but config"),
    (dict(model_type="gemma"), r"model_type is 'gemma', expected one of 'gpt2', 'llama', 'qwen2', 'qwen3', "
                              r"'mistral'"),
], ids=["rope-longrope", "rope5-dynamic", "sliding-window", "attention-bias", "mlp-bias", "moe", "kv-not-dividing",
        "layers-disagree", "ffn-disagrees", "kv-disagrees", "gemma"])
def test_what_megalite_does_not_model_or_a_folder_that_disagrees_is_one_line(tmp_path, hf_gqa, changes, pattern):
    folder = tmp_path / "hf"
    shutil.copytree(hf_gqa[1], folder)
    _edit(folder, **changes)
    for run in (lambda: convert(folder, tmp_path / "out.safetensors"),
                lambda: split(folder, tmp_path / "ck", 1, 1, 1)):
        with pytest.raises(ConvertError, match=pattern) as e:
            run()
        assert "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing written, no temp left


# ---------------------------------------------------------------- --check catches the classic scrambles
def _to_interleaved(w, heads):
    """rotate-half rows -> interleaved pairs (the inverse of the permutation torchtitan's importer needs)."""
    hd = w.shape[0] // heads
    return w.view(heads, 2, hd // 2, -1).transpose(1, 2).reshape(w.shape)


def _roll_one_group(w, heads):
    """kv heads in the wrong order: each q-head group reads the next group's key/value head."""
    return torch.roll(w.view(heads, -1, w.shape[-1]), 1, 0).reshape(w.shape)


PLANTS = {
    "rope-interleaved": lambda n, t: _to_interleaved(t, 4 if ".q_proj" in n else 2)
    if n.endswith(("q_proj.weight", "k_proj.weight")) else t,
    "gqa-off-by-one-group": lambda n, t: _roll_one_group(t, 2) if n.endswith(("k_proj.weight", "v_proj.weight")) else t,
    "gate-up-swapped": None,  # below: the names swapped
}
SWAP = {"mlp.gate_proj.weight": "mlp.up_proj.weight", "mlp.up_proj.weight": "mlp.gate_proj.weight"}


def _planted(kind, direction):
    real_from, real_to = Llama.from_hf, Llama.to_hf

    def swap(name):
        for a, b in SWAP.items():
            if name.endswith(a):
                return name[: -len(a)] + b
        return name

    def from_hf(self, name, t, tied=True):
        if kind == "gate-up-swapped":
            return real_from(self, swap(name), t, tied)
        return real_from(self, name, PLANTS[kind](name, t), tied)

    def to_hf(self, name, t):
        if kind == "gate-up-swapped":
            return [(swap(n), x) for n, x in real_to(self, name, t)]
        return [(n, PLANTS[kind](n, x)) for n, x in real_to(self, name, t)]
    return ("from_hf", from_hf) if direction == "import" else ("to_hf", to_hf)


@pytest.mark.parametrize("direction", ["import", "export"])
@pytest.mark.parametrize("kind", list(PLANTS))
def test_check_refuses_a_planted_scramble_and_writes_nothing(tmp_path, hf_gqa, monkeypatch, kind, direction):
    f, folder = hf_gqa
    monkeypatch.setattr(Llama, *_planted(kind, direction))
    src, out, fmt = (folder, tmp_path / "m.safetensors", "megalite") if direction == "import" else \
        (f, tmp_path / "hf", "hf")
    with pytest.raises(ConvertError, match=r"--check: .*logits differ from the source's \(largest difference "
                                           r"[0-9.e+]+, KL ") as e:
        convert(src, out, fmt=fmt)
    print(f"planted {kind} in the {direction}er: {e.value}")
    assert not out.exists() and not list(tmp_path.glob("*.tmp-megalite"))
    convert(src, out, fmt=fmt, check=False, quiet=True)  # without the check the scramble is written silently
    assert out.exists()


def test_check_off_and_bf16_tolerance(tmp_path, hf_gqa, capsys):
    f, _ = hf_gqa
    convert(f, tmp_path / "a", fmt="hf", check=False)
    assert "check:" not in capsys.readouterr().err
    convert(f, tmp_path / "b", fmt="hf", dtype="bf16")  # the bf16 export passes bf16's own tolerance
    assert "check: transformers' forward" in capsys.readouterr().err
    with pytest.raises(ConvertError, match=r"--check: .* has no model forward"):
        convert(f, tmp_path / "c", fmt="dcp", check=True)


# ---------------------------------------------------------------- the commands docs/converting.md shows
def test_the_documented_llama_commands(tmp_path, monkeypatch):
    """Each line of docs/converting.md's Llama block, run as shown on a tiny Llama file (in this process: the same
    `megalite` entry point, main(argv), without five interpreter start-ups)."""
    import shlex
    from pathlib import Path

    import helpers as H
    doc = (Path(__file__).parents[1] / "docs" / "converting.md").read_text()
    block = doc.split("test_the_documented_llama_commands", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [ln for ln in block.splitlines() if ln.strip()]
    assert len(lines) == 5 and all(ln.startswith("megalite ") for ln in lines)
    (tmp_path / "llama").mkdir()
    llama_file(tmp_path / "llama" / "model.safetensors", 2, False)
    monkeypatch.chdir(tmp_path)
    for line in lines:
        rc, _, err = H.cli_in_process(*shlex.split(line)[1:])
        assert rc == 0, (line, err[-2000:])
        if "--format hf" in line:
            assert "check: transformers' forward of the export: largest logit difference" in err
    assert len(list((tmp_path / "llama" / "hf-sharded").glob("model-*-of-*.safetensors"))) > 2
    src, back = open_source(tmp_path / "llama" / "model.safetensors"), open_source(tmp_path / "llama" / "back.safetensors")
    assert all(torch.equal(src.read(n), back.read(n)) for n in src.specs)


def test_format_names_and_shard_sizes(tmp_path, hf_gqa):
    from megalite.convert.single import parse_size
    assert [parse_size(s, "--max-shard-size") for s in ("5GB", "20KB", "1MiB", "123")] == [5 * 10**9, 20_000, 2**20,
                                                                                          123]
    for bad in ("lots", "0", "-1GB", "5TB"):
        with pytest.raises(ConvertError, match=rf"--max-shard-size '{bad}': expected a size"):
            parse_size(bad, "--max-shard-size")
    with pytest.raises(ConvertError, match=r"--format hf-gpt2: .* model.arch = 'llama' model; --format hf writes "):
        convert(hf_gqa[0], tmp_path / "hf", fmt="hf-gpt2")
    assert not (tmp_path / "hf").exists()
