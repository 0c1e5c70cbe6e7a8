"""Real text, end to end, against the tokenizers library and transformers (issue 24).

The world of this file: a GPT-2-format folder made here (vocab.json + merges.txt written by the tokenizers
library, 50,257 ids with <|endoftext|> last as in GPT-2, and a tiny GPT2LMHeadModel saved by transformers);
text prepared with that folder's tokenizer; the folder split at (2,2,2) and fine-tuned there under torchrun
(one launch) and at (1,1,1) in this process; the run converted back to an HF folder. Every check compares
with code megalite did not write: `tokenizers.Tokenizer.encode`, transformers' GPT2TokenizerFast,
AutoTokenizer, generate() and pipeline(), torch.optim.AdamW on transformers' model.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import helpers as H
from megalite.cli import main
from megalite.config import Config
from helpers import cli_in_process as cli  # `megalite ARGS` in this process

transformers = pytest.importorskip("transformers")

EOT = "<|endoftext|>"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
# the text transformers and tokenizers must agree on: non-ASCII, emoji, tabs, \r\n, runs of spaces
TRICKY = "héllo wörld — naïve café 日本語 🚀🎉 x\ty\r\nz   four    spaces\t\t\r\n\r\nend \x00\x7f ok"
MODEL = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=50257, dropout=0.0)
TRAIN = dict(steps=4, seq_len=16, global_batch_size=8, micro_batch_size=2, lr=1e-3, min_lr=1e-4, warmup_steps=1,
             weight_decay=0.1, grad_clip=1.0, seed=1234, log_interval=1000, eval_interval=2, eval_batches=1)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One thread, like the workers (a shared 2-core machine)."""
    before = torch.get_num_threads()
    yield torch.set_num_threads(1)
    torch.set_num_threads(before)




def one_line(rc, out, err, *fragments) -> str:
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err + out, (rc, out, err)
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


# ---------------------------------------------------------------- a GPT-2-format folder, made here
def gpt2_vocab(n_vocab: int = 50257) -> tuple[dict, list]:
    """GPT-2's layout at GPT-2's size: the 256 byte characters, merges up to n_vocab - 1 ids, <|endoftext|>
    last. The merges are every letter pair, then space+letter pairs, then triples, then quadruples: a
    valid BPE whose ids spread over the whole range for lower-case words."""
    from megalite.tokenizer import byte_alphabet
    vocab = {ch: i for i, ch in enumerate(byte_alphabet().values())}
    merges = []
    pairs = [(a, b) for a in LETTERS for b in LETTERS]
    cands = [("Ġ", a) for a in LETTERS] + pairs + [("Ġ" + a, b) for a, b in pairs]
    cands += [(a + b, c) for a, b in pairs for c in LETTERS] + [("Ġ" + a + b, c) for a, b in pairs for c in LETTERS]
    cands += [(a + b + c, d) for a, b in pairs for c in LETTERS for d in LETTERS]
    for a, b in cands:
        if len(vocab) == n_vocab - 1:
            break
        merges.append((a, b))
        vocab[a + b] = len(vocab)
    vocab[EOT] = len(vocab)
    return vocab, merges


def words(rng: random.Random, n: int) -> str:
    out = []
    for i in range(n):
        out.append("".join(rng.choice(LETTERS[:rng.choice((6, 12, 26))]) for _ in range(rng.randint(1, 5))))
        out.append("\n" if i % 11 == 10 else " ")
    return "".join(out)


def gpt2_folder(folder: Path, init_std: float = 0.3) -> Path:
    """vocab.json + merges.txt (the tokenizers library's BPE.save) and a tiny GPT-2 of that vocabulary
    saved by transformers: what `save_pretrained` of the real gpt2 gives, small."""
    from tokenizers import models
    folder.mkdir(parents=True)
    vocab, merges = gpt2_vocab()
    models.BPE(vocab=vocab, merges=merges).save(str(folder))
    cfg = transformers.GPT2Config(vocab_size=len(vocab), n_positions=MODEL["block_size"], n_embd=MODEL["n_embd"],
                                  n_layer=MODEL["n_layer"], n_head=MODEL["n_head"], bos_token_id=len(vocab) - 1,
                                  eos_token_id=len(vocab) - 1, initializer_range=init_std, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(str(folder))
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json", "merges.txt",
                                                         "model.safetensors", "vocab.json"]
    return folder


