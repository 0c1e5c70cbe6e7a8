"""megatron-core as an outside reference: checkpoints, logits, layer outputs and schedule tables, made by
megatron-core 0.16 itself on CPU (gloo), once per test session (the `mref` fixture in tests/conftest.py, for
tests/test_foreign_megatron.py and tests/test_foreign_llama.py).

    python3 tests/megatron_ref.py OUT_DIR

writes into OUT_DIR:
    tied_tp2pp2/        a Megatron-LM-style torch_dist checkpoint (iter folder + latest_checkpointed_iteration.txt)
                        of a tied GPT-2-shaped model saved at TP=2, PP=2; exact-erf GeLU; vocab 256 padded to 384
    tied_tp2pp2.pt      {"ids", "logits"}: megatron-core's own forward (its pipeline schedule, forward only)
    untied_tp2/         untied output layer, GeLU through megatron's fused bias-GeLU (the tanh approximation),
    untied_tp2.pt       layernorm_epsilon 1e-6, TP=2, PP=1
    llama_tp2pp2/       Llama-shaped (RoPE, SwiGLU, RMSNorm, GQA 4 heads / 2 groups, untied, no linear biases), 4 layers,
    llama_tp2pp2.pt     vocabulary 256 padded to 320, TP=2 PP=2; llama_tp2pp2_noargs/: the same model saved by
                        megatron-core's dist_checkpointing.save alone (no args in common.pt)
    llama_tp4/          8 heads / 4 groups, Qwen-style q/k/v biases, Llama 3 rope scaling, theta 500000, TP=4
    llama_pp2vpp2/      PP=2 with 2 virtual chunks per stage (interleaved schedule), RoPE on interleaved pairs
    qwen3_tp2/          Qwen3-shaped (Megatron-Bridge's Qwen3: qk_layernorm, RMSNorm q_layernorm / k_layernorm of
                        the head width before RoPE, kv_channels 32 over hidden 64 / 4 heads, no biases), TP=2;
                        qwen3_tp2_noargs/: saved by dist_checkpointing.save alone
    untied_tp2_noargs/  the untied GPT-2, saved by dist_checkpointing.save alone
    layers.pt           ColumnParallelLinear / RowParallelLinear at tp=2, with and without sequence
                        parallelism: full weights, input, output gradient, and each rank's output and gradients
    schedule.json       get_schedule_table + get_pp_rank_microbatches for the interleaved 1F1B schedule

The module imports megatron once, then forks the ranks of each job (gloo, file rendezvous): one import
instead of one per rank. megatron-core needs CUDA in four places even for a CPU model; `patch_for_cpu`
replaces exactly those (test helpers only, never the package). Saving stays under __main__: megatron's
checkpoint writer starts a helper process.
"""
from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import os
import sys
import traceback
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

N_LAYER, N_HEAD, N_EMBD, MAX_POS, VOCAB, PADDED = 2, 4, 64, 32, 256, 384
B, T = 2, 16


def patch_for_cpu() -> None:
    """The CUDA-only calls megatron-core 0.16 makes for a CPU model: the device of its buffers
    (torch.cuda.current_device), the CUDA RNG state its RNG tracker saves and restores, torch.cuda.synchronize
    in its checkpoint writer, a literal device="cuda" in the pipeline schedules, and (a tied model at pp > 1)
    the `.cuda()` that moves the last stage's copy of the word embeddings before their first all-reduce."""
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda *a, **k: None
    torch.cuda.manual_seed = lambda *a, **k: None
    import megatron.core.tensor_parallel.random as mrandom
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    from megatron.core.pipeline_parallel import schedules

    class _CpuTorch(types.ModuleType):  # schedules.py's torch, with device="cuda" read as the CPU
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def zeros(*a, device=None, **k):
            return torch.zeros(*a, device="cpu" if device == "cuda" else device, **k)

    schedules.torch = _CpuTorch("torch")


