"""How the next token is drawn from the model's last logits, in transformers' order (its TemperatureLogitsWarper,
TopKLogitsWarper, TopPLogitsWarper): temperature, then top-k, then top-p (nucleus), then one draw from the
softmax. Temperature 0 is greedy (the argmax; top-k and top-p do not change it)."""
from __future__ import annotations

import math

import torch

from ..config import ConfigError

SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes an unsigned 64-bit seed
NEW_TOKENS_MAX = 2**24  # the sampled ids are held in memory and re-read each step: 16 M of them is hours already


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """(B, V) logits -> (B, V) logits whose softmax is the distribution drawn from (temperature > 0): divided by
    the temperature, then all but the top_k largest set to -inf (0: off; k above V keeps all), then all but the
    smallest set of the likeliest tokens whose probabilities sum to at least top_p (1.0: off; the likeliest is
    always kept)."""
    # Shifted so that the largest is 0 before dividing, by a temperature within the logits' dtype's normal range:
    # no smaller than its smallest normal number (5e-324 is 0 in float32: 0/0 would be NaN), no larger than its
    # largest (1e308 is inf in float32: a padding row's -inf / inf would be NaN; any temperature that large samples
    # uniformly anyway). Logits <= 0 (or -inf), the largest exactly 0, and a softmax with no NaN.
    info = torch.finfo(logits.dtype)
    logits = (logits - logits.max(-1, keepdim=True).values) / min(max(temperature, info.tiny), info.max)
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:  # drop the least likely tokens whose probabilities sum to at most 1 - top_p (ties: as transformers)
        ordered, order = logits.sort(dim=-1)  # (B, V), least likely first
        drop = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1] = False  # the likeliest stays
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits


def draw(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, g: torch.Generator) -> torch.Tensor:
    """(B, V) logits -> (B, 1) next ids: the argmax at temperature 0, else one draw from filter_logits' softmax."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    return torch.multinomial(torch.softmax(filter_logits(logits, temperature, top_k, top_p), -1), 1, generator=g)


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, seed: int, top_p: float = 1.0) -> None:
    """The sampling settings, each in the range its consumer takes (the CLI's flags and the Python API alike):
    one ConfigError naming the flag."""
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise ConfigError(f"--top-k {top_k}: expected 0 (off) or a positive integer")
    if not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not 0 < top_p <= 1:
        raise ConfigError(f"--top-p {top_p}: expected a number > 0 and <= 1 (1: off)")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise ConfigError(f"--temperature {temperature}: expected a finite number >= 0 (0: greedy)")
    if max_new_tokens is None:  # the default: decided once the prompt and the model are known
        pass
    elif (not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool)
            or not 0 <= max_new_tokens <= NEW_TOKENS_MAX):
        raise ConfigError(f"--max-new-tokens {max_new_tokens}: expected a number >= 0 and <= {NEW_TOKENS_MAX}")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= SEED_MAX:
        raise ConfigError(f"--seed {seed}: expected an integer >= 0 and <= {SEED_MAX} (torch's generator seed)")
