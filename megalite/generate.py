"""Sample from a model in one plain process (no torch.distributed): a checkpoint (root or step folder), a
`megalite convert` file or an HF GPT-2 folder, encoded and decoded with the tokenizer it carries."""
from __future__ import annotations

import codecs
import math
import sys
from pathlib import Path
from typing import Optional

import torch

from .config import ConfigError, ModelConfig
from .convert import ConvertError, read_model_file
from .model import GPTStage
from .parallel.grid import ParallelGrid
from .tokenizer import Tokenizer, byte_tokenizer, carried_by


def load_model(path) -> GPTStage:
    """A whole GPT (tp = pp = 1) with its tokenizer (`.tokenizer`; the byte tokenizer for a model that carries
    none, as every model did before tokenizers were carried). Ids past the tokenizer's vocabulary are
    padding rows: `generate` never draws them (`.real_vocab`)."""
    m, get, names = read_model_file(path)
    tok = carried_by(path)
    if tok is None:
        if m["vocab_size"] > 256:
            _warn(f"{path} carries no tokenizer; its ids are read as bytes (ids 256 and up are never drawn)")
        tok = byte_tokenizer()
    model = GPTStage(ModelConfig(**m), ParallelGrid.single(), real_vocab=tok.vocab_size)
    with torch.no_grad():
        for name, p in model.global_parameters():
            if name not in names:
                raise ConvertError(f"{path}: tensor '{name}' is missing")
            t = get(name)
            if t.shape != p.shape:
                raise ConvertError(f"{path}: tensor '{name}' has shape {list(t.shape)}, expected {list(p.shape)}")
            p.copy_(t)
    model.tokenizer = tok
    return model.eval()


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


@torch.no_grad()
def generate(model: GPTStage, ids: list[int], max_new_tokens: Optional[int] = None, temperature: float = 0.8,
             top_k: int = 0, seed: int = 0, warn=_warn, on_token=None, stop_id: Optional[int] = None) -> list[int]:
    """Autoregressive sampling; temperature 0 means greedy. `on_token(id)` is called with each new token as
    soon as it is drawn (streaming). Drawing `stop_id` (the end-of-text token) ends the sampling after it,
    as transformers' generate does with eos_token_id. Padding ids (model.real_vocab and up) are never drawn.

    The model has block_size positions. A longer context is cropped to its last block_size tokens (a
    sliding window; transformers refuses instead), and `warn` says so once, before the first token.
    `max_new_tokens` None: `default_new_tokens`."""
    block = model.cfg.block_size
    if max_new_tokens is None:
        max_new_tokens = default_new_tokens(len(ids), block)
    check_sampling(max_new_tokens, temperature, top_k, seed)
    note = context_warning(len(ids), max_new_tokens, block)
    if note:
        warn(note)
    real = getattr(model, "real_vocab", model.cfg.vocab_size)
    g = torch.Generator().manual_seed(seed)
    x = torch.tensor([ids], dtype=torch.long)
    for _ in range(max_new_tokens):
        logits = model(x[:, -block:])[:, -1, :]  # (1, V)
        logits[:, real:] = float("-inf")  # padding rows: never a token
        if temperature <= 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            # Shifted so that the largest is 0 before dividing, by a temperature within the logits' dtype's normal
            # range: no smaller than its smallest normal number (5e-324 is 0 in float32: 0/0 would be NaN), no
            # larger than its largest (1e308 is inf in float32: a padding row's -inf / inf would be NaN; any
            # temperature that large samples uniformly anyway). Logits <= 0 (or -inf), the largest exactly 0,
            # and a softmax with no NaN (softmax itself is unchanged by the shift).
            info = torch.finfo(logits.dtype)
            logits = (logits - logits.max(-1, keepdim=True).values) / min(max(temperature, info.tiny), info.max)
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)
        x = torch.cat([x, nxt], dim=1)
        if on_token is not None:
            on_token(int(nxt))
        if stop_id is not None and int(nxt) == stop_id:
            break
    return x[0].tolist()


SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes an unsigned 64-bit seed
NEW_TOKENS_MAX = 2**24  # the sampled ids are held in memory and re-read each step: 16 M of them is hours already


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, seed: int) -> None:
    """The sampling settings, each in the range its consumer takes (the CLI's flags and the Python API alike):
    one ConfigError naming the flag."""
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise ConfigError(f"--top-k {top_k}: expected 0 (off) or a positive integer")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise ConfigError(f"--temperature {temperature}: expected a finite number >= 0 (0: greedy)")
    if max_new_tokens is None:  # the default: decided once the prompt and the model are known
        pass
    elif (not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool)
            or not 0 <= max_new_tokens <= NEW_TOKENS_MAX):
        raise ConfigError(f"--max-new-tokens {max_new_tokens}: expected a number >= 0 and <= {NEW_TOKENS_MAX}")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= SEED_MAX:
        raise ConfigError(f"--seed {seed}: expected an integer >= 0 and <= {SEED_MAX} (torch's generator seed)")


class _Text:
    """The text of a growing list of ids, written to a stream as it grows: the byte tokenizer's bytes through
    an incremental UTF-8 decoder (a multi-byte character appears with its last byte); another tokenizer's
    decode of all the ids, written up to the end once it does not end in U+FFFD (a cut character)."""

    def __init__(self, tok: Tokenizer, stream, ids: list[int]):
        self.tok, self.stream, self.ids = tok, stream, list(ids)
        self.bytes = codecs.getincrementaldecoder("utf-8")(errors="replace") if tok.is_byte else None
        self.shown = ""
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

    def add(self, i: int, hide: bool = False) -> None:
        if hide:  # the end-of-text token that stopped sampling: not part of the text
            return
        self.ids.append(i)
        self._write(self.bytes.decode(bytes([i]) if i < 256 else b"") if self.bytes else self._new())

    def close(self) -> None:  # a character cut by the end: U+FFFD, as in decode()
        self._write(self.bytes.decode(b"", final=True) if self.bytes else self._new(final=True))


def sample_text(path: str | Path, prompt: str, as_ids: bool = False, stream=None, stop_at_eot: bool = True,
                **kw) -> str:
    """The prompt and its continuation as text (or token ids with `as_ids`), with the model's own tokenizer.
    With `stop_at_eot`, drawing the end-of-text token ends the text (the token itself is not printed; its id
    is, with `as_ids`). With `stream` (a text file such as sys.stdout) the same text is also written there
    as it is produced, flushed after every token; any warning comes before the prompt, never inside the text."""
    model = load_model(path)
    tok = getattr(model, "tokenizer", None) or byte_tokenizer()
    ids = tok.encode(prompt)
    hidden = 0  # leading ids that are not text: an empty prompt starts a fresh document after end-of-text
    if not ids:
        ids, hidden = ([tok.eot_id], 1) if tok.eot_id is not None else (tok.encode("\n"), 0)
    if max(ids) >= model.cfg.vocab_size:  # a tokenizer larger than the model (a mismatched folder): no crash
        raise ConvertError(f"{path}: the prompt encodes to id {max(ids)}, but the model has {model.cfg.vocab_size} "
                           f"token rows (its tokenizer, {tok.vocab_size} ids, does not fit it)")
    stop = tok.eot_id if stop_at_eot else None
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
        text = _Text(tok, stream, ids[hidden:])
        on_token = lambda i: text.add(i, hide=i == stop)  # noqa: E731
    out = generate(model, ids, on_token=on_token, warn=lambda msg: None, stop_id=stop, **kw)
    if text is not None:
        text.close()
    if as_ids:
        return " ".join(map(str, out))
    if stop is not None and len(out) > len(ids) and out[-1] == stop:
        out = out[:-1]
    return tok.decode(out[hidden:])
