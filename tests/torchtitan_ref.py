"""torchtitan as an outside reference: a tiny Llama 3 built by torchtitan 0.3.0 itself, its own forward's
logits, and its state saved with torch.distributed.checkpoint under each naming torchtitan has written
(tests/test_foreign_torchtitan.py runs this once per session, in a subprocess).

    python3 tests/torchtitan_ref.py OUT_DIR

writes into OUT_DIR:
    ref.pt          {"ids", "logits", "config"}: Llama3Model's forward (ComplexRoPE with Llama 3 scaling, flex
                    attention with the block-causal mask get_attention_masks builds from the positions)
    step-10/        torchtitan >= 0.2 names (attention.qkv_linear.{wq,wk,wv}, lm_head), model keys flattened to
                    the top level as its checkpointer does since PR #1347 (June 2025), beside "optimizer",
                    "lr_scheduler", "dataloader" and "train_state" entries
    step-10-v01/    the <= 0.1 names (attention.{wq,wk,wv}, output) under the "model." prefix that torchtitan's
                    full checkpoints carried before PR #1347, beside an "optimizer" entry
    step-10-v01-model-only/
                    the <= 0.1 names without a prefix (its model-only last-step save)
    qwen3.pt, qwen3-step-10/
                    torchtitan's Qwen3Model (torchtitan/models/qwen3, built as its registry builds every dense size:
                    _build_qwen3_layers with fused wqkv, q/k RMSNorm of the head width, CosSinRoPE, eps 1e-6,
                    weight tying) at a head width of its own (4 heads of 32 over a width of 64); its forward's
                    logits and its state saved by DCP (tok_embeddings and lm_head both, one tied tensor)

torchtitan's FlexAttention is compiled with torch.compile; here its `_compiled_flex_attn` is the eager
`flex_attention` (the same op: the compiled form agreed to 4.5e-8 on this model, and compiling costs ~60 s of
CPU). Nothing else of torchtitan is replaced.
"""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import torch

DIM, HEADS, KV_HEADS, LAYERS, VOCAB, FFN, T, B = 64, 4, 2, 2, 256, 160, 16, 2
THETA, MAX_SEQ = 500000.0, 64
SCALING = dict(scaling_factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)


def build():
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers
    FlexAttention._compiled_flex_attn = flex_attention
    init = {"weight": torch.nn.init.normal_}
    cfg = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=init),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=init),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=init),
        layers=_build_llama3_layers(n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=FFN,
                                    rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=MAX_SEQ, theta=THETA,
                                                            scaling="llama", **SCALING),
                                    attn_backend="flex"))
    model = Llama3Model(cfg)
    model.init_states()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # every parameter far from its init (norm gains too): a misplaced tensor shows
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * r if p.dim() == 1 else 0.3 * r)
    return model.eval()


Q3_HEAD_DIM, Q3_THETA, Q3_FFN = 32, 1e6, 96


def build_qwen3():
    """torchtitan's Qwen3Model as its config registry builds a dense size (qwen3/__init__.py's _0_6b), tiny."""
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_layers, _qwen3_norm
    FlexAttention._compiled_flex_attn = flex_attention
    init = {"weight": torch.nn.init.normal_}
    cfg = Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=_qwen3_norm(DIM), enable_weight_tying=True,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=init),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=init),
        layers=_build_qwen3_layers(n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=Q3_HEAD_DIM,
                                   hidden_dim=Q3_FFN, fuse_qkv=True, attn_backend="flex",
                                   rope=CosSinRoPE.Config(dim=Q3_HEAD_DIM, max_seq_len=MAX_SEQ, theta=Q3_THETA)))
    model = Qwen3Model(cfg)
    model.init_states()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():  # every parameter far from its init (q/k norms too)
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * r if p.dim() == 1 else 0.3 * r)
    return model.eval()


def v01_name(name: str) -> str:
    """torchtitan <= 0.1's name for a >= 0.2 name."""
    return name.replace("attention.qkv_linear.", "attention.").replace("lm_head.", "output.")


def main(out: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = build()
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(T).unsqueeze(0).expand(B, T)
    with torch.no_grad():
        logits = model(ids, positions, model.get_attention_masks(positions))
    config = {"dim": DIM, "n_heads": HEADS, "n_kv_heads": KV_HEADS, "n_layers": LAYERS, "vocab_size": VOCAB,
              "ffn_hidden": FFN, "rope_theta": THETA, "rope_scaling": SCALING}
    torch.save({"ids": ids, "logits": logits, "config": config}, out / "ref.pt")

    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # an optimizer state as torchtitan's OptimizersContainer saves it (flattened FQN keys), after one step (on
    # made-up gradients: flex attention has no backward on CPU)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    optim = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    train_state = {"step": 10, "ntokens_seen": 10 * B * T}
    dataloader = {"dp_rank_0": io.BytesIO(json.dumps({"sample_idx": 20}).encode())}
    lr_scheduler = {"lr_scheduler_0": {"last_epoch": 10, "base_lrs": [1e-3]}}

    full = dict(sd, optimizer=optim, lr_scheduler=lr_scheduler, dataloader=dataloader, train_state=train_state)
    dcp.save(full, checkpoint_id=str(out / "step-10"), no_dist=True)
    old = {v01_name(k): v for k, v in sd.items()}
    dcp.save({"model": old, "optimizer": optim, "train_state": train_state},
             checkpoint_id=str(out / "step-10-v01"), no_dist=True)
    dcp.save(old, checkpoint_id=str(out / "step-10-v01-model-only"), no_dist=True)

    q3 = build_qwen3()
    with torch.no_grad():
        logits = q3(ids, positions, q3.get_attention_masks(positions))
    config = {"dim": DIM, "n_heads": HEADS, "n_kv_heads": KV_HEADS, "head_dim": Q3_HEAD_DIM, "n_layers": LAYERS,
              "vocab_size": VOCAB, "ffn_hidden": Q3_FFN, "rope_theta": Q3_THETA, "eps": 1e-6}
    torch.save({"ids": ids, "logits": logits, "config": config}, out / "qwen3.pt")
    sd = {k: v.detach().clone() for k, v in q3.state_dict().items()}
    dcp.save(dict(sd, train_state=train_state), checkpoint_id=str(out / "qwen3-step-10"), no_dist=True)
    (out / "done").write_text("ok")


if __name__ == "__main__":
    import warnings
    warnings.filterwarnings("ignore")
    main(Path(sys.argv[1]))
