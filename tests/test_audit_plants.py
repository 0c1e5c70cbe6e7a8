"""Round five's planted-bug audit (issue 42; docs/reliability.md has the table): for each realistic mistake in the
newest code that no earlier test caught, one small check against an outside reference (transformers' own rope
functions and config classes, a hand computation). Each was confirmed by planting its mistake and watching it
fail; pure functions and one-process forwards only (a few seconds in all)."""
from __future__ import annotations

import pytest
import torch

from megalite.config import ModelConfig
from megalite.convert.family import FAMILIES
from megalite.model import rope_attention_factor, rope_frequencies

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

# YaRN tables as published models write them: Qwen2.5's (factor, original 32768, nothing else), DeepSeek's
# (mscale and mscale_all_dim: their ratio is the attention factor), an explicit attention_factor, other betas,
# and truncate false (gpt-oss: the band edges are not rounded)
YARN = {"yarn-plain": {},
        "yarn-mscale": {"mscale": 1.0, "mscale_all_dim": 0.707},
        "yarn-attention-factor": {"attention_factor": 1.3},
        "yarn-betas": {"beta_fast": 16.0, "beta_slow": 2.0},
        "yarn-no-truncate": {"truncate": False, "beta_fast": 24.0}}


def _yarn(extra: dict) -> dict:
    return {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, **extra}


@pytest.mark.parametrize("case", list(YARN))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_yarn_frequencies_and_attention_factor_are_transformers(case, head_dim):
    """megalite's yarn inverse frequencies and cos/sin scale = transformers' _compute_yarn_parameters, for every
    optional key of the table. Planted: the mscale ratio inverted, a given attention_factor ignored, truncate
    read as false by default, beta_fast and beta_slow swapped: each fails here."""
    rs = _yarn(YARN[case])
    m = ModelConfig(arch="llama", n_head=4, n_embd=4 * head_dim, block_size=16384, rope_theta=1e6, rope_scaling=rs)
    cfg = transformers.LlamaConfig(hidden_size=m.n_embd, num_attention_heads=4, max_position_embeddings=16384,
                                   rope_parameters={**rs, "rope_theta": 1e6})
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    assert torch.allclose(rope_frequencies(m), want, rtol=1e-6, atol=0), case
    assert rope_attention_factor(m) == pytest.approx(factor, rel=1e-12), case


@pytest.mark.parametrize("family,cls", [("llama", "LlamaConfig"), ("qwen2", "Qwen2Config")])
def test_rope_parameters_as_transformers_5_writes_them_are_read_and_written_whole(family, cls):
    """A config.json as transformers 5 writes it (rope_theta inside rope_parameters, every yarn key there) is
    read into the same frequencies and attention factor transformers computes, and megalite's exported
    config.json gives transformers those again. Planted: rope_parameters' rope_theta ignored (10000 used), the
    yarn optional keys dropped on import, and dropped on export: each fails here."""
    rs = _yarn({"mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16.0})
    theirs = getattr(transformers, cls)(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                                        rope_theta=5e5,
                                        rope_scaling=dict(rs))
    hf = theirs.to_dict()
    assert "rope_theta" in hf["rope_parameters"] and "rope_theta" not in hf  # 5.x's layout: the case under test
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](theirs, "cpu")
    fam = FAMILIES[family]
    m = fam.model_from_hf(hf, "config.json")
    ours = ModelConfig(**m)
    assert torch.allclose(rope_frequencies(ours), want, rtol=1e-6, atol=0)
    assert rope_attention_factor(ours) == pytest.approx(factor, rel=1e-12)
    back = getattr(transformers, cls)(**fam.hf_config(m))  # the export's config.json, read by transformers
    again, factor_again = ROPE_INIT_FUNCTIONS["yarn"](back, "cpu")
    assert torch.allclose(again, want, rtol=1e-6, atol=0) and factor_again == pytest.approx(factor, rel=1e-12)


def test_top_p_below_any_token_keeps_the_likeliest_even_when_the_float_sum_falls_short_of_one():
    """top_p smaller than every probability keeps exactly the likeliest token (transformers' TopPLogitsWarper,
    min_tokens_to_keep = 1), also for logits whose float32 softmax sums to just under 1 (seeds 5 and 7: the
    last cumulative sum 0.99999994 <= 1 - 1e-9). Planted: the likeliest not protected -> every token dropped,
    a NaN draw."""
    from transformers.generation.logits_process import TopPLogitsWarper
    from megalite.generate.sampling import filter_logits
    short = 0
    for seed in range(8):
        logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(seed)) * 3
        short += logits.sort(-1).values.softmax(-1).cumsum(-1)[0, -1].item() <= 1 - 1e-9
        kept = torch.isfinite(filter_logits(logits, 1.0, top_p=1e-9))
        want = torch.isfinite(TopPLogitsWarper(1e-9)(None, logits.clone()))
        assert kept.sum() == 1 and kept[0, logits.argmax()] and torch.equal(kept, want), seed
    assert short  # the case under test happens


