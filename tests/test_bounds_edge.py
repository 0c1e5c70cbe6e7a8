"""Every bound at its edge (issue 42, item 3): each entry of megalite/base/limits.py, and the positive-only and
integer fields read from other trainers' files, at the bound (accepted), one past it (refused in one line), and
0 / negative / NaN / inf / the wrong type where they apply. Pure function calls: no model, no torchrun.

(The jsonl and parquet corpus readers' caps are another helper's: tests/test_corpus.py.)
"""
from __future__ import annotations

import math
import pickle
import sys
from pathlib import Path

import pytest

from megalite.base import jsonio, limits
from megalite.base.errors import ConfigError, ConvertError, DataError
from megalite.config import Config, check_numbers, check_rope_scaling, model_from
from megalite.convert import hints, megatron, megatron_llama
from megalite.tokenizer import check_ids

sys.path.insert(0, str(Path(__file__).parent))
from megatron_ref import megatron_args  # noqa: E402

NAN, INF = float("nan"), float("inf")


class Bound(Exception):
    """The error class the tests pass to limits' helpers."""


def one_line(e) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg, msg
    return msg


# ---------------------------------------------------------------- FILE_BYTES: a file's size, at its budget
@pytest.mark.parametrize("kind", list(limits.FILE_BYTES))
def test_every_file_budget_at_its_edge(kind):
    cap = limits.FILE_BYTES[kind]
    assert limits.within(cap, kind, "f", Bound) == cap
    with pytest.raises(Bound, match=rf"^f: {cap + 1:,} bytes, more than the {cap:,} megalite reads"):
        limits.within(cap + 1, kind, "f", Bound)


def test_a_json_text_at_its_budget_parses_and_one_byte_more_is_refused(monkeypatch):
    monkeypatch.setitem(limits.FILE_BYTES, "json", 64)
    text = '{"a": "' + "x" * (64 - 11) + '"}'
    assert len(text) == 64 - 2
    assert jsonio.loads(text + "  ", "c.json", Bound, kind="json")["a"]  # 64 bytes
    with pytest.raises(Bound, match=r"^c.json: 65 bytes, more than the 64"):
        jsonio.loads(text + "   ", "c.json", Bound, kind="json")


def test_a_config_json_at_the_budget_and_past_it(tmp_path, monkeypatch):
    """`--config` (hints.merge_config) reads at most the budget + 1 bytes, so one byte past is refused by the
    budget's own message, not as a cut-off JSON."""
    monkeypatch.setitem(limits.FILE_BYTES, "json", 64)
    p = tmp_path / "config.json"
    body = '{"model_type": "llama", "hidden_act": "silu"}'
    p.write_text(body + " " * (64 - len(body)))
    hints.merge_config(hints.Hints(), p)
    p.write_text(body + " " * (65 - len(body)))
    with pytest.raises(ConvertError, match=r"65 bytes, more than the 64") as e:
        hints.merge_config(hints.Hints(), p)
    one_line(e)


def _latest(tmp_path, text: str) -> Path:
    root = tmp_path / "mg"
    root.mkdir(exist_ok=True)
    (root / megatron.LATEST).write_text(text)
    return root


@pytest.mark.parametrize("digits,ok", [(1, True), (limits.MAX_ITERATION_DIGITS, True),
                                       (limits.MAX_ITERATION_DIGITS + 1, False)])
def test_megatrons_iteration_number_at_its_digit_bound(tmp_path, digits, ok):
    root = _latest(tmp_path, "9" * digits + "\n")
    with pytest.raises(ConvertError) as e:
        megatron.iteration_folder(root)  # no iteration folder exists: an accepted number names the missing one
    msg = one_line(e)
    if ok:
        assert f"names iteration folder 'iter_{int('9' * digits):07d}', which has no" in msg
    else:
        assert f"expected an iteration number (at most {limits.MAX_ITERATION_DIGITS} digits)" in msg