def megatron_args(**kw) -> argparse.Namespace:
    """The training arguments Megatron-LM saves in common.pt (its own field names), for our tiny GPT."""
    a = dict(num_layers=N_LAYER, hidden_size=N_EMBD, ffn_hidden_size=4 * N_EMBD, num_attention_heads=N_HEAD,
             kv_channels=N_EMBD // N_HEAD, group_query_attention=False, num_query_groups=N_HEAD,
             max_position_embeddings=MAX_POS, seq_length=T, position_embedding_type="learned_absolute",
             padded_vocab_size=PADDED, vocab_size=VOCAB, make_vocab_size_divisible_by=96,
             normalization="LayerNorm", layernorm_epsilon=1e-5, layernorm_zero_centered_gamma=False,
             apply_layernorm_1p=False, add_bias_linear=True, add_qkv_bias=True, swiglu=False, squared_relu=False,
             quick_geglu=False, openai_gelu=False, bias_gelu_fusion=False, untie_embeddings_and_output_weights=False,
             num_experts=None, multi_latent_attention=False, qk_layernorm=False,
             apply_residual_connection_post_layernorm=False, transformer_impl="local", params_dtype=torch.float32,
             tensor_model_parallel_size=2, pipeline_model_parallel_size=1, ckpt_format="torch_dist",
             hidden_dropout=0.0, attention_dropout=0.0)
    a.update(kw)
    return argparse.Namespace(**a)


# ---------------------------------------------------------------- ranks of one job, forked
def _rank_main(rank, world, rdzv, fn, args, errors):
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world)
        fn(rank, world, *args)
        dist.barrier()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        os._exit(1)
    dist.destroy_process_group()
    # return normally: multiprocessing then runs its finalizers (a helper process megatron may have started
    # stops with them; os._exit would leave it running, holding our stdout)


