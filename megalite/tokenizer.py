"""Tokenizers: the byte tokenizer, GPT-2-style byte-level BPE (trained here or GPT-2's own), and the one form
a run carries them in: a `tokenizer.json` of the `tokenizers` library.

    Tokenizer          what megalite knows of a tokenizer: its canonical tokenizer.json text (and sha256),
                       vocab size, end-of-text id, encode/decode (lossless for any text)
    load(spec)         "byte", a tokenizer.json, or an HF tokenizer folder (its tokenizer.json, or GPT-2's
                       vocab.json + merges.txt)
    train_bpe(...)     `megalite tokenizer train`: a GPT-2-style byte-level BPE over some files
    write_hf_folder    tokenizer.json + tokenizer_config.json (+ special_tokens_map.json) that
                       transformers' AutoTokenizer loads as is
    of_token_file(...) which tokenizer made a token file (which one an artifact carries: checkpoint/validate.py's
                       carried_by, the side that opens checkpoints and model files; this floor opens none)

The byte tokenizer is token id = byte value (0..255), built with `tokenizers` as a BPE with no merges over
GPT-2's byte-to-character alphabet and the ByteLevel pre-tokenizer without its regex split or a prefix
space; it has no special tokens. A BPE here is GPT-2's recipe: GPT-2's pre-tokenization regex, the 256 byte
characters as the initial alphabet (so every byte, hence every text, is encodable), `<|endoftext|>` as a
special token, and the ByteLevel decoder. Identity is the sha256 of the canonical text
(`tokenizers.Tokenizer.to_str(pretty=True)`): that is what token files record and checkpoints carry.
"""
from __future__ import annotations

import codecs
import contextlib
import functools
import hashlib
import io
import json
import os
import re
import sys
from pathlib import Path
from typing import Iterable, Iterator, Optional

from .base import limits
from .base.corpus import RECORD_SUFFIXES, records
from .base.errors import CheckpointError, DataError
from .base.fs import (by_descriptor, folder_locked, identity, open_read, output_refusal, path_kind, read_all,
                      remove_tree, replace_output, what_is)
from .base.jsonio import loads

EOT = "<|endoftext|>"  # GPT-2's end-of-text token
TOKENIZER_KEY = "megalite.tokenizer"  # safetensors metadata of a converted model file: the run's tokenizer.json
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
        ids = backend.get_vocab(with_added_tokens=True).values()
        # the largest id + 1, not the count of ids: a vocabulary with holes (ids 0..255 and 70000) would
        # otherwise be stored as uint16 and its id 70000 lost
        self.vocab_size = check_ids(ids, source) + 1
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
        steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
        # Llama 3's split (megalite's own --pre-tokenizer llama3) cuts no pre-token across such a point either:
        # every whitespace run begins a pre-token of its own or one (" word", " ;") that starts with it
        llama3 = (len(steps) == 2 and steps[0].get("type") == "Split"
                  and steps[0].get("pattern", {}).get("Regex") == LLAMA3_SPLIT
                  and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert")
                  and steps[1].get("type") == "ByteLevel" and not steps[1].get("use_regex", True)
                  and not steps[1].get("add_prefix_space", False))
        gpt2 = pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space", False)
        return (d.get("normalizer") is None and (gpt2 or llama3)
                and not any(any(c.isspace() for c in t.get("content", "")) for t in d.get("added_tokens", [])))

    def specials(self) -> tuple:
        """The contents of its added tokens, which the library matches whole in any text (never cut inside)."""
        return tuple(t["content"] for t in json.loads(self.json).get("added_tokens", []) if t.get("content"))

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


# ---------------------------------------------------------------- loading
def check_ids(ids, where: str) -> int:
    """The largest of a vocabulary's `ids`, which must lie within limits.HOLES x their count (+ SLACK): per-id
    tables (the token dtype, bytes per token) are sized by the largest id, and the tokenizers library itself
    walks every id up to it when it writes a tokenizer out (an id of 2**31 - 1 among 27: minutes)."""
    ids = [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]
    top = max(ids, default=-1)
    if top + 1 > limits.HOLES * len(set(ids)) + limits.SLACK:
        shown = f"{top:,}" if top.bit_length() <= 128 else limits.describe(top)
        raise DataError(f"{where}: the largest token id is {shown}, but the tokenizer lists only "
                        f"{len(set(ids)):,} ids; expected ids numbered from 0 with at most {limits.HOLES}x as many "
                        f"unused ones (per-id tables are sized by the largest id)")
    return top