def test_megatrons_latest_file_at_its_line_budget(tmp_path):
    """latest_checkpointed_iteration.txt of FILE_BYTES['line'] bytes is read; one byte more is refused (before,
    the reader took the first 4096 bytes: '10' followed by 4,095 spaces and '7' read as iteration 10)."""
    cap = limits.FILE_BYTES["line"]
    root = _latest(tmp_path, "10" + " " * (cap - 2))
    with pytest.raises(ConvertError, match="names iteration folder 'iter_0000010'"):
        megatron.iteration_folder(root)
    root = _latest(tmp_path, "10" + " " * (cap - 2) + "7")
    with pytest.raises(ConvertError, match=rf"{cap + 1:,} bytes, more than the {cap:,}") as e:
        megatron.iteration_folder(root)
    one_line(e)


# ---------------------------------------------------------------- numbers: number(), finite()
@pytest.mark.parametrize("v,lo,hi,ok", [
    (0, 0, limits.MAX_INT, True), (limits.MAX_INT, 0, limits.MAX_INT, True),
    (limits.MAX_INT + 1, 0, limits.MAX_INT, False),
    (-1, 0, limits.MAX_INT, False), (1, 1, limits.MAX_SIZE, True), (limits.MAX_SIZE, 1, limits.MAX_SIZE, True),
    (0, 1, limits.MAX_SIZE, False), (limits.MAX_SIZE + 1, 1, limits.MAX_SIZE, False), (True, 0, 5, False),
    (1.0, 0, 5, False), ("1", 0, 5, False), (None, 0, 5, False), (2**4000, 0, limits.MAX_INT, False)])
def test_number_at_its_edges(v, lo, hi, ok):
    if ok:
        assert limits.number(v, "n", Bound, lo, hi) == v
    else:
        with pytest.raises(Bound, match=rf"^n = .*, expected an integer in \[{lo}, {hi}\]$") as e:
            limits.number(v, "n", Bound, lo, hi)
        assert len(one_line(e)) < 120


@pytest.mark.parametrize("v,positive,ok", [
    (0, False, True), (0.0, True, False), (-0.0, True, False), (-1e-300, True, False), (5e-324, True, True),
    (sys.float_info.max, True, True), (NAN, False, False), (INF, False, False), (-INF, False, False),
    (2**1023, True, True), (2**1024 - 2**970, True, False), (2**1024 - 1, True, False), (2**1024, True, False),
    (10**400, False, False), (True, False, False), ("1", False, False), (None, False, False), ([1.0], False, False)],
    ids=limits.describe)
def test_finite_at_its_edges(v, positive, ok):
    """2**1024 - 2**970 is the first integer float() cannot hold (it rounds to 2**1024): before the fix it raised
    OverflowError (a traceback) while its bit length (1024) passed the old check."""
    if ok:
        assert limits.finite(v, "x", Bound, positive) == float(v)
    else:
        with pytest.raises(Bound, match=r"^x = .*, expected a finite( positive)? number$") as e:
            limits.finite(v, "x", Bound, positive)
        one_line(e)


# ---------------------------------------------------------------- MAX_DEPTH: JSON and pickles
def nested(depth: int):
    v = 1
    for _ in range(depth):
        v = {"a": v}
    return v


def test_json_nesting_at_max_depth_and_one_past():
    import json
    assert jsonio.loads(json.dumps(nested(limits.MAX_DEPTH)), "j", Bound) == nested(limits.MAX_DEPTH)
    with pytest.raises(Bound, match=rf"^j: JSON nested more than {limits.MAX_DEPTH} levels deep$"):
        jsonio.loads(json.dumps(nested(limits.MAX_DEPTH + 1)), "j", Bound)


@pytest.mark.parametrize("protocol", [0, 2, 4])
def test_pickle_nesting_at_max_depth_and_one_past(protocol):
    limits.check_pickle(pickle.dumps(nested(limits.MAX_DEPTH), protocol), "p", Bound)
    with pytest.raises(Bound, match=rf"^p nests containers more than {limits.MAX_DEPTH} deep"):
        limits.check_pickle(pickle.dumps(nested(limits.MAX_DEPTH + 1), protocol), "p", Bound)


