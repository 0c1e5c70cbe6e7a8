"""`megalite generate` as a practitioner uses it, against outside references:

- the KV cache: incremental decoding (prefill, then one token at a time, then a chunk) gives the full forward's
  logits at every position (1e-5), for GPT-2 (learned positions) and Llama (rotary, GQA), built at (1,1,1) and
  from model files written by (2,2,1) runs; sampling with and without the cache draws the same ids;
- the sampling filters (temperature, top-k, top-p) against a hand computation and transformers' warpers;
- transformers folders saved by transformers itself (GPT-2 and Llama, a byte-level BPE with added special
  tokens, a chat template and a list of eos ids): greedy ids equal transformers' `generate` (with its cache),
  the sample stops at the list's first id drawn, `--chat` gives `apply_chat_template`'s ids, `--stop` ends the
  text before its string.
"""
from __future__ import annotations

import json

import pytest
import torch

import helpers as H
from megalite.config import ModelConfig
from megalite.generate import generate, load_model, sample_text
from megalite.generate.cache import KVCache
from megalite.generate.sampling import filter_logits
from megalite.model import GPTStage
from megalite.parallel.grid import ParallelGrid

FAMILIES = {"gpt2": {}, "llama": {"arch": "llama", "n_kv_head": 2, "rope_theta": 10000.0}}  # 4 heads, 2 kv
# the other specs' features under the cache: q/k/v biases, per-head q/k norms with a head width of their own,
# a sliding window shorter than the context
MORE = {"qwen2": {"arch": "qwen2", "n_kv_head": 2}, "qwen3": {"arch": "qwen3", "n_kv_head": 1, "head_size": 16},
        "mistral": {"arch": "mistral", "n_kv_head": 2, "sliding_window": 5}}


def tiny(family: str, seed: int = 0) -> GPTStage:
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=24, vocab_size=64, dropout=0.0,
                      **{**FAMILIES, **MORE}[family])
    model = GPTStage(cfg, ParallelGrid.single())
    model.init_weights(seed)
    with torch.no_grad():  # weights of std 0.3: attention that is far from uniform, so positions matter;
        for p in model.parameters():  # norms and biases moved off their ones and zeros
            g = torch.Generator().manual_seed(seed + p.numel())
            p.add_(0.1 * torch.randn(p.shape, generator=g)) if p.dim() == 1 else p.normal_(0, 0.3, generator=g)
    return model.eval()


@torch.no_grad()
def cached_logits(model, ids: torch.Tensor, cuts=(5, 6, 7, 8, 11)) -> torch.Tensor:
    """The logits of every position of ids (B, T), fed through a KV cache in pieces: the prompt up to cuts[0]
    (prefill), single tokens, then a chunk of several (a query block that sees cached keys), then the rest."""
    cache, out, start = KVCache(capacity=4), [], 0  # a small buffer: it grows twice on the way
    for end in (*cuts, ids.shape[1]):
        assert cache.length == start
        out.append(model(ids[:, start:end], cache=cache))
        start = end
    return torch.cat(out, dim=1)  # (B, T, V)


def assert_cache_is_the_full_forward(model, tag: str):
    ids = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.block_size), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
    got = cached_logits(model, ids)
    d = (got - full).abs().max().item()
    print(f"{tag}: cached vs full forward, largest |logit difference| {d:.2e} (logits up to {full.abs().max():.1f})")
    assert d <= 1e-5, (tag, d)
    for kw in ({"temperature": 0}, {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "seed": 3}):
        for prompt, n in ((ids[0, :5].tolist(), 12), (ids[0, :20].tolist(), 10)):  # the second outgrows the block
            with_cache = generate(model, prompt, max_new_tokens=n, warn=lambda m: None, **kw)
            assert with_cache == generate(model, prompt, max_new_tokens=n, warn=lambda m: None, kv_cache=False,
                                          **kw), (tag, kw, len(prompt))


@pytest.mark.parametrize("family", [*FAMILIES, *MORE])
def test_kv_cache_gives_the_full_forwards_logits_at_every_position(family):
    """Planted: rotary at positions 0.. for the cached tokens too (heads' `start` ignored), GPT-2's wpe rows
    from 0, the chunk's mask without its offset (queries at positions 0..T-1): each fails at 1e-5; the window
    applied to the cached keys as if the queries were at 0..T-1 fails Mistral's."""
    assert_cache_is_the_full_forward(tiny(family), f"{family} (1,1,1)")