@pytest.mark.parametrize("cp", [2, 3])
def test_the_rings_blocks_and_masks_add_up_to_the_sliding_window_at_every_width(cp):
    """The blocks ring attention computes (context._blocks: which (q chunk, kv chunk) pairs it visits) and the
    mask of each (_Blocks.scores) put together over every rank and hop give exactly transformers' sliding-window
    mask (key j seen by query i iff i - window < j <= i), for chunk sizes 1-3 and every window from 1 to past the
    sequence: the block edges where a window of k chunks starts or ends. Planted: a block skipped whose nearest
    pair is inside the window, the partial-block mask or its `>=` test off by one: each fails here (cp = 1, the
    one block of the single-process tests, never reaches them)."""
    from megalite.parallel.context import _blocks, _Blocks, chunk_ids
    from megalite.parallel.grid import Axis
    for c in (1, 2, 3):
        T = 2 * cp * c
        i = torch.arange(T)
        for window in range(1, T + 2):
            seen = torch.zeros(T, T, dtype=torch.bool)
            for r in range(cp):
                blk = _Blocks(torch.zeros(1, 1, 2 * c, 4), Axis(cp, r), 0.0, 0, 0, window)
                for src in range(cp):
                    for _, _, a, b in _blocks(chunk_ids(r, cp), chunk_ids(src, cp), c, window):
                        s = blk.scores(torch.zeros(1, 1, c, 4), torch.zeros(1, 1, c, 4), a, b)[0, 0]
                        seen[a * c:(a + 1) * c, b * c:(b + 1) * c] = torch.isfinite(s)
            want = (i[None] <= i[:, None]) & (i[None] > i[:, None] - window)
            assert torch.equal(seen, want), (cp, c, window)


# a template whose block tags stand on lines of their own, indented: its text depends on trim_blocks/lstrip_blocks
LAYOUT_TEMPLATE = ("{% for m in messages %}\n    {% if m['role'] == 'user' %}\nU: {{ m['content'] }} {{ eos_token }}\n"
                   "    {% else %}\nS: {{ m['content'] }}\n    {% endif %}\n{% endfor %}\n"
                   "{% if add_generation_prompt %}\nA:\n{% endif %}")


def test_chat_template_file_wins_and_renders_as_transformers_apply_chat_template(tmp_path):
    """A folder with chat_template.jinja (transformers 5's file) and another chat_template in tokenizer_config.json:
    transformers renders the .jinja one; megalite's --chat prompt is AutoTokenizer.apply_chat_template's text,
    character for character, with and without a system turn. Planted: tokenizer_config.json's template read
    first; trim_blocks/lstrip_blocks off: each fails here."""
    import json
    from tokenizers import Tokenizer, models, pre_tokenizers
    from megalite.generate.prompt import chat_prompt, folder_files, read_model_text
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"] + [chr(i) for i in range(32, 127)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                         chat_template=LAYOUT_TEMPLATE).save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "OTHER {{ messages[0]['content'] }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)

    class Bytes:  # read_model_text asks a byte tokenizer for no end id
        is_byte = True

    text = read_model_text(str(tmp_path), Bytes(), folder_files(tmp_path))
    for system in (None, "Be brief."):
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "hi"}]
        want = theirs.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert want.startswith(("U:", "S:")) and chat_prompt(text, "hi", system) == want, want


def test_a_mixture_sources_epochs_each_visit_every_window_once_in_an_order_of_their_own(tmp_path):
    """Through Source.starts (what the sampler draws): each of three epochs of a source visits every window
    once (sorted starts = 0, seq, 2 seq, ... by hand), and no two epochs share an order; a split holds as many
    windows as fit (by hand, at every seq from 2 to 40). Planted: the epoch left out of the permutation's key
    (every epoch the same order; test_mixture checks permute with a key it builds itself), and the window count
    len // seq (one window past the end where seq divides the length): each fails here."""
    import numpy as np
    import helpers as H
    from megalite.data import mixture as M
    path = H.make_token_file(tmp_path, H.synthetic_text()[:3000])
    src = M.Source(0, str(path), "train", 16, "data.mixture[0]")
    n = src.windows
    assert n > 16
    epochs = [src.starts(np.arange(e * n, (e + 1) * n), 5, M.TRAIN) for e in range(3)]
    assert all(sorted(s.tolist()) == list(range(0, n * 16, 16)) for s in epochs)
    assert len({tuple(s.tolist()) for s in epochs}) == 3
    # every window count by hand: the most windows of seq + 1 tokens, sharing one token at each seam, that fit
    L, divides = len(src.dataset), 0
    for seq in range(2, 41):
        k = M.Source(0, str(path), "train", seq, "data.mixture[0]").windows
        assert k * seq + 1 <= L < (k + 1) * seq + 1, (seq, k, L)
        divides += L % seq == 0
    assert divides  # a length the seq divides: where len // seq would count one window too many