def toml(path: Path, tokens: Path, **sections) -> Path:
    raw = {"model": dict(MODEL), "train": dict(TRAIN), "data": {"path": str(tokens)}}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    lines = []
    for section, values in raw.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v) if isinstance(v, str) else repr(v).lower() if isinstance(v, bool) else v}"
                  for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def config(tokens: Path, out_dir: Path, **sections) -> Config:
    raw = {"model": dict(MODEL), "train": dict(TRAIN, out_dir=str(out_dir)), "data": {"path": str(tokens)}}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return Config.from_dict(raw)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The walkthrough: split -> prepare with the folder's tokenizer -> train at (2,2,2) -> convert; plus the
    same fine-tuning at (1,1,1) in this process."""
    d = tmp_path_factory.mktemp("text-world")
    gpt2 = gpt2_folder(d / "gpt2")
    rng = random.Random(0)
    docs = [words(rng, 3000), TRICKY + "\n" + words(rng, 2000), words(rng, 2500) + f" {EOT} " + TRICKY]
    for i, text in enumerate(docs):
        (d / f"doc{i}.txt").write_text(text, encoding="utf-8", newline="")
    files = [d / f"doc{i}.txt" for i in range(len(docs))]
    assert cli("split", gpt2, "--tp", 2, "--pp", 2, "--dp", 2, "--out", d / "split", "--quiet")[0] == 0
    rc, out, err = cli("prepare", *files, "--tokenizer", gpt2, "--out", d / "data" / "gpt2.bin", "--quiet")
    assert rc == 0, err
    tokens = d / "data" / "gpt2.bin"
    resume = {"checkpoint": {"resume": str(d / "split"), "dir": str(d / "ck222")}}
    recs = H.torchrun_train(8, toml(d / "run.toml", tokens, **resume), d / "run222",
                            **{"parallel.tp": 2, "parallel.pp": 2, "parallel.dp": 2})
    single = H.train_in_process(config(tokens, d / "run111", checkpoint={"resume": str(d / "split"),
                                                                          "dir": str(d / "ck111")}))
    assert cli("convert", d / "ck222", "--format", "hf-gpt2", "--out", d / "hf", "--quiet")[0] == 0
    return {"dir": d, "gpt2": gpt2, "docs": docs, "files": files, "tokens": tokens, "recs222": recs,
            "recs111": single.history, "ck222": d / "ck222", "hf": d / "hf", "split": d / "split"}


# ---------------------------------------------------------------- prepare: the library's ids
def test_prepare_ids_are_the_tokenizers_and_gpt2_tokenizer_fast_ids(world):
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers
    gpt2 = world["gpt2"]
    fast = transformers.GPT2TokenizerFast.from_pretrained(str(gpt2))  # transformers' own GPT-2 tokenizer
    lib = Backend(models.BPE.from_file(str(gpt2 / "vocab.json"), str(gpt2 / "merges.txt")))
    lib.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    lib.decoder = decoders.ByteLevel()
    lib.add_special_tokens([EOT])
    eot = lib.token_to_id(EOT)
    assert eot == 50256 == fast.eos_token_id
    meta = json.loads(world["tokens"].with_suffix(".json").read_text())
    ids = np.fromfile(world["tokens"], dtype=np.uint16).tolist()
    assert (meta["dtype"], meta["vocab_size"], meta["eot_id"], meta["tokenizer"]) == ("uint16", 50257, eot, "bpe")
    want = []
    for i, text in enumerate(world["docs"]):
        per_doc = lib.encode(text).ids
        assert per_doc == fast(text)["input_ids"], i  # the library and transformers agree per document
        want += ([eot] if i else []) + per_doc
    assert ids == want and meta["num_tokens"] == len(ids) and meta["max_token"] == max(ids)
    assert max(ids) > 40000 and sum(i < 25129 for i in ids) > 1000  # both tp=2 shards of the vocab in use
    # the tokenizer recorded beside the token file is the one that made it
    beside = world["tokens"].parent / meta["tokenizer_file"]
    import hashlib
    assert hashlib.sha256(beside.read_bytes()).hexdigest() == meta["tokenizer_sha256"]
    assert Backend.from_file(str(beside)).encode(TRICKY).ids == fast(TRICKY)["input_ids"]


def test_prepare_cuts_documents_where_the_ids_do_not_change(tmp_path):
    """Pieces of 50 characters (cut inside words' whitespace runs, \\r\\n, emoji...) give the whole text's ids;
    a tokenizer that may not be cut (a normalizer) is read whole; the byte tokenizer too."""
    from megalite.data import prepare
    from megalite.tokenizer import from_json, train_bpe
    rng = random.Random(1)
    parts = [TRICKY, words(rng, 30), "  \n\n\t ", "\r\n", "a" * 120, "🚀 " * 3]
    text = "".join(rng.choice(parts) for _ in range(200))
    (tmp_path / "a.txt").write_text(text, encoding="utf-8", newline="")
    (tmp_path / "b.txt").write_bytes(b"valid \xff\xfe invalid \xe2\x82 bytes " * 20)  # replaced, as decode() does
    tok = train_bpe([text, words(rng, 3000)], 400)
    assert tok.streams_by_words()
    for piece in (50, 1 << 18):
        meta = prepare([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / f"t{piece}.bin", tokenizer=tok,
                       piece_chars=piece, batch_chars=300, log=lambda *a: None)
        ids = np.fromfile(tmp_path / f"t{piece}.bin", dtype=meta["dtype"]).tolist()
        b = (tmp_path / "b.txt").read_bytes().decode("utf-8", errors="replace")
        assert ids == tok.backend.encode(text).ids + [tok.eot_id] + tok.backend.encode(b).ids, piece
        assert tok.decode(ids) == text + EOT + b  # lossless
    d = json.loads(tok.json)
    d["normalizer"] = {"type": "Lowercase"}
    lower = from_json(json.dumps(d), "lowercase")
    assert not lower.streams_by_words()
    meta = prepare([tmp_path / "a.txt"], tmp_path / "low.bin", tokenizer=lower, piece_chars=50, log=lambda *a: None)
    assert np.fromfile(tmp_path / "low.bin", dtype=meta["dtype"]).tolist() == lower.backend.encode(text).ids
    meta = prepare([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "byte.bin", piece_chars=50, log=lambda *a: None)
    assert np.fromfile(tmp_path / "byte.bin", dtype=np.uint16).tobytes()[::2] == (text + "\n\n" + b).encode()
    assert meta["eot_id"] is None and meta["tokenizer"] == "byte"


def test_prepare_writes_uint32_ids_for_a_vocabulary_above_65536(tmp_path):
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers
    from megalite.data import TokenDataset, prepare
    from megalite.tokenizer import Tokenizer
    from megalite.tokenizer import byte_alphabet
    vocab = {ch: i for i, ch in enumerate(byte_alphabet().values())}
    vocab.update({f"<unused{i}>": len(vocab) + i for i in range(69_000)})  # in the vocabulary, never produced
    merges = [("a", "b"), ("ab", "c"), ("Ġ", "ab"), ("Ġab", "c")]
    for a, b in merges:
        vocab[a + b] = len(vocab)  # ids 69256..69259: above what uint16 holds
    vocab[EOT] = len(vocab)
    backend = Backend(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([EOT])
    tok = Tokenizer(backend, "big")
    text = "abc ab abc x\n" * 50
    (tmp_path / "a.txt").write_text(text)
    meta = prepare([tmp_path / "a.txt"], tmp_path / "t.bin", tokenizer=tok, log=lambda *a: None)
    ids = np.fromfile(tmp_path / "t.bin", dtype=np.uint32)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 69_261
    assert (tmp_path / "t.bin").stat().st_size == 4 * ids.size
    assert ids.tolist() == backend.encode(text).ids and ids.max() >= 69_257  # ids that uint16 could not hold
    ds = TokenDataset(tmp_path / "t.bin", "train")
    assert ds.tokens.dtype == np.uint32 and ds.tokens[:5].tolist() == ids[:5].tolist()


# ---------------------------------------------------------------- `megalite tokenizer train`
def test_tokenizer_train_writes_a_folder_transformers_loads_deterministically(tmp_path):
    rng = random.Random(2)
    (tmp_path / "src").mkdir()
    for i in range(3):
        (tmp_path / "src" / f"{i}.txt").write_text(words(rng, 4000) + TRICKY)
    rc, out, err = cli("tokenizer", "train", tmp_path / "src", "--vocab-size", 600, "--out", tmp_path / "a")
    assert rc == 0 and "wrote" in out, err
    assert cli("tokenizer", "train", tmp_path / "src", "--vocab-size", 600, "--out", tmp_path / "b", "--quiet")[0] == 0
    names = ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == names
    for n in names:  # the same files and N: the same bytes
        assert (tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes(), n
    from tokenizers import Tokenizer as Backend
    lib = Backend.from_file(str(tmp_path / "a" / "tokenizer.json"))
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    assert lib.get_vocab_size() == 600 and lib.token_to_id(EOT) == auto.eos_token_id == auto.bos_token_id
    pre = json.loads((tmp_path / "a" / "tokenizer.json").read_text())["pre_tokenizer"]
    assert pre["type"] == "ByteLevel" and pre["use_regex"] and not pre["add_prefix_space"]  # GPT-2's split
    for text in (TRICKY, "  leading spaces\r\n", "\x00\x01\x02 🎉", "日本語のテキスト", EOT + " after"):
        ids = lib.encode(text).ids
        assert auto(text)["input_ids"] == ids, text
        assert auto.decode(ids) == lib.decode(ids, skip_special_tokens=False) == text  # lossless
    one_line(*cli("tokenizer", "train", tmp_path / "src", "--vocab-size", 600, "--out", tmp_path / "a"),
             "already exists", "--force")
    one_line(*cli("tokenizer", "train", tmp_path / "src", "--vocab-size", 100, "--out", tmp_path / "c"),
             "--vocab-size 100", ">= 257")
    assert not (tmp_path / "c").exists()


# ---------------------------------------------------------------- training: tp=2 == tp=1, the checkpoint's tokenizer
def test_walkthrough_trains_the_same_at_2_2_2_and_1_1_1(world):
    a = [r["loss"] for r in world["recs222"]]
    b = [r["loss"] for r in world["recs111"]]
    assert len(a) == len(b) == TRAIN["steps"]
    print(f"\nvocab 50257, (2,2,2) vs (1,1,1): losses {a} vs {b}")
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)
    assert a[0] > 10.0  # ln(50257) = 10.8: the model starts from a random GPT-2 over the whole vocabulary
    # bits per byte, from the validation loss and the bytes the validation targets stand for
    with_val = [r for r in world["recs222"] if "val_loss" in r]
    assert len(with_val) == 2 and all(r["val_bpb"] > 0 for r in with_val)
    assert [r["val_bpb"] for r in with_val] == pytest.approx([r["val_bpb"] for r in world["recs111"]
                                                              if "val_loss" in r], rel=1e-5)


def test_bits_per_byte_is_nats_per_token_times_tokens_per_byte_over_ln2(world):
    """By hand: the validation targets' bytes counted from the library's own token strings (GPT-2's byte
    characters, one per byte; <|endoftext|> stands for no text)."""
    from tokenizers import Tokenizer as Backend
    from megalite.data import TokenDataset, eval_batches
    lib = Backend.from_file(str(world["tokens"].parent / "gpt2.tokenizer.json"))
    val = TokenDataset(world["tokens"], "val")
    ys = torch.cat([y.reshape(-1) for _, y in eval_batches(val, TRAIN["seq_len"], TRAIN["global_batch_size"], 0, 1,
                                                             TRAIN["eval_batches"], TRAIN["seed"])]).tolist()
    nbytes = sum(0 if i == 50256 else len(lib.id_to_token(i)) for i in ys)
    assert 1.0 < nbytes / len(ys) < 5.0
    for r in [r for r in world["recs111"] if "val_loss" in r]:
        assert r["val_bpb"] == pytest.approx(r["val_loss"] * len(ys) / nbytes / math.log(2), rel=1e-12)


def test_every_checkpoint_carries_the_runs_tokenizer(world):
    from megalite.checkpoint import manifest as mf
    from megalite.checkpoint.tree import resolve
    from megalite.tokenizer import load
    mine = load(world["tokens"].parent / "gpt2.tokenizer.json")
    assert mine.sha256 == load(world["gpt2"]).sha256  # prepare's copy is the folder's tokenizer
    for root in (world["split"], world["ck222"]):
        step = resolve(root)
        man = mf.read_json(step)
        assert "tp00-pp00-dp00/tokenizer.json" in man["files"], root  # listed and checksummed
        assert [f for f in man["files"] if f.endswith("tokenizer.json")] == ["tp00-pp00-dp00/tokenizer.json"]
        assert load(step / "tp00-pp00-dp00" / "tokenizer.json").sha256 == mine.sha256
        assert H.verify_cli(root)[0] == 0


def test_a_damaged_tokenizer_in_a_checkpoint_is_found_by_verify(world, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(world["ck222"], ck)
    from megalite.checkpoint.tree import resolve
    path = resolve(ck) / "tp00-pp00-dp00" / "tokenizer.json"
    path.write_text(path.read_text().replace("Ġabc", "Ġabd", 1))
    rc, text = H.verify_cli(ck)
    assert rc == 1 and "tokenizer.json fails its checksum" in text, text


# ---------------------------------------------------------------- the export: transformers as is
def test_export_carries_the_tokenizer_and_greedy_text_equals_transformers(world):
    hf = world["hf"]
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["vocab_size"] == 50257 and cfg["eos_token_id"] == cfg["bos_token_id"] == 50256
    assert sorted(p.name for p in hf.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                    "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    auto = transformers.AutoTokenizer.from_pretrained(str(hf))
    fast = transformers.GPT2TokenizerFast.from_pretrained(str(world["gpt2"]))
    assert auto(TRICKY)["input_ids"] == fast(TRICKY)["input_ids"] and auto.decode(auto(TRICKY)["input_ids"]) == TRICKY
    assert auto.eos_token_id == 50256
    model = transformers.GPT2LMHeadModel.from_pretrained(str(hf)).eval()
    pipe = transformers.pipeline("text-generation", model=str(hf), device="cpu")  # the folder as is
    for prompt in ("abc de", "héllo wörld 🚀\t"):
        ids = auto(prompt)["input_ids"]
        n = MODEL["block_size"] - len(ids)
        with torch.no_grad():
            theirs = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n)[0].tolist()
        rc, out, err = cli("generate", "--model", world["ck222"], "--prompt", prompt, "--max-new-tokens", n,
                           "--temperature", 0, "--ids")
        assert rc == 0 and err == "", err
        ours = [int(i) for i in out.split()]
        assert ours == theirs, (prompt, ours, theirs)
        assert len(set(ours[len(ids):])) >= 3  # varied: not one token repeated
        rc, text, err = cli("generate", "--model", world["ck222"], "--prompt", prompt, "--max-new-tokens", n,
                            "--temperature", 0)
        assert rc == 0 and err == ""
        piped = pipe(prompt, max_new_tokens=n, do_sample=False)[0]["generated_text"]
        assert text[:-1] == piped == auto.decode(theirs[:len(theirs) - (theirs[-1] == 50256)]), prompt
    # the same model from the converted file and from the HF folder: the same ids
    assert cli("convert", world["ck222"], "--out", world["dir"] / "m.safetensors", "--quiet")[0] == 0
    outs = {cli("generate", "--model", m, "--prompt", "abc", "--max-new-tokens", 5, "--temperature", 0, "--ids")[1]
            for m in (world["ck222"], world["dir"] / "m.safetensors", hf)}
    assert len(outs) == 1


# ---------------------------------------------------------------- stopping, and never drawing padding
def _constant_hidden_model(tmp_path, world, name: str, rows: dict) -> Path:
    """The converted file with ln_f's weight zero and its bias b, so that every position's final hidden state
    is b and token v's logit is b . wte[v]; `rows` sets wte[v] = scale * b (scale 50: v is always the greedy
    choice). Rows past the vocabulary are appended (model.vocab_size grows): padding rows."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    src = world["dir"] / "m.safetensors"
    if not src.exists():
        assert cli("convert", world["ck222"], "--out", src, "--quiet")[0] == 0
    with safe_open(str(src), framework="pt") as f:
        meta, t = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    b = torch.randn(MODEL["n_embd"], generator=torch.Generator().manual_seed(0))
    t["ln_f.weight"].zero_()
    t["ln_f.bias"].copy_(b)
    vocab = max([t["wte.weight"].shape[0]] + [v + 1 for v in rows])
    t["wte.weight"] = torch.cat([t["wte.weight"], torch.zeros(vocab - t["wte.weight"].shape[0], MODEL["n_embd"])])
    for v, scale in rows.items():
        t["wte.weight"][v] = scale * b
    cfg = json.loads(meta["megalite.model_config"])
    meta["megalite.model_config"] = json.dumps({**cfg, "vocab_size": vocab})
    save_file(t, str(tmp_path / name), metadata=meta)
    return tmp_path / name


