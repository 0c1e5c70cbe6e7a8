"""`megalite eval` against outside references:

- per document, on folders transformers itself saved (GPT-2 and a GQA Llama): the summed log-likelihood of each
  document's tokens after its first equals AutoModelForCausalLM's on that document alone (1e-5), for a jsonl
  corpus and for the token file `megalite prepare` made of it, a document longer than block_size included
  (scored by hand in transformers as lm-eval's rolling windows with one token of context);
- at every layout: tp = 2 (with sp too), pp = 2 (1F1B, AFAB, vpp 2), dp = 2 and cp = 2 (one grouped launch of
  two gloo ranks) give the single process's per-document numbers (1e-5 relative), and `megalite torchrun ...
  eval --parallel.pp=2` prints them;
- a megalite checkpoint and its model file score a byte token file (one document) in rolling windows as
  generate's load_model does window by window;
- bad input (a missing file, nothing to score, a token file of another tokenizer, --out that exists) is one
  line and writes nothing.
"""
from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

import helpers as H
from megalite.config import Config
from megalite.testing import run_parallel

TEXTS = ["the cat sat on the mat and the dog sat on the log", "a pipeline stage holds layers", "x",
         "the dog sat", "tensor parallel " * 30, "lambda yield", "def return class import for while if else print"]
