"""`convert --check`: every conversion proves itself before its output is moved into place.

The source's forward and the result's forward run on the same fixed token prompts; the largest logit
difference and the KL divergence (source || result, averaged over positions) are printed, and above the
tolerance the output is refused in one line (sink.deliver then removes it). Which forwards run:

    source side   the source's own forward where it has one (`Source.reference()`: transformers for a
                  transformers folder; megatron-core's or torchtitan's where a foreign source provides it),
                  else megalite's model on the source's tensors
    result side   transformers from the written folder (--format hf), or megalite's model on the written file;
                  where both sides would be megalite's model, transformers on the result's tensors instead

A model whose attention does not matter (an untrained one: near-uniform attention) barely moves its logits
when q/k are scrambled; the check proves conversions of models whose weights carry a signal.
"""
from __future__ import annotations

import math
import sys
from typing import Callable, Optional

import torch

from ..config import ModelConfig
from ..model import GPTStage
from ..parallel.grid import ParallelGrid
from .common import ConvertError, Runner, Source
from .family import family_of

PROMPTS = 2  # fixed prompts: rows of token ids drawn from a fixed seed
PROMPT_LEN = 16
# (largest |logit difference| relative to 1 + the largest |logit|, KL) accepted, by the result's weight dtype
TOLERANCE = {torch.float32: (1e-4, 1e-6), torch.float16: (1e-2, 1e-3), torch.bfloat16: (5e-2, 1e-2)}


def available() -> bool:
    """Whether transformers can be imported (the check's default is on only then)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def build_model(src: Source, real_vocab: Optional[int] = None) -> GPTStage:
    """megalite's whole model (tp = pp = 1) with the source's tensors, fp32."""
    model = GPTStage(ModelConfig(**src.model), ParallelGrid.single(), real_vocab=real_vocab)
    with torch.no_grad():
        for name, p in model.global_parameters():
            if name not in src.specs:
                raise ConvertError(f"{src.where}: tensor '{name}' is missing")
            t = src.read(name)
            if t.shape != p.shape:
                raise ConvertError(f"{src.where}: tensor '{name}' has shape {list(t.shape)}, expected "
                                   f"{list(p.shape)}")
            p.copy_(t.float())
    return model.eval()


def megalite_runner(src: Source) -> Runner:
    model = build_model(src)

    def run(ids):
        with torch.no_grad():
            return model(ids)
    return run


def transformers_on(src: Source) -> Optional[Runner]:
    """transformers' model of the source's family with the source's tensors (None without transformers)."""
    if not available():
        return None
    import transformers
    fam = family_of(src.model)
    cfg = fam.hf_config(src.model)
    cfg.pop("architectures"), cfg.pop("torch_dtype")
    config = transformers.AutoConfig.for_model(**cfg)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = {hn: ht.float() for n in src.specs for hn, ht in fam.to_hf(n, src.read(n))}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise ConvertError(f"{src.where}: transformers' {fam.architecture} does not take these tensors "
                           f"({(unexpected or missing)[0]})")
    model.tie_weights()

    def run(ids):
        with torch.no_grad():
            return model(ids).logits
    return run


def prompts(vocab: int, block: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (PROMPTS, min(PROMPT_LEN, block)), generator=g)  # (B, T)


def compare(ref: Runner, got: Runner, vocab: int, block: int) -> tuple[float, float, float]:
    """(largest |logit difference|, KL(ref || got) per position, largest |logit| of ref) over the first
    `vocab` logits (the tokenizer's ids: padding rows are not exported)."""
    ids = prompts(vocab, block)
    a, b = ref(ids)[..., :vocab].double(), got(ids)[..., :vocab].double()
    kl = torch.sum(a.softmax(-1) * (a.log_softmax(-1) - b.log_softmax(-1)), -1).mean().item()
    return (a - b).abs().max().item(), max(kl, 0.0), a.abs().max().item()


def rounding_alone(src: Source, dtype: torch.dtype, vocab: int, block: int) -> tuple[float, float]:
    """(largest |logit difference|, KL) that rounding the source's tensors to `dtype` alone makes: megalite's
    model on the source's tensors against the same model on them rounded (one model in memory at a time)."""
    ids = prompts(vocab, block)
    with torch.no_grad():
        a = build_model(src)(ids)[..., :vocab].double()
        rounded = build_model(src)
        for p in rounded.parameters():
            p.copy_(p.to(dtype).float())
        b = rounded(ids)[..., :vocab].double()
    kl = torch.sum(a.softmax(-1) * (a.log_softmax(-1) - b.log_softmax(-1)), -1).mean().item()
    return (a - b).abs().max().item(), max(kl, 0.0)


def check(src: Source, result: Callable[[], Runner], dtype: torch.dtype, what: str, quiet: bool = False,
          vocab: Optional[int] = None) -> None:
    """Run the source and the result (`result()` builds its forward) on the fixed prompts; refuse (one line)
    above TOLERANCE[dtype]. A reduced-precision result above the table's bound is measured once more against
    what rounding the source's own tensors to that dtype does (`rounding_alone`): the rounding's error grows
    with the logits (its KL with their square), the table's KL bound does not, so a faithful bf16 output of a
    model with large logits would be refused; within twice the rounding's own difference and KL it passes."""
    ref = src.reference() or megalite_runner(src)
    vocab = vocab or src.model["vocab_size"]
    block = src.model["block_size"]
    diff, kl, top = compare(ref, result(), vocab, block)
    del ref  # the rounding's measure below builds models of its own
    rel_tol, kl_tol = TOLERANCE[dtype]
    tol, tol_kl, why = rel_tol * (1 + top), kl_tol, ""
    ok = math.isfinite(diff) and diff <= tol and kl <= tol_kl
    if not ok and dtype != torch.float32 and src.specs and math.isfinite(diff):
        alone, alone_kl = rounding_alone(src, dtype, vocab, block)
        tol, tol_kl = max(tol, 2 * alone), max(tol_kl, 2 * alone_kl)
        ok = diff <= tol and kl <= tol_kl
        why = f" (rounding to {str(dtype)[6:]} alone: {alone:.2e}, KL {alone_kl:.2e}; twice that taken)"
    line = (f"check: {what}: largest logit difference {diff:.2e} (logits up to {top:.2f}), KL {kl:.2e} on "
            f"{PROMPTS} fixed prompts of {min(PROMPT_LEN, block)} tokens; tolerance "
            f"{rel_tol:.0e} x (1 + {top:.2f}) and KL {kl_tol:.0e}{why}")
    if not ok:
        raise ConvertError(f"--check: {what}: the result's logits differ from the source's (largest difference "
                           f"{diff:.2e}, KL {kl:.2e}; tolerance {tol:.2e} and KL {tol_kl:.{2 if why else 0}e}{why}); "
                           f"nothing was written")
    if not quiet:
        print(line, file=sys.stderr, flush=True)
