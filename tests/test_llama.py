"""The Llama family (model.arch = "llama") against transformers' LlamaForCausalLM, which megalite did not write.

- Logits and loss of a tiny Llama at (1,1,1) equal transformers' with the same weights: MHA, GQA (2 kv heads of
  4) and MQA, tied and untied, and the llama3 rope_scaling of Llama 3.1/3.2.
- 30 training steps: megalite (1,1,1) against transformers' LlamaForCausalLM + torch.optim.AdamW +
  torch.nn.utils.clip_grad_norm_ on the same batches and LR schedule (test_reference.py's tolerances for GPT-2);
  the same for the Llama-shaped families against their own transformers class (Qwen2ForCausalLM with q/k/v
  biases and a tied head, Qwen3ForCausalLM with q/k norms and a head width of its own, MistralForCausalLM with a
  window shorter than the sequence).
- bf16 + fused AdamW + async save and resume, and train.compile, for Llama, Qwen3 and a windowed Mistral.
- Bad input: one line naming the field.
The weights go to transformers by the name table of docs/families.md, written out here by hand (the test's
own reference, not megalite's converter).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

import dataclasses

import helpers as H
from megalite import models
from megalite.config import Config, ConfigError, ModelConfig, load_config, resolve, validate
from megalite.data import BatchSampler, TokenDataset
from megalite.model import GPTStage
from megalite.run.schedule import lr_at
from megalite.parallel.grid import ParallelGrid

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}
RENAME = [("blocks.", "model.layers."), ("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm"),
          ("attn.q.", "self_attn.q_proj."), ("attn.k.", "self_attn.k_proj."), ("attn.v.", "self_attn.v_proj."),
          ("attn.proj.", "self_attn.o_proj."), ("mlp.gate.", "mlp.gate_proj."), ("mlp.up.", "mlp.up_proj."),
          ("mlp.proj.", "mlp.down_proj."), ("attn.q_norm.", "self_attn.q_norm."),
          ("attn.k_norm.", "self_attn.k_norm.")]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def hf_name(name: str) -> str:
    """megalite's global name -> transformers' (docs/families.md's table)."""
    special = {"wte.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight"}
    if name in special or name == "lm_head.weight":
        return special.get(name, name)
    for ours, theirs in RENAME:
        name = name.replace(ours, theirs)
    return name


def hf_model(m: ModelConfig, weights: dict):
    """transformers' class of megalite's family (LlamaForCausalLM, Qwen2/Qwen3/MistralForCausalLM) of megalite's
    dims, holding `weights` (megalite names), eager attention, fp32."""
    spec = models.spec(m.arch)
    own = spec.hf.own_config(dataclasses.asdict(m))  # the family's own keys (Mistral's window, Qwen's off ones)
    cfg = getattr(transformers, spec.hf.config_class)(
        vocab_size=m.vocab_size, hidden_size=m.n_embd, intermediate_size=m.ffn_size, num_hidden_layers=m.n_layer,
        num_attention_heads=m.n_head, num_key_value_heads=m.kv_heads, max_position_embeddings=m.block_size,
        rms_norm_eps=m.layer_norm_eps, rope_theta=m.rope_theta, rope_scaling=dict(m.rope_scaling) or None,
        tie_word_embeddings=m.tie_embeddings, head_dim=m.head_dim, attn_implementation="eager",
        bos_token_id=None, eos_token_id=None, pad_token_id=None, **own)
    model = getattr(transformers, spec.hf.architecture)(cfg)
    state = {hf_name(n): t for n, t in weights.items()}
    if m.tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    assert sorted(state) == sorted(model.state_dict()), "every transformers tensor comes from megalite"
    return model


def tiny(kv: int, tie: bool, **kw) -> ModelConfig:
    return ModelConfig(**{**dict(arch="llama", n_layer=2, n_head=4, n_kv_head=kv, n_embd=32, block_size=32,
                                 vocab_size=96, tie_embeddings=tie, rope_theta=500000.0), **kw})


# ---------------------------------------------------------------- one forward, same weights
@pytest.mark.parametrize("kv,tie,scaling", [(4, False, {}), (4, True, {}), (2, False, {}), (2, True, LLAMA3),
                                            (1, False, LLAMA3), (1, True, {})],
                         ids=["mha", "mha-tied", "gqa", "gqa-tied-llama3", "mqa-llama3", "mqa-tied"])
def test_logits_and_loss_equal_transformers(kv, tie, scaling):
    m = tiny(kv, tie, rope_scaling=scaling)
    ours = GPTStage(m, ParallelGrid.single())
    ours.init_weights(7)
    with torch.no_grad():  # norms off their ones init: a norm applied wrongly (or not at all) shows
        for name, p in ours.global_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    theirs = hf_model(m, {n: p.detach().clone() for n, p in ours.global_parameters()}).eval()
    x, y = torch.randint(0, m.vocab_size, (2, 2, m.block_size))
    with torch.no_grad():
        logits, want = ours(x), theirs(input_ids=x).logits
        loss, want_loss = ours(x, y), F.cross_entropy(want.reshape(-1, m.vocab_size), y.reshape(-1))
    diff = ((logits - want).abs().max() / want.abs().max()).item()
    print(f"\nLlama kv={kv} tied={tie} rope_scaling={scaling.get('rope_type', 'none')}: "
          f"max logit diff / max |logit| {diff:.2e}, loss {loss.item():.6f} vs {want_loss.item():.6f}")
    assert diff < 1e-5
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-5)