def _train_221(rank, world_size, rdzv, tokens, out):
    from megalite.run.train import train
    for family in FAMILIES:
        model = {f"model.{k}": v for k, v in FAMILIES[family].items()}
        cfg = H.TINY.config(tokens, f"{out}/run-{family}", **{"parallel.tp": 2, "parallel.pp": 2, "train.steps": 2,
                                                              "checkpoint.dir": f"{out}/ckpt-{family}", **model})
        train(cfg, log=lambda *a: None)


def test_kv_cache_of_model_files_from_221_runs(tmp_path, token_file):
    """GPT-2 and a GQA Llama trained 2 steps at tp=2 pp=2 (one 4-process launch), each converted to one file:
    the cache gives the file's model its full forward's logits."""
    from megalite.convert import convert
    from megalite.testing import run_parallel
    run_parallel(_train_221, 4, tmp_path / "rdzv", args=(token_file, tmp_path))
    for family in FAMILIES:
        f = convert(tmp_path / f"ckpt-{family}", tmp_path / f"{family}.safetensors", quiet=True)
        model = load_model(f)
        assert (model.cfg.arch, model.cfg.n_layer) == (FAMILIES[family].get("arch", "gpt2"), H.TINY_MODEL["n_layer"])
        assert_cache_is_the_full_forward(model, f"{family} from (2,2,1)")


# ---------------------------------------------------------------- sampling filters
def test_sampling_filters_keep_the_tokens_a_hand_computation_keeps():
    """Probabilities 1/32, 1/2, 1/8, 1/4, 3/32 (logits log p). top-p keeps the fewest likeliest whose sum reaches
    p: 0.7 -> ids 1, 3 (0.75); 0.76 -> 1, 3, 2 (0.875); 0.1 -> 1 alone. top-k 3 -> 1, 3, 2. top-k then top-p
    renormalises in between: k 2 leaves 2/3, 1/3, so p 0.6 keeps id 1 alone and p 0.7 both. Temperature 2 takes
    sqrt(p) normalised: 0.0865 0.3460 0.1730 0.2447 0.1498; top-p 0.8 then keeps ids 1, 3, 2, 4 (0.346 + 0.2447
    + 0.173 = 0.764 < 0.8) and drops id 0. transformers' warpers agree on each."""
    p = torch.tensor([[1 / 32, 1 / 2, 1 / 8, 1 / 4, 3 / 32]])
    logits = p.log()

    def kept(**kw):
        out = filter_logits(logits, kw.pop("temperature", 1.0), **kw)
        return sorted(torch.isfinite(out[0]).nonzero().flatten().tolist())

    assert kept(top_p=0.7) == [1, 3] and kept(top_p=0.76) == [1, 2, 3] and kept(top_p=0.1) == [1]
    assert kept(top_p=1.0) == [0, 1, 2, 3, 4] and kept(top_k=3) == [1, 2, 3]
    assert kept(top_k=2, top_p=0.6) == [1] and kept(top_k=2, top_p=0.7) == [1, 3]
    probs = torch.softmax(filter_logits(logits, 2.0, top_k=0, top_p=0.8), -1)[0]
    root = torch.tensor([0.0, 0.5 ** 0.5, 0.125 ** 0.5, 0.5, (3 / 32) ** 0.5])  # id 0 dropped
    assert torch.allclose(probs, root / root.sum(), atol=1e-6), probs
    transformers = pytest.importorskip("transformers")
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    for t, k, tp in ((1.0, 0, 0.7), (2.0, 0, 0.8), (0.5, 3, 0.9), (1.0, 2, 0.6)):
        ref = TemperatureLogitsWarper(t)(None, logits.clone())
        ref = TopKLogitsWarper(k)(None, ref) if k else ref
        ref = TopPLogitsWarper(tp)(None, ref)
        assert torch.allclose(torch.softmax(ref, -1), torch.softmax(filter_logits(logits, t, k, tp), -1), atol=1e-6)


# ---------------------------------------------------------------- transformers folders, saved by transformers
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
            "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
            "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
PROMPT, NEW = "the cat sat", 16