# ---------------------------------------------------------------- MAX_INT_BYTES: a pickle's integers
BITS = 8 * limits.MAX_INT_BYTES - 1  # two's complement: 16 bytes hold -2**127 .. 2**127 - 1


@pytest.mark.parametrize("protocol", [0, 2, 4])
def test_a_pickled_integer_at_max_int_bytes_and_one_past(protocol):
    for v in (2**BITS - 1, -2**BITS, 0, -1):
        limits.check_pickle(pickle.dumps(v, protocol), "p", Bound)
    for v in (2**BITS, -2**BITS - 1, 10**39, 10**45):
        with pytest.raises(Bound, match=rf"^p holds an integer of .* expected integers of at most "
                                        rf"{limits.MAX_INT_BYTES} bytes$"):
            limits.check_pickle(pickle.dumps(v, protocol), "p", Bound)


# ---------------------------------------------------------------- MAX_COUNT and MAX_SIZE: a config's numbers
@pytest.mark.parametrize("field,limit", [("train.steps", limits.MAX_COUNT), ("train.seed", limits.MAX_COUNT),
                                         ("model.n_layer", limits.MAX_SIZE), ("model.vocab_size", limits.MAX_SIZE)])
def test_config_counts_and_sizes_at_their_bound(field, limit):
    sec, key = field.split(".")
    check_numbers(Config.from_dict({sec: {key: limit}}, "t"))
    with pytest.raises(ConfigError, match=rf"^{field} = {limit + 1}: too large, expected at most {limit} ") as e:
        check_numbers(Config.from_dict({sec: {key: limit + 1}}, "t"))
    one_line(e)


def test_a_samplers_batch_index_at_max_count():
    from megalite.data import BatchSampler
    s = BatchSampler.__new__(BatchSampler)
    s.load_state_dict({"batch_index": limits.MAX_COUNT})
    assert s.batch_index == limits.MAX_COUNT
    with pytest.raises(DataError, match=rf"batch_index' must be an integer in \[0, {limits.MAX_COUNT}\], got "
                                        rf"{limits.MAX_COUNT + 1}"):
        s.load_state_dict({"batch_index": limits.MAX_COUNT + 1})
    with pytest.raises(DataError, match="got -1"):
        s.load_state_dict({"batch_index": -1})


# ---------------------------------------------------------------- HOLES and SLACK: a tokenizer's largest id
def test_a_tokenizers_largest_id_at_its_bound():
    n = 100
    top = limits.HOLES * n + limits.SLACK - 1  # top + 1 == HOLES x (n ids) + SLACK: accepted
    ids = list(range(n - 1)) + [top]
    assert check_ids(ids, "tok") == top
    with pytest.raises(DataError, match=rf"^tok: the largest token id is {top + 1:,}, but the tokenizer lists only "
                                        rf"{n} ids") as e:
        check_ids(list(range(n - 1)) + [top + 1], "tok")
    one_line(e)


# ---------------------------------------------------------------- fields read from Megatron-LM's arguments
def gpt_args(**kw) -> dict:
    return vars(megatron_args(**kw))


def llama_args(**kw) -> dict:
    a = gpt_args(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                 add_qkv_bias=False, ffn_hidden_size=96, rotary_base=10000, norm_epsilon=1e-5)
    a.update(kw)
    return a


POSITIVE = [0, 0.0, -1.0, NAN, INF, -INF, True, "1e-5", None, 10**400]


@pytest.mark.parametrize("field", ["rotary_base", "norm_epsilon", "rope_scaling_factor"])
@pytest.mark.parametrize("bad", POSITIVE, ids=[repr(b)[:12] for b in POSITIVE])
def test_megatron_llamas_positive_fields_refuse_zero_negative_nan_inf(field, bad):
    args = llama_args(**{field: bad}, **({"use_rope_scaling": True} if field == "rope_scaling_factor" else {}))
    if bad is None and field != "rope_scaling_factor":
        args.pop(field)  # absent: megatron-core's default (tests/test_defaults_reached.py), not None
        megatron_llama.llama_from_args(args, "common.pt")
        return
    with pytest.raises((ConvertError, ConfigError), match=rf"{field}") as e:
        megatron_llama.llama_from_args(args, "common.pt")
    one_line(e)