def from_json(text: str, where: str) -> Tokenizer:
    """A Tokenizer from tokenizer.json text; `where` names its source in a one-line error."""
    from tokenizers import Tokenizer as Backend
    d = loads(text, where, DataError, kind="tokenizer")
    if not isinstance(d, dict) or not isinstance(d.get("model"), dict):
        raise DataError(f"{where}: not a tokenizer.json (no 'model' object; expected a file saved by the "
                        f"tokenizers library, e.g. `megalite tokenizer train` or an HF tokenizer folder)")
    vocab = d["model"].get("vocab")  # checked before the library builds anything from it
    check_ids([*(vocab.values() if isinstance(vocab, dict) else range(len(vocab)) if isinstance(vocab, list) else []),
               *(t.get("id") for t in d.get("added_tokens") or [] if isinstance(t, dict))], where)
    try:
        backend = Backend.from_str(text)
    except Exception as e:  # noqa: BLE001 - the library's own parse error (a Rust message)
        raise DataError(f"{where}: the tokenizers library cannot load it ({' '.join(str(e).split())})") from None
    tok = Tokenizer(backend, where)
    if tok.vocab_size < 1:
        raise DataError(f"{where}: the tokenizer has an empty vocabulary")
    unk = d["model"].get("unk_token")
    if unk is not None and backend.token_to_id(unk) is None:  # encoding any word it lacks would fail
        raise DataError(f"{where}: model.unk_token = {limits.describe(unk)} is not in its vocabulary (the library "
                        f"then fails on the first unknown word); expected a token of the vocabulary, or null")
    return tok


def _read_text(path: Path, what: str) -> str:
    if not path.is_file():
        raise DataError(f"{what} '{path}' is {path_kind(path)}, expected a file")
    limits.within(path.stat().st_size, "tokenizer", f"{what} '{path}'", DataError)
    data = read_all(path, limits.FILE_BYTES["tokenizer"] + 1, follow=True)  # a FIFO refused at open, never waited on
    limits.within(len(data), "tokenizer", f"{what} '{path}'", DataError)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{what} '{path}': not UTF-8 text ({e.reason} at byte {e.start})") from None