def test_generate_stops_at_end_of_text_as_transformers_does(world, tmp_path):
    from safetensors import safe_open
    from megalite.convert.family import FAMILIES
    from megalite.tokenizer import load
    path = _constant_hidden_model(tmp_path, world, "eot.safetensors", {50256: 50})
    prompt = load(world["gpt2"]).encode("abc")
    ids = [int(i) for i in cli("generate", "--model", path, "--prompt", "abc", "--max-new-tokens", 5,
                               "--temperature", 0, "--ids")[1].split()]
    assert ids == prompt + [50256]  # stopped right after drawing it
    rc, text, err = cli("generate", "--model", path, "--prompt", "abc", "--max-new-tokens", 5, "--temperature", 0)
    assert rc == 0 and text == "abc\n"  # the end-of-text token ends the text and is not printed
    rc, text, _ = cli("generate", "--model", path, "--prompt", "abc", "--max-new-tokens", 3, "--temperature", 0,
                      "--ignore-eot")
    assert text == "abc" + EOT * 3 + "\n"
    # transformers' GPT-2 with the same weights and eos_token_id: generate() stops there too
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=50257, n_positions=32, n_embd=32, n_layer=2, n_head=2, eos_token_id=50256)).eval()
    with safe_open(str(path), framework="pt") as f:
        sd = {hn: ht for k in f.keys() for hn, ht in FAMILIES["gpt2"].to_hf(k, f.get_tensor(k))}
    assert not model.load_state_dict(sd, strict=False).unexpected_keys
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=5)[0].tolist()
    assert theirs == ids