def test_a_batchs_loss_mask_is_the_mask_of_its_targets_not_of_its_inputs(tmp_path):
    """A token file whose mask marks the tokens of a few byte values (mask[t] = f(token t), by hand): every batch
    row's mask is then f of its targets y, whatever window was drawn, from the random sampler, a mixture and the
    fixed validation batches; dp ranks split the global batch's rows and all count the same global total.
    Planted: the inputs' mask (mask_rows[:, :-1], one token early): fails here."""
    import numpy as np
    import helpers as H
    from megalite.data import BatchSampler, TokenDataset, masks, mixture as M
    path = H.make_token_file(tmp_path, H.synthetic_text()[:4000])
    tokens = np.fromfile(path, dtype=TokenDataset(path, "train").tokens.dtype)  # the whole file (train | val)
    chosen = np.array([ord(ch) for ch in "aeiou"])
    masks.attach(path, np.isin(tokens, chosen).astype(np.uint8))

    def check(batch, total):
        x, y = batch
        assert torch.equal(batch.mask, torch.from_numpy(np.isin(y.numpy(), chosen)).float())
        assert not torch.equal(batch.mask, torch.from_numpy(np.isin(x.numpy(), chosen)).float())
        assert batch.counted == total

    for dp in (1, 2):
        rows = [BatchSampler(TokenDataset(path, "train"), 16, 8, r, dp, seed=3).next_batch() for r in range(dp)]
        total = sum(int(b.mask.sum()) for b in rows)
        for b in rows:
            check(b, total)
    sources, w = M.open_sources([{"path": str(path), "weight": 1.0}], "train", 16)
    vs, vw = M.open_sources([{"path": str(path), "weight": 1.0}], "val", 16)
    for b in (M.MixtureSampler(sources, w, 8, 0, 1, seed=3).next_batch(), M.eval_batches(vs, vw, 4, 0, 1, 1, 3)[0]):
        check(b, int(b.mask.sum()))


def test_a_packed_rows_mask_counts_no_target_across_a_document_boundary_by_hand():
    """document_batch on rows written by hand: a target counts iff it is in its input's document and not padding
    (row 0: documents 0 | 1 | padding; row 1: one document). Planted: the boundary target counted (only padding
    left out): fails here; test_documents' sampled rows (seq 16) happened to hold one document each."""
    import numpy as np
    from megalite.data.documents import document_batch
    ids = np.arange(14).reshape(2, 7)
    docs = np.array([[0, 0, 0, 1, 1, -1, -1], [0, 0, 0, 0, 0, 0, 0]])
    b = document_batch(ids, docs, 0, 1, None, "by-hand")
    assert b.mask.tolist() == [[1, 1, 0, 1, 0, 0], [1, 1, 1, 1, 1, 1]] and b.counted == 9
    assert b.docs.tolist() == docs[:, :-1].tolist()
    halves = [document_batch(ids, docs, r, 2, None, "by-hand") for r in range(2)]
    assert [h.mask.tolist() for h in halves] == [[b.mask.tolist()[0]], [b.mask.tolist()[1]]]
    assert all(h.counted == 9 for h in halves)


def test_each_document_ends_with_its_end_of_text_token_by_hand():
    """document_starts on ids written by hand (0 is end-of-text): a document is the tokens after one end-of-text
    up to and including the next. Planted: the end-of-text token starting the next document: fails here."""
    import numpy as np
    from megalite.data.documents import document_starts

    class Ids:  # what document_starts reads of a TokenDataset
        def __init__(self, ids):
            self.tokens, self.meta, self.path = np.array(ids, dtype=np.uint16), {"eot_id": 0}, "by-hand"

        def __len__(self):
            return len(self.tokens)

    assert document_starts(Ids([5, 6, 0, 7, 0, 8, 9])).tolist() == [0, 3, 5, 7]
    assert document_starts(Ids([5, 0])).tolist() == [0, 2] and document_starts(Ids([0, 0, 4])).tolist() == [0, 1, 2, 3]