def gpt2_from_files(vocab: Path, merges: Path) -> Tokenizer:
    """GPT-2's own format (vocab.json + merges.txt) as GPT-2's tokenizer: byte-level BPE with GPT-2's regex,
    no prefix space, `<|endoftext|>` special when the vocabulary has it (as transformers' GPT2Tokenizer)."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers
    table = loads(_read_text(vocab, "vocab.json"), str(vocab), DataError)
    if not isinstance(table, dict) or not table or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0 for k, v in table.items()):
        raise DataError(f"{vocab}: expected GPT-2's vocab.json, a JSON object of token -> non-negative id")
    check_ids(table.values(), str(vocab))
    _read_text(merges, "merges.txt")
    try:  # the library opens the two files by name: given the descriptors checked (base/fs.by_descriptor)
        with by_descriptor(vocab) as v, by_descriptor(merges) as m:
            backend = Backend(models.BPE.from_file(v, m))
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
            return _with_folder_eos(from_json(_read_text(p / TOKENIZER_JSON, what), str(p / TOKENIZER_JSON)), p)
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


def _with_folder_eos(tok: Tokenizer, folder: Path) -> Tokenizer:
    """A tokenizer without GPT-2's end-of-text token (Llama 3's has <|end_of_text|>) takes its folder's own: the
    eos_token its tokenizer_config.json names, where the vocabulary has it (never a default: issue 38)."""
    cfg_path = folder / "tokenizer_config.json"
    if tok.eot_id is not None or tok.is_byte or not cfg_path.exists():  # a FIFO there: refused at open
        return tok
    cfg = loads(read_all(cfg_path, limits.FILE_BYTES["json"] + 1, follow=True), str(cfg_path), DataError, kind="json")
    eos = cfg.get("eos_token") if isinstance(cfg, dict) else None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    tok.eot_id = tok.backend.token_to_id(eos) if isinstance(eos, str) else None
    return tok


# ---------------------------------------------------------------- an HF tokenizer folder
def write_hf_folder(tok: Tokenizer, folder: Path, max_length: Optional[int]) -> list[Path]:
    """tokenizer.json, tokenizer_config.json and (with an end-of-text token) special_tokens_map.json, so that
    `transformers.AutoTokenizer.from_pretrained(folder)` loads it as is: a PreTrainedTokenizerFast on the
    tokenizer.json, end-of-text as its bos/eos/unk token, no extra tokens added, no space clean-up (decode
    stays lossless). The byte tokenizer has no special tokens."""
    folder = Path(folder)
    (folder / TOKENIZER_JSON).write_text(tok.json, encoding="utf-8")
    config = _hf_config(max_length, tok.eot_id is not None)
    written = [folder / TOKENIZER_JSON, folder / "tokenizer_config.json"]
    if tok.eot_id is not None:
        (folder / SPECIAL_MAP).write_text(json.dumps(_SPECIAL, indent=2) + "\n")
        written.append(folder / SPECIAL_MAP)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return written


SPECIAL_MAP = "special_tokens_map.json"
_SPECIAL = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT}


def _hf_config(max_length: Optional[int], eot: bool) -> dict:
    """tokenizer_config.json as write_hf_folder writes it."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False}
    if max_length is None:  # a tokenizer apart from any model: transformers' own default (no limit)
        del config["model_max_length"]
    if eot:
        config.update(_SPECIAL, add_prefix_space=False)
    return config


def not_our_folder(out: Path) -> str:
    """'' when `out` is a folder `megalite tokenizer train` wrote (its tokenizer.json, the tokenizer_config.json
    and special_tokens_map.json write_hf_folder writes beside it, and nothing else), else what it is:
    `tokenizer train --force` replaces only such a folder, never one of the user's files."""
    if out.is_symlink() or not out.is_dir():
        return what_is(out)
    names = sorted(p.name for p in out.iterdir())
    ours = {TOKENIZER_JSON, "tokenizer_config.json", SPECIAL_MAP}
    other = [n for n in names if n not in ours or not (out / n).is_file() or (out / n).is_symlink()]
    if other or TOKENIZER_JSON not in names:
        return f"it holds '{other[0]}'" + (f" and {len(other) - 1} more" if len(other) > 1 else "") if other \
            else f"it has no {TOKENIZER_JSON}"
    try:
        config = loads(read_all(out / "tokenizer_config.json", limits.FILE_BYTES["json"] + 1),
                       "tokenizer_config.json", DataError, kind="json")
        special = loads(read_all(out / SPECIAL_MAP, limits.FILE_BYTES["json"] + 1), SPECIAL_MAP, DataError, kind="json") \
            if SPECIAL_MAP in names else None
    except (OSError, DataError):
        config = special = None
    if config != _hf_config(None, SPECIAL_MAP in names) or special not in (None, _SPECIAL):
        return "its tokenizer_config.json is not the one `megalite tokenizer train` writes"
    return ""


# ---------------------------------------------------------------- training a BPE
# Llama 3's split (tiktoken's cl100k-style pattern, as Meta's tokenizer.json writes it for the tokenizers library):
# contractions, letters with one leading non-letter, digits in groups of at most 3, punctuation runs, newlines.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = ("gpt2", "llama3")


def gpt2_style_bpe(pre_tokenizer: str = "gpt2"):
    """An untrained byte-level BPE (the tokenizers library's parts): GPT-2's regex inside its ByteLevel
    pre-tokenizer, or ("llama3") Llama 3's split pattern before a ByteLevel step without a regex of its own."""
    from tokenizers import Regex, Tokenizer as Backend, decoders, models, pre_tokenizers
    backend = Backend(models.BPE())
    if pre_tokenizer == "llama3":
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


