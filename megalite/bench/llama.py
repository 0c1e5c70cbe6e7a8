"""`megalite bench train`, tables 9 and 10: the Llama family (its spec: megalite/models/llama.py; docs/families.md).

9. megalite (1,1,1) beside transformers' LlamaForCausalLM of the same dims (RMSNorm, rotary, SwiGLU, GQA with
   n_head / 2 kv heads, untied head), the same batch and micro-batches, both eager (no torch.compile; both
   attentions are torch's SDPA), each trained with AdamW + clipping in a fresh interpreter, in `pairs`
   back-to-back pairs whose order alternates; the ratio is megalite / transformers tokens/s within a pair.
10. The bytes one Llama block saves for backward per rank (saved_tensors_hooks, distinct non-parameter storages,
   one sequence, fp32, no recompute, no sp, dropout 0) at tp = 1, 2, 4 and cp = 2, 4, beside the formula
   (elements; s = the rank's tokens, b = 1, h width, a heads, d = h / a, k = kv heads on this rank, F the
   SwiGLU width, t = tp):
       attention  3sbh + sb + 2sbh/t + 2sbkd + sba/t + 2sd
                  (RMSNorm input, x * rstd and output (the q/k/v input), rstd; q and the attention output;
                   k and v; the log-sum-exp; rotary's cos and sin)
       MLP        3sbh + sb + 4sbF/t      (RMSNorm as above; gate, silu(gate), up, and their product)
   With cp > 1 the ring carries (k, v) repeated to the query heads, so k = a / t there (`model._ring_core`).
"""
from __future__ import annotations

import json
import os

import torch

from .. import models
from ..parallel import agree
from . import SavedBytes, StreamTable, paired, reference_step

LLAMA = models.llama.SPEC.name


