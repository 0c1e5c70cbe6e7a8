"""Sample from a single-file model in one plain process (no torch.distributed), proving the file is a model."""
from __future__ import annotations

import codecs
import math
import sys
from pathlib import Path

import torch

from .config import ConfigError, ModelConfig
from .convert import ConvertError, read_model_file
from .data import ByteTokenizer
from .model import GPTStage
from .parallel.grid import ParallelGrid


def load_model(path) -> GPTStage:
    """A whole GPT (tp = pp = 1) from a `megalite convert` file or an HF GPT-2 folder."""
    m, get, names = read_model_file(path)
    model = GPTStage(ModelConfig(**m), ParallelGrid.single())
    with torch.no_grad():
        for name, p in model.global_parameters():
            if name not in names:
                raise ConvertError(f"{path}: tensor '{name}' is missing")
            t = get(name)
            if t.shape != p.shape:
                raise ConvertError(f"{path}: tensor '{name}' has shape {list(t.shape)}, expected {list(p.shape)}")
            p.copy_(t)
    return model.eval()


def _warn(msg: str) -> None:
    print(f"generate: WARNING: {msg}", file=sys.stderr, flush=True)


@torch.no_grad()
def generate(model: GPTStage, ids: list[int], max_new_tokens: int = 200, temperature: float = 0.8,
             top_k: int = 0, seed: int = 0, warn=_warn, on_token=None) -> list[int]:
    """Autoregressive sampling; temperature 0 means greedy. `on_token(id)` is called with each new token as
    soon as it is drawn (streaming).

    The model has block_size positions. A longer context is cropped to its last block_size tokens (a
    sliding window; transformers refuses instead), and `warn` says so once, before the first token."""
    check_sampling(max_new_tokens, temperature, top_k, seed)
    block = model.cfg.block_size
    if len(ids) > block:
        warn(f"the prompt has {len(ids)} tokens but model.block_size is {block}: the model sees only the "
             f"last {block}")
    elif len(ids) + max_new_tokens > block:
        warn(f"prompt ({len(ids)} tokens) + --max-new-tokens {max_new_tokens} exceeds model.block_size "
             f"{block}: from token {block - len(ids) + 1} on, the model sees only the last {block} tokens")
    g = torch.Generator().manual_seed(seed)
    x = torch.tensor([ids], dtype=torch.long)
    for _ in range(max_new_tokens):
        logits = model(x[:, -block:])[:, -1, :]  # (1, V)
        if temperature <= 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            # Shifted so that the largest is 0 before dividing, by a temperature no smaller than the logits' dtype's
            # smallest normal number (5e-324 is 0 in float32: 0/0 would be NaN): logits <= 0 (or -inf), the largest
            # exactly 0, and a softmax with no NaN (softmax itself is unchanged by the shift).
            tiny = torch.finfo(logits.dtype).tiny
            logits = (logits - logits.max(-1, keepdim=True).values) / max(temperature, tiny)
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)
        x = torch.cat([x, nxt], dim=1)
        if on_token is not None:
            on_token(int(nxt))
    return x[0].tolist()


SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes an unsigned 64-bit seed


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, seed: int) -> None:
    """The sampling settings, each in the range its consumer takes (the CLI's flags and the Python API alike):
    one ConfigError naming the flag."""
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise ConfigError(f"--top-k {top_k}: expected 0 (off) or a positive integer")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise ConfigError(f"--temperature {temperature}: expected a finite number >= 0 (0: greedy)")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens {max_new_tokens}: expected a number >= 0")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= SEED_MAX:
        raise ConfigError(f"--seed {seed}: expected an integer >= 0 and <= {SEED_MAX} (torch's generator seed)")


def sample_text(path: str | Path, prompt: str, as_ids: bool = False, stream=None, **kw) -> str:
    """The prompt and its continuation as text (or token ids with `as_ids`). With `stream` (a text file such
    as sys.stdout) the same text is also written there as it is produced, flushed after every token: bytes
    are decoded incrementally, so a multi-byte character appears once its last byte is drawn."""
    tok = ByteTokenizer()
    ids = tok.encode(prompt) or [10]
    model = load_model(path)
    on_token = None
    if stream is not None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        stream.write(" ".join(map(str, ids)) if as_ids else decoder.decode(bytes(ids)))
        stream.flush()

        def on_token(i):
            stream.write(f" {i}" if as_ids else decoder.decode(bytes([i])))
            stream.flush()
    out = generate(model, ids, on_token=on_token, **kw)
    if stream is not None and not as_ids:
        stream.write(decoder.decode(b"", final=True))  # a character cut by the end: U+FFFD, as in decode()
        stream.flush()
    return " ".join(map(str, out)) if as_ids else tok.decode(out)