def test_no_padding_id_is_ever_sampled(world, tmp_path):
    """A vocab-50304 model (GPT-2's 50257 padded, as configs/gpt2-124m.toml) whose 47 padding rows are made the
    likeliest: at temperature 5, 500 draws never give one (unmasked, nearly all of them would)."""
    from megalite.generate import generate, load_model
    path = _constant_hidden_model(tmp_path, world, "pad.safetensors", {v: 80 for v in range(50257, 50304)})
    model = load_model(path)
    assert model.cfg.vocab_size == 50304 and model.real_vocab == 50257
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]]))[0, -1]
    assert int(logits.argmax()) >= 50257  # the raw logits do prefer padding
    drawn = []
    for seed in range(25):
        drawn += generate(model, [1, 2, 3], max_new_tokens=20, temperature=5.0, seed=seed, warn=lambda m: None)[3:]
    assert len(drawn) == 500 and max(drawn) < 50257 and len(set(drawn)) > 100


# ---------------------------------------------------------------- padding rows are out of the loss: transformers
def test_vocab_padding_is_out_of_the_loss_like_a_50257_row_transformers_model(world, tmp_path):
    """megalite with model.vocab_size 50304 on data of a 50257-id tokenizer trains exactly as transformers'
    GPT-2 with the 50257 real rows (the same initial weights, torch.optim.AdamW, the same batches)."""
    from megalite.data import BatchSampler, TokenDataset
    from megalite.model import GPTStage
    from megalite.run.schedule import lr_at
    from megalite.parallel.grid import ParallelGrid
    from megalite.config import ModelConfig
    from megalite.convert.family import FAMILIES
    cfg = config(world["tokens"], tmp_path / "run", model={"vocab_size": 50304},
                 train={"steps": 5, "eval_interval": 1000}, checkpoint={"dir": str(tmp_path / "ck")})
    init = GPTStage(ModelConfig(**{**MODEL, "vocab_size": 50304}), ParallelGrid.single())
    init.init_weights(TRAIN["seed"])
    ours = [r["loss"] for r in H.train_in_process(cfg).history]
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=50257, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0)).train()
    sd = {hn: ht[:50257] if hn == "transformer.wte.weight" else ht
          for n, p in init.global_parameters() for hn, ht in FAMILIES["gpt2"].to_hf(n, p.detach())}
    assert not hf.load_state_dict(sd, strict=False).unexpected_keys
    named = list(hf.named_parameters())
    no_decay = [p for n, p in named if n.endswith(".bias") or ".ln_" in n]
    decay = [p for n, p in named if not (n.endswith(".bias") or ".ln_" in n)]
    t = cfg.train
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8)
    sampler = BatchSampler(TokenDataset(world["tokens"], "train"), t.seq_len, t.global_batch_size, 0, 1, t.seed)
    theirs = []
    for step in range(t.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, t)
        x, y = sampler.next_batch()
        logits = hf(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, 50257), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), t.grad_clip)
        opt.step()
        theirs.append(loss.item())
    err = max(abs(a - b) / b for a, b in zip(ours, theirs))
    print(f"\nvocab 50304 (47 padding rows) vs transformers with 50257 rows: max loss rel diff {err:.2e}")
    assert err < 1e-5, (ours, theirs)
    # the export leaves the padding rows out: a 50257-token GPT-2 whose logits are megalite's real ones
    from megalite.generate import load_model
    assert cli("convert", tmp_path / "ck", "--format", "hf-gpt2", "--out", tmp_path / "hf", "--quiet")[0] == 0
    exported = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    assert exported.config.vocab_size == 50257 and exported.config.eos_token_id == 50256
    x = torch.tensor([[5, 300, 20000, 50256, 7]])
    with torch.no_grad():
        mine = load_model(tmp_path / "ck")(x)
        assert mine.shape[-1] == 50304
        assert (exported(x).logits - mine[..., :50257]).abs().max() < 1e-4


