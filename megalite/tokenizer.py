"""Tokenizers: the byte tokenizer, GPT-2-style byte-level BPE (trained here or GPT-2's own), and the one form
a run carries them in: a `tokenizer.json` of the `tokenizers` library.

    Tokenizer          what megalite knows of a tokenizer: its canonical tokenizer.json text (and sha256),
                       vocab size, end-of-text id, encode/decode (lossless for any text)
    load(spec)         "byte", a tokenizer.json, or an HF tokenizer folder (its tokenizer.json, or GPT-2's
                       vocab.json + merges.txt)
    train_bpe(...)     `megalite tokenizer train`: a GPT-2-style byte-level BPE over some files
    write_hf_folder    tokenizer.json + tokenizer_config.json (+ special_tokens_map.json) that
                       transformers' AutoTokenizer loads as is

The byte tokenizer is token id = byte value (0..255), built with `tokenizers` as a BPE with no merges over
GPT-2's byte-to-character alphabet and the ByteLevel pre-tokenizer without its regex split or a prefix
space; it has no special tokens. A BPE here is GPT-2's recipe: GPT-2's pre-tokenization regex, the 256 byte
characters as the initial alphabet (so every byte, hence every text, is encodable), `<|endoftext|>` as a
special token, and the ByteLevel decoder. Identity is the sha256 of the canonical text
(`tokenizers.Tokenizer.to_str(pretty=True)`): that is what token files record and checkpoints carry.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Iterable, Optional

from .base.corpus import read_text_pieces  # tokenizer train reads its files in pieces too
from .base.errors import DataError

EOT = "<|endoftext|>"  # GPT-2's end-of-text token
BYTE = "byte"
TOKENIZER_JSON = "tokenizer.json"


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
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers
    vocab = {ch: b for b, ch in byte_alphabet().items()}
    tok = Backend(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


# ---------------------------------------------------------------- what a run carries
class Tokenizer:
    """A tokenizer as megalite carries it: the canonical tokenizer.json text, and what it says.

    encode/decode are lossless for every text (byte-level: every byte has a token); decode never fails on
    an id (an id the vocabulary lacks decodes to nothing, a cut UTF-8 character to U+FFFD)."""

    def __init__(self, backend, source: str):
        self.backend, self.source = backend, source
        self.json = backend.to_str(pretty=True)
        self.sha256 = hashlib.sha256(self.json.encode("utf-8")).hexdigest()
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.is_byte = self.sha256 == _byte_sha256()
        self.eot_id = None if self.is_byte else backend.token_to_id(EOT)

    @property
    def kind(self) -> str:
        """'byte', or the model type in lower case ('bpe', 'unigram', ...)."""
        return BYTE if self.is_byte else json.loads(self.json)["model"]["type"].lower()

    def encode(self, text: str) -> list[int]:
        if self.is_byte:
            return list(text.encode("utf-8"))
        return self.backend.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Several texts at once, encoded in parallel by the tokenizers library's threads."""
        if self.is_byte:
            return [list(t.encode("utf-8")) for t in texts]
        return [e.ids for e in self.backend.encode_batch(texts)]

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.is_byte:  # a sampled sequence may cut a multi-byte character: replaced, never an error
            return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
        return self.backend.decode([i for i in ids if i >= 0], skip_special_tokens=False)

    def streams_by_words(self) -> bool:
        """Whether a text may be encoded in pieces cut before a space, newline or tab that follows a
        non-whitespace character, giving the same ids as the whole text (see read_text_pieces). True for the
        byte tokenizer and for GPT-2-style byte-level BPE: no normalizer, the ByteLevel pre-tokenizer with
        GPT-2's regex and no prefix space (no pre-token of that regex reaches across such a point, and none
        looks behind), and no added token containing whitespace."""
        if self.is_byte:
            return True
        d = json.loads(self.json)
        pre = d.get("pre_tokenizer") or {}
        return (d.get("normalizer") is None and pre.get("type") == "ByteLevel"
                and pre.get("use_regex", True) and not pre.get("add_prefix_space", False)
                and not any(any(c.isspace() for c in t.get("content", "")) for t in d.get("added_tokens", [])))

    def token_bytes(self) -> list[int]:
        """How many bytes of text each id stands for (bits per byte need it): 1 per byte-level character of a
        token, 0 for special tokens (the end-of-text separator is not text of the corpus)."""
        if self.is_byte:
            return [1] * 256
        d = json.loads(self.json)
        special = {t["id"] for t in d.get("added_tokens", []) if t.get("special")}
        out = [0] * self.vocab_size
        byte_level = (d.get("decoder") or {}).get("type") == "ByteLevel"
        for tok, i in self.backend.get_vocab(with_added_tokens=True).items():
            if i in special or not 0 <= i < self.vocab_size:
                continue
            out[i] = len(tok) if byte_level else len(self.backend.decode([i]).encode("utf-8"))
        return out