@pytest.mark.parametrize("head_dim,theta", [(8, 500000.0), (64, 500000.0), (128, 10000.0)])
def test_rope_frequencies_are_transformers(head_dim, theta):
    """Llama 3.2's rope_scaling (original 8192, factor 32) at real head sizes: transformers' own llama3 function."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from megalite.model import rope_frequencies
    scaling = dict(LLAMA3, factor=32.0, original_max_position_embeddings=8192)
    m = ModelConfig(arch="llama", n_head=4, n_embd=4 * head_dim, block_size=131072, rope_theta=theta,
                    rope_scaling=scaling)
    cfg = transformers.LlamaConfig(hidden_size=m.n_embd, num_attention_heads=4, rope_theta=theta,
                                   rope_scaling=dict(scaling), max_position_embeddings=m.block_size)  # (it adds keys)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours, plain = rope_frequencies(m), rope_frequencies(ModelConfig(arch="llama", n_head=4, n_embd=4 * head_dim,
                                                                    rope_theta=theta))
    assert torch.allclose(ours, want, rtol=1e-6, atol=0) and not torch.allclose(ours, plain)


# ---------------------------------------------------------------- 30 steps against transformers + AdamW
RECIPE = dict(steps=30, seq_len=16, global_batch_size=8, micro_batch_size=2, lr=1e-3, min_lr=1e-4, warmup_steps=5,
              weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=2.0, seed=1234, log_interval=1000,
              eval_interval=1000, eval_batches=1)


def _hf_train(m: ModelConfig, weights: dict, t, token_file):
    model = hf_model(m, weights).train()
    named = list(model.named_parameters())  # decay: every matrix and embedding; not the RMSNorm weights
    decay, no_decay = [p for _, p in named if p.dim() >= 2], [p for _, p in named if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8)
    sampler = BatchSampler(TokenDataset(token_file, "train"), t.seq_len, t.global_batch_size, 0, 1, t.seed)
    losses, norms = [], []
    for step in range(t.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, t)
        x, y = sampler.next_batch()
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)))
        opt.step()
        losses.append(loss.item())
    return losses, norms, {n: p.detach() for n, p in model.named_parameters()}


FAMILY_CASES = {"llama": {}, "qwen2-tied": dict(arch="qwen2", tie_embeddings=True),
                "qwen3": dict(arch="qwen3", head_size=16, rope_theta=1e6), "mistral-window": dict(arch="mistral",
                                                                                              sliding_window=5)}


@pytest.mark.parametrize("case", list(FAMILY_CASES))
def test_training_matches_transformers_and_torch_adamw(token_file, tmp_path, case):
    raw = {"model": dict(dict(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=16,
                              vocab_size=256, rope_theta=10000.0), **FAMILY_CASES[case]),
           "train": dict(RECIPE, out_dir=str(tmp_path / "run")), "data": {"path": str(token_file)},
           "checkpoint": {"dir": ""}}
    cfg = Config.from_dict(raw)
    assert cfg.model.tie_embeddings is (case == "qwen2-tied")  # untied: Llama's default, and its families'
    start = GPTStage(cfg.model, ParallelGrid.single())
    start.init_weights(cfg.train.seed)  # what train() starts from
    hf_losses, hf_norms, hf_params = _hf_train(cfg.model, {n: p.detach().clone() for n, p in
                                                           start.global_parameters()}, cfg.train, token_file)
    tr = H.train_in_process(cfg)
    losses = [r["loss"] for r in tr.history]
    assert len(losses) == 30 and losses[-1] < losses[0] - 0.5  # it trains
    print(f"\ngrad norms {min(hf_norms):.2f}..{max(hf_norms):.2f}")
    assert any(n > RECIPE["grad_clip"] for n in hf_norms) and any(n < RECIPE["grad_clip"] for n in hf_norms)
    loss_err = [abs(a - b) / abs(b) for a, b in zip(losses, hf_losses)]
    norm_err = [abs(r["grad_norm"] - n) / n for r, n in zip(tr.history, hf_norms)]
    errs = {hf_name(n): H.rel_err(p.detach(), hf_params[hf_name(n)]) for n, p in tr.params}
    worst = max(errs, key=errs.get)
    weights = max((e, n) for n, e in errs.items() if not n.endswith(".bias"))
    print(f"\n{case} (1,1,1) vs transformers+AdamW, 30 steps: max loss rel diff {max(loss_err):.2e}, grad-norm "
          f"{max(norm_err):.2e}, final parameters {errs[worst]:.2e} ({worst}), weights {weights[0]:.2e}")
    assert max(loss_err) <= 1e-6, [f"step {i + 1}: {e:.2e}" for i, e in enumerate(loss_err) if e > 1e-6]
    assert max(norm_err) <= 1e-5
    # Qwen2's q/k/v biases start at zero: AdamW's normalised step turns the reduction-order noise of their tiny
    # gradients into a larger relative difference than a weight's (2.3e-5 measured; test_families.py's rule)
    assert len(errs) == len(hf_params) and weights[0] <= 1e-5 and errs[worst] <= 1e-4


# ---------------------------------------------------------------- bad input: one line naming the field
@pytest.mark.parametrize("overrides,match", [
    (["--model.n_kv_head=3"], r"model\.n_kv_head = 3 does not divide model\.n_head = 4"),
    (['--model.rope_scaling={rope_type="longrope", factor=4.0}'], r"model\.rope_scaling\.rope_type = 'longrope': "
                                                                       r"megalite models none"),
    (['--model.rope_scaling={rope_type="yarn", factor=4.0}'], r"model\.rope_scaling\.original_max_position_"
                                                                   r"embeddings = None, expected a finite positive number"),
    (['--model.rope_scaling={rope_type="llama3", factor=8.0}'], r"model\.rope_scaling\.low_freq_factor = None"),
    (["--model.rope_scaling=[1, 2]"], r"model\.rope_scaling = \[1, 2\] has type list, expected dict"),
    (["--model.arch=mamba"], r"model\.arch = 'mamba': expected one of gpt2, llama, qwen2, qwen3, mistral"),
    (["--model.n_kv_head=2", "--parallel.tp=4", "--model.n_head=12", "--model.n_embd=48", "--model.n_kv_head=6"],
     r"parallel\.tp = 4 neither divides model\.n_kv_head = 6 nor is a multiple of it"),
    (["--model.rope_theta=0.5"], r"model\.rope_theta = 0\.5: expected a finite number above 1"),
])
def test_bad_llama_config_is_one_line(tiny_toml, overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        validate(resolve(load_config(tiny_toml, ["--model.arch=llama", *overrides]), 4 if "--parallel.tp=4"
                         in overrides else None))
    assert "\n" not in str(e.value)


def test_bad_llama_config_on_the_command_line_is_one_line_and_writes_nothing(tiny_toml, tmp_path):
    out = tmp_path / "never"
    for flags, match in ((["--model.n_kv_head=3"], r"model\.n_kv_head = 3 does not divide model\.n_head = 4"),
                         (['--model.rope_scaling={rope_type="dynamic", factor=2.0}'], r"rope_type = 'dynamic'")):
        p = H.cli("train", "--config", tiny_toml, "--model.arch=llama", f"--train.out_dir={out}", *flags)
        H.one_line_error(p, match=match)
        assert not out.exists()


def test_gpt2_refuses_llama_keys(tiny_toml):
    with pytest.raises(ConfigError, match=r"model\.n_kv_head = 2 applies to model\.arch = llama \| qwen2 \| qwen3 \| mistral only"):
        validate(resolve(load_config(tiny_toml, ["--model.n_kv_head=2"])))


def test_every_llama_key_has_a_default(tiny_toml):
    """--model.arch=llama on a GPT-2 config trains as is: untied, kv heads = heads, Llama's MLP rule."""
    cfg = validate(resolve(load_config(tiny_toml, ["--model.arch=llama"])))
    m = cfg.model
    assert (m.tie_embeddings, m.kv_heads, m.ffn_size, m.rope_scaling) == (False, 4, 256, {})
    assert load_config(tiny_toml, ["--model.arch=llama", "--model.tie_embeddings=true"]).model.tie_embeddings
    assert load_config(tiny_toml).model.tie_embeddings  # GPT-2 stays tied
    assert ModelConfig(arch="llama", n_embd=2048).ffn_size == 5632  # Llama 2 7B's rule: 4096 -> 11008 below
    assert ModelConfig(arch="llama", n_embd=4096).ffn_size == 11008


