"""megatron-core 0.16 as an outside reference (skipped where it is not installed).

tests/megatron_ref.py runs megatron-core itself on CPU once per session (one subprocess; its ranks are forked
after one import): GPT-2-shaped models saved as Megatron-LM does (torch_dist) at TP=2 PP=2 and TP=2, their
logits from megatron's own forward (its pipeline schedule), Llama-shaped models (tests/test_foreign_llama.py),
its tensor-parallel layers' outputs and gradients, and its interleaved-1F1B schedule table. Here:

  * the checkpoints -> `megalite convert --format hf-gpt2` -> transformers' logits == megatron's (1e-5);
  * the TP=2 PP=2 checkpoint -> `megalite split` (2,2,1) -> megalite's pipeline logits == megatron's; a
    converted file -> split -> a resumed megalite run's first loss == transformers' on the same batch;
  * what megalite does not model is refused in one line naming it, from the arguments or from the tensors;
  * megalite's Column/RowParallelLinear (tp=2, with and without sequence parallelism) == megatron's on the
    same weights: outputs and every gradient;
  * megalite's interleaved 1F1B order == the order megatron's schedule runs (pp 2 and 4, vpp 2, m 4 and 8).
"""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import helpers as H
from megalite.convert import convert, split
from megalite.testing import run_parallel
from helpers import cli_in_process as cli  # `megalite ARGS` in this process

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                or importlib.util.find_spec("megatron.core") is None,
                                reason="megatron-core is not installed (pip install -e '.[megatron]')")

REF_SCRIPT = H.MEGATRON_REF  # the `mref` fixture (conftest.py) runs it once per session
VOCAB = 256  # the real vocabulary; megatron's tensors hold 384 rows (padded)




def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        return model(ids).logits


# ---------------------------------------------------------------- Megatron -> transformers / megalite
def test_tp2_pp2_tied_exports_to_transformers_with_megatrons_logits(tmp_path, mref):
    ref = torch.load(mref / "tied_tp2pp2.pt")
    rc, _, err = cli("convert", mref / "tied_tp2pp2", "--format", "hf-gpt2", "--vocab-size", VOCAB,
                     "--out", tmp_path / "hf")
    assert rc == 0, err
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (cfg["n_layer"], cfg["n_embd"], cfg["n_head"], cfg["n_positions"], cfg["vocab_size"]) == (2, 64, 4, 32, 256)
    assert cfg["activation_function"] == "gelu" and cfg["tie_word_embeddings"] is True  # unfused: exact erf GeLU
    got = hf_logits(tmp_path / "hf", ref["ids"])
    assert got.shape == (2, 16, VOCAB)
    err_ = max_rel(got, ref["logits"][..., :VOCAB])
    print(f"tied TP=2 PP=2 -> hf-gpt2: max |transformers - megatron| / max |megatron| = {err_:.2e}")
    assert err_ < 1e-5


def test_untied_fused_gelu_checkpoint_exports_and_reads_as_a_megalite_model(tmp_path, mref):
    from megalite.generate import load_model
    ref = torch.load(mref / "untied_tp2.pt")
    hf = convert(mref / "untied_tp2", tmp_path / "hf", fmt="hf-gpt2", quiet=True)  # padded vocabulary kept
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["activation_function"] == "gelu_new" and cfg["tie_word_embeddings"] is False  # fused bias-GeLU: tanh
    assert cfg["layer_norm_epsilon"] == 1e-6 and cfg["vocab_size"] == 384
    err_hf = max_rel(hf_logits(hf, ref["ids"]), ref["logits"])
    f = convert(mref / "untied_tp2", tmp_path / "m.safetensors", quiet=True)
    with torch.no_grad():
        from_file = load_model(f)(ref["ids"])
        from_dir = load_model(mref / "untied_tp2")(ref["ids"])  # a Megatron folder is a model file too
    err_file = max_rel(from_file, ref["logits"])
    print(f"untied TP=2 -> hf-gpt2: {err_hf:.2e}; -> megalite file: {err_file:.2e}")
    assert err_hf < 1e-5 and err_file < 1e-5
    assert torch.equal(from_dir, from_file)
    # --format dcp: the same megalite tensors, read back by DCP itself
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    convert(mref / "untied_tp2", tmp_path / "dcp", fmt="dcp", quiet=True)
    want = load_file(str(f))
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(got, storage_reader=HuggingFaceStorageReader(str(tmp_path / "dcp")))
    assert all(torch.equal(got[k], want[k]) for k in want) and "lm_head.weight" in want


