"""`megalite bench generate`: `megalite generate`'s tokens/s beside transformers' `generate` with its KV cache.

The model is a Llama of a 135M-class shape (30 layers, width 576, 9 heads over 3 kv heads, head size 64, MLP
1536, vocab 49,152, tied embeddings: SmolLM2-135M's), random weights, built and saved by transformers itself
into a folder with a tokenizer.json of 49,152 ids (byte-level: the 256 byte tokens, then filler tokens) and no
eos, so that both sides draw exactly --new-tokens. Both start from a loaded model and the same prompt ids and
decode greedily; alternating (the first side swapped every round), --rounds times each, in this process (same
threads):

    megalite generate         megalite.generate.generate on load_model(folder): prefill once, then one token a
                              step through the KV cache (what the command runs after loading)
    transformers generate     AutoModelForCausalLM.from_pretrained(folder).generate(do_sample=False), its cache

Both must give the same ids. The goal: >= 1.0x transformers' tokens/s (median of the alternated pairs).
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from . import StreamTable, pair_verdict

PROMPT = "def fibonacci(n):\n    \"\"\"The n-th Fibonacci number.\"\"\"\n"


def _folder(work: Path, n_layer: int, n_embd: int, vocab_size: int) -> Path:
    """The model saved by transformers (heads of 64, a third as many kv heads, MLP 8/3 of the width rounded to
    64), with a byte-level tokenizer.json of vocab_size ids."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from ..tokenizer import byte_alphabet
    heads = max(1, n_embd // 64)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=n_layer, hidden_size=n_embd, intermediate_size=(8 * n_embd // 3 + 63) // 64 * 64,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 3), vocab_size=vocab_size,
        max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5,
        bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    folder = work / "model"
    model.save_pretrained(folder)
    vocab = {ch: b for b, ch in byte_alphabet().items()}
    vocab.update({f"<fill{i}>": i for i in range(256, vocab_size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def bench_generate(n_layer: int = 30, n_embd: int = 576, vocab_size: int = 49152, new_tokens: int = 64,
                   rounds: int = 3, dir: Optional[str] = None, log=print) -> dict:
    import torch
    import transformers
    from ..generate import generate, load_model
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    work = Path(tempfile.mkdtemp(prefix="megalite-bench-generate-", dir=dir))
    try:
        folder = _folder(work, n_layer, n_embd, vocab_size)
        ours = load_model(folder)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        ids = ours.tokenizer.encode(PROMPT)
        cfg = theirs.config
        log(f"bench generate: Llama {n_layer} layers, width {n_embd}, {cfg.num_attention_heads} heads / "
            f"{cfg.num_key_value_heads} kv heads, vocab {vocab_size:,} ({sum(p.numel() for p in ours.parameters()):,} "
            f"parameters), random weights saved by transformers; prompt {len(ids)} tokens, {new_tokens} new, greedy; "
            f"{torch.get_num_threads()} torch threads, {os.cpu_count()} cores (load average "
            f"{os.getloadavg()[0]:.1f} at the start)")

        def run(kind: str, n: int) -> list[int]:
            if kind == "megalite":
                return generate(ours, ids, max_new_tokens=n, temperature=0, warn=lambda m: None)
            with torch.no_grad():
                return theirs.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n,
                                       use_cache=True)[0].tolist()

        for kind in ("megalite", "transformers"):  # warm-up: first calls allocate and pick kernels
            run(kind, 2)
        t = StreamTable(["run", "round", "seconds", "tokens/s"], [28, 5, 8, 9], log=log)
        rates, outs = {"megalite": [], "transformers": []}, {}
        for r in range(rounds):
            # alternated, the first side swapped every round (ABBA): a drift in machine speed hits both alike
            for kind in ("megalite", "transformers")[::1 if r % 2 == 0 else -1]:
                t0 = time.perf_counter()
                outs[kind] = run(kind, new_tokens)
                dt = time.perf_counter() - t0
                rates[kind].append(new_tokens / dt)
                t.row([f"{kind} generate", r + 1, f"{dt:.2f}", f"{new_tokens / dt:.2f}"])
        ratios = [a / b for a, b in zip(rates["megalite"], rates["transformers"])]  # round by round
        same = outs["megalite"] == outs["transformers"]
        pair_verdict(ratios, "megalite / transformers tokens/s", 1.0, same,
                     f"{len(outs['megalite']) - len(ids)} new tokens", log)
        if not same:
            print(f"bench generate: megalite and transformers disagree: {outs}", file=sys.stderr)
        return {"ratios": ratios, "same_ids": same, "rates": rates}
    finally:
        shutil.rmtree(work, ignore_errors=True)
