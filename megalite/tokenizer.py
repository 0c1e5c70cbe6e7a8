"""megalite's byte tokenizer as a Hugging Face fast tokenizer, so an exported folder works with
`AutoTokenizer` and `pipeline("text-generation")` as is.

Token id = byte value (0..255), exactly as `megalite prepare` and `megalite generate` use. Built with the
`tokenizers` library: a BPE model with no merges over GPT-2's byte-to-character alphabet (so every byte,
including control bytes and non-ASCII UTF-8 pieces, is one token), the ByteLevel pre-tokenizer without its
regex split or a prefix space (text is cut into bytes only), and the ByteLevel decoder (bytes back to text).
It has no special tokens: the byte vocabulary has none.
"""
from __future__ import annotations

import json
from pathlib import Path


def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map: printable Latin-1 bytes stand for themselves, the
    other 68 bytes take the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {ch: b for b, ch in byte_alphabet().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def write_byte_tokenizer(folder: Path, max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json (a PreTrainedTokenizerFast with no special tokens)."""
    build_byte_tokenizer().save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