# ---------------------------------------------------------------- features at (1,1,1), configs, gpu-check
FEATURE_CASES = {"llama": {"model.arch": "llama"},
                 "qwen3": {"model.arch": "qwen3", "model.head_size": 16},  # q/k norms, a head of 16 over 32 / 4
                 "mistral-window": {"model.arch": "mistral", "model.sliding_window": 5}}  # < the 16-token sequence


@pytest.mark.parametrize("case", list(FEATURE_CASES))
def test_bf16_fused_adamw_async_save_and_resume(token_file, tmp_path, case):
    """bf16 autocast with fp32 masters, torch's fused AdamW and an async checkpoint: a run resumed from step 2
    takes step 3 exactly as the uninterrupted run did, and bf16 stays near fp32 (1e-3 relative per step, the
    tolerance test_features_parallel.py allows bf16 against fp32) without being it."""
    llama = {**FEATURE_CASES[case], "model.n_kv_head": 2, "train.steps": 3}
    feats = {**llama, "train.precision": "bf16", "train.fused_adamw": "on", "checkpoint.async": True,
             "checkpoint.interval": 2, "checkpoint.dir": str(tmp_path / "ck")}
    run = H.train_in_process(H.CKPT.config(token_file, tmp_path / "a", **feats))
    resumed = H.train_in_process(H.CKPT.config(token_file, tmp_path / "b", **{
        **feats, "checkpoint.dir": str(tmp_path / "ck2"), "checkpoint.resume": str(tmp_path / "ck" / "step_00000002")}))
    fp32 = H.train_in_process(H.CKPT.config(token_file, tmp_path / "c", **llama))
    assert run.optimizer.fused and all(p.dtype == torch.float32 for _, p in run.params)
    assert [r["loss"] for r in resumed.history] == [run.history[-1]["loss"]]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(run.params, resumed.params))
    losses16, losses32 = [r["loss"] for r in run.history], [r["loss"] for r in fp32.history]
    assert losses16 != losses32 and losses16 == pytest.approx(losses32, rel=1e-3)