def test_untied_checkpoint_cut_to_the_real_vocabulary_gives_megatrons_first_logits(tmp_path, mref):
    """--vocab-size cuts the padding rows of both the input embedding and the separate output layer of an
    untied checkpoint: megalite's and transformers' logits == megatron's first VOCAB logits (1e-5)."""
    from megalite.generate import load_model
    ref = torch.load(mref / "untied_tp2.pt")
    want = ref["logits"][..., :VOCAB]
    f = convert(mref / "untied_tp2", tmp_path / "m.safetensors", vocab_size=VOCAB, quiet=True)
    with torch.no_grad():
        got = load_model(f)(ref["ids"])
    hf = convert(mref / "untied_tp2", tmp_path / "hf", fmt="hf-gpt2", vocab_size=VOCAB, quiet=True)
    assert json.loads((hf / "config.json").read_text())["vocab_size"] == VOCAB
    assert got.shape == want.shape and max_rel(got, want) < 1e-5
    assert max_rel(hf_logits(hf, ref["ids"]), want) < 1e-5


def test_args_without_bias_gelu_fusion_mean_megatrons_default_fused_tanh_gelu(tmp_path, mref):
    """Megatron-LM fuses bias + GeLU unless told not to (`--no-bias-gelu-fusion`: the field defaults to true, and
    args saved before the flag existed have no such field). The untied checkpoint was made fused; with the field
    deleted from its args it still converts to megatron's logits (the tanh GeLU), 1e-5."""
    from megalite.generate import load_model
    src = tmp_path / "untied"
    shutil.copytree(mref / "untied_tp2", src)
    common = next(src.rglob("common.pt"))
    saved = torch.load(common, weights_only=False)  # our own reference file
    assert saved["args"].bias_gelu_fusion is True
    del saved["args"].bias_gelu_fusion
    torch.save(saved, common)
    ref = torch.load(mref / "untied_tp2.pt")
    f = convert(src, tmp_path / "m.safetensors", quiet=True)
    with torch.no_grad():
        assert max_rel(load_model(f)(ref["ids"]), ref["logits"]) < 1e-5


def _pipeline_logits(rank, world, tmp, step, model_cfg, ids, out):
    """megalite at (2,2,1) on the split checkpoint: the pipeline's forward, the vocab-parallel logits gathered."""
    from megalite.checkpoint import load_checkpoint
    from megalite.config import ModelConfig
    from megalite.model import GPTStage
    from megalite.parallel.grid import Layout, ParallelGrid
    from megalite.parallel.pipeline import P2P, forward_only
    grid = ParallelGrid.create(Layout(2, 2, 1))
    model = GPTStage(ModelConfig(**model_cfg), grid).eval()
    load_checkpoint(step, model, None, grid)
    p2p = P2P(grid, (ids.shape[0], ids.shape[1], model_cfg["n_embd"]), torch.float32, torch.device("cpu"))
    outs = forward_only(lambda x, i: model(x), [ids], 1, grid, p2p)
    if grid.is_last_stage:
        parts = [torch.empty_like(outs[0]) for _ in range(grid.tp.size)]
        dist.all_gather(parts, outs[0].contiguous(), group=grid.tp.group)
        if grid.tp.rank == 0:
            torch.save(torch.cat(parts, dim=-1), out)


def test_split_into_megalite_221_gives_megatrons_logits(tmp_path, mref):
    from megalite.checkpoint import manifest as mf
    ref = torch.load(mref / "tied_tp2pp2.pt")
    step = split(mref / "tied_tp2pp2", tmp_path / "ck", 2, 2, 1, quiet=True)
    m = mf.read(step).model_config
    run_parallel(_pipeline_logits, 4, tmp_path / "rdzv", args=(str(step), m, ref["ids"], str(tmp_path / "l.pt")))
    got = torch.load(tmp_path / "l.pt")
    err_ = max_rel(got, ref["logits"])
    print(f"tied TP=2 PP=2 -> split (2,2,1) -> megalite pipeline logits: {err_:.2e} over {got.numel()} logits")
    assert got.shape == ref["logits"].shape and err_ < 1e-5


def test_a_converted_megatron_model_resumes_training(tmp_path, mref, convert_tokens):
    """convert (vocab cut to the byte vocabulary) -> split -> train: the first loss is transformers' on the
    megatron weights for the same batch."""
    from megalite.data import BatchSampler, TokenDataset
    f = convert(mref / "tied_tp2pp2", tmp_path / "m.safetensors", vocab_size=VOCAB, quiet=True)
    hf = convert(mref / "tied_tp2pp2", tmp_path / "hf", fmt="hf-gpt2", vocab_size=VOCAB, quiet=True)
    step = split(f, tmp_path / "ck", 1, 1, 1, quiet=True)
    model = dict(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=VOCAB, activation="gelu")
    over = {f"model.{k}": v for k, v in model.items()}
    cfg = H.CONVERT.config(convert_tokens, tmp_path / "run", **over, **{
        "train.steps": 2, "checkpoint.resume": str(step), "checkpoint.dir": str(tmp_path / "ck2")})
    losses = [r["loss"] for r in H.train_in_process(cfg).history]
    s = BatchSampler(TokenDataset(convert_tokens, "train"), 32, cfg.train.global_batch_size, 0, 1, cfg.train.seed)
    x, y = s.batch_at(0)
    logits = hf_logits(hf, x)
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)).item()
    print(f"resumed megalite run's first loss {losses[0]:.6f} vs transformers on the megatron weights {want:.6f}")
    assert len(losses) == 2 and abs(losses[0] - want) <= 1e-5 * abs(want)


