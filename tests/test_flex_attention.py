"""train.attn_backend = "flex" (megalite/attention.py) against the sdpa path's boolean masks: the mask rule, the
logits of every family with document masks, a sliding window and both, and the one-line refusals.

torch 2.13's flex_attention has no backward on the CPU, so these compare forwards (eval); `megalite gpu-check`
compares the gradients on a GPU (bench/gpu_check.py's flex case)."""
import warnings

import pytest
import torch

from megalite.attention import block_mask, mask_mod
from megalite.config import ConfigError, ModelConfig, load_config, resolve, validate
from megalite.model import GPTStage
from megalite.parallel.grid import ParallelGrid

T = 40
DOCS = torch.tensor([[0] * 7 + [1] * 20 + [2] * 13, [5] * 33 + [6] * 7])  # ids as the sampler numbers runs


def by_hand(docs, window: int) -> torch.Tensor:
    """(B, T, T): query i sees key j when j <= i, i - j < window (when set), same document (when given)."""
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    m = (j <= i) & ((i - j < window) if window else True)
    return m & (docs[:, :, None] == docs[:, None, :]) if docs is not None else m.expand(2, T, T)


@pytest.mark.parametrize("docs,window", [(DOCS, 0), (None, 9), (DOCS, 9)])
def test_the_mask_mod_is_the_rule_and_the_block_mask_covers_it(docs, window):
    from torch.nn.attention.flex_attention import create_mask
    dense = create_mask(mask_mod(docs, window), 2 if docs is not None else None, None, T, T, device="cpu")
    assert torch.equal(dense[:, 0], by_hand(docs, window)) if docs is not None else \
        torch.equal(dense[0, 0], by_hand(None, window)[0])
    block = block_mask(docs, window, 2, T, torch.device("cpu"))
    assert block.shape == ((2 if docs is not None else 1), 1, T, T)  # per row when documents differ per row


def test_one_block_mask_per_micro_batch_shared_by_layers_and_chunks():
    """GPTStage builds the BlockMask once for a micro-batch's `docs` (every layer, every vpp chunk reads it)
    and again only for another micro-batch."""
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=64, vocab_size=97, arch="llama")
    model = GPTStage(cfg, ParallelGrid.single(), attn_backend="flex")
    ids, other = torch.zeros(2, T, dtype=torch.long), DOCS.clone()
    first = model.flex_mask(ids, DOCS)
    assert model.flex_mask(ids, DOCS) is first and model.flex_mask(ids, other) is not first
    assert GPTStage(cfg, ParallelGrid.single(), attn_backend="sdpa").flex_mask(ids, DOCS) is None


CASES = [("gpt2", DOCS, 0), ("llama", DOCS, 0), ("qwen3", DOCS, 0), ("mistral", None, 9), ("mistral", DOCS, 9)]


@pytest.mark.parametrize("arch,docs,window", CASES)
def test_flex_logits_equal_the_sdpa_boolean_mask(arch, docs, window):
    """The same weights run with sdpa's (B, 1, T, T) mask and with flex's BlockMask: logits within 1e-5.
    gpt2 checks learned positions restarting per document, llama/qwen3 rotary (qwen3: qk-norm, GQA), mistral
    the window alone and with documents."""
    extra = {"sliding_window": window} if window else {}
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=64, vocab_size=97, arch=arch,
                      **({"n_kv_head": 2} if arch != "gpt2" else {}), **extra)
    torch.manual_seed(0)
    ids = torch.randint(0, 97, (2, T))
    out = {}
    for backend in ("sdpa", "flex"):
        model = GPTStage(cfg, ParallelGrid.single(), attn_backend=backend)
        model.init_weights(7)
        model.eval()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # flex unfused on the CPU says so
            out[backend] = model(ids, docs=docs)
        assert (model._flex is not None) == (backend == "flex")  # flex really ran, one mask for both layers
    assert torch.allclose(out["flex"], out["sdpa"], atol=1e-5, rtol=0), (out["flex"] - out["sdpa"]).abs().max()


@pytest.mark.parametrize("overrides,names", [
    (["--train.attn_backend=fast"], ["train.attn_backend = 'fast'", "auto, sdpa, flex"]),
    (["--train.attn_backend=flex", "--model.dropout=0.1"], ["'flex'", "model.dropout = 0.1", "no attention dropout"]),
    (["--train.attn_backend=flex", "--parallel.cp=2", "--model.block_size=64"], ["parallel.cp = 2", "ring"]),
])
def test_what_flex_cannot_honour_is_one_line(overrides, names):
    world = 2 if "--parallel.cp=2" in overrides else 1
    with pytest.raises(ConfigError) as e:
        validate(resolve(load_config(None, overrides), world), world)
    assert "\n" not in str(e.value) and all(n in str(e.value) for n in names), str(e.value)


def test_flex_training_on_the_cpu_is_refused_and_auto_is_sdpa_there():
    from megalite.attention import check_device, uses_flex
    with pytest.raises(ConfigError, match=r"^train.attn_backend = 'flex' on the CPU: .*no backward"):
        check_device("flex", torch.device("cpu"))
    check_device("auto", torch.device("cpu"))
    assert not uses_flex("auto", torch.device("cpu"), True, 0.0, 1)
    assert uses_flex("auto", torch.device("cuda"), True, 0.0, 1)
    assert not any(uses_flex("auto", torch.device("cuda"), *a) for a in [(False, 0.0, 1), (True, 0.1, 1),
                                                                          (True, 0.0, 2)])


def _tp_worker(rank, world_size, tmp_dir, cfg, ids, docs):
    from megalite.parallel.grid import Layout
    model = GPTStage(cfg, ParallelGrid.create(Layout(2, 1, 1)), sp=True, attn_backend="flex")
    model.init_weights(7)
    model.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = model(ids[:, :-1], ids[:, 1:], docs=docs[:, :-1])
    hidden = torch.zeros(2, T // 2, 32)  # a later pp stage's input under sp: T/tp tokens, the mask for all T
    assert model.flex_mask(hidden, docs[:, 1:]).shape == (2, 1, T, T)
    if rank == 0:
        torch.save(loss, f"{tmp_dir}/tp.pt")


@pytest.mark.slow  # 2 gloo processes: ~25 s on 2 shared cores
def test_flex_under_tp_2_with_sp_is_the_single_sdpa_loss(tmp_path):
    """tp = 2 with sp (each rank its heads; the mask built for the gathered sequence): the single process's
    sdpa loss on the same weights (1e-5)."""
    from megalite.testing import run_parallel
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=64, vocab_size=96, arch="llama", n_kv_head=2)
    ids, docs = torch.randint(0, 96, (2, T + 1)), torch.cat([DOCS, DOCS[:, -1:]], 1)
    model = GPTStage(cfg, ParallelGrid.single(), attn_backend="sdpa")
    model.init_weights(7)
    model.eval()
    with torch.no_grad():
        ref = model(ids[:, :-1], ids[:, 1:], docs=docs[:, :-1])
    run_parallel(_tp_worker, 2, tmp_path, args=(cfg, ids, docs))
    assert torch.load(tmp_path / "tp.pt").item() == pytest.approx(ref.item(), abs=1e-5)