@pytest.mark.parametrize("field,edge", [("rotary_base", 1.0000001), ("norm_epsilon", 5e-324),
                                        ("rope_scaling_factor", 1e-3)])
def test_megatron_llamas_positive_fields_accept_their_smallest(field, edge):
    args = llama_args(**{field: edge}, use_rope_scaling=True)
    m = megatron_llama.llama_from_args(args, "common.pt")
    got = {"rotary_base": m["rope_theta"], "norm_epsilon": m["layer_norm_eps"],
           "rope_scaling_factor": m["rope_scaling"]["factor"]}[field]
    assert got == edge


@pytest.mark.parametrize("theta", [0.5, 1.0])
def test_megatron_rotary_base_of_one_or_less_is_refused_as_a_config_would(theta):
    """theta = 1 makes every frequency 1 (no position information): megalite's config takes theta > 1, and a
    Megatron Llama's model is checked as a config is (before the fix a theta of 1 was converted into a file
    that megalite then refused to open)."""
    with pytest.raises(ConvertError, match=rf"rope_theta = {theta}: expected a finite number above 1") as e:
        megatron.model_from_args(llama_args(rotary_base=theta), "common.pt")
    one_line(e)


@pytest.mark.parametrize("bad", POSITIVE, ids=[repr(b)[:12] for b in POSITIVE])
def test_megatron_gpts_layernorm_epsilon_refuses_zero_negative_nan_inf(bad):
    args = gpt_args(layernorm_epsilon=bad)
    if bad is None:
        args.pop("layernorm_epsilon")
        assert megatron.model_from_args(args, "common.pt")["layer_norm_eps"] == 1e-5  # megatron-core's default
        return
    with pytest.raises(ConvertError, match="layernorm_epsilon") as e:
        megatron.model_from_args(args, "common.pt")
    one_line(e)


SIZES = ["num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings"]


@pytest.mark.parametrize("reader", ["gpt", "llama"])
@pytest.mark.parametrize("field", SIZES)
def test_megatron_size_fields_at_their_bound(reader, field):
    make, read = (gpt_args, megatron.model_from_args) if reader == "gpt" else \
        (llama_args, megatron_llama.llama_from_args)
    for bad in (0, -1, limits.MAX_SIZE + 1, True, 2.0, "2", None):
        with pytest.raises(ConvertError, match=rf"{field} = .*, expected an integer in \[1, {limits.MAX_SIZE}\]") as e:
            read(make(**{field: bad}), "common.pt")
        one_line(e)
    if field == "num_layers":  # the bound itself: accepted (a dict of sizes; nothing is allocated)
        assert read(make(num_layers=limits.MAX_SIZE), "common.pt")["n_layer"] == limits.MAX_SIZE