@pytest.mark.slow  # inductor compiles the blocks on the CPU: ~30-90 s each
@pytest.mark.parametrize("case", list(FEATURE_CASES))
def test_compile_equals_eager(case):
    """train.compile on a Llama block (rotary, GQA, SwiGLU; Qwen3's q/k norms and head width; Mistral's window):
    the same losses as eager within 1e-5."""
    from torch._dynamo.utils import counters
    from megalite.run.compile import compile_blocks
    own = {k.removeprefix("model."): v for k, v in FEATURE_CASES[case].items()}
    m = tiny(2, False, rope_scaling=LLAMA3, **own)
    x, y = torch.randint(0, m.vocab_size, (2, 2, m.block_size))
    losses = {}
    for on in (False, True):
        model = GPTStage(m, ParallelGrid.single())
        model.init_weights(1)
        counters.clear()
        if on:
            compile_blocks(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[on] = []
        for _ in range(3):
            loss = model(x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[on].append(loss.item())
        if on:
            assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)


def test_llama3_1b_config_is_llama_3_2_1b(tmp_path):
    """configs/llama3-1b.toml: transformers' count of the same LlamaConfig (built on the meta device), megalite's
    own model's, and the number gpu-check's FLOPs use agree: 1,235,814,400; 6N + 12 L C T at T = 2048."""
    from pathlib import Path
    from megalite.bench import gpu_check
    cfg = validate(resolve(load_config(Path(__file__).parents[1] / "configs" / "llama3-1b.toml"), 8), 8)
    m = cfg.model
    assert (m.n_layer, m.n_embd, m.n_head, m.kv_heads, m.ffn_size, m.vocab_size, m.tie_embeddings) == (
        16, 2048, 32, 8, 8192, 128256, True)
    with torch.device("meta"):
        theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=m.vocab_size, hidden_size=m.n_embd, intermediate_size=m.ffn_size, num_hidden_layers=m.n_layer,
            num_attention_heads=m.n_head, num_key_value_heads=m.kv_heads, tie_word_embeddings=True))
        ours = GPTStage(m, ParallelGrid.single())
    n = sum(p.numel() for _, p in ours.global_parameters())
    assert n == theirs.num_parameters() == gpu_check.n_params(m) == 1_235_814_400
    assert gpu_check.flops_per_token(m, 2048) == 6 * 1_235_814_400 + 12 * 16 * 2048 * 2048 == 8_220_192_768
    tiny_cfg = validate(resolve(load_config(Path(__file__).parents[1] / "configs" / "llama-tiny-cpu.toml"), 8), 8)
    assert (tiny_cfg.model.arch, tiny_cfg.parallel.tp, tiny_cfg.parallel.pp, tiny_cfg.parallel.dp) == ("llama", 2, 2, 2)