# ---------------------------------------------------------------- bad input: one line each, nothing written
def test_bad_tokenizers_are_one_line_and_write_nothing(tmp_path):
    (tmp_path / "a.txt").write_text("some text\n")
    (tmp_path / "notjson.json").write_text("{not json")
    (tmp_path / "other.json").write_text('{"version": "1.0", "vocab": {"a": 1}}')
    (tmp_path / "broken.json").write_text('{"model": {"type": "BPE", "vocab": 3}}')
    (tmp_path / "only").mkdir()
    shutil.copy(Path(__file__), tmp_path / "only" / "vocab.json")  # no merges.txt beside it
    (tmp_path / "empty").mkdir()
    cases = [("notjson.json", ["notjson.json", "not valid JSON"]),
             ("other.json", ["other.json", "not a tokenizer.json", "'model'"]),
             ("broken.json", ["broken.json", "the tokenizers library cannot load it"]),
             ("only", ["vocab.json", "no merges.txt"]),
             ("only/vocab.json", ["vocab.json", "no merges.txt"]),
             ("empty", ["neither tokenizer.json nor vocab.json + merges.txt"]),
             ("missing", ["--tokenizer", "missing", "does not exist"])]
    for name, fragments in cases:
        one_line(*cli("prepare", tmp_path / "a.txt", "--tokenizer", tmp_path / name, "--out", tmp_path / "t.bin"),
                 "megalite prepare: error:", *fragments)
        assert not list(tmp_path.glob("t*")) and not list(tmp_path.glob(".t*")), name


