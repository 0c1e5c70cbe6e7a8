"""Issue 29's test audit: realistic bugs planted one at a time in the newest code that no test caught, each with
a test of its own here (cheap: no process group, tiny models), against an outside reference where one exists:
torch.topk, the `tokenizers` library's own ids and token strings, a count by hand, torch's own compiled-module
state. docs/reliability.md's table of planted bugs names each bug and the test that fails on it; the survivors
whose test needs a fixture of another file live there (test_context_parallel, test_foreign_dcp,
test_foreign_megatron, test_error_contract_torchrun).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megalite.config import ModelConfig
from megalite.model import GPTStage
from megalite.parallel.grid import ParallelGrid

EOT = "<|endoftext|>"


# ---------------------------------------------------------------- generate: top-k
class FixedLogits(torch.nn.Module):
    """A 'model' whose next-token logits are always `logits`: generate's sampling alone is under test."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits, self.real_vocab = logits, logits.numel()
        self.cfg = ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=logits.numel())

    def forward(self, x, **cache):  # (1, T) -> (1, T, V); a KV cache (generate's) is given and left empty
        return self.logits.expand(x.shape[0], x.shape[1], -1).clone()


@pytest.mark.parametrize("k", [1, 3, 5, 20])
def test_top_k_draws_exactly_the_k_ids_torch_topk_keeps(k):
    """At a temperature that makes the kept ids about equally likely, 300 draws reach every id of
    torch.topk(logits, k) and no other (keeping k - 1, or k + 1, shows at once); a k above the vocabulary (20
    of 10) keeps every id, as transformers' TopKLogitsWarper does (min(top_k, vocab))."""
    from megalite.generate import generate
    logits = torch.tensor([0.3, 2.0, -1.0, 1.5, 1.9, 0.0, 1.0, -0.5, 0.7, 1.2])
    out = generate(FixedLogits(logits), [0], max_new_tokens=300, temperature=50.0, top_k=k, seed=5,
                   warn=lambda msg: None)
    assert set(out[1:]) == set(torch.topk(logits, min(k, logits.numel())).indices.tolist())


class Recorder(FixedLogits):
    """FixedLogits that records every context it is given."""

    def __init__(self, logits: torch.Tensor):
        super().__init__(logits)
        self.seen = []

    def forward(self, x, **cache):
        self.seen.append(x[0].tolist())
        return super().forward(x)


def test_generate_feeds_the_model_exactly_its_last_block_size_tokens():
    """A context longer than the model's block_size (8) is cropped to its last 8 tokens at every step: the
    sliding window written out by hand (a window one shorter still samples, so only the input shows it)."""
    from megalite.generate import generate
    model = Recorder(torch.arange(10, dtype=torch.float32))
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5]  # 9 > block_size
    out = generate(model, ids, max_new_tokens=3, temperature=0, warn=lambda msg: None)
    assert out == ids + [9, 9, 9]
    assert model.seen == [out[k - 8:k] for k in (9, 10, 11)]
    model.seen.clear()
    generate(model, ids[:4], max_new_tokens=2, temperature=0)  # shorter than the block: the whole context
    assert model.seen == [ids[:4], ids[:4] + [9]]


# ---------------------------------------------------------------- bits per byte: <|endoftext|> is no text
def _docs(n: int) -> list[str]:
    words = "the cat sat on a mat while model and data ran fast over every token in all ranks".split()
    rng = np.random.default_rng(3)
    return [" ".join(words[i] for i in rng.integers(0, len(words), size=int(rng.integers(4, 12)))) + "."
            for _ in range(n)]


def test_bits_per_byte_counts_no_bytes_for_end_of_text(tmp_path):
    """A BPE's bytes per id against the `tokenizers` library's own token strings (one byte-level character per
    byte; <|endoftext|> stands for no text, not its 13 characters), and tokens per byte of validation targets
    that hold many end-of-text separators (80 short documents) counted by hand."""
    from tokenizers import Tokenizer as Backend
    from megalite.data import TokenDataset, eval_batches, eval_tokens_per_byte, prepare
    from megalite.tokenizer import train_bpe
    docs = _docs(80)
    tok = train_bpe(docs, 300)
    (tmp_path / "bpe.json").write_text(tok.json)
    lib = Backend.from_file(str(tmp_path / "bpe.json"))
    eot = lib.token_to_id(EOT)
    want = [0 if i == eot else len(lib.id_to_token(i)) for i in range(lib.get_vocab_size())]
    assert tok.token_bytes() == want
    files = []
    for i, d in enumerate(docs):
        files.append(tmp_path / f"doc{i:03d}.txt")
        files[-1].write_text(d)
    prepare(files, tmp_path / "t.bin", val_fraction=0.5, tokenizer=tmp_path / "bpe.json", log=lambda *a: None)
    val = TokenDataset(tmp_path / "t.bin", "val")
    ys = torch.cat([y.reshape(-1) for _, y in eval_batches(val, 16, 8, 0, 1, 2, 7)]).tolist()
    assert ys.count(eot) >= 3  # the case under test: end-of-text among the targets
    by_hand = len(ys) / sum(len(lib.id_to_token(i)) for i in ys if i != eot)
    assert eval_tokens_per_byte(val, 16, 8, 2, 7, tok) == pytest.approx(by_hand, rel=1e-12)