def test_each_epoch_of_packed_documents_takes_them_in_an_order_of_its_own():
    """DocumentRows (the sampler's rows) over 40 documents written by hand: every epoch holds each document once, and three epochs
    take them in three orders. Planted: the epoch left out of the order's key: fails here."""
    import numpy as np
    from megalite.data.documents import DocumentRows
    rng = np.random.default_rng(0)
    ids = np.concatenate([np.append(rng.integers(1, 50, int(n)), 0) for n in rng.integers(2, 9, 40)])

    class Ids:  # what DocumentRows reads of a TokenDataset (0 is end-of-text)
        tokens, meta, path, limit, mask = ids.astype(np.uint16), {"eot_id": 0}, "by-hand", None, None

        def __len__(self):
            return len(self.tokens)

    packed = DocumentRows(Ids(), 16, seed=3)
    orders = [packed._epoch(e)[0].tolist() for e in range(3)]
    assert all(sorted(o) == list(range(40)) for o in orders) and len({tuple(o) for o in orders}) == 3


def _hybrid_grads(rank, world_size, tmp_dir):
    """4 ranks, hybrid ZeRO-2: shard groups {0, 1}, {2, 3}; replicate groups {0, 2}, {1, 3}. Each rank's chunk
    of each gradient must be that chunk of the mean of the 4 ranks' gradients, computed here by hand."""
    import torch.distributed as dist
    from megalite.parallel.grid import Axis
    from megalite.parallel.partition import shard_range
    from megalite.parallel.tensor import ColumnParallelLinear
    from megalite.parallel.zero import ShardedState
    shards = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    shard, replicate = Axis(2, rank % 2, shards[rank // 2]), Axis(2, rank // 2, replicas[rank % 2])
    torch.manual_seed(0)
    layer = ColumnParallelLinear(5, 3, Axis(1, 0))  # the same weights on every rank
    with torch.no_grad():
        layer.weight.normal_(), layer.bias.normal_()
    xs = [torch.randn(2, 5, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
    want = {}
    for r, x in enumerate(xs):  # every rank's gradient, by hand (autograd of the same layer alone)
        for n, g in zip(("weight", "bias"), torch.autograd.grad(layer(x).square().sum(), [layer.weight, layer.bias])):
            want[n] = want.get(n, 0) + g / world_size
    state = ShardedState([("weight", layer.weight), ("bias", layer.bias)], [], layer, Axis(1, 0), shard, 2,
                         replicate=replicate)
    state.zero()
    state.arm(1)
    layer(xs[rank]).square().sum().backward()
    state.finish()
    for n in ("weight", "bias"):
        a, b = shard_range(want[n].numel(), shard.rank, shard.size)
        assert torch.allclose(state.grad(n), want[n].reshape(-1)[a:b], rtol=1e-6, atol=1e-6), (rank, n)


def test_hybrid_zero_2_gives_each_rank_its_chunk_of_the_mean_gradient():
    """Hybrid sharding (parallel.dp_shard = 2 of 4): each rank's gradient chunk = that chunk of the mean over all
    4 ranks' gradients, by hand. Planted: the mean over the shard group only (/2, not /4), the all-reduce across
    shard groups skipped: each fails here. test_zero's runs compare losses and weights after AdamW, which a
    gradient scaled by 2 does not change (AdamW divides it out)."""
    from megalite.testing import run_parallel
    run_parallel(_hybrid_grads, 4)


def test_an_origins_dtype_is_what_the_weights_are_stored_in_not_what_config_json_says(tmp_path):
    """A transformers folder whose weights are bf16 (safetensors' own header says BF16) but whose config.json was
    edited to say float32: its origin's dtype (an export's default) is bfloat16. Planted: config.json's dtype
    taken before the stored one: fails here (test_own_model's folder says bfloat16 in both places)."""
    import json
    from safetensors import safe_open
    from megalite.convert.sources import open_source
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, max_position_embeddings=16)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    config = json.loads((tmp_path / "config.json").read_text())
    config.update({k: "float32" for k in ("dtype", "torch_dtype") if k in config} or {"dtype": "float32"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert open_source(tmp_path).origin().dtype == "bfloat16"


@pytest.mark.parametrize("family,cls", [("qwen2", "Qwen2Config"), ("qwen3", "Qwen3Config")])
def test_a_sliding_window_config_of_qwen_is_refused_key_by_key(family, cls):
    """transformers' own Qwen2/Qwen3 config with use_sliding_window true (its layer_types then 'sliding_attention':
    the forward changes) is refused in one line naming the key, and so is each way of saying it alone: the
    layer_types list, or use_sliding_window true without one (Qwen2Config then derives the sliding layers from
    max_window_layers). use_sliding_window true beside an all-"full_attention" layer_types is transformers' no
    window (tests/test_family_inputs.py compares its logits). Planted: use_sliding_window moved to the harmless
    keys, or layer_types accepting 'sliding_attention': each fails here."""
    from megalite.base.errors import ConvertError
    hf = getattr(transformers, cls)(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                    sliding_window=4, max_window_layers=0).to_dict()
    assert hf["use_sliding_window"] is True and set(hf["layer_types"]) == {"sliding_attention"}
    fam = FAMILIES[family]
    full = {**hf, "use_sliding_window": False, "layer_types": ["full_attention"] * 2}
    no_list = {k: v for k, v in hf.items() if k != "layer_types"}
    for key, config in (("use_sliding_window", no_list), ("layer_types", {**full, "layer_types": hf["layer_types"]}),
                        ("layer_types", hf)):
        with pytest.raises(ConvertError, match=key) as e:
            fam.read_config(config, "config.json")
        assert "\n" not in str(e.value)
    fam.read_config(full, "config.json")
    fam.read_config({**full, "use_sliding_window": True}, "config.json")


def test_a_tokenizer_json_that_is_not_the_canonical_text_travels_byte_for_byte(tmp_path):
    """Origin.of_folder keeps tokenizer.json only where its bytes differ from the canonical text (by hand: the same
    JSON indented otherwise is kept, the canonical bytes are not). Planted: tokenizer.json always dropped: fails."""
    from megalite.base.origin import Origin
    canonical = '{"model": {"type": "BPE"}}'
    for text, kept in ((canonical, False), ('{\n  "model": {"type": "BPE"}\n}', True)):
        (tmp_path / "tokenizer.json").write_text(text)
        files = Origin.of_folder(tmp_path, {}, canonical, "0" * 64).files
        assert ("tokenizer.json" in files) == kept and (not kept or files["tokenizer.json"] == text.encode())


def test_a_qwen3_config_without_head_dim_has_transformers_default_head_width():
    """config.json without head_dim: Qwen3Config's default is 128 (not hidden_size / heads), as transformers reads
    it. Planted: the default lost (64 / 4 = 16 used): fails here."""
    hf = transformers.Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2).to_dict()
    hf.pop("head_dim", None)
    assert transformers.Qwen3Config(**hf).head_dim == 128
    m = FAMILIES["qwen3"].model_from_hf(hf, "config.json")
    assert ModelConfig(**m).head_dim == 128


def test_a_mistral_config_without_sliding_window_has_transformers_default_window():
    """config.json without sliding_window: MistralConfig's default is 4096 (null: no window), as transformers reads
    it. Planted: the default lost (absent read as no window): fails here."""
    hf = transformers.MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2).to_dict()
    hf.pop("sliding_window", None)
    assert transformers.MistralConfig(**hf).sliding_window == 4096
    assert ModelConfig(**FAMILIES["mistral"].model_from_hf(hf, "config.json")).sliding_window == 4096
    assert FAMILIES["mistral"].model_from_hf({**hf, "sliding_window": None}, "config.json")["sliding_window"] == 0


def test_an_only_at_value_of_another_json_type_is_refused():
    """docs/families.md's only-at values are JSON values: `true` is not `pretraining_tp` 1 and `0` is not
    `mlp_bias` false, though Python's True == 1 and 0 == False. Planted: the type check dropped from the
    comparison (True taken as 1): fails here."""
    from megalite.base.errors import ConvertError
    hf = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2).to_dict()
    FAMILIES["llama"].read_config({**hf, "pretraining_tp": 1, "mlp_bias": False}, "config.json")
    for key, value in (("pretraining_tp", True), ("mlp_bias", 0)):
        with pytest.raises(ConvertError, match=key):
            FAMILIES["llama"].read_config({**hf, key: value}, "config.json")


def test_a_qwen2_config_saying_attention_bias_false_is_refused():
    """transformers' Qwen2Attention builds q/k/v with bias whatever config.json says (Qwen2Config has no
    attention_bias key), so `attention_bias: false` contradicts the model it names: refused in one line naming
    the key; true is accepted. Planted: false accepted as well: fails here."""
    from megalite.base.errors import ConvertError
    hf = transformers.Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2).to_dict()
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**hf, "attention_bias": False}))
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    FAMILIES["qwen2"].read_config({**hf, "attention_bias": True}, "config.json")
    with pytest.raises(ConvertError, match="attention_bias") as e:
        FAMILIES["qwen2"].read_config({**hf, "attention_bias": False}, "config.json")
    assert "\n" not in str(e.value)
