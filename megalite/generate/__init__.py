"""Sample from a model in one plain process (no torch.distributed): a megalite checkpoint (root or step folder),
a megalite model file (`megalite convert`) or a transformers folder (GPT-2 or Llama), encoded and decoded with
the tokenizer it carries, with a KV cache (cache.py), transformers' sampling filters (sampling.py) and the
model's own end ids and chat template (prompt.py)."""
from __future__ import annotations

import codecs
import sys
from pathlib import Path
from typing import Optional

import torch

from ..base.errors import ConvertError
from ..convert import open_source
from ..convert import check as checking
from ..convert.check import build_model
from ..convert.sources import FileSource, StepSource
from ..model import GPTStage
from ..tokenizer import Tokenizer, byte_tokenizer
from .cache import KVCache
from .prompt import chat_prompt, folder_files, origin_files, read_model_text
from .sampling import check_sampling, draw


def load_model(path, check: Optional[bool] = False) -> GPTStage:
    """A whole GPT (tp = pp = 1) with its tokenizer (`.tokenizer`; the byte tokenizer for a model that carries
    none, as every model did before tokenizers were carried). Ids past the tokenizer's vocabulary are
    padding rows: `generate` never draws them (`.real_vocab`). check: convert's self-check of a model from
    elsewhere (a transformers folder, another trainer's checkpoint) before it is used; None: on where
    transformers is installed (`megalite generate`'s default)."""
    src = open_source(path)
    if src.model is None:
        raise ConvertError(f"{path}: a plain DCP checkpoint does not say what model its tensors make")
    if check is None:
        check = not isinstance(src, (StepSource, FileSource)) and checking.available()
    if check:
        checking.check(src, lambda: checking.megalite_runner(src), torch.float32,
                       "megalite's model on the source's tensors", quiet=True)
    tok = src.tokenizer()
    if tok is None:
        if src.model["vocab_size"] > 256:
            _warn(f"{path} carries no tokenizer; its ids are read as bytes (ids 256 and up are never drawn)")
        tok = byte_tokenizer()
    model = build_model(src, real_vocab=tok.vocab_size)
    model.tokenizer = tok
    return model


def _warn(msg: str) -> None:
    print(f"generate: WARNING: {msg}", file=sys.stderr, flush=True)


def context_warning(n_prompt: int, max_new_tokens: int, block: int) -> Optional[str]:
    """What the model will not see, or None: a prompt longer than block_size, or one that will outgrow it."""
    if n_prompt > block:
        return (f"the prompt has {n_prompt} tokens but model.block_size is {block}: the model sees only the "
                f"last {block}")
    if n_prompt + max_new_tokens > block:
        return (f"prompt ({n_prompt} tokens) + --max-new-tokens {max_new_tokens} exceeds model.block_size "
                f"{block}: from token {block - n_prompt + 1} on, the model sees only the last {block} tokens")
    return None


DEFAULT_NEW_TOKENS = 200


def default_new_tokens(n_prompt: int, block: int) -> int:
    """--max-new-tokens when not given: 200, or fewer so that the prompt and the sample fit the model's
    block_size (the model then sees all of it); at least 1."""
    return max(1, min(DEFAULT_NEW_TOKENS, block - n_prompt))


@torch.inference_mode()  # no autograd records, no version counters: less work per op than no_grad
def generate(model: GPTStage, ids: list[int], max_new_tokens: Optional[int] = None, temperature: float = 0.8,
             top_k: int = 0, seed: int = 0, warn=_warn, on_token=None, stop_ids=(), stop_when=None,
             top_p: float = 1.0, kv_cache: bool = True) -> list[int]:
    """Autoregressive sampling (sampling.draw: temperature, top-k, top-p; temperature 0 means greedy).
    `on_token(id)` is called with each new token as soon as it is drawn (streaming). Drawing one of `stop_ids`
    (the model's end ids), or `stop_when(new ids)` turning true, ends the sampling after that token, as
    transformers' generate does with eos_token_id and stop_strings. Padding ids (model.real_vocab and up) are
    never drawn.

    With `kv_cache` the prompt runs through the model once (prefill) and then each new token alone, its keys and
    values appended to the cache (cache.py); without, every step reruns the whole context (the reference the
    cache is tested against). The model has block_size positions. A longer context is cropped to its last
    block_size tokens (a sliding window; transformers refuses instead): from there on each step reruns the
    window, and `warn` says so once, before the first token. `max_new_tokens` None: `default_new_tokens`."""
    block = model.cfg.block_size
    if max_new_tokens is None:
        max_new_tokens = default_new_tokens(len(ids), block)
    check_sampling(max_new_tokens, temperature, top_k, seed, top_p)
    note = context_warning(len(ids), max_new_tokens, block)
    if note:
        warn(note)
    real = getattr(model, "real_vocab", model.cfg.vocab_size)
    stop_ids = {stop_ids} if isinstance(stop_ids, int) else set(stop_ids)
    g = torch.Generator().manual_seed(seed)
    out = list(ids)
    cache = KVCache(min(block, len(ids) + max_new_tokens)) if kv_cache else None
    for _ in range(max_new_tokens):
        if cache is not None and len(out) <= block:  # the tokens the cache does not hold yet: all, then one
            logits = model(torch.tensor([out[cache.length:]]), cache=cache, logits_to_keep=1)[:, -1, :]  # (1, V)
        else:
            logits = model(torch.tensor([out[-block:]]))[:, -1, :]  # (1, V)
        logits[:, real:] = float("-inf")  # padding rows: never a token
        nxt = int(draw(logits, temperature, top_k, top_p, g))
        out.append(nxt)
        if on_token is not None:
            on_token(nxt)
        if nxt in stop_ids or (stop_when is not None and stop_when(out[len(ids):])):
            break
    return out