# ---------------------------------------------------------------- rope scaling: a transformers/torchtitan table
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("key", ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"])
@pytest.mark.parametrize("bad", [0, -1.0, NAN, INF, True, "8", None], ids=repr)
def test_rope_scaling_fields_refuse_zero_negative_nan_inf(key, bad):
    with pytest.raises(ConvertError, match=rf"rope_scaling {key} = ") as e:
        hints.rope_scaling({**LLAMA3, key: bad})
    one_line(e)
    with pytest.raises(ConfigError, match=rf"model.rope_scaling.{key} = ") as e:
        check_rope_scaling({**LLAMA3, key: bad})
    one_line(e)


def test_rope_scaling_high_must_pass_low_at_the_edge():
    check_rope_scaling({**LLAMA3, "low_freq_factor": 1.0, "high_freq_factor": math.nextafter(1.0, 2)})
    with pytest.raises(ConfigError, match="high_freq_factor = 1.0: must be larger than low_freq_factor = 1.0"):
        check_rope_scaling({**LLAMA3, "low_freq_factor": 1.0, "high_freq_factor": 1.0})


def test_rope_scaling_original_context_is_a_whole_number():
    """original_max_position_embeddings is a count of positions (transformers keeps it an int): 8192.0 is 8192;
    0.5 or 8192.5 would be cut to an int silently, so they are refused."""
    assert hints.rope_scaling({**LLAMA3, "original_max_position_embeddings": 8192.0})[
        "original_max_position_embeddings"] == 8192
    for bad in (0.5, 8192.5):
        with pytest.raises(ConvertError, match="original_max_position_embeddings") as e:
            hints.rope_scaling({**LLAMA3, "original_max_position_embeddings": bad})
        one_line(e)


# ---------------------------------------------------------------- a model's own fields at their edge
@pytest.mark.parametrize("field,ok,bad", [
    ("layer_norm_eps", 5e-324, 0.0), ("rope_theta", 1.0000001, 1.0), ("dropout", 0.999, 1.0),
    ("n_kv_head", 0, -1), ("intermediate_size", 0, -1)])
def test_model_fields_at_their_edge(field, ok, bad):
    base = dict(arch="llama", n_layer=1, n_head=4, n_embd=32, block_size=8, vocab_size=16, dropout=0.0)
    assert model_from({**base, field: ok}, "m")[field] == ok
    with pytest.raises(ConfigError, match=rf"model.{field} = ") as e:
        model_from({**base, field: bad}, "m")
    one_line(e)


# ---------------------------------------------------------------- a transformers config.json's numbers
@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    d = tmp_path_factory.mktemp("hf_bounds") / "hf"
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def _with(folder, tmp_path, **fields):
    import json
    import shutil
    d = tmp_path / "hf"
    shutil.copytree(folder, d)
    raw = json.loads((d / "config.json").read_text())
    for k, v in fields.items():
        if k == "rope_theta":
            raw.setdefault("rope_parameters", {})["rope_theta"] = v
        else:
            raw[k] = v
    (d / "config.json").write_text(json.dumps(raw))  # NaN and Infinity as Python's json writes (and reads) them
    return d


TOO_BIG = 10**400  # a JSON integer no float holds: was an OverflowError traceback in models/hf.positive_float
HF_EDGES = [("rms_norm_eps", 5e-324, True), ("rms_norm_eps", 0, False), ("rms_norm_eps", -1e-6, False),
            ("rms_norm_eps", NAN, False), ("rms_norm_eps", INF, False), ("rms_norm_eps", True, False),
            ("rope_theta", 1.0000001, True), ("rope_theta", 1.0, False), ("rope_theta", 0, False),
            ("rope_theta", -1e4, False), ("rope_theta", NAN, False), ("rope_theta", INF, False),
            ("max_position_embeddings", 1, True), ("max_position_embeddings", limits.MAX_SIZE, True),
            ("max_position_embeddings", limits.MAX_SIZE + 1, False),
            ("max_position_embeddings", 0, False), ("max_position_embeddings", -1, False),
            ("max_position_embeddings", 32.0, False),
            ("num_key_value_heads", 0, False), ("num_key_value_heads", -2, False),
            ("num_key_value_heads", 3, False), ("vocab_size", 0, False), ("num_hidden_layers", 0, False),
            ("rms_norm_eps", TOO_BIG, False), ("rope_theta", TOO_BIG, False)]


@pytest.mark.parametrize("field,value,ok", HF_EDGES,
                         ids=[f"{c[0]}={limits.describe(c[1])}" for c in HF_EDGES])
def test_a_transformers_configs_numbers_at_their_edges(hf_folder, tmp_path, field, value, ok):
    from megalite.base.errors import MegaliteError
    from megalite.convert import open_source
    d = _with(hf_folder, tmp_path, **{field: value})
    if ok:
        src = open_source(d)
        key = {"rms_norm_eps": "layer_norm_eps", "rope_theta": "rope_theta", "max_position_embeddings": "block_size",
               "num_key_value_heads": "n_kv_head"}[field]
        assert src.model[key] == value
        return
    with pytest.raises(MegaliteError, match=field.replace("max_position_embeddings", "(max_position_embeddings|"
                                                                                       "block_size)")) as e:
        open_source(d)
    one_line(e)