@pytest.mark.parametrize("config, family", [("llama3-1b.toml", "Llama"), ("qwen3-0.6b.toml", "Qwen3")])
def test_gpu_check_dry_run_takes_the_family_configs(tmp_path, config, family):
    """`launch/gpu-check.sh --config configs/<it>` as it will run where a GPU is lent (issue 39 names qwen3-0.6b),
    rehearsed on the CPU with the dry run's tiny sizes: the family's model trains, saves, converts and checks."""
    import io
    from contextlib import redirect_stdout
    from pathlib import Path
    from megalite.bench import gpu_check
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = gpu_check.main(["--dry-run", "--window", "0.5", "--dir", str(tmp_path),
                             "--config", str(Path(__file__).parents[1] / "configs" / config)])
    out = buf.getvalue()
    assert rc == 0 and f"\n2. eager: train {family} 2x64 V256 bf16 (1,1,1), " in out and "all checks passed" in out, out


def test_llama_tiny_demo_commands(tmp_path):
    """docs/families.md's three commands as shown (tokenizer train --pre-tokenizer llama3, prepare, torchrun train
    of configs/llama-tiny-cpu.toml at (2,2,2)) on a 60 KB corpus, 2 steps: the tokenizer is Llama 3's split
    and the run trains at its 3D layout."""
    import json
    from pathlib import Path
    config = Path(__file__).parents[1] / "configs" / "llama-tiny-cpu.toml"
    (tmp_path / "corpus.txt").write_text(H.stdlib_text(), encoding="utf-8")
    tok, data = tmp_path / "tok", tmp_path / "tokens.bin"
    assert H.cli_in_process("tokenizer", "train", tmp_path / "corpus.txt", "--pre-tokenizer", "llama3",
                            "--vocab-size", "1024", "--out", tok, "--quiet")[0] == 0
    pre = json.loads((tok / "tokenizer.json").read_text())["pre_tokenizer"]
    assert [p["type"] for p in pre["pretokenizers"]] == ["Split", "ByteLevel"]
    assert H.cli_in_process("prepare", tmp_path / "corpus.txt", "--tokenizer", tok, "--out", data, "--quiet")[0] == 0
    out = tmp_path / "run"
    rows = H.torchrun_train(8, config, out, **{"data.path": data, "train.steps": 2, "train.log_interval": 1,
                                               "train.eval_interval": 2, "checkpoint.dir": ""})
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2 and all(r["loss"] == r["loss"] for r in steps)