@functools.lru_cache(maxsize=1)
def _byte_sha256() -> str:
    return hashlib.sha256(build_byte_tokenizer().to_str(pretty=True).encode("utf-8")).hexdigest()


def byte_tokenizer() -> Tokenizer:
    return Tokenizer(build_byte_tokenizer(), BYTE)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------- loading
def from_json(text: str, where: str) -> Tokenizer:
    """A Tokenizer from tokenizer.json text; `where` names its source in a one-line error."""
    from tokenizers import Tokenizer as Backend
    try:
        d = json.loads(text)
    except ValueError as e:
        raise DataError(f"{where}: not valid JSON ({e}); expected a tokenizer.json saved by the tokenizers "
                        f"library") from None
    if not isinstance(d, dict) or not isinstance(d.get("model"), dict):
        raise DataError(f"{where}: not a tokenizer.json (no 'model' object; expected a file saved by the "
                        f"tokenizers library, e.g. `megalite tokenizer train` or an HF tokenizer folder)")
    try:
        backend = Backend.from_str(text)
    except Exception as e:  # noqa: BLE001 - the library's own parse error (a Rust message)
        raise DataError(f"{where}: the tokenizers library cannot load it ({' '.join(str(e).split())})") from None
    tok = Tokenizer(backend, where)
    if tok.vocab_size < 1:
        raise DataError(f"{where}: the tokenizer has an empty vocabulary")
    return tok


def _read_text(path: Path, what: str) -> str:
    if not path.is_file():
        from .config import path_kind
        raise DataError(f"{what} '{path}' is {path_kind(path)}, expected a file")
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{what} '{path}': not UTF-8 text ({e.reason} at byte {e.start})") from None


def gpt2_from_files(vocab: Path, merges: Path) -> Tokenizer:
    """GPT-2's own format (vocab.json + merges.txt) as GPT-2's tokenizer: byte-level BPE with GPT-2's regex,
    no prefix space, `<|endoftext|>` special when the vocabulary has it (as transformers' GPT2Tokenizer)."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers
    text = _read_text(vocab, "vocab.json")
    try:
        table = json.loads(text)
    except ValueError as e:
        raise DataError(f"{vocab}: not valid JSON ({e}); expected GPT-2's vocab.json (token -> id)") from None
    if not isinstance(table, dict) or not table or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0 for k, v in table.items()):
        raise DataError(f"{vocab}: expected GPT-2's vocab.json, a JSON object of token -> non-negative id")
    _read_text(merges, "merges.txt")
    try:
        backend = Backend(models.BPE.from_file(str(vocab), str(merges)))
    except Exception as e:  # noqa: BLE001 - the library's own parse error
        raise DataError(f"{merges}: the tokenizers library cannot read it with {vocab.name} "
                        f"({' '.join(str(e).split())}); expected GPT-2's merges.txt") from None
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    if EOT in table:
        backend.add_special_tokens([EOT])
    return Tokenizer(backend, str(vocab.parent))


def load(spec, what: str = "--tokenizer") -> Tokenizer:
    """`byte`, a tokenizer.json, GPT-2's vocab.json (merges.txt beside it), or a folder holding either."""
    if str(spec) == BYTE:
        return byte_tokenizer()
    p = Path(spec)
    if p.is_dir():
        if (p / TOKENIZER_JSON).exists():
            return from_json(_read_text(p / TOKENIZER_JSON, what), str(p / TOKENIZER_JSON))
        if (p / "vocab.json").exists():
            p = p / "vocab.json"
        else:
            raise DataError(f"{what} '{p}': the folder holds neither {TOKENIZER_JSON} nor vocab.json + merges.txt "
                            f"(expected an HF tokenizer folder)")
    if not p.exists():
        raise DataError(f"{what} '{p}' does not exist (expected '{BYTE}', a {TOKENIZER_JSON}, or an HF tokenizer "
                        f"folder)")
    if p.name == "vocab.json":
        merges = p.with_name("merges.txt")
        if not merges.exists():
            raise DataError(f"{what} '{p}': no merges.txt beside it (GPT-2's format is vocab.json + merges.txt "
                            f"in one folder)")
        return gpt2_from_files(p, merges)
    return from_json(_read_text(p, what), str(p))