def test_bad_data_for_the_model_is_one_line(world, tmp_path):
    """A vocabulary larger than model.vocab_size; a tokenizer file changed after prepare; a file that names
    no tokenizer but needs one; resuming with another tokenizer's data. Nothing is written."""
    toml_ = toml(tmp_path / "t.toml", world["tokens"], train={"steps": 1}, checkpoint={"dir": ""})
    run = ["train", "--config", toml_, f"--train.out_dir={tmp_path / 'out'}"]
    one_line(*cli(*run, "--model.vocab_size=256"), "gpt2.json", "vocab_size 50257", "model.vocab_size = 256")
    data = tmp_path / "data"
    shutil.copytree(world["tokens"].parent, data)
    tok_file = data / "gpt2.tokenizer.json"
    tok_file.write_text(tok_file.read_text().replace("Ġabc", "Ġabd", 1))
    one_line(*cli(*run, f"--data.path={data / 'gpt2.bin'}"), "gpt2.tokenizer.json", "tokenizer_sha256",
             "prepare the data again")
    meta = json.loads((data / "gpt2.json").read_text())
    del meta["tokenizer_file"]
    (data / "gpt2.json").write_text(json.dumps(meta))
    one_line(*cli(*run, f"--data.path={data / 'gpt2.bin'}"), "gpt2.json", "names no tokenizer_file")
    # resuming a BPE run's checkpoint with byte data: the same model, another tokenizer
    (tmp_path / "b.txt").write_text(words(random.Random(3), 2000))
    assert cli("prepare", tmp_path / "b.txt", "--out", tmp_path / "bytes.bin", "--quiet")[0] == 0
    before = H.tree_digest(world["ck222"])
    one_line(*cli(*run, f"--data.path={tmp_path / 'bytes.bin'}", f"--checkpoint.resume={world['ck222']}"),
             "checkpoint.resume", "tokenizer.json", "is not the tokenizer of data.path", "bytes.bin",
             "--tokenizer")
    assert H.tree_digest(world["ck222"]) == before and not (tmp_path / "out").exists()