MIN_VOCAB = 257  # the 256 byte characters + <|endoftext|>


def check_vocab_size(vocab_size) -> None:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not MIN_VOCAB <= vocab_size <= 2**31:
        raise DataError(f"--vocab-size {vocab_size}: expected an integer >= {MIN_VOCAB} (the 256 byte characters + "
                        f"{EOT})")


def train_bpe(texts: Iterable[str], vocab_size: int, show_progress: bool = False, length: Optional[int] = None,
              min_frequency: int = 2, pre_tokenizer: str = "gpt2") -> Tokenizer:
    """Train a byte-level BPE of `vocab_size` ids (<|endoftext|> is id 0, the 256 byte characters next, then the
    merges in the order learned) on `texts`, with GPT-2's or Llama 3's pre-tokenizer (`gpt2_style_bpe`).
    Deterministic: the same texts give the same tokenizer.json. Fewer ids come out when the texts hold fewer
    distinct pairs worth merging."""
    from tokenizers import pre_tokenizers, trainers
    check_vocab_size(vocab_size)
    if pre_tokenizer not in PRE_TOKENIZERS:
        raise DataError(f"--pre-tokenizer '{pre_tokenizer}': expected one of {', '.join(PRE_TOKENIZERS)}")
    backend = gpt2_style_bpe(pre_tokenizer)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=show_progress)
    backend.train_from_iterator(texts, trainer, length=length)
    return Tokenizer(backend, "trained")


def train_folder(files: list[Path], vocab_size: int, out, force: bool = False, quiet: bool = False,
                 min_frequency: int = 2, log=print, pre_tokenizer: str = "gpt2", text_field: str = "text") -> Path:
    """`megalite tokenizer train`: train_bpe on the files' documents (each read in pieces, see read_text_pieces;
    the records of a .jsonl or .parquet file, their `text_field`, as prepare reads them) and write
    the HF tokenizer folder `out`, built next to it and moved into place when complete (an existing `out`
    only with `force`, and only then replaced)."""
    out = Path(out)
    refused = output_refusal(out)  # no name, the current folder or one holding it
    if refused:
        raise DataError(refused)
    if os.path.lexists(out) and not force:
        raise DataError(f"--out '{out}' already exists (pass --force to replace it)")
    if os.path.lexists(out):
        why = not_our_folder(out)
        if why:
            raise DataError(f"--out '{out}' already exists and is not a tokenizer folder `megalite tokenizer train` "
                            f"wrote ({why}); --force replaces only such a folder: remove it yourself or choose "
                            f"another --out")
    found = identity(out)  # a writer finishing first changes it
    if isinstance(min_frequency, bool) or not isinstance(min_frequency, int) or min_frequency < 1:
        raise DataError(f"--min-frequency {min_frequency}: expected an integer >= 1")
    if not files:
        raise DataError("tokenizer train: no text files to train on")
    check_vocab_size(vocab_size)
    if pre_tokenizer not in PRE_TOKENIZERS:
        raise DataError(f"--pre-tokenizer '{pre_tokenizer}': expected one of {', '.join(PRE_TOKENIZERS)}")
    total = sum(Path(f).stat().st_size for f in files)
    if not quiet:
        log(f"tokenizer: training a byte-level BPE of {vocab_size:,} ids ({pre_tokenizer} pre-tokenizer) on "
            f"{len(files):,} files ({total / 1e6:,.1f} MB)")
    texts = (text for f in map(Path, files) for text in (
        map(io.BytesIO, records(f, text_field)) if f.suffix in RECORD_SUFFIXES else [f]))
    tok = train_bpe((piece for text in texts for piece in read_text_pieces(text)), vocab_size,
                    show_progress=progress_on(quiet), min_frequency=min_frequency, pre_tokenizer=pre_tokenizer)
    if tok.vocab_size < vocab_size and not quiet:
        log(f"tokenizer: WARNING: the text gives only {tok.vocab_size:,} ids (pairs seen fewer than "
            f"{min_frequency} times are not merged), not {vocab_size:,}")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    remove_tree(tmp)
    tmp.mkdir(parents=True)
    try:
        write_hf_folder(tok, tmp, None)
        with folder_locked(out.parent):  # of two runs to one --out, the second to finish is refused
            if identity(out) != found:
                raise DataError(f"--out '{out}' was written by another process while this one trained (two runs "
                                f"to one --out?); this run's tokenizer is discarded and the other's kept: run "
                                f"again with --force to replace it, or choose another --out")
            replace_output(tmp, out)  # --force: the old folder goes only once the new one is in place
    except BaseException:
        remove_tree(tmp)
        raise
    return out