# ---------------------------------------------------------------- an HF tokenizer folder
def write_hf_folder(tok: Tokenizer, folder: Path, max_length: Optional[int]) -> list[Path]:
    """tokenizer.json, tokenizer_config.json and (with an end-of-text token) special_tokens_map.json, so that
    `transformers.AutoTokenizer.from_pretrained(folder)` loads it as is: a PreTrainedTokenizerFast on the
    tokenizer.json, end-of-text as its bos/eos/unk token, no extra tokens added, no space clean-up (decode
    stays lossless). The byte tokenizer has no special tokens."""
    folder = Path(folder)
    (folder / TOKENIZER_JSON).write_text(tok.json, encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False}
    if max_length is None:  # a tokenizer apart from any model: transformers' own default (no limit)
        del config["model_max_length"]
    written = [folder / TOKENIZER_JSON, folder / "tokenizer_config.json"]
    if tok.eot_id is not None:
        special = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT}
        config.update(special, add_prefix_space=False)
        (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
        written.append(folder / "special_tokens_map.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return written


# ---------------------------------------------------------------- training a BPE
def gpt2_style_bpe():
    """An untrained GPT-2-style byte-level BPE (the tokenizers library's parts, GPT-2's settings)."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


MIN_VOCAB = 257  # the 256 byte characters + <|endoftext|>


def check_vocab_size(vocab_size) -> None:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not MIN_VOCAB <= vocab_size <= 2**31:
        raise DataError(f"--vocab-size {vocab_size}: expected an integer >= {MIN_VOCAB} (the 256 byte characters + "
                        f"{EOT})")


def train_bpe(texts: Iterable[str], vocab_size: int, show_progress: bool = False, length: Optional[int] = None,
              min_frequency: int = 2) -> Tokenizer:
    """Train a GPT-2-style byte-level BPE of `vocab_size` ids (<|endoftext|> is id 0, the 256 byte characters
    next, then the merges in the order learned) on `texts`. Deterministic: the same texts give the same
    tokenizer.json. Fewer ids come out when the texts hold fewer distinct pairs worth merging."""
    from tokenizers import pre_tokenizers, trainers
    check_vocab_size(vocab_size)
    backend = gpt2_style_bpe()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=show_progress)
    backend.train_from_iterator(texts, trainer, length=length)
    return Tokenizer(backend, "trained")


def train_folder(files: list[Path], vocab_size: int, out, force: bool = False, quiet: bool = False,
                 min_frequency: int = 2, log=print) -> Path:
    """`megalite tokenizer train`: train_bpe on the files (each read in pieces, see read_text_pieces) and write
    the HF tokenizer folder `out`, built next to it and moved into place when complete (an existing `out`
    only with `force`, and only then replaced)."""
    out = Path(out)
    if out.name in ("", ".", ".."):
        raise DataError(f"--out '{out}': expected the path of a new folder")
    if os.path.lexists(out) and not force:
        raise DataError(f"--out '{out}' already exists (pass --force to replace it)")
    if isinstance(min_frequency, bool) or not isinstance(min_frequency, int) or min_frequency < 1:
        raise DataError(f"--min-frequency {min_frequency}: expected an integer >= 1")
    if not files:
        raise DataError("tokenizer train: no text files to train on")
    check_vocab_size(vocab_size)
    total = sum(Path(f).stat().st_size for f in files)
    if not quiet:
        log(f"tokenizer: training a byte-level BPE of {vocab_size:,} ids on {len(files):,} files "
            f"({total / 1e6:,.1f} MB)")
    tok = train_bpe((piece for f in files for piece in read_text_pieces(Path(f))), vocab_size,
                    show_progress=progress_on(quiet), min_frequency=min_frequency)
    if tok.vocab_size < vocab_size and not quiet:
        log(f"tokenizer: WARNING: the text gives only {tok.vocab_size:,} ids (pairs seen fewer than "
            f"{min_frequency} times are not merged), not {vocab_size:,}")
    from .base.fs import remove_tree, replace_output
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    remove_tree(tmp)
    tmp.mkdir(parents=True)
    try:
        write_hf_folder(tok, tmp, None)
    except BaseException:
        remove_tree(tmp)
        raise
    replace_output(tmp, out)  # --force: the old folder goes only once the new one is in place
    return out


def progress_on(quiet: bool = False) -> bool:
    """Progress bars on stderr: when someone watches (a terminal) or MEGALITE_PROGRESS=1; never when quiet
    or MEGALITE_PROGRESS=0."""
    want = os.environ.get("MEGALITE_PROGRESS", "")
    return not quiet and (want == "1" if want in ("0", "1") else sys.stderr.isatty())