def test_every_text_is_encodable_and_decodes_back(world):
    """Byte fallback: no character is outside a byte-level tokenizer (a random sample of every plane); only
    text that is not UTF-8 at all (a lone surrogate) is refused, in one line, before the model is read."""
    from megalite.tokenizer import byte_tokenizer, load
    rng = random.Random(5)
    points = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    for tok in (load(world["gpt2"]), byte_tokenizer()):
        for _ in range(300):
            text = "".join(chr(rng.choice(points)) for _ in range(rng.randint(1, 40)))
            ids = tok.encode(text)
            assert ids and max(ids) < tok.vocab_size and tok.decode(ids) == text, repr(text)
    one_line(*cli("generate", "--model", world["hf"], "--prompt", "bad \udc80 surrogate"), "--prompt", "UTF-8")


def test_old_token_files_without_tokenizer_fields_still_train_as_bytes(tmp_path):
    """A token file from before tokenizers were recorded (no tokenizer_sha256, eot_id, documents): the byte
    tokenizer, whose tokenizer.json the run then carries."""
    from megalite.tokenizer import byte_tokenizer, load
    tokens = H.make_token_file(tmp_path, H.synthetic_text(20_000))
    meta = json.loads(tokens.with_suffix(".json").read_text())
    for key in ("tokenizer_sha256", "eot_id", "documents"):
        del meta[key]
    tokens.with_suffix(".json").write_text(json.dumps(meta))
    cfg = H.TINY.config(tokens, tmp_path / "run", **{"train.steps": 1, "checkpoint.dir": str(tmp_path / "ck"),
                                                     "model.n_layer": 2})
    tr = H.train_in_process(cfg)
    assert tr.tokenizer.is_byte and tr.history[0]["loss"] > 0
    carried = load(next((tmp_path / "ck").glob("step_*")) / "tp00-pp00-dp00" / "tokenizer.json")
    assert carried.sha256 == byte_tokenizer().sha256 and carried.is_byte


def test_the_documented_numpy_recipe_writes_a_token_file_megalite_trains_on(tmp_path, monkeypatch):
    """docs/tokenizers.md's token-file format, as a user would follow it: its Python block run as written, as its
    own script in a fresh interpreter."""
    from benchmarks.transcripts import run_script
    from megalite.data import TokenDataset, check_vocab
    from megalite.tokenizer import train_bpe, write_hf_folder
    doc = (Path(__file__).resolve().parents[1] / "docs" / "tokenizers.md").read_text()
    block = doc.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "data" / "bpe-4k").mkdir(parents=True)
    write_hf_folder(train_bpe([words(random.Random(4), 3000)], 300), tmp_path / "data" / "bpe-4k", None)
    rc, out, _ = run_script(block, tmp_path, "numpy_recipe")
    assert rc == 0, out
    ds = TokenDataset(tmp_path / "data" / "mine.bin", "train")
    check_vocab(ds, 300)
    tok = ds.tokenizer()
    every = np.concatenate([ds.tokens, TokenDataset(tmp_path / "data" / "mine.bin", "val").tokens]).tolist()
    assert tok.vocab_size == 300 and tok.decode(every) == "first document" + EOT + "second document"