LONG = 4  # TEXTS[3] is longer than block_size + 1 tokens: scored in windows
BLOCK = 32


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """{family: folder}: a GPT-2 (2 layers) and a GQA Llama (4 layers: pp 2 x vpp 2) with block_size 32, random
    weights of std 0.2, saved by transformers with test_generate's byte-level BPE (bos/eot <|endoftext|>)."""
    transformers = pytest.importorskip("transformers")
    from test_generate import _tokenizer
    out = {}
    for family, config in (("gpt2", transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=BLOCK)),
                           ("llama", transformers.LlamaConfig(
                               num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=BLOCK, tie_word_embeddings=False))):
        tok = _tokenizer(chat=False)
        config.vocab_size, config.initializer_range, config.bos_token_id, config.eos_token_id = len(tok), 0.2, 0, 0
        torch.manual_seed(1)
        d = tmp_path_factory.mktemp(f"hf-{family}")
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(d)
        tok.save_pretrained(d)
        out[family] = d
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    (d / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return d / "docs.jsonl"


def transformers_loglik(folder) -> list[tuple[float, int]]:
    """(summed log-probability of each document's tokens after its first, their number) by transformers: each
    document alone from position 0; a longer one in windows of BLOCK + 1 tokens overlapping by one, each alone."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    out = []
    for text in TEXTS:
        ids, total, n = tok(text)["input_ids"], 0.0, 0
        for a in range(0, max(len(ids) - 1, 0), BLOCK):
            w = torch.tensor([ids[a:a + BLOCK + 1]])
            with torch.no_grad():
                logp = torch.log_softmax(model(w[:, :-1]).logits[0].double(), -1)
            total += float(logp.gather(1, w[0, 1:, None]).sum())
            n += w.shape[1] - 1
        out.append((total, n))
    return out


def per_document(lines: str) -> list[tuple[float, int]]:
    return [(r["loglik"], r["tokens"]) for r in map(json.loads, lines.strip().splitlines())]


def close(a: list, b: list) -> None:
    assert [n for _, n in a] == [n for _, n in b]
    worst = max(abs(x - y) for (x, _), (y, _) in zip(a, b))
    print(f"largest difference {worst:.2e}")
    assert worst <= 1e-5, (a, b)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_per_document_logliks_are_transformers_for_a_corpus_and_its_token_file(folders, corpus, family, tmp_path):
    ref = transformers_loglik(folders[family])
    assert ref[2][1] == 0 and ref[LONG][1] > 2 * BLOCK  # a document with nothing to score; one of 9 windows
    rc, out, err = H.cli_in_process("eval", "--model", folders[family], "--data", corpus, "--per-document",
                                    "--out", tmp_path / "docs.jsonl")
    assert rc == 0, err
    got = per_document((tmp_path / "docs.jsonl").read_text())
    close(got, ref)
    total = -sum(ll for ll, _ in ref) / sum(n for _, n in ref)
    loss, ppl = (float(re.search(rf"{w} ([0-9.]+)", out).group(1)) for w in ("loss", "perplexity"))
    assert loss == pytest.approx(total, abs=1e-4) and ppl == pytest.approx(math.exp(total), rel=1e-4), out
    bin_ = tmp_path / "docs.bin"
    rc, _, err = H.cli_in_process("prepare", corpus, "--tokenizer", folders[family], "--out", bin_, "--quiet",
                                  "--val-fraction", "0.4")  # both splits: 'all' reads them as the corpus's documents
    assert rc == 0, err
    rc, out2, err = H.cli_in_process("eval", "--model", folders[family], "--data", bin_, "--per-document")
    assert rc == 0, err
    lines = out2.strip().splitlines()
    assert lines[-1] == out.strip().splitlines()[-1].split("; per document")[0]
    by_tokens = sorted(per_document("\n".join(lines[:-1])), key=lambda r: (r[1], r[0]))
    close(by_tokens, sorted(ref, key=lambda r: (r[1], r[0])))  # the val split's documents come after the train's


LAYOUTS = {"tp2": ["--parallel.tp=2"], "tp2-sp": ["--parallel.tp=2", "--parallel.sp=true"], "pp2": ["--parallel.pp=2"],
           "pp2-afab": ["--parallel.pp=2", "--parallel.schedule=afab"],
           "pp2-vpp2": ["--parallel.pp=2", "--parallel.vpp=2"], "dp2": ["--parallel.dp=2"], "cp2": ["--parallel.cp=2"]}


def _layouts(rank, world_size, tmp, folder, corpus):
    from megalite.config import load_config
    from megalite.run.evaluate import evaluate
    for name, flags in LAYOUTS.items():
        s = evaluate(str(folder), str(corpus), load_config(None, flags), batch_rows=3)
        if rank == 0:
            np.save(f"{tmp}/{name}.npy", np.stack([s.loglik, s.tokens]))


def test_every_layout_gives_the_single_process_numbers(folders, corpus, tmp_path):
    """tp = 2 (the Llama's 2 kv heads split; with and without sp), pp = 2 (1F1B, AFAB, interleaved with vpp = 2),
    dp = 2 and cp = 2 (the ring reads the whole rows' document ids) in one launch of two ranks,
    with 3 rows a batch (dp = 2 pads one): each document's numbers are the single process's (1e-5)."""
    from megalite.run.evaluate import evaluate
    ref = evaluate(str(folders["llama"]), str(corpus), Config(), batch_rows=3)
    run_parallel(_layouts, 2, tmp_path, args=(folders["llama"], corpus))
    for name in LAYOUTS:
        got = np.load(tmp_path / f"{name}.npy")
        assert (got[1] == ref.tokens).all(), name
        print(f"{name}: largest difference {np.abs(got[0] - ref.loglik).max():.2e}")
        np.testing.assert_allclose(got[0], ref.loglik, rtol=1e-5, atol=1e-5, err_msg=name)  # float32 losses summed


def test_under_torchrun_the_command_prints_the_same_numbers(folders, corpus):
    """`megalite eval` under torchrun at pp = 2 prints the single process's per-document lines; a bad --data under
    torchrun is one error line (rank 0's), not one a rank."""
    p = H.ok(H.run(H.torchrun_cmd(2, "eval", "--model", folders["gpt2"], "--data", corpus, "--per-document",
                                  "--parallel.pp=2")))
    rc, out, err = H.cli_in_process("eval", "--model", folders["gpt2"], "--data", corpus, "--per-document")
    assert rc == 0, err
    close(per_document("\n".join(p.stdout.strip().splitlines()[:-1])), per_document("\n".join(
        out.strip().splitlines()[:-1])))
    bad = H.run(H.torchrun_cmd(2, "eval", "--model", folders["gpt2"], "--data", corpus.with_name("none.txt"),
                               "--parallel.tp=2"))  # a rank's error said once, by rank 0
    said = [ln for ln in bad.stderr.splitlines() if ln.startswith("megalite eval: error:")]
    assert bad.returncode != 0 and len(said) == 1 and said[0].endswith("--data: source '" + str(
        corpus.with_name("none.txt")) + "' does not exist"), bad.stderr[-3000:]


def test_bad_input_is_one_line_and_writes_nothing(folders, corpus, token_file, tmp_path):
    out = tmp_path / "per-doc.jsonl"
    (tmp_path / "empty.jsonl").write_text('{"text": "x"}\n\n')
    cases = {tmp_path / "missing.txt": "--data: source", tmp_path / "empty.jsonl": "no token to score",
             token_file: "another tokenizer"}
    for data, words in cases.items():
        rc, _, err = H.cli_in_process("eval", "--model", folders["gpt2"], "--data", data, "--per-document",
                                      "--out", out)
        assert rc == 2 and words in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()
    out.write_text("mine\n")
    rc, _, err = H.cli_in_process("eval", "--model", folders["gpt2"], "--data", corpus, "--per-document", "--out", out)
    assert rc == 2 and "already exists" in err and out.read_text() == "mine\n", err
    rc, _, err = H.cli_in_process("eval", "--model", folders["gpt2"], "--data", corpus, "--train.steps=3")
    assert rc == 2 and "only --parallel.*" in err, err
    rc, _, err = H.cli_in_process("eval", "--model", folders["gpt2"], "--data", corpus, "--parallel.pp=2")
    assert rc == 2 and "torchrun --nproc-per-node 2 -m megalite eval" in err, err


def test_a_checkpoint_and_its_model_file_score_a_byte_token_file_in_rolling_windows(run111, model_file,
                                                                                    convert_tokens):
    """A megalite checkpoint and the model file converted from it, on the validation split of a byte token file
    (no end-of-text id: one document, scored in windows of block_size + 1 tokens overlapping by one): the same
    log-likelihood, and the one computed window by window with generate's load_model (1e-5)."""
    from megalite.data import TokenDataset
    from megalite.generate import load_model
    from megalite.run.evaluate import evaluate
    a = evaluate(str(run111["ckpt"]), str(convert_tokens), Config(), split="val", batch_rows=64)
    b = evaluate(str(model_file), str(convert_tokens), Config(), split="val", batch_rows=64)
    model = load_model(model_file).eval()
    ids, seq = torch.from_numpy(np.asarray(TokenDataset(convert_tokens, "val").tokens, dtype=np.int64)), \
        model.cfg.block_size
    full = (len(ids) - 1) // seq  # windows of seq + 1 tokens, overlapping by one, then the rest
    windows = [ids[k * seq:k * seq + seq + 1][None] for k in range(full)]
    windows = [torch.cat(windows)] + ([ids[full * seq:][None]] if len(ids) - 1 > full * seq else [])
    total = 0.0
    with torch.no_grad():
        for w in windows:
            logp = torch.log_softmax(model(w[:, :-1]).double(), -1)
            total += float(logp.gather(2, w[:, 1:, None]).sum())
    assert len(a.tokens) == 1 and a.tokens[0] == b.tokens[0] == len(ids) - 1
    assert a.loglik[0] == b.loglik[0]
    print(f"largest difference {abs(a.loglik[0] - total):.2e} of {total:.1f}")
    assert abs(a.loglik[0] - total) <= 1e-5 * abs(total)  # relative: ~3,900 tokens' float32 losses summed