def run_job(fn, world: int, out: Path, *args) -> None:
    ctx = mp.get_context("fork")
    errors = ctx.SimpleQueue()
    rdzv = out / f"rdzv-{fn.__name__}"
    rdzv.unlink(missing_ok=True)
    procs = [ctx.Process(target=_rank_main, args=(r, world, str(rdzv), fn, args, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    if not errors.empty() or any(p.exitcode != 0 for p in procs):
        raise SystemExit(errors.get() if not errors.empty() else f"{fn.__name__}: a rank exited with "
                                                                   f"{[p.exitcode for p in procs]}")


# ---------------------------------------------------------------- GPT checkpoints and their logits
def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig
    base = dict(num_layers=N_LAYER, hidden_size=N_EMBD, num_attention_heads=N_HEAD, use_cpu_initialization=True,
                pipeline_dtype=torch.float32, bias_activation_fusion=False, masked_softmax_fusion=False,
                persist_layer_norm=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
                hidden_dropout=0.0, attention_dropout=0.0, apply_rope_fusion=False, init_method_std=0.3)
    base.update(kw)
    return TransformerConfig(**base)


def _perturb(model, tp_rank: int, tp: int, pp_rank: int, layers_per_stage: int, first_layer=None) -> None:
    """Give every parameter (LayerNorm gains and biases included) values far from their init, the same on
    every rank that holds a copy: each full tensor is drawn from a seed of its global name, then sliced
    along megatron's own partition dim. A conversion that swaps, drops or misorders anything shows."""
    for name, p in model.named_parameters():
        key = name
        if name in ("embedding.word_embeddings.weight", "output_layer.weight") and \
                getattr(model, "share_embeddings_and_output_weights", False):
            key = "tied word embeddings"
        if name.startswith("decoder.layers."):
            i, rest = name[len("decoder.layers."):].split(".", 1)
            first = pp_rank * layers_per_stage if first_layer is None else first_layer
            key = f"decoder.layers.{first + int(i)}.{rest}"
        split = getattr(p, "tensor_model_parallel", False)
        dim = getattr(p, "partition_dim", 0)
        shape = list(p.shape)
        if split:
            shape[dim] *= tp
        g = torch.Generator().manual_seed(sum(ord(c) * 131 ** i for i, c in enumerate(key)) % 2**31)
        full = torch.randn(shape, generator=g)
        full = 1.0 + 0.2 * full if ("norm" in key and key.endswith("weight")) else 0.3 * full
        with torch.no_grad():
            p.copy_(full.chunk(tp, dim=dim)[tp_rank] if split else full)


def _save_megatron_lm_style(root: Path, iteration: int, sharded, args, extra=None) -> None:
    """What Megatron-LM's save_checkpoint writes for ckpt_format torch_dist: iter_XXXXXXX/ (the dist
    checkpoint with args, checkpoint_version and iteration in common.pt) and latest_checkpointed_iteration.txt."""
    import queue
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    # a synchronous save collects its write results in this process: a plain queue instead of the
    # multiprocessing Manager megatron would spawn for it (a fresh interpreter per rank, ~2 s of CPU each)
    filesystem_async._results_queue = queue.Queue()
    step = root / f"iter_{iteration:07d}"
    if dist.get_rank() == 0:
        step.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = {"model": sharded} if extra is None else dict(extra)
    dist_checkpointing.save({**state, "args": args, "checkpoint_version": 3.0, "iteration": iteration}, str(step))
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def _gpt(rank, world, out, name, tp, pp, tied, fused_gelu, eps):
    patch_for_cpu()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    ps.initialize_model_parallel(tp, pp)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    cfg = _config(bias_activation_fusion=fused_gelu, layernorm_epsilon=eps, pipeline_model_parallel_size=pp,
                  tensor_model_parallel_size=tp)
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=PADDED, max_sequence_length=MAX_POS,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=tied, parallel_output=False)
    _perturb(model, ps.get_tensor_model_parallel_rank(), tp, ps.get_pipeline_model_parallel_rank(), N_LAYER // pp)
    model.eval()
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(T).unsqueeze(0).expand(B, T)
    mask = torch.triu(torch.ones(T, T), diagonal=1).bool()[None, None]  # True: masked (no CUDA default mask)

    def step(data_iterator, m):
        out_ = m(ids, pos, mask)
        return out_, lambda o, non_loss_data=False: o

    with torch.no_grad():
        got = get_forward_backward_func()(forward_step_func=step, data_iterator=iter([None]), model=[model],
                                          num_microbatches=1, seq_length=T, micro_batch_size=B, forward_only=True,
                                          collect_non_loss_data=True)
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        torch.save({"ids": ids, "logits": got[0].detach().clone()}, out / f"{name}.pt")
    args = megatron_args(untie_embeddings_and_output_weights=not tied, bias_gelu_fusion=fused_gelu,
                         layernorm_epsilon=eps, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    _save_megatron_lm_style(out / name, 10, model.sharded_state_dict(), args)
    if not tied:  # and as megatron-core alone writes it (no args): the "tried as a new user would"
        _save_plain(out / f"{name}_noargs", model.sharded_state_dict())


LLAMA_LAYERS, LLAMA_VOCAB, LLAMA_PADDED, LLAMA_FFN = 4, 256, 320, 96


def _save_plain(root: Path, sharded: dict) -> None:
    """What megatron-core alone writes (NeMo-style and hand-written loops): dist_checkpointing.save of the model's
    sharded state dict, no Megatron-LM `args` in common.pt, no latest_checkpointed_iteration.txt."""
    from megatron.core import dist_checkpointing
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(sharded, str(root))


def _llama(rank, world, out, name, tp, pp, vpp, heads, groups, qkv_bias, scaling, theta, plain, interleaved=False,
           qk_norm=False, kv_channels=None):
    """A Llama-shaped GPTModel (RoPE, SwiGLU, RMSNorm, GQA, untied, no linear biases; Qwen-style qkv biases when
    `qkv_bias`; Llama 3 rope scaling when `scaling`; RoPE on interleaved pairs when `interleaved`; Qwen3's
    q/k RMSNorm when `qk_norm`; a head width of `kv_channels`) at TP=tp, PP=pp with `vpp` model chunks per stage;
    saved as Megatron-LM does (and, when `plain`, again as megatron-core alone does); megatron-core's own forward
    (its pipeline schedule, interleaved when vpp > 1) on fixed tokens saved with the logits."""
    patch_for_cpu()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    ps.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    cfg = _config(num_layers=LLAMA_LAYERS, num_attention_heads=heads, num_query_groups=groups,
                  normalization="RMSNorm", layernorm_epsilon=1e-5, gated_linear_unit=True, activation_func=F.silu,
                  add_bias_linear=False, add_qkv_bias=qkv_bias, ffn_hidden_size=LLAMA_FFN,
                  tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, rotary_interleaved=interleaved,
                  virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, qk_layernorm=qk_norm,
                  **({"kv_channels": kv_channels} if kv_channels else {}))
    chunks = []
    for v in range(vpp):
        vp = v if vpp > 1 else None
        chunks.append(GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_norm),
                               vocab_size=LLAMA_PADDED,
                               max_sequence_length=MAX_POS, position_embedding_type="rope", rotary_base=theta,
                               rope_scaling=scaling, rope_scaling_factor=8.0,
                               pre_process=ps.is_pipeline_first_stage(ignore_virtual=vp is None, vp_stage=vp),
                               post_process=ps.is_pipeline_last_stage(ignore_virtual=vp is None, vp_stage=vp),
                               share_embeddings_and_output_weights=False, parallel_output=False, vp_stage=vp))
        per_chunk = LLAMA_LAYERS // (pp * vpp)
        _perturb(chunks[-1], ps.get_tensor_model_parallel_rank(), tp, 0, 0,
                 first_layer=(v * pp + ps.get_pipeline_model_parallel_rank()) * per_chunk)
        chunks[-1].eval()
    ids = torch.randint(0, LLAMA_VOCAB, (B, T), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(T).unsqueeze(0)
    mask = torch.triu(torch.ones(T, T), diagonal=1).bool()[None, None]
    micro = list(ids.split(1))  # one sequence per microbatch: the interleaved schedule needs pp microbatches

    def step(data_iterator, m):
        x = next(data_iterator)
        return m(x, pos, mask), lambda o, non_loss_data=False: o

    with torch.no_grad():
        its = [iter(micro) for _ in range(vpp)] if vpp > 1 else iter(micro)
        got = get_forward_backward_func()(forward_step_func=step, data_iterator=its,
                                          model=chunks if vpp > 1 else chunks[0], num_microbatches=len(micro),
                                          seq_length=T, micro_batch_size=1, forward_only=True,
                                          collect_non_loss_data=True)
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        torch.save({"ids": ids, "logits": torch.cat([g.detach() for g in got])}, out / f"{name}.pt")
    args = megatron_args(num_layers=LLAMA_LAYERS, num_attention_heads=heads, kv_channels=kv_channels or N_EMBD // heads,
                         qk_layernorm=qk_norm,
                         ffn_hidden_size=LLAMA_FFN, position_embedding_type="rope", rotary_base=theta,
                         rotary_percent=1.0, use_rope_scaling=scaling, rope_scaling_factor=8.0,
                         rotary_interleaved=interleaved,
                         normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True, add_bias_linear=False,
                         add_qkv_bias=qkv_bias, group_query_attention=True, num_query_groups=groups,
                         untie_embeddings_and_output_weights=True, padded_vocab_size=LLAMA_PADDED,
                         vocab_size=LLAMA_VOCAB, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                         virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    if vpp > 1:  # Megatron-LM saves one entry per model chunk: model0, model1, ...
        sharded = {f"model{v}": c.sharded_state_dict() for v, c in enumerate(chunks)}
        _save_megatron_lm_style(out / name, 10, None, args, extra=sharded)
    else:
        _save_megatron_lm_style(out / name, 10, chunks[0].sharded_state_dict(), args)
    if plain:
        _save_plain(out / f"{name}_noargs", chunks[0].sharded_state_dict())


# ---------------------------------------------------------------- the tensor-parallel layers
def _megatron_layers(rank, world, out):
    """Megatron core's column/row-parallel layers at tp 2 (with and without sp): inputs, weights, outputs and
    gradients per rank into layers-rank{r}.pt, which test_foreign_megatron._megalite_layers runs megalite's on."""
    patch_for_cpu()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    ps.initialize_model_parallel(2, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    n_in, n_out = 32, 48
    g = torch.Generator().manual_seed(11)
    data = {"x": torch.randn(T, B, n_in, generator=g), "dy": torch.randn(T, B, n_out, generator=g),
            "x_row": torch.randn(T, B, n_out, generator=g), "dy_row": torch.randn(T, B, n_in, generator=g),
            "w_col": torch.randn(n_out, n_in, generator=g), "b_col": torch.randn(n_out, generator=g),
            "w_row": torch.randn(n_in, n_out, generator=g), "b_row": torch.randn(n_in, generator=g)}
    res = {}
    for sp in (False, True):
        cfg = _config(sequence_parallel=sp, tensor_model_parallel_size=2)
        init = lambda w: None  # noqa: E731 (weights are copied in below)
        col = ColumnParallelLinear(n_in, n_out, config=cfg, init_method=init, bias=True, gather_output=False)
        row = RowParallelLinear(n_out, n_in, config=cfg, init_method=init, bias=True, input_is_parallel=True,
                                skip_bias_add=False)
        with torch.no_grad():
            col.weight.copy_(data["w_col"].chunk(2, 0)[rank])
            col.bias.copy_(data["b_col"].chunk(2, 0)[rank])
            row.weight.copy_(data["w_row"].chunk(2, 1)[rank])
            row.bias.copy_(data["b_row"])
        # column: the input is the full sequence, or this rank's sequence chunk with sp
        x = (data["x"].chunk(2, 0)[rank] if sp else data["x"]).clone().requires_grad_()
        y, _ = col(x)
        y.backward(data["dy"].chunk(2, 2)[rank])
        # row: the input is this rank's column chunk of the features; the output the full sequence or its chunk
        xr = data["x_row"].chunk(2, 2)[rank].clone().requires_grad_()
        yr, _ = row(xr)
        yr.backward(data["dy_row"].chunk(2, 0)[rank] if sp else data["dy_row"])
        res[f"sp{int(sp)}"] = {"col_y": y.detach(), "col_dx": x.grad, "col_dw": col.weight.grad.clone(),
                               "col_db": col.bias.grad.clone(), "row_y": yr.detach(), "row_dx": xr.grad,
                               "row_dw": row.weight.grad.clone(), "row_db": row.bias.grad.clone()}
    torch.save({"data": data, "ranks": res}, out / f"layers-rank{rank}.pt")


# ---------------------------------------------------------------- the interleaved schedule table
def schedule_tables() -> dict:
    """megatron-core's own interleaved-1F1B table and warm-up count for each (pp, rank, m, vpp) we test."""
    from megatron.core.pipeline_parallel import schedules

    class _Comm:  # what get_pp_rank_microbatches asks of its p2p communicator
        def __init__(self, pp, rank, vpp):
            self.pp_group = types.SimpleNamespace(size=lambda: pp, rank=lambda: rank)
            self.virtual_pipeline_model_parallel_size = vpp

    out = []
    for pp in (2, 4):
        for m in (4, 8):
            vpp = 2
            table = schedules.get_schedule_table(m, vpp, pp)  # microbatch_group_size_per_vp_stage defaults to pp
            for rank in range(pp):
                total, all_warmup, warmup, remaining = schedules.get_pp_rank_microbatches(
                    m, vpp, pp, forward_only=False, p2p_communicator=_Comm(pp, rank, vpp))
                out.append({"pp": pp, "rank": rank, "m": m, "vpp": vpp, "table": table, "total": total,
                            "warmup": warmup, "remaining": remaining, "all_warmup": all_warmup})
    return {"megatron_core": __import__("megatron.core.package_info", fromlist=["x"]).__version__, "cases": out}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for module in ("megatron.core", "megatron.core.models.gpt.gpt_model", "megatron.core.dist_checkpointing"):
        importlib.import_module(module)  # once, here: the ranks are forked from this process
    (out / "schedule.json").write_text(json.dumps(schedule_tables()))
    run_job(_gpt, 4, out, out, "tied_tp2pp2", 2, 2, True, False, 1e-5)
    run_job(_gpt, 2, out, out, "untied_tp2", 2, 1, False, True, 1e-6)
    run_job(_megatron_layers, 2, out, out)
    # name, tp, pp, vpp, heads, groups, qkv_bias, rope scaling, theta, also saved without args
    run_job(_llama, 4, out, out, "llama_tp2pp2", 2, 2, 1, 4, 2, False, False, 10000.0, True)
    run_job(_llama, 4, out, out, "llama_tp4", 4, 1, 1, 8, 4, True, True, 500000.0, False)
    run_job(_llama, 2, out, out, "llama_pp2vpp2", 1, 2, 2, 4, 2, False, False, 10000.0, False, True)
    run_job(_llama, 2, out, out, "qwen3_tp2", 2, 1, 1, 4, 2, False, False, 1e6, True, False, True, 32)
    (out / "done").write_text("ok")


if __name__ == "__main__":
    import warnings
    warnings.filterwarnings("ignore")
    main(Path(sys.argv[1]))