class _Text:
    """The text of a growing list of ids, written to a stream as it grows: the byte tokenizer's bytes through
    an incremental UTF-8 decoder (a multi-byte character appears with its last byte); another tokenizer's
    decode of all the ids, written up to the end once it does not end in U+FFFD (a cut character). With `stops`
    (--stop), the generated text ends before the first one, and a tail that may begin one is held back until
    the next token shows whether it does."""

    def __init__(self, tok: Tokenizer, stream, ids: list[int], stops: tuple = ()):
        self.tok, self.stream, self.ids, self.stops = tok, stream, list(ids), stops
        self.bytes = codecs.getincrementaldecoder("utf-8")(errors="replace") if tok.is_byte else None
        self.shown, self.gen, self.done, self.ended = "", "", 0, False
        self._write(self.bytes.decode(bytes(i for i in ids if i < 256)) if tok.is_byte else self._new())

    def _new(self, final: bool = False) -> str:
        text = self.tok.decode(self.ids)
        if not final and text.endswith("\ufffd"):
            return ""
        new, self.shown = text[len(self.shown):], text
        return new

    def _write(self, s: str) -> None:
        self.stream.write(s)
        self.stream.flush()

    def _emit(self, s: str, final: bool = False) -> None:
        """Generated text s: written, up to a stop string (then nothing more) or a tail that may begin one."""
        if self.ended:
            return
        self.gen += s
        cut = first_stop(self.gen, self.stops)
        if cut is not None:
            self.ended = True
        elif final:
            cut = len(self.gen)
        else:
            cut = len(self.gen) - max((k for t in self.stops for k in range(1, len(t)) if self.gen.endswith(t[:k])),
                                      default=0)
        self._write(self.gen[self.done:cut])
        self.done = cut

    def add(self, i: int, hide: bool = False) -> None:
        if hide:  # the end token that stopped sampling: not part of the text
            return
        self.ids.append(i)
        self._emit(self.bytes.decode(bytes([i]) if i < 256 else b"") if self.bytes else self._new())

    def close(self) -> None:  # a character cut by the end: U+FFFD, as in decode()
        self._emit(self.bytes.decode(b"", final=True) if self.bytes else self._new(final=True), final=True)


def first_stop(text: str, stops, start: int = 0) -> Optional[int]:
    """Where the first of the stop strings begins in text[start:] (its index in text), or None."""
    found = [i for i in (text.find(t, start) for t in stops) if i >= 0]
    return min(found) if found else None


def sample_text(path: str | Path, prompt: str, as_ids: bool = False, stream=None, stop_at_eot: bool = True,
                stops: tuple = (), chat: bool = False, system: Optional[str] = None, check: Optional[bool] = False,
                **kw) -> str:
    """The prompt and its continuation as text (or token ids with `as_ids`), with the model's own tokenizer.
    With `stop_at_eot`, drawing one of the model's end ids (prompt.read_model_text) ends the text (the token
    itself is not printed; its id is, with `as_ids`); a stop string of `stops` ends it too (the text ends
    before it; the ids end with the token that completed it). With `chat` the prompt is one user turn (after
    `system`) in the model's chat template, and the text is the reply alone. With `stream` (a text file such as
    sys.stdout) the same text is also written there as it is produced, flushed after every token; any warning
    comes before the prompt, never inside the text."""
    model = load_model(path, check)
    tok = getattr(model, "tokenizer", None) or byte_tokenizer()
    text_of = read_model_text(str(path), tok, folder_files(path) or origin_files(path, tok))
    if chat:  # the template writes the special tokens itself: none added by the tokenizer (apply_chat_template)
        ids = tok.backend.encode(chat_prompt(text_of, prompt, system), add_special_tokens=False).ids
        hidden = len(ids)  # the reply alone is text
    else:
        ids = tok.encode(prompt)
        hidden = 0  # leading ids that are not text: an empty prompt starts a fresh document after end-of-text
        if not ids:
            ids, hidden = ([tok.eot_id], 1) if tok.eot_id is not None else (tok.encode("\n"), 0)
    if max(ids) >= model.cfg.vocab_size:  # a tokenizer larger than the model (a mismatched folder): no crash
        raise ConvertError(f"{path}: the prompt encodes to id {max(ids)}, but the model has {model.cfg.vocab_size} "
                           f"token rows (its tokenizer, {tok.vocab_size} ids, does not fit it)")
    ends = set(text_of.end_ids) if stop_at_eot else set()
    stops = tuple(stops)
    if kw.get("max_new_tokens") is None:
        kw["max_new_tokens"] = default_new_tokens(len(ids), model.cfg.block_size)
    note = context_warning(len(ids), kw["max_new_tokens"], model.cfg.block_size)
    if note:
        _warn(note)
    on_token, text = None, None
    if stream is not None and as_ids:
        stream.write(" ".join(map(str, ids)))
        stream.flush()
        on_token = lambda i: stream.write(f" {i}") or stream.flush()  # noqa: E731
    elif stream is not None:
        text = _Text(tok, stream, ids[hidden:], stops)
        on_token = lambda i: text.add(i, hide=i in ends)  # noqa: E731
    stop_when = (lambda new: first_stop(tok.decode(new), stops) is not None) if stops else None  # noqa: E731
    out = generate(model, ids, on_token=on_token, warn=lambda msg: None, stop_ids=ends, stop_when=stop_when, **kw)
    if text is not None:
        text.close()
    if as_ids:
        return " ".join(map(str, out))
    if len(out) > len(ids) and out[-1] in ends:
        out = out[:-1]
    whole = tok.decode(out[hidden:])
    cut = first_stop(whole, stops, len(tok.decode(ids[hidden:])))
    return whole if cut is None else whole[:cut]