def progress_on(quiet: bool = False) -> bool:
    """Progress bars on stderr: when someone watches (a terminal) or MEGALITE_PROGRESS=1; never when quiet
    or MEGALITE_PROGRESS=0."""
    want = os.environ.get("MEGALITE_PROGRESS", "")
    return not quiet and (want == "1" if want in ("0", "1") else sys.stderr.isatty())


# A cut before a space, newline or tab that follows a non-whitespace character (Python's isspace covers
# every character the regex's \s may mean, and more): no GPT-2 pre-token spans it, none looks behind its start.
_CUT = re.compile(r"(?<=\S)[ \n\t]")
# Where a text has no such cut for long (minified JSON, base64, a URL list): the end of a run of ASCII letters
# before an ASCII digit or punctuation mark, or of a run of ASCII digits before a letter or punctuation mark.
# GPT-2's regex ends a pre-token there too (` ?\p{L}+` and ` ?\p{N}+` stop; the next match begins afresh at
# the mark: a contraction, a number, a punctuation run), so the ids are again those of the whole text.
_PUNCT = r"!-/:-@\[-`{-~"
_CUT_IN_WORDS = re.compile(rf"(?<=[A-Za-z])[0-9{_PUNCT}]|(?<=[0-9])[A-Za-z{_PUNCT}]")
FORCED_CUT = 2  # a run of FORCED_CUT x piece_chars characters with no cut at all is cut anyway (see below)


