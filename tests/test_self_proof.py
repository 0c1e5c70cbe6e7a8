"""`convert --check` proved itself: its tolerances at their edge, both of its conditions, the KL's direction, and
the subtle conversion errors it must refuse (issue 42, item 1).

- The tolerance table (check.TOLERANCE: fp32, fp16, bf16) is the one the check's line prints and the one
  docs/converting.md states; each bound is tested just inside it (0.999 x: accepted) and just outside it
  (1.001 x: refused), the logit difference with a constant shift at one position (KL 0), the KL with one
  logit moved at large logits (difference far inside its bound): so each condition alone refuses.
- The KL is KL(source || result) = sum p_src (log p_src - log p_result), averaged over positions, checked against
  a hand-computed value on fixed two-token logits where the two directions differ (0.1438 vs 0.1308).
- Subtle planted conversion errors, on a tiny transformers Llama with real-model scales (embeddings std 0.02,
  so RMSNorm's eps matters; linears std 0.3, so attention is far from uniform): eps 1e-6 for 1e-5, rope_theta
  5e5 for 1e4, one tensor scaled by 1.01, a constant shift per position (KL 0). Each is refused at fp32.
  Faithful conversions are accepted: fp32, bf16 (tensors rounded to bf16, at bf16's tolerance), and both with
  logits in the hundreds.
Planted in check.py while writing this file (each fails a test here): the fp32 tolerance loosened 1000-fold
(or 10-fold), `or` for `and` between the two conditions, the KL's arguments swapped.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from megalite.base.errors import ConvertError
from megalite.convert import check as C
from megalite.convert import open_source
from megalite.convert.common import Source, Spec

transformers = pytest.importorskip("transformers")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
B, T = C.PROMPTS, C.PROMPT_LEN


class Fixed(Source):
    """A source whose forward returns fixed logits (B, T, V), whatever the ids."""

    def __init__(self, logits: torch.Tensor):
        self.where, self.guards, self.logits = "fixed", [], logits
        self.model = {"vocab_size": logits.shape[-1], "block_size": logits.shape[1]}

    def reference(self):
        return lambda ids: self.logits


def run_check(ref: torch.Tensor, got: torch.Tensor, dtype=torch.float32, quiet=False):
    C.check(Fixed(ref), lambda: (lambda ids: got), dtype, "fixed logits", quiet=quiet)


def ref_logits(v=64, seed=0, scale=3.0):
    return scale * torch.randn(B, T, v, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ---------------------------------------------------------------- the table: written once, printed, documented
@pytest.mark.parametrize("name", list(DTYPES))
def test_the_line_prints_the_tables_tolerance(name, capsys):
    ref = ref_logits()
    run_check(ref, ref.clone(), DTYPES[name])
    line = capsys.readouterr().err.strip()
    m = re.search(r"tolerance ([0-9.e+-]+) x \(1 \+ ([0-9.]+)\) and KL ([0-9.e+-]+)$", line)
    assert m and len(line.splitlines()) == 1, line
    assert (float(m[1]), float(m[3])) == C.TOLERANCE[DTYPES[name]]
    assert float(m[2]) == pytest.approx(ref.abs().max().item(), abs=0.01)


def test_the_docs_state_the_tables_numbers():
    doc = (Path(__file__).parents[1] / "docs" / "converting.md").read_text()
    text = " ".join(doc.split("The tolerance is stated in the code", 1)[1].split("Above it", 1)[0].split())
    m = re.search(r"at most ([0-9.e-]+) × \(1 \+ the largest logit\) and KL ≤ ([0-9.e-]+) for fp32 outputs "
                  r"\(bf16: ([0-9.e-]+) and ([0-9.e-]+); fp16: ([0-9.e-]+) and ([0-9.e-]+)\)", text)
    assert m, text
    stated = [float(x) for x in m.groups()]
    assert stated == [*C.TOLERANCE[torch.float32], *C.TOLERANCE[torch.bfloat16], *C.TOLERANCE[torch.float16]]
    assert set(C.TOLERANCE) == set(DTYPES.values())  # one row per output dtype `convert --dtype` writes


# ---------------------------------------------------------------- each bound at its edge, each condition alone
@pytest.mark.parametrize("factor,accepted", [(0.999, True), (1.001, False)])
@pytest.mark.parametrize("name", list(DTYPES))
def test_the_difference_bound_at_its_edge_with_kl_zero(name, factor, accepted):
    """A constant shift at one position (softmax ignores it: KL 0) of factor x the difference bound."""
    ref = ref_logits()
    rel, _ = C.TOLERANCE[DTYPES[name]]
    got = ref.clone()
    got[1, 5] += factor * rel * (1 + ref.abs().max().item())
    diff, kl, _ = C.compare(Fixed(ref).reference(), lambda ids: got, ref.shape[-1], T)
    assert kl < 1e-15
    if accepted:
        run_check(ref, got, DTYPES[name], quiet=True)
    else:
        with pytest.raises(ConvertError, match=rf"largest difference {diff:.2e}, KL .*nothing was written$"):
            run_check(ref, got, DTYPES[name])


def _two_way(delta: float, top: float = 1000.0, v: int = 64):
    """Logits in the hundreds: position (0, 3) is a two-way tie at `top`; the result moves one of the two by
    `delta` (KL grows with delta, the difference is delta)."""
    ref = ref_logits(v)
    ref[0, 3, :2] = top
    got = ref.clone()
    got[0, 3, 1] += delta
    return ref, got


def _delta_for_kl(kl: float) -> float:
    """The shift of _two_way whose KL (as compare computes it) is `kl` (bisection: KL rises with the shift)."""
    lo, hi = 0.0, 30.0
    for _ in range(100):
        mid = (lo + hi) / 2
        ref, got = _two_way(mid)
        if C.compare(lambda ids: ref, lambda ids: got, ref.shape[-1], T)[1] < kl:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@pytest.mark.parametrize("factor,accepted", [(0.999, True), (1.001, False)])
@pytest.mark.parametrize("name", list(DTYPES))
def test_the_kl_bound_at_its_edge_with_the_difference_inside_its_own(name, factor, accepted):
    rel, kl_tol = C.TOLERANCE[DTYPES[name]]
    ref, got = _two_way(_delta_for_kl(factor * kl_tol))
    diff, kl, top = C.compare(lambda ids: ref, lambda ids: got, ref.shape[-1], T)
    assert kl == pytest.approx(factor * kl_tol, rel=1e-6)
    assert diff < 0.5 * rel * (1 + top)  # the difference alone would pass: the KL decides
    if accepted:
        run_check(ref, got, DTYPES[name], quiet=True)
    else:
        with pytest.raises(ConvertError, match=rf"KL {kl:.2e}; tolerance"):
            run_check(ref, got, DTYPES[name])


def test_a_result_of_nan_or_inf_is_refused():
    ref = ref_logits()
    for bad in (float("nan"), float("inf")):
        got = ref.clone()
        got[0, 0, 0] = bad
        with pytest.raises(ConvertError, match="logits differ"):
            run_check(ref, got, torch.bfloat16)


# ---------------------------------------------------------------- the KL's direction, by hand
def test_kl_is_source_given_result_on_fixed_tensors():
    """p (source) = softmax(0, 0) = (1/2, 1/2), q (result) = softmax(0, ln 3) = (1/4, 3/4):
    KL(p || q) = 1/2 ln(1/2 / 1/4) + 1/2 ln(1/2 / 3/4) = 1/2 ln(4/3) = 0.143841;
    KL(q || p) = 1/4 ln(1/2) + 3/4 ln(3/2) = 0.130812 (the other direction: a swapped check reports it)."""
    p = torch.zeros(B, T, 2, dtype=torch.float64)
    q = p.clone()
    q[..., 1] = math.log(3)
    diff, kl, top = C.compare(lambda ids: p, lambda ids: q, 2, T)
    assert kl == pytest.approx(0.5 * math.log(4 / 3), abs=1e-12)
    assert abs(kl - (0.25 * math.log(0.5) + 0.75 * math.log(1.5))) > 0.01
    assert diff == pytest.approx(math.log(3)) and top == 0.0  # top: the source's largest |logit|


# ---------------------------------------------------------------- subtle conversion errors on a real forward
class Memory(Source):
    def __init__(self, model: dict, tensors: dict):
        self.where, self.guards, self.model, self.t = "memory", [], model, tensors
        self.specs = {n: Spec(tuple(t.shape), t.dtype) for n, t in tensors.items()}

    def read(self, name, region=None):
        return self.t[name]


def hf_folder(d: Path, head_scale: float = 1.0):
    """A transformers Llama folder (GQA 2 of 4, width 32, 2 layers) with real-model scales: embeddings std 0.02
    (hidden states near 0.02: RMSNorm's eps of 1e-5 is 2.5% of their mean square), other matrices std 0.3
    (the head's times `head_scale`), as a Source and its tensors in fp32."""
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                std = 0.02 if "embed_tokens" in n else 0.3 * (head_scale if n == "lm_head.weight" else 1.0)
                p.copy_(std * torch.randn(p.shape, generator=g))
    model.save_pretrained(d)
    src = open_source(d)
    return src, {n: src.read(n).float() for n in src.specs}


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    return hf_folder(tmp_path_factory.mktemp("self_proof") / "hf")


@pytest.fixture(scope="module")
def hf_llama_large(tmp_path_factory):
    return hf_folder(tmp_path_factory.mktemp("self_proof") / "hf-large", head_scale=30.0)


def planted(src, tensors, what: str):
    m, t = dict(src.model), dict(tensors)
    if what == "eps 1e-6 for 1e-5":
        m["layer_norm_eps"] = 1e-6
    elif what == "rope_theta 5e5 for 1e4":
        m["rope_theta"] = 5e5
    elif what == "one tensor scaled by 1.01":
        name = "blocks.1.attn.proj.weight"
        assert name in t
        t[name] = 1.01 * t[name]
    elif what.startswith("faithful"):
        pass
    else:
        raise AssertionError(what)
    return Memory(m, t)


SUBTLE = ["eps 1e-6 for 1e-5", "rope_theta 5e5 for 1e4", "one tensor scaled by 1.01"]


@pytest.mark.parametrize("what", SUBTLE)
def test_a_subtle_planted_error_is_refused(hf_llama, what):
    src, tensors = hf_llama
    assert src.model["layer_norm_eps"] == 1e-5 and src.model["rope_theta"] == 1e4
    wrong = planted(src, tensors, what)
    with pytest.raises(ConvertError, match="logits differ from the source's") as e:
        C.check(src, lambda: C.megalite_runner(wrong), torch.float32, what)
    print(f"planted {what}: {e.value}")


def test_a_constant_shift_per_position_is_refused_though_its_kl_is_zero(hf_llama):
    src, tensors = hf_llama
    faithful = C.megalite_runner(Memory(dict(src.model), tensors))
    shift = torch.arange(T, dtype=torch.float32).view(1, T, 1) * 0.01  # 0.00 .. 0.15 per position

    def shifted(ids):
        return faithful(ids) + shift[:, :ids.shape[1]]
    _, kl, _ = C.compare(src.reference(), shifted, 256, T)
    assert kl < 1e-9
    with pytest.raises(ConvertError, match=r"largest difference 1\.5\de-01"):
        C.check(src, lambda: shifted, torch.float32, "shifted")


@pytest.mark.parametrize("name,large", [("fp32", False), ("fp16", False), ("bf16", False), ("fp32", True),
                                        ("fp16", True), ("bf16", True)],
                         ids=["fp32", "fp16", "bf16", "fp32-logits-in-the-hundreds", "fp16-logits-in-the-hundreds",
                              "bf16-logits-in-the-hundreds"])
def test_a_faithful_conversion_is_accepted(request, name, large, capsys):
    """megalite's model on the source's tensors rounded to the output dtype, against transformers on the
    source folder: accepted at that dtype's tolerance, also with the head drawn 30x larger (logits in the
    hundreds)."""
    src, tensors = request.getfixturevalue("hf_llama_large" if large else "hf_llama")
    dtype = DTYPES[name]
    rounded = Memory(dict(src.model), {n: x.to(dtype).float() for n, x in tensors.items()})
    C.check(src, lambda: C.megalite_runner(rounded), dtype, f"faithful {name}")
    line = capsys.readouterr().err
    top = float(re.search(r"logits up to ([0-9.]+)", line)[1])
    assert top > 100 if large else top < 30
    # bf16 at logits near 190: KL 6.0e-2 above the table's 1e-2, within twice rounding's own (check.rounding_alone)
    assert ("rounding to bfloat16 alone" in line) is (name == "bf16" and large), line
    print(line.strip())


@pytest.mark.parametrize("what", ["rope_theta 5e5 for 1e4", "eps 1e-6 for 1e-5"])
def test_an_error_is_refused_at_bf16_where_rounding_alone_is_large(hf_llama_large, what):
    """The rounding allowance is the rounding's own effect, measured: an error on top of it is still refused."""
    src, tensors = hf_llama_large
    wrong = planted(src, {n: x.to(torch.bfloat16).float() for n, x in tensors.items()}, what)
    with pytest.raises(ConvertError, match=r"rounding to bfloat16 alone: .*twice that taken\)\); nothing was written") as e:
        C.check(src, lambda: C.megalite_runner(wrong), torch.bfloat16, what)
    print(f"planted {what} at bf16: {e.value}")