def test_bytes_per_id_of_a_tokenizer_without_byte_level_decoding_are_utf8_bytes():
    """A word-level vocabulary with accents, CJK and an emoji: each id stands for its word's UTF-8 bytes
    (str.encode), not its characters; the special end-of-text token for none."""
    from tokenizers import Tokenizer as Backend, models, pre_tokenizers
    from megalite.tokenizer import from_json
    words = ["[UNK]", "cat", "café", "日本語", "🚀", "naïve"]
    lib = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    lib.pre_tokenizer = pre_tokenizers.Whitespace()
    lib.add_special_tokens([EOT])
    tok = from_json(lib.to_str(), "test")
    assert tok.token_bytes() == [len(w.encode("utf-8")) for w in words] + [0] == [5, 3, 5, 9, 4, 6, 0]


def test_a_tokenizer_folder_with_both_formats_is_read_from_its_tokenizer_json(tmp_path):
    """HF tokenizer folders often hold tokenizer.json beside vocab.json + merges.txt; tokenizer.json is the whole
    tokenizer (added tokens, pre-tokenizer), so it is what a folder means, as transformers' fast tokenizers
    read it. Here the two files disagree: the ids are the `tokenizers` library's from tokenizer.json."""
    from tokenizers import Tokenizer as Backend
    from megalite.tokenizer import load, train_bpe
    text = "the cat sat on the mat"
    (tmp_path / "tokenizer.json").write_text(train_bpe(_docs(40), 300).json)
    (tmp_path / "vocab.json").write_text(json.dumps({c: i for i, c in enumerate([*"abcdefghijklmnopqrstuvwxyzĠ", "th"])}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\nt h\n")
    want = Backend.from_file(str(tmp_path / "tokenizer.json")).encode(text).ids
    assert load(tmp_path).encode(text) == want


# ---------------------------------------------------------------- prepare: where a corpus may be cut
@pytest.mark.parametrize("prefix_space", [False, True])
def test_prepare_in_small_pieces_gives_the_librarys_ids_of_the_whole_text(tmp_path, prefix_space):
    """A byte-level BPE with and without `add_prefix_space`, a corpus read in 64-character pieces: the token file
    holds exactly `tokenizers`' ids of the whole file (a prefix space would be added at every cut if pieces were
    encoded apart, so such a tokenizer reads each file whole)."""
    from tokenizers import Tokenizer as Backend, pre_tokenizers
    from megalite.data import prepare
    from megalite.tokenizer import train_bpe
    text = "\n".join(_docs(60)) + "\n  two  spaces\tand a tab\n"
    tok = train_bpe([text], 320)
    tok.backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space, use_regex=True)
    (tmp_path / "bpe.json").write_text(tok.backend.to_str())
    (tmp_path / "corpus.txt").write_text(text)
    meta = prepare([tmp_path / "corpus.txt"], tmp_path / "t.bin", tokenizer=tmp_path / "bpe.json", piece_chars=64,
                   batch_chars=128, log=lambda *a: None)
    got = np.fromfile(tmp_path / "t.bin", dtype=meta["dtype"]).tolist()
    want = Backend.from_file(str(tmp_path / "bpe.json")).encode(text).ids
    assert len(text) > 20 * 64 and got == want


def test_prepare_records_the_largest_id_written_separators_included(tmp_path):
    """`max_token` in the .json is the largest id in the .bin (numpy's max of the file), also when that id is
    the end-of-text separator between documents (GPT-2 puts <|endoftext|> last: 50256); a run then opens the
    file at the vocabulary that holds it, not refusing it as corrupt."""
    from tokenizers import Tokenizer as Backend, models, pre_tokenizers
    from megalite.data import TokenDataset, check_vocab, prepare
    lib = Backend(models.WordLevel({"[UNK]": 0, "the": 1, "cat": 2, "sat": 3}, unk_token="[UNK]"))
    lib.pre_tokenizer = pre_tokenizers.Whitespace()
    lib.add_special_tokens([EOT])  # id 4: the largest, written only between documents
    (tmp_path / "wl.json").write_text(lib.to_str())
    files = []
    for i, text in enumerate(["the cat sat", "sat the cat the", "cat"]):
        files.append(tmp_path / f"d{i}.txt")
        files[-1].write_text(text)
    meta = prepare(files, tmp_path / "t.bin", val_fraction=0.0, tokenizer=tmp_path / "wl.json", log=lambda *a: None)
    ids = np.fromfile(tmp_path / "t.bin", dtype=meta["dtype"])
    assert ids.tolist() == [1, 2, 3, 4, 3, 1, 2, 1, 4, 2]
    assert meta["max_token"] == int(ids.max()) == json.loads((tmp_path / "t.json").read_text())["max_token"]
    check_vocab(TokenDataset(tmp_path / "t.bin", "train"), 5)


# ---------------------------------------------------------------- the allow-list unpickler: package prefixes
@pytest.mark.parametrize("module", ["megatron_tools", "megatronx.core", "megatron2", "megatron-evil"])
def test_a_package_prefix_allows_that_package_only_not_every_module_name_starting_so(module):
    """MEGATRON_COMMON lets megatron's own enums through as inert records: `megatron` and `megatron.*` (Python's
    package paths), never another top-level module whose name merely starts with those letters."""
    from megalite.convert.unpickle import MEGATRON_COMMON, Record, RefusedGlobal, load
    for inside in ("megatron", "megatron.core.enums"):
        assert issubclass(load(f"c{inside}\nModelType\n.".encode(), MEGATRON_COMMON), Record)
    with pytest.raises(RefusedGlobal, match=module):
        load(f"c{module}\nrun\n.".encode(), MEGATRON_COMMON)


# ---------------------------------------------------------------- jsonio's exact codec: types come back
def _same(a, b) -> bool:
    """Equal with the same types all the way down (Python's == takes 1 == 1.0 == True, but not (1,) == [1])."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)  # NaN


def test_the_scheduler_codec_gives_back_every_type_it_promises():
    """jsonio.encode -> JSON text -> jsonio.decode returns the value with the same types (its docstring's
    list: a Counter of int milestones, tuples, int keys, an OrderedDict, inf and NaN), checked type by type."""
    import math
    from collections import Counter, OrderedDict
    from megalite.base.jsonio import decode, encode
    value = {"milestones": Counter({30: 1, 80: 2}), "betas": (0.9, 0.95), 3: [1, (2, (3, "x")), None, True],
             "od": OrderedDict(b=1, a=2), "hi": math.inf, "lo": -math.inf, "nan": math.nan, "f": 1.0}
    back = decode(json.loads(json.dumps(encode(value, "state"))), "state")
    assert _same(back, value), back


# ---------------------------------------------------------------- metrics.jsonl: a redone step's last record
def test_metrics_read_keeps_the_last_record_of_a_redone_step(tmp_path):
    """A launch killed after logging steps 1-3 with its checkpoint at step 1, resumed: it logs a resume event
    and steps 2-3 again. `read` (what `megalite plot` draws) gives steps 1, 2, 3 with the redone values, as
    metrics.py's docstring says, written out here by hand."""
    from megalite.run.metrics import events, read
    lines = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}, {"step": 3, "loss": 3.0},
             {"event": "resume", "step": 1}, {"step": 2, "loss": 4.5}, {"step": 3, "loss": 3.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert read(tmp_path) == [lines[0], lines[4], lines[5]]
    assert events(tmp_path) == [lines[3]]


# ---------------------------------------------------------------- train.compile: every block
def test_compile_blocks_compiles_every_block_of_the_stage():
    """nn.Module.compile marks the module it compiled (torch's `_compiled_call_impl`): every block of the stage,
    and nothing else (the embeddings, final norm and head stay eager, as compile.py says)."""
    from megalite.run.compile import compile_blocks
    cfg = ModelConfig(n_layer=3, n_head=2, n_embd=16, block_size=8, vocab_size=64)
    model = GPTStage(cfg, ParallelGrid.single())
    assert compile_blocks(model) == 3
    compiled = sorted(name for name, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None)
    assert compiled == sorted(f"blocks.{k}" for k in model.blocks), compiled
