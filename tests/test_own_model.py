"""A practitioner's own pretrained model in, fine-tuned at a layout, and back out whole (issue 38, items 2-4),
against transformers as the outside reference: a tiny LlamaForCausalLM with a byte-level BPE (built with the
`tokenizers` library, saved through transformers' PreTrainedTokenizerFast), a chat template, added special tokens
and a list of eos ids in generation_config.json, saved in bf16 by transformers' own save_pretrained.

Planted and watched fail (see the commit message): the export dropping chat_template.jinja, the export writing
fp32 by default, the export's config.json ids left at megalite's defaults, init_from not reading the weights."""
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import helpers as H
from megalite.base.origin import Origin
from megalite.config import load_config
from megalite.convert.sources import open_source

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CARRIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f(x): return hello"}]


def save_own_llama(folder: Path) -> None:
    """The model as transformers saves it: bf16 weights (std 0.3, so logits carry a signal), config.json with
    bos 1 / eos 2 / pad 2, generation_config.json with eos [2, 0], the tokenizer's files and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator([H.synthetic_text(20_000)], trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|im_end|>", unk_token="<|endoftext|>")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=[2, 0], pad_token_id=2)
    model.save_pretrained(folder)


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    folder = tmp_path_factory.mktemp("own") / "my-llama"
    save_own_llama(folder)
    return folder


def _tensors(path: Path) -> dict:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def test_the_documented_own_model_commands(tmp_path, own, monkeypatch):
    """Each line of docs/converting.md's own-model block, run as shown on the tiny Llama (the training line
    under torchrun at tp = 2 with --train.lr=0 added, so the export must hold the source's weights bit for bit),
    then a second run from the first run's checkpoint at tp = 1, against the original folder."""
    doc = (ROOT / "docs" / "converting.md").read_text()
    block = doc.split("test_the_documented_own_model_commands", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [ln for ln in block.splitlines() if ln.strip()]
    assert len(lines) == 6
    (tmp_path / "my-llama").symlink_to(own)
    (tmp_path / "my-notes.txt").write_text(H.stdlib_text(30_000))
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    outs = {}
    for line in lines:
        argv = shlex.split(line)
        if argv[0] == "torchrun":
            p = H.run([*H.TORCHRUN, *argv[1:], "--train.lr=0", "--train.min_lr=0"], cwd=tmp_path,
                      timeout=H.TORCHRUN_TIMEOUT)
            assert p.returncode == 0, p.stderr[-3000:]
            out, err = p.stdout, p.stderr
            assert "initialised from my-llama.safetensors" in out and "schedule gave" not in out
        else:
            rc, out, err = H.cli_in_process(*argv[1:])
            assert rc == 0, (line, err[-2000:])
        outs[argv[1] if argv[0] == "megalite" else "train"] = out + err
    assert "check: transformers' forward of the export" in outs["convert"]
    (tmp_path / "my.toml").write_text(outs["inspect"])  # the [model] section as TOML a config reads back
    m = load_config(tmp_path / "my.toml").model
    assert (m.arch, m.n_layer, m.n_embd, m.n_head, m.n_kv_head, m.vocab_size, m.tie_embeddings) == \
        ("llama", 2, 64, 4, 2, 300, False)
    back = tmp_path / "my-llama-tuned"
    _same_model_whole(own, back)

    # a second fresh run from the first run's checkpoint (its weights only) at tp = 1, in this process
    cfg = load_config(None, ["--train.init_from=runs/mine/checkpoints", "--data.path=data/my-notes.bin",
                             "--train.seq_len=64", "--train.steps=1", "--train.lr=0", "--train.min_lr=0",
                             "--train.out_dir=runs/again", "--train.global_batch_size=4"])
    loss, ref = H.train_in_process(cfg).history[0]["loss"], _transformers_loss(own, cfg)
    print(f"step-1 loss from init_from (tp=1, from the tp=2 run's checkpoint) {loss:.7f}, transformers {ref:.7f}")
    assert abs(loss - ref) <= 1e-5 * loss  # the weights transformers saved, at step 1
    rc, _, err = H.cli_in_process("convert", "runs/again/checkpoints", "--format", "hf", "--out", "again")
    assert rc == 0, err
    _same_model_whole(own, tmp_path / "again")


def _transformers_loss(own: Path, cfg) -> float:
    """transformers' own model (fp32) on the run's first batch, drawn as the run draws it."""
    from transformers import AutoModelForCausalLM
    from megalite.data import BatchSampler, TokenDataset
    t = cfg.train
    x, y = BatchSampler(TokenDataset(cfg.data.path, "train"), t.seq_len, t.global_batch_size, 0, 1,
                        t.seed).batch_at(0)
    model = AutoModelForCausalLM.from_pretrained(own, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(x).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()


def _same_model_whole(own: Path, back: Path) -> None:
    """The export against the folder transformers saved: tensors bitwise, the tokenizer's and generation's files
    byte for byte, the chat template's ids, bf16, config.json's ids, the family in the metadata; loadable."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
    a, b = _tensors(own), _tensors(back)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert {k: v.dtype for k, v in b.items()} == {k: torch.bfloat16 for k in a}
    for name in CARRIED:
        assert (back / name).read_bytes() == (own / name).read_bytes(), name
    ta, tb = AutoTokenizer.from_pretrained(own), AutoTokenizer.from_pretrained(back)
    want = ta.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"]
    assert tb.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"] == want
    assert want[0] == 1 and 2 in want
    ca, cb = (json.loads((f / "config.json").read_text()) for f in (own, back))
    assert [cb[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")] == \
        [ca[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")] == [1, 2, 2]
    with safe_open(back / "model.safetensors", "pt") as st:
        assert st.metadata()["megalite.kind"] == "hf-llama"
    model = AutoModelForCausalLM.from_pretrained(back)
    assert model.dtype == torch.bfloat16 and model.generation_config.eos_token_id == [2, 0]
    text = pipeline("text-generation", model=model, tokenizer=tb)("hello", max_new_tokens=3, do_sample=False)
    assert text[0]["generated_text"].startswith("hello")


def test_init_from_refuses_what_contradicts_the_model(tmp_path, own, monkeypatch):
    """One line naming every contradicting key with both values, nothing written; init_from with resume=PATH is
    refused; --dtype overrides the recorded dtype; the origin survives split (a checkpoint's origin.json)."""
    monkeypatch.chdir(tmp_path)
    rc, _, err = H.cli_in_process("train", f"--train.init_from={own}", "--model.n_layer=4", "--model.n_head=4",
                                  "--model.n_embd=32", "--model.dropout=0.1", "--train.out_dir=runs/x")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"model.n_layer = 4 but {own} has 2; model.n_embd = 32 but {own} has 64" in err
    assert "n_head =" not in err and "dropout" not in err and not (tmp_path / "runs").exists()
    rc, _, err = H.cli_in_process("train", f"--train.init_from={own}", "--checkpoint.resume=elsewhere")
    assert rc == 2 and "choose one" in err
    rc, _, err = H.cli_in_process("convert", str(own), "--dtype", "fp32", "--no-check", "--out", "f32.safetensors")
    assert rc == 0, err
    rc, _, err = H.cli_in_process("split", str(own), "--tp", "2", "--pp", "1", "--dp", "1", "--out", "ck")
    assert rc == 0, err
    assert {v.dtype for v in _tensors(tmp_path).values()} == {torch.float32}
    origin = open_source(tmp_path / "ck").origin()
    assert origin.dtype == "bfloat16" and origin.eos_ids() == [2, 0] and origin.ids["bos_token_id"] == 1
    assert origin.chat_template() == TEMPLATE
    assert Origin.from_json(origin.to_json(), "x") == origin
    assert origin.beside(origin.tokenizer) == origin and origin.beside("0" * 64) == Origin(dtype="bfloat16")
    nameless = Origin(origin.files, None, "bfloat16", origin.ids).beside("0" * 64)  # a source without a tokenizer
    assert set(nameless.files) == {"generation_config.json"} and nameless.ids == origin.ids
    from megalite.convert.resharding import reshard
    assert open_source(reshard(tmp_path / "ck", tmp_path / "ck1", 1, 1, 1, quiet=True)).origin() == origin
    # resuming that weights-only split (the old route) says nothing of a run's schedule: there never was one
    from megalite.data import prepare
    (tmp_path / "notes.txt").write_text(H.synthetic_text(8_000))
    prepare([tmp_path / "notes.txt"], tmp_path / "notes.bin", tokenizer=str(own), log=lambda *a: None)
    cfg = load_config(None, [f"--checkpoint.resume={tmp_path / 'ck'}", f"--data.path={tmp_path / 'notes.bin'}",
                             "--train.steps=1", "--train.seq_len=32", "--train.global_batch_size=4",
                             f"--train.out_dir={tmp_path / 'run'}"])
    for k, v in open_source(own).model.items():  # the split's [model], as a config would spell it
        setattr(cfg.model, k, v)
    lines = []
    H.train_in_process(cfg, log=lines.append)
    assert any("resumed from" in ln for ln in lines) and not any("schedule now spans" in ln for ln in lines), lines


def test_an_origin_is_checked_where_it_is_read(tmp_path, own):
    """A model file's megalite.origin and a checkpoint's origin.json are parsed with one-line errors naming the
    field; a changed origin.json fails its checksum in `verify`."""
    from megalite.base.errors import ConvertError
    from megalite.checkpoint.verify import verify
    from megalite.convert.resharding import split
    good = json.loads(Origin(files={"generation_config.json": b"{}"}, dtype="bfloat16").to_json())
    for change, says in [({"format": "x"}, "not a megalite origin"), ({"extra": 1}, "unknown field 'extra'"),
                         ({"files": {"model.safetensors": ""}}, "field 'files'"),
                         ({"dtype": "int8"}, "field 'dtype' = 'int8'"),
                         ({"ids": {"eos_token_id": [2, -1]}}, "eos_token_id = -1"),
                         ({"tokenizer": "abc"}, "field 'tokenizer' = 'abc'")]:
        with pytest.raises(ConvertError, match=says):
            Origin.from_json(json.dumps({**good, **change}), "m.safetensors: metadata 'megalite.origin'", ConvertError)
    step = split(own, tmp_path / "ck", 1, 1, 1, quiet=True)
    rel = step / "tp00-pp00-dp00" / "origin.json"
    rel.write_bytes(rel.read_bytes().replace(b"bfloat16", b"float16\x20"))
    assert any("origin.json fails its checksum" in p for p in verify(step)[1])


def test_end_of_text_comes_from_the_tokenizers_folder(tmp_path):
    """A tokenizer without <|endoftext|> (Llama 3's names <|end_of_text|>): prepare separates documents with the
    eos_token its tokenizer_config.json names, records it, and a run's tokenizer reads it back; the "\\n\\n"
    default (the ids of two newlines) is never used for it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from megalite.data import TokenDataset, prepare
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["some text " * 50], trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>",
                            eos_token="<|end_of_text|>").save_pretrained(tmp_path / "tok")
    eos = backend.token_to_id("<|end_of_text|>")
    for i in range(2):
        (tmp_path / f"d{i}.txt").write_text(f"document {i} " * 40)
    prepare([tmp_path / "d0.txt", tmp_path / "d1.txt"], tmp_path / "t.bin", tokenizer=str(tmp_path / "tok"),
            val_fraction=0.0, log=lambda *a: None)
    assert json.loads((tmp_path / "t.json").read_text())["eot_id"] == eos
    ds = TokenDataset(tmp_path / "t.bin", "train")
    assert ds.tokenizer().eot_id == eos and list(ds.tokens).count(eos) == 1


def test_a_folder_as_transformers_4_writes_it_comes_back_whole(tmp_path, own):
    """transformers 4.x's layout of the same model: the chat template and added_tokens_decoder inside
    tokenizer_config.json, a special_tokens_map.json, `torch_dtype` and `rope_theta` in config.json. split ->
    convert (a model file) -> convert --format hf writes each file back byte for byte, and the dtype it names."""
    from megalite.convert.resharding import split
    from megalite.convert.single import convert
    from transformers import AutoTokenizer
    old = tmp_path / "v4"
    old.mkdir()
    for f in ("model.safetensors", "tokenizer.json", "generation_config.json"):
        (old / f).write_bytes((own / f).read_bytes())
    cfg = json.loads((own / "config.json").read_text())
    cfg["torch_dtype"] = cfg.pop("dtype")
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    (old / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for i, t in enumerate(SPECIAL)}
    (old / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": added, "bos_token": "<|im_start|>", "chat_template": TEMPLATE,
         "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "model_max_length": 128,
         "pad_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<|endoftext|>"},
        indent=2) + "\n")
    (old / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
         "unk_token": "<|endoftext|>"}, indent=2) + "\n")
    step = split(old, tmp_path / "ck", 2, 1, 1, quiet=True)  # folder -> checkpoint -> model file -> folder
    one = convert(step, tmp_path / "one.safetensors", quiet=True, check=False)
    back = convert(one, tmp_path / "back", fmt="hf", quiet=True, check=False)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert (back / f).read_bytes() == (old / f).read_bytes(), f
    assert not (back / "chat_template.jinja").exists()
    assert json.loads((back / "config.json").read_text())["torch_dtype"] == "bfloat16"
    ids = AutoTokenizer.from_pretrained(back).apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"]
    assert ids == AutoTokenizer.from_pretrained(own).apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"]