# ---------------------------------------------------------------- what megalite does not model
def _common_pt(step: Path, args) -> None:
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 10}, step / "common.pt")


def _args(**kw):
    sys.path.insert(0, str(REF_SCRIPT.parent))
    try:
        from megatron_ref import megatron_args  # plain argparse, no megatron import
    finally:
        sys.path.pop(0)
    return megatron_args(**kw)


REFUSED = {  # args changes on the real TP=2 PP=2 checkpoint -> the one line naming it
    "RoPE": (dict(position_embedding_type="rope"), r"normalization = 'LayerNorm': megalite does not model RoPE with LayerNorm"),
    "SwiGLU": (dict(swiglu=True), r"swiglu = True: megalite does not model SwiGLU"),
    "RMSNorm": (dict(normalization="RMSNorm"), r"normalization = 'RMSNorm': megalite does not model RMSNorm \(not LayerNorm\)"),
    "GQA": (dict(group_query_attention=True, num_query_groups=2),
            r"num_query_groups = 2: megalite does not model grouped-query attention \(2 key/value groups for 4 heads\)"),
    "MoE": (dict(num_experts=8), r"num_experts = 8: megalite does not model a mixture of experts \(MoE\)"),
    "no biases": (dict(add_bias_linear=False), r"add_bias_linear = False: megalite does not model linear layers without biases"),
    "MLP width": (dict(ffn_hidden_size=128), r"ffn_hidden_size = 128: megalite does not model an MLP width other than 4 \* hidden_size"),
    "vocab": ({}, r"--vocab-size 999: expected 1 to the checkpoint's padded vocabulary 384"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_architectures_megalite_does_not_model_are_refused_in_one_line(tmp_path, mref, case):
    change, pattern = REFUSED[case]
    src = tmp_path / "src"
    shutil.copytree(mref / "tied_tp2pp2", src)
    _common_pt(src / "iter_0000010", _args(**change, untie_embeddings_and_output_weights=False))
    extra = ["--vocab-size", "999"] if case == "vocab" else []
    rc, _, err = cli("convert", src, "--out", tmp_path / "out", *extra)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and re.search(pattern, err), err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out*"))


def test_a_llama_shaped_checkpoint_whose_args_claim_a_gpt2_is_refused_by_its_tensors(tmp_path, mref):
    src = tmp_path / "lying"  # arguments that claim a GPT-2 do not get a Llama's tensors through
    shutil.copytree(mref / "llama_tp2pp2", src)
    _common_pt(src / "iter_0000010", _args(num_layers=4, untie_embeddings_and_output_weights=True))  # its 4 layers
    rc, _, err = cli("convert", src, "--out", tmp_path / "b")
    assert rc == 2 and "tensor 'embedding.position_embeddings.weight' is missing" in err and "RoPE?" in err, err
    assert not any(tmp_path.glob("b*"))


def test_megatron_input_errors_are_one_line_and_nothing_runs(tmp_path, mref):
    class Armed:
        def __reduce__(self):
            import os
            return os.system, (f"touch {tmp_path / 'PWNED'}",)

    step = lambda d: d / "iter_0000010"  # noqa: E731
    cases = []
    d = tmp_path / "armed"
    shutil.copytree(mref / "tied_tp2pp2", d)
    torch.save({"args": _args(), "x": Armed()}, step(d) / "common.pt")
    cases.append((d, r"common\.pt: the pickle names 'posix\.system', which is not on megalite's allow-list"))
    d = tmp_path / "noargs"
    shutil.copytree(mref / "tied_tp2pp2", d)
    torch.save({"iteration": 10}, step(d) / "common.pt")
    cases.append((d, r"common\.pt: has no 'args'"))
    d = tmp_path / "zarr"
    shutil.copytree(mref / "tied_tp2pp2", d)
    (step(d) / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    cases.append((d, r"metadata\.json: sharded_backend = 'zarr', expected 'torch_dist'"))
    d = tmp_path / "latest"
    shutil.copytree(mref / "tied_tp2pp2", d)
    (d / "latest_checkpointed_iteration.txt").write_text("20")
    cases.append((d, r"latest_checkpointed_iteration\.txt names iteration folder 'iter_0000020', which has no"))
    d = tmp_path / "legacy"
    (d / "release" / "mp_rank_00").mkdir(parents=True)
    (d / "latest_checkpointed_iteration.txt").write_text("release")
    cases.append((d, r"release: a legacy Megatron checkpoint \(mp_rank_XX/model_optim_rng\.pt"))
    for src, pattern in cases:
        rc, _, err = cli("convert", src, "--from", "megatron", "--out", tmp_path / "out")
        assert rc == 2 and len(err.strip().splitlines()) == 1 and re.search(pattern, err), (src, err)
        assert not (tmp_path / "out").exists()
    assert not (tmp_path / "PWNED").exists()


# ---------------------------------------------------------------- the tensor-parallel layers
def _megalite_layers(rank, world, tmp, ref_dir):
    """megalite's column/row-parallel layers on the inputs and weights megatron_ref._megatron_layers ran
    Megatron core's on (its layers-rank{r}.pt): the same outputs and gradients, with and without sp."""
    from megalite.parallel.grid import Layout, ParallelGrid
    from megalite.parallel.tensor import ColumnParallelLinear, RowParallelLinear
    ref = torch.load(Path(ref_dir) / f"layers-rank{rank}.pt")
    d = ref["data"]
    grid = ParallelGrid.create(Layout(2, 1, 1))
    tp = grid.tp
    T_, B_, n_in = d["x"].shape
    n_out = d["w_col"].shape[0]
    bt = lambda t: t.transpose(0, 1).contiguous()  # noqa: E731  megatron is (T, B, C), megalite (B, T, C)
    for sp in (False, True):
        want = ref["ranks"][f"sp{int(sp)}"]
        col = ColumnParallelLinear(n_in, n_out, tp, sp=sp)
        row = RowParallelLinear(n_out, n_in, tp, sp=sp)
        with torch.no_grad():
            col.weight.copy_(d["w_col"].chunk(2, 0)[rank])
            col.bias.copy_(d["b_col"].chunk(2, 0)[rank])
            row.weight.copy_(d["w_row"].chunk(2, 1)[rank])
            row.bias.copy_(d["b_row"])
        x = bt(d["x"].chunk(2, 0)[rank] if sp else d["x"]).requires_grad_()
        y = col(x)
        y.backward(bt(d["dy"].chunk(2, 2)[rank]))
        xr = bt(d["x_row"].chunk(2, 2)[rank]).requires_grad_()
        yr = row(xr)
        yr.backward(bt(d["dy_row"].chunk(2, 0)[rank] if sp else d["dy_row"]))
        got = {"col_y": bt(y.detach()), "col_dx": bt(x.grad), "col_dw": col.weight.grad, "col_db": col.bias.grad,
               "row_y": bt(yr.detach()), "row_dx": bt(xr.grad), "row_dw": row.weight.grad, "row_db": row.bias.grad}
        for k, v in want.items():
            assert got[k].shape == v.shape, (sp, k, got[k].shape, v.shape)
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-5, msg=f"sp={sp} rank {rank} {k}")


def test_parallel_linears_match_megatron_core(tmp_path, mref):
    run_parallel(_megalite_layers, 2, tmp_path / "rdzv", args=(str(mref),))


# ---------------------------------------------------------------- the interleaved schedule
def megatron_order(case: dict) -> list:
    """The (kind, micro, chunk) operations megatron's forward_backward_pipelining_with_interleaving runs on
    one rank: forwards of table[0:warmup]; then forward table[warmup + k] and backward k in each steady step;
    then the remaining backwards. A backward's chunk is vpp - 1 - table[k].chunk; its micro-batch is the
    oldest in flight on that chunk (megatron pops input_tensors[chunk][0])."""
    table, warmup, total, vpp = case["table"], case["warmup"], case["total"], case["vpp"]
    done = [0] * vpp
    ops = []

    def backward(k):
        chunk = vpp - 1 - table[k % total][1]
        ops.append(("B", done[chunk], chunk))
        done[chunk] += 1

    for k in range(warmup):
        ops.append(("F", *table[k]))
    for k in range(total - warmup):
        ops.append(("F", *table[k + warmup]))
        backward(k)
    for k in range(total - warmup, total):
        backward(k)
    return ops


def test_interleaved_order_is_megatron_cores(mref):
    from megalite.parallel.pipeline import interleaved_order
    ref = json.loads((mref / "schedule.json").read_text())
    assert ref["megatron_core"].startswith("0.16")
    assert len(ref["cases"]) == 12  # pp 2 and 4, every rank, m 4 and 8, vpp 2
    for case in ref["cases"]:
        want = megatron_order(case)
        got = interleaved_order(case["pp"], case["rank"], case["m"], case["vpp"])
        assert [tuple(o) for o in got] == [tuple(o) for o in want], (case["pp"], case["rank"], case["m"],
                                                                    case["warmup"])