def _tokenizer(chat: bool):
    """A byte-level BPE of 300 ids (the tokenizers library) with three added special tokens, as transformers'
    PreTrainedTokenizerFast (bos <|endoftext|>, eos <|im_end|>; with `chat` a chat template)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([H.synthetic_text(2000)], trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[2],
                                                chat_template=TEMPLATE if chat else None)


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory) -> dict:
    """{family: (folder, its greedy continuation of PROMPT by transformers' full forward, NEW tokens)}: a GPT-2
    (no chat template) and a GQA Llama (a chat template), random weights of std 0.2, saved by transformers. The
    Llama's generation_config.json then lists two eos ids: <|im_end|> and the first new id of the continuation
    from its third on, so that the sample ends there."""
    transformers = pytest.importorskip("transformers")
    out = {}
    for family, config in (("gpt2", transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=64)),
                           ("llama", transformers.LlamaConfig(
                               num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False))):
        tok = _tokenizer(chat=family == "llama")
        config.vocab_size, config.initializer_range, config.bos_token_id, config.eos_token_id = len(tok), 0.2, 0, 2
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        d = tmp_path_factory.mktemp(f"hf-{family}")
        model.save_pretrained(d)
        tok.save_pretrained(d)
        ids = tok(PROMPT)["input_ids"]
        with torch.no_grad():  # greedy by hand: transformers' forward over the whole context, argmax
            for _ in range(NEW):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        cont = ids[-NEW:]
        assert not set(cont) & {0, 1, 2}, cont  # the seed's sample draws no special token
        if family == "llama":
            k = next(i for i in range(2, NEW) if cont[i] not in cont[:i])
            gen = json.loads((d / "generation_config.json").read_text())
            (d / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, cont[k]]}))
        out[family] = (d, cont)
    return out


def _ids(*args) -> list[int]:
    rc, out, err = H.cli_in_process("generate", *args, "--ids", "--temperature", "0")
    assert rc == 0, err
    return [int(i) for i in out.split()]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_greedy_ids_are_transformers_and_stop_at_the_first_eos_of_the_list(hf_folders, family):
    """--temperature 0 on a folder transformers saved: the ids of transformers' greedy forward by hand
    (--ignore-eot, all 16 new); without it the Llama's sample ends at the first id of generation_config.json's
    eos list that it draws, where transformers' `generate` (with its cache) ends too, with the same ids."""
    import transformers
    d, cont = hf_folders[family]
    tok = transformers.AutoTokenizer.from_pretrained(d)
    prompt = tok(PROMPT)["input_ids"]
    assert _ids("--model", d, "--prompt", PROMPT, "--max-new-tokens", NEW, "--ignore-eot") == prompt + cont
    model = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    theirs = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW, use_cache=True)[0].tolist()
    ours = _ids("--model", d, "--prompt", PROMPT, "--max-new-tokens", NEW)
    assert ours == theirs, (ours, theirs)
    if family == "llama":
        eos = json.loads((d / "generation_config.json").read_text())["eos_token_id"]
        assert isinstance(eos, list) and len(ours) < len(prompt) + NEW and ours[-1] == eos[1]


def test_chat_ids_are_apply_chat_templates_and_a_model_without_one_is_refused(hf_folders):
    """--chat (with and without --system) renders the folder's chat_template.jinja: the prompt's ids are
    AutoTokenizer.apply_chat_template's (add_generation_prompt=True); the printed text is the reply alone. The
    GPT-2 folder has no chat template: one line, exit 2."""
    import transformers
    d = hf_folders["llama"][0]
    tok = transformers.AutoTokenizer.from_pretrained(d)
    for system in (None, "Be brief."):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": PROMPT}]
        want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        got = _ids("--model", d, "--prompt", PROMPT, "--chat", *(["--system", system] if system else []),
                   "--max-new-tokens", 2)
        assert got[:len(want)] == want and len(got) == len(want) + 2, (got, want)
    rc, out, err = H.cli_in_process("generate", "--model", d, "--prompt", PROMPT, "--chat", "--max-new-tokens", 3,
                                    "--temperature", "0", "--ignore-eot")
    assert rc == 0 and "<|im_start|>" not in out and PROMPT not in out, out
    rc, out, err = H.cli_in_process("generate", "--model", hf_folders["gpt2"][0], "--prompt", PROMPT, "--chat")
    assert rc == 2 and out == "" and err.count("\n") == 1 and "has no chat template" in err, err


def test_stop_text_ends_the_text_before_it(hf_folders):
    """--stop TEXT: the text ends before TEXT's first appearance in the sample (streamed the same: a tail that
    may begin TEXT is held back); the ids end with the token that completed it; an absent TEXT changes nothing."""
    import transformers
    d, cont = hf_folders["gpt2"]
    tok = transformers.AutoTokenizer.from_pretrained(d)
    gen = tok.decode(cont)
    stop = gen[len(gen) // 2:len(gen) // 2 + 3]  # three characters from the middle of the sample
    j = next(j for j in range(NEW) if stop in tok.decode(cont[:j + 1]))
    base = ["--model", d, "--prompt", PROMPT, "--max-new-tokens", NEW, "--temperature", "0"]
    rc, out, err = H.cli_in_process("generate", *base, "--stop", "\x01never", "--stop", stop)
    assert rc == 0 and out == PROMPT + gen[:gen.find(stop)] + "\n", (out, stop)
    assert sample_text(d, PROMPT, max_new_tokens=NEW, temperature=0, stops=[stop]) == out[:-1]
    prompt = tok(PROMPT)["input_ids"]
    assert _ids(*base[:-2], "--stop", stop) == prompt + cont[:j + 1]
    assert H.cli_in_process("generate", *base, "--stop", "\x01never")[1] == PROMPT + gen + "\n"


def test_bench_generate_prints_its_table(tmp_path, capsys):
    """`megalite bench generate` as docs/performance.md shows it, small (transcripts.SMALL_ARGS: 2 layers, width
    192): every shown line's shape is printed, both sides give the same ids, nothing is left behind."""
    import shlex
    from benchmarks import transcripts
    from megalite.cli import main
    pytest.importorskip("transformers")
    outs = []

    def runner(cmd):
        assert main([*shlex.split(cmd)[1:], "--dir", str(tmp_path)]) == 0
        outs.append(capsys.readouterr().out)
        return outs[-1]

    problems = transcripts.check("bench-generate", runner)
    assert problems == [], f"docs/performance.md shows lines the bench no longer prints: {problems}"
    [out] = outs
    assert "same ids: yes (4 new tokens)" in out and "(median of 2 alternated pairs; range" in out
    assert list(tmp_path.iterdir()) == []


def test_help_names_what_generate_accepts(capsys):
    from megalite.cli import main
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for want in ("a megalite checkpoint (root or step folder), a megalite model file (`megalite convert`), or a "
                 "transformers folder (GPT-2, Llama,", "--top-p TOP_P", "--stop TEXT", "--chat", "--system TEXT"):
        assert want in out, want
    assert "HF GPT-2 folder" not in out


def test_bad_end_ids_and_failing_templates_are_one_line():
    """An eos_token_id that is no id (a text, a negative number, a list holding one) names the file and the field;
    a template that raises (transformers' raise_exception) is one ConfigError naming the model and the message."""
    from megalite.base.errors import ConfigError, ConvertError
    from megalite.generate.prompt import ModelText, chat_prompt, read_model_text
    from megalite.tokenizer import byte_tokenizer
    for bad in ('"two"', "-1", "[2, true]"):
        files = {"generation_config.json": f'{{"eos_token_id": {bad}}}'.encode()}
        with pytest.raises(ConvertError) as e:
            read_model_text("m", byte_tokenizer(), files)
        assert str(e.value).startswith("m/generation_config.json: eos_token_id = ") and "\n" not in str(e.value)
    ok = read_model_text("m", byte_tokenizer(), {"generation_config.json": b'{"eos_token_id": [7, 3]}',
                                                 "config.json": b'{"eos_token_id": 5}'})
    assert ok.end_ids == [3, 5, 7] and ok.chat_template is None
    text = ModelText("m", chat_template="{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system "
                                        "role') }}{% endif %}{{ messages[0]['content'] }}")
    assert chat_prompt(text, "hi", None) == "hi"
    with pytest.raises(ConfigError, match=r"^--chat: the chat template of m failed: no system role$"):
        chat_prompt(text, "hi", "be brief")