def test_the_documented_help_blocks_are_the_clis(capsys):
    """docs/tokenizers.md's `--help` blocks: every line shown (the "..." elisions apart) is a line of that
    command's help as the CLI prints it (argparse's wrapping depends on COLUMNS: fixed here)."""
    import os
    import re
    from megalite.cli import main
    doc = (Path(__file__).resolve().parents[1] / "docs" / "tokenizers.md").read_text()
    blocks = re.findall(r"```console\n\$ megalite (.*?) --help\n(.*?)```", doc, re.S)
    assert [b[0] for b in blocks] == ["tokenizer train", "prepare", "generate"]
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "80"
    try:
        for command, shown in blocks:
            with pytest.raises(SystemExit):
                main([*command.split(), "--help"])
            printed = capsys.readouterr().out.splitlines()
            missing = [line for line in shown.splitlines() if line != "..." and line not in printed]
            assert missing == [], f"megalite {command} --help does not print {missing}"
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def test_bench_prepare_prints_prepare_beside_encode_batch(tmp_path, capsys):
    """`megalite bench prepare` as docs/performance.md shows it (the CLI in this process, at the small size of
    transcripts.SMALL_ARGS): every shown line's shape is printed, the ids agree, nothing is left behind."""
    import shlex
    from benchmarks import transcripts
    outs = []

    def runner(cmd):
        assert main([*shlex.split(cmd)[1:], "--dir", str(tmp_path)]) == 0
        outs.append(capsys.readouterr().out)
        return outs[-1]

    assert transcripts.check("bench-prepare", runner) == [], "docs/performance.md shows lines the bench no longer prints"
    assert "--size-mb 0.3 --vocab-size 300 --rounds 2" in transcripts.small_command(
        "bench-prepare", "megalite bench prepare --size-mb 32 --rounds 3")
    [out] = outs
    assert "megalite prepare " in out and "tokenizers encode_batch " in out and "peak anon MiB" in out
    assert "same ids: yes" in out and "(median of 2 alternated pairs; range" in out
    import re
    assert re.search(r"^megalite prepare\s+2\s", out, re.M), "the second round did not run"  # once crashed
    assert "prepare / encode_batch throughput:" in out and list(tmp_path.iterdir()) == []  # nothing left behind


def test_the_bpe_twin_config_validates_at_the_demo_layouts():
    from megalite.config import load_config, resolve, validate
    root = Path(__file__).resolve().parents[1] / "configs"
    for tp, pp, world in ((2, 2, 8), (1, 1, 1)):
        flags = [f"--parallel.tp={tp}", f"--parallel.pp={pp}"]
        cfg = validate(resolve(load_config(root / "small-cpu-bpe.toml", flags), world), world)
        twin = validate(resolve(load_config(root / "small-cpu.toml", flags), world), world)
        assert cfg.model.vocab_size == 2048 and cfg.data.path == "data/stdlib-bpe.bin"
        assert (cfg.train, cfg.parallel) == (twin.train.__class__(**{**vars(twin.train), "out_dir": "runs/small-bpe"}),
                                             twin.parallel)  # the same run but for its data and vocabulary
    gpt2 = load_config(root / "gpt2-124m.toml", [])
    m = gpt2.model
    assert (m.vocab_size, m.n_layer, m.n_head, m.n_embd, m.block_size) == (50304, 12, 12, 768, 1024)


def test_a_tokenizer_larger_than_its_model_is_one_line_not_a_crash(world, tmp_path):
    import dataclasses
    from safetensors.torch import save_file
    from megalite.config import ModelConfig
    from megalite.model import GPTStage
    from megalite.parallel.grid import ParallelGrid
    from megalite.tokenizer import load
    cfg = ModelConfig(**{**MODEL, "vocab_size": 300})
    model = GPTStage(cfg, ParallelGrid.single())
    tensors = {n: p.detach().clone().contiguous() for n, p in model.global_parameters()}
    save_file(tensors, str(tmp_path / "m.safetensors"), metadata={
        "megalite.model_config": json.dumps(dataclasses.asdict(cfg)), "megalite.tokenizer": load(world["gpt2"]).json})
    one_line(*cli("generate", "--model", tmp_path / "m.safetensors", "--prompt", "abc def"), "m.safetensors",
             "the prompt encodes to id", "300 token rows")


def test_a_warning_comes_before_the_sample_never_inside_it(world):
    """stdout and stderr into one stream, as on a terminal: the context warning is the first line, and the
    sample after it is the text, whole (a 40-token prompt for a 32-position model, streamed token by token)."""
    prompt = "ab cd " * 20
    both = io.StringIO()
    with contextlib.redirect_stdout(both), contextlib.redirect_stderr(both):
        rc = main(["generate", "--model", str(world["ck222"]), "--prompt", prompt, "--max-new-tokens", "5",
                   "--temperature", "0"])
    first, rest = both.getvalue().split("\n", 1)
    assert rc == 0 and first.startswith("generate: WARNING: the prompt has") and "block_size is 32" in first
    assert rest.startswith(prompt) and "WARNING" not in rest
    rc, alone, err = cli("generate", "--model", world["ck222"], "--prompt", prompt, "--max-new-tokens", 5,
                         "--temperature", 0)
    assert alone == rest and err.startswith("generate: WARNING")