def llama_model(o: dict, arch: str = LLAMA) -> dict:
    """The bench's GPT dims as a Llama-shaped family: half as many kv heads as heads (GQA), SwiGLU at Llama's own
    rule; a family with a sliding window sees half the block."""
    m = {**o["model"], "arch": arch, "n_kv_head": max(1, o["model"]["n_head"] // 2), "tie_embeddings": False}
    if models.spec(arch).features.sliding_window:
        m["sliding_window"] = o["model"]["block_size"] // 2
    return m


def _transformers_step(cfg):
    """A training step of the family's transformers class (LlamaForCausalLM, Qwen2ForCausalLM, ...) with the
    config's dims and recipe (torch AdamW, clipping, megalite's batches and schedule)."""
    import dataclasses
    import transformers
    from ..convert.family import family_of
    m = cfg.model
    torch.manual_seed(cfg.train.seed)
    hf = family_of(dataclasses.asdict(m)).hf_config(dataclasses.asdict(m))
    hf.pop("architectures"), hf.pop("torch_dtype")
    hf.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config = transformers.AutoConfig.for_model(**hf)
    config._attn_implementation = "sdpa"

    def loss(model, x, y):
        logits = model(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return reference_step(cfg, transformers.AutoModelForCausalLM.from_config(config).train(), loss)


def vs_transformers(o: dict, pairs: int, run_single, log=print, arch: str = LLAMA) -> list:
    """Table 9 (see the module docstring), for family `arch`; run_single(kind, raw, steps) runs one in a fresh
    interpreter."""
    cls = models.spec(arch).hf.architecture
    raw = {"model": llama_model(o, arch), "parallel": {"tp": 1, "pp": 1, "dp": 1},  # as table 1's (1,1,1) runs
           "train": {"global_batch_size": o["batch"], "micro_batch_size": o["micro"], "steps": 1000,
                     "warmup_steps": 10, "eval_batches": 1, "out_dir": o["work"]}, "data": {"path": o["data"]}}
    log(f"\n9. {cls} (model.arch = {arch}, {raw['model']['n_kv_head']} kv heads of {o['model']['n_head']}): "
        f"megalite (1,1,1) vs transformers' {cls} (same dims and batch, eager, SDPA, torch.optim.AdamW), {pairs} "
        f"pairs of fresh processes, the order alternating; ratio = megalite / transformers tokens/s within a pair, "
        f"by the wall clock and by the process's CPU time per step")
    return paired(o, "transformers", raw, pairs, run_single, log, label=f"{arch}-")


def llama_block_formula(s: int, b: int, m, t: int, cp: int, bytes_per: int = 4) -> tuple[int, int]:
    """(attention, MLP) bytes a Llama block saves for backward per rank (the module docstring's formula)."""
    h, a, d = m.n_embd, m.n_head, m.head_dim
    kv = a // t if cp > 1 else max(1, m.kv_heads // t)  # cp's ring carries k, v repeated to the query heads
    attn = 3 * s * b * h + s * b + 2 * s * b * h // t + 2 * s * b * kv * d + s * b * a // t + 2 * s * d
    mlp = 3 * s * b * h + s * b + 4 * s * b * m.ffn_size // t
    return attn * bytes_per, mlp * bytes_per


def block_layouts(world: int, n_head: int, seq: int) -> list[tuple]:
    """(tp, pp, dp, cp): tp = 1, 2, 4 and cp = 2, 4 where the world, the heads and the sequence allow."""
    out = [(tp, 1, world // tp, 1) for tp in (1, 2, 4) if world % tp == 0 and n_head % tp == 0]
    return out + [(1, 1, world // cp, cp) for cp in (2, 4) if world % cp == 0 and seq % (2 * cp) == 0]


def _worker(rank: int, world: int, tmp: str, o: dict) -> None:
    from ..config import Config
    from ..model import GPTStage
    from ..parallel.grid import Layout, ParallelGrid
    out = []
    for lay in o["layouts"]:
        grid = ParallelGrid.create(Layout(*lay))
        m = Config.from_dict({"model": o[LLAMA]}).model
        model = GPTStage(m, grid)
        model.init_weights(0)
        blk = model.blocks["0"]
        saved = []
        for run in (lambda x: x + blk.attn(blk.ln_1(x)), lambda x: x + blk.mlp(blk.ln_2(x))):
            x = torch.randn(1, m.block_size // grid.cp.size, m.n_embd, generator=torch.Generator().manual_seed(1),
                            requires_grad=True)
            mem = SavedBytes(list(model.parameters()))
            with torch.autograd.graph.saved_tensors_hooks(mem.pack, mem.unpack):
                y = run(x)
            y.sum().backward()  # every rank runs the same collectives, and the graph is freed
            saved.append(mem.peak)
        out.append(saved)
    everyone = agree.everyone(out)  # every rank's rows, on the job's default group
    if rank == 0:
        with open(os.path.join(tmp, f"llama-{world}.json"), "w") as f:
            json.dump(everyone, f)


def block_activations(o: dict, world: int, seq: int, log=print) -> list:
    """Table 10 at `world` ranks for one `seq`-token sequence; printed row by row."""
    from ..config import Config
    from ..testing import run_parallel
    llama = {**llama_model(o), "n_layer": 1, "block_size": seq}
    m = Config.from_dict({"model": llama}).model
    layouts = block_layouts(world, m.n_head, seq)
    log(f"\n10. saved bytes of one Llama block per rank ({m.n_embd} wide, {m.n_head} heads, {m.kv_heads} kv heads, "
        f"SwiGLU {m.ffn_size}), one {seq}-token sequence, fp32, vs the formula (bench/llama.py)")
    run_parallel(_worker, world, tmp_dir=o["work"], args=({**o, LLAMA: llama, "layouts": layouts},))
    with open(os.path.join(o["work"], f"llama-{world}.json")) as f:
        result = json.load(f)
    t = StreamTable(["tp,pp,dp,cp", "attn KiB", "(formula)", "MLP KiB", "(formula)", "block vs tp=1"],
                    [11, 9, 9, 8, 9, 13], log=log)
    rows, base = [], None
    kib = lambda n: f"{n / 1024:.1f}"  # noqa: E731
    for i, lay in enumerate(layouts):
        tp, _, _, cp = lay
        attn, mlp = result[0][i]
        want = llama_block_formula(seq // cp, 1, m, tp, cp)
        base = base or attn + mlp
        rows.append({"layout": tuple(lay), "attn_bytes": attn, "attn_formula_bytes": want[0], "mlp_bytes": mlp,
                     "mlp_formula_bytes": want[1], "vs_tp1": (attn + mlp) / base})
        t.row([",".join(map(str, lay)), kib(attn), kib(want[0]), kib(mlp), kib(want[1]), f"{(attn + mlp) / base:.3f}"])
    return rows


def bench_llama(o: dict, nproc: int, pairs: int, run_single, seq: int, log=print) -> dict:
    return {LLAMA: vs_transformers(o, pairs, run_single, log),
            "families": [r for arch in models.FAMILIES if o.get("families") and arch != LLAMA and
                         models.spec(arch).features.mlp == "swiglu" for r in vs_transformers(o, pairs, run_single, log,
                                                                                              arch)],
            "llama_block": block_activations(o, nproc, seq, log)}