def read_text_pieces(path, piece_chars: int = 1 << 20, block: int = 1 << 20, specials: tuple = (),
                     on_forced_cut=None) -> Iterator[str]:
    """The text of one file (a path, or a binary file object: a jsonl or parquet record) in pieces of at least `piece_chars` characters (the last may be shorter), read
    `block` bytes at a time: UTF-8 decoded with invalid bytes as U+FFFD (as `bytes.decode(errors="replace")`
    does on the whole file), each piece cut only where a word-streaming tokenizer (Tokenizer.streams_by_words)
    gives the ids of the whole text: before whitespace that follows a non-whitespace character, else at the
    end of a run of ASCII letters or digits (_CUT_IN_WORDS), never inside one of `specials` (the tokenizer's
    added tokens, matched whole by the library).

    Memory: about a piece and a block, whatever the text. A run of FORCED_CUT x piece_chars characters with
    no such point at all (one "word" of megabytes) is cut at that length anyway, never inside a special
    token: the ids next to that cut may then differ from encoding the run whole (one BPE merge across it is
    lost), which `on_forced_cut(character offset)` reports. Without the bound, 16 MB of text without a space
    took 3.4 GB in the tokenizer."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    buf, scanned, offset = "", 0, 0
    hard = FORCED_CUT * piece_chars
    with open_read(path, follow=True) if isinstance(path, (str, os.PathLike)) else contextlib.nullcontext(path) as f:
        while True:
            raw = f.read(block)
            buf += decoder.decode(raw, final=not raw)
            while len(buf) > piece_chars:
                m = _CUT.search(buf, max(piece_chars, scanned))
                at = m.start() if m else None
                if at is None and len(buf) > hard:
                    m = _CUT_IN_WORDS.search(buf, piece_chars, hard)
                    at = _clear_of(buf, m.start(), specials) if m else None
                    if at is None or at <= 0:
                        at = _clear_of(buf, hard, specials) or hard
                        if on_forced_cut is not None:
                            on_forced_cut(offset + at)
                if at is None:
                    scanned = len(buf)  # nothing up to here: the next search starts where this one ended
                    break
                yield buf[:at]
                buf, scanned, offset = buf[at:], 0, offset + at
            if not raw:
                break
    if buf:
        yield buf


def _clear_of(text: str, at: int, specials: tuple) -> int:
    """`at`, moved back to the start of any special token that spans it (the library matches them whole)."""
    moved = True
    while moved:
        moved = False
        for s in specials:
            i = text.rfind(s, max(0, at - len(s) + 1), at + len(s) - 1)
            if 0 <= i < at < i + len(s):
                at, moved = i, True
    return at


# ---------------------------------------------------------------- which tokenizer made a token file
def of_token_file(path: Path, meta: dict, vocab_size: int) -> Tokenizer:
    """The tokenizer that made a token file (its .json `meta` at `path`): the `tokenizer_file` it names (its bytes
    checked against the recorded `tokenizer_sha256`), or the byte tokenizer for a file that names none and
    records at most 256 ids (every token file written before tokenizers were recorded is one)."""
    mpath = Path(path)
    name = meta.get("tokenizer_file")
    if name is None:
        if meta.get("tokenizer", BYTE) != BYTE or vocab_size > 256:
            raise DataError(f"data.path: '{mpath}' records vocab_size {vocab_size} (tokenizer "
                            f"{meta.get('tokenizer', BYTE)!r}) but names no tokenizer_file; add \"tokenizer_file\": "
                            f"the path of the tokenizer.json that made it (docs/tokenizers.md)")
        return byte_tokenizer()
    if not isinstance(name, str) or not name:
        raise DataError(f"data.path: '{mpath}' has tokenizer_file {name!r}, expected the path of a tokenizer.json")
    tpath = mpath.parent / name
    if not tpath.is_file():
        raise DataError(f"data.path: tokenizer_file '{tpath}' named by '{mpath.name}' is {path_kind(tpath)}, "
                        f"expected the tokenizer.json that made the token file")
    raw = read_all(tpath, limits.FILE_BYTES["tokenizer"] + 1, follow=True)
    limits.within(len(raw), "tokenizer", f"data.path: tokenizer_file '{tpath}'", DataError)
    sha = meta.get("tokenizer_sha256")
    if sha is not None and sha != hashlib.sha256(raw).hexdigest():
        raise DataError(f"data.path: tokenizer_file '{tpath}' has sha256 {hashlib.sha256(raw).hexdigest()[:16]}..., "
                        f"not the tokenizer_sha256 {str(sha)[:16]}... recorded in '{mpath.name}' (the tokenizer was "
                        f"changed after `megalite prepare`; prepare the data again)")
    tok = from_json(raw.decode("utf-8", errors="replace"), f"data.path: tokenizer_file '{tpath}'")
    eot = meta.get("eot_id")
    if tok.eot_id is None and isinstance(eot, int) and not isinstance(eot, bool) and 0 <= eot < tok.vocab_size:
        tok.eot_id = eot  # the end of text prepare separated documents with (the folder's eos: _with_folder_eos)
    if vocab_size > tok.vocab_size:
        raise DataError(f"data.path: '{mpath}' records vocab_size {vocab_size} but its tokenizer "
                        f"'{tpath}' has {tok.vocab_size} ids")
    return tok


def check_same(saved: Optional[Tokenizer], ours: Optional[Tokenizer], where: str, data_path: str) -> None:
    """On resume: the token file must come from the checkpoint's tokenizer (compared as re-serialized by this
    tokenizers library, so a library upgrade alone changes nothing); a checkpoint without one (older, or saved
    by the API) is not checked."""
    if saved is None or ours is None or saved.sha256 == ours.sha256:
        return
    raise CheckpointError(
        f"checkpoint.resume: {where} ({saved.kind}, vocab {saved.vocab_size}, sha256 {saved.sha256[:12]}) is not "
        f"the tokenizer of data.path '{data_path}' ({ours.kind}, vocab {ours.vocab_size}, sha256 "
        f"{ours.sha256[:12]}); prepare the data with the checkpoint's tokenizer: megalite prepare FILES "
        f"--tokenizer {where} --out X.bin")
