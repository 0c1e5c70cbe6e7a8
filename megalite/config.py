"""Typed configuration: five dataclass sections loaded from TOML, overridable as --section.key=value.

`resolve()` fills in what a config leaves to the run (dp from the world size, ...); `validate()` then checks
every rule and changes nothing. Every error is one line that names the field, the value and what was
expected, so a typo on the command line never trains the wrong thing silently.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

from .base.errors import ConfigError, LayoutError
from .base.limits import MAX_COUNT, MAX_INT, MAX_SIZE, describe, finite  # noqa: F401 (MAX_COUNT: read elsewhere)
from .base.fs import path_kind, read_all
from . import models
from .attention import check_backend
from .parallel.grid import Layout

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass
class ModelConfig:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 64
    vocab_size: int = 256
    dropout: float = 0.0  # a training setting kept here for the layers: it may change on resume or fine-tuning
    tie_embeddings: bool = True  # the LM head is wte.weight (GPT-2); false: a separate lm_head.weight
    layer_norm_eps: float = 1e-5  # LayerNorm's epsilon (gpt2); RMSNorm's (llama)
    activation: str = "gelu_new"  # GPT-2's MLP: "gelu_new" (tanh approximation) | "gelu" (exact, erf) | "relu"
    # The family (megalite/models/: one spec file each). The keys below apply to the families whose spec takes
    # them; each has a default, so `--model.arch=llama` (or qwen2, qwen3, mistral) trains any config as is.
    arch: str = models.DEFAULT  # a name of models.FAMILIES (megalite/models/: one spec file per family)
    n_kv_head: int = 0  # key/value heads, dividing n_head (GQA; 1: MQA); 0: n_head (MHA)
    intermediate_size: int = 0  # SwiGLU's hidden width; 0: Llama's rule from the width (`ffn_size`)
    rope_theta: float = 10000.0  # rotary base (transformers' LlamaConfig default; Llama 3: 500000; Qwen: 1e6)
    rope_scaling: dict = field(default_factory=dict)  # {}: none; {rope_type = "llama3", factor, low_freq_factor,
    #                                                   high_freq_factor, original_max_position_embeddings} or
    #                                                   {rope_type = "yarn", factor, original_max_position_embeddings,
    #                                                   optional attention_factor, beta_fast, beta_slow, ...}
    head_size: int = 0  # a head's width; 0: n_embd / n_head (transformers' head_dim; Qwen3: 128)
    sliding_window: int = 0  # attention sees at most this many keys back (Mistral); 0: the whole sequence

    @property
    def spec(self):
        return models.spec(self.arch)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_head, or n_head when 0 (and always for GPT-2)."""
        return self.n_kv_head or self.n_head

    @property
    def ffn_size(self) -> int:
        """The MLP's hidden width: intermediate_size, or the family's rule from the width when 0 (GPT-2's 4C;
        Meta's for the SwiGLU families: two thirds of 4C, rounded up to a multiple of 256)."""
        return self.intermediate_size or self.spec.ffn_size({"n_embd": self.n_embd})


ACTIVATIONS = ("gelu_new", "gelu", "relu")
ARCHS = tuple(models.FAMILIES)
ROPE_SCALING = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                "yarn": ("factor", "original_max_position_embeddings")}
ROPE_OPTIONAL = {"llama3": (), "yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                                        "truncate")}
SIZE_FIELDS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")  # positive integers
TRAINING_ONLY = ("dropout",)  # [model] keys that do not define the model: never compared with a checkpoint


def model_architecture(model: dict) -> dict:
    """The [model] keys that define the network (defaults filled in for keys an older checkpoint lacks)."""
    full = {**dataclasses.asdict(ModelConfig()), **model}
    return {k: v for k, v in full.items() if k not in TRAINING_ONLY}


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    dp: int = 0  # 0: inferred as world_size / (tp * cp * pp), as Megatron and torchtitan do
    cp: int = 1  # context parallelism: every sequence split over cp ranks (ring attention)
    schedule: str = "1f1b"  # "1f1b" | "afab"
    zero1: bool = False  # the older spelling of zero = 1 (with another zero level: refused); read `zero_level`
    zero: int = 0  # 0 replicated | 1 AdamW moments | 2 + gradients | 3 + parameters, sharded over dp x cp
    reshard_after_forward: bool = True  # zero 3: free a block's gathered parameters after its forward
    dp_shard: int = 0  # zero 2/3 hybrid sharding: cut within groups of this many dp x cp ranks (0: all of them)
    bucket_mb: float = 25.0  # size of a data-parallel gradient all-reduce bucket
    sp: bool = False  # sequence parallelism: LayerNorm/dropout regions hold seq/tp of the sequence
    vpp: int = 1  # virtual pipeline stages per rank (interleaved 1F1B when > 1)
    overlap_grad_reduce: bool = False  # all-reduce dp gradient buckets during backward, as they fill
    timeout_s: float = 1800.0  # how long a collective waits for a silent peer (the process-group timeout)

    @property
    def layout(self) -> Layout:
        """The grid's sizes (dp as resolved: 0 until `resolve` fills it in). Built here only."""
        return Layout(self.tp, self.pp, self.dp, self.cp)

    @property
    def zero_level(self) -> int:
        """What is cut over dp x cp: parallel.zero, or 1 for the older `zero1 = true` (validate refuses both)."""
        return self.zero or int(self.zero1)


@dataclass
class TrainConfig:
    steps: int = 100
    seq_len: int = 0  # tokens per training sequence, <= model.block_size (the position table); 0: block_size
    stop_at_step: int = 0  # stop early (with a checkpoint) after this step; the schedule still spans `steps`
    global_batch_size: int = 16
    micro_batch_size: int = 4
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    on_nonfinite: str = "stop"  # a NaN/inf loss or gradient norm: "stop" (one-line error) | "skip" the update
    seed: int = 1234
    log_interval: int = 10
    eval_interval: int = 50
    eval_batches: int = 4
    out_dir: str = "runs/tiny"
    precision: str = "auto"  # "auto" (bf16 autocast on GPU, fp32 on CPU) | "fp32" | "bf16"
    recompute: str = "none"  # activation recomputation: "none" | "selective" (attention core) | "full" (blocks)
    # the masked attention core (megalite/attention.py): "auto" (flex on CUDA when a document mask or a sliding
    # window needs one, sdpa otherwise) | "sdpa" (a boolean mask per layer) | "flex" (one BlockMask per micro-batch)
    attn_backend: str = "auto"
    compile: bool = False  # torch.compile each transformer block of this rank's pipeline stage (megalite/run/compile.py)
    fused_adamw: str = "auto"  # torch's fused AdamW kernel: "auto"/"on" (any device that has it: CUDA, CPU) | "off"
    tensorboard: bool = False  # also write TensorBoard event files to <out_dir>/tensorboard (needs `tensorboard`)
    wandb: bool = False  # also log to a Weights & Biases run, files in <out_dir>/wandb (needs `wandb`)
    wandb_project: str = "megalite"
    # A fresh run's weights, [model] section and tokenizer from a model: a transformers folder, a megalite model
    # file, or a checkpoint's weights (not its run state); "" = initialise from train.seed (run/init_from.py)
    init_from: str = ""


DEFAULT_DATA_PATH = "data/stdlib.bin"  # the only path `auto_prepare` may build (from the stdlib sources)


@dataclass
class DataConfig:
    path: str = DEFAULT_DATA_PATH
    val_fraction: float = 0.0  # 0: the split the token file records (prepare's); else its last share of tokens
    auto_prepare: bool = False  # build the default corpus when `path` is the default path and missing
    # several token files drawn at fixed shares (data/mixture.py); [] (the default): `path` alone is the data.
    # In TOML an array of tables: [[data.mixture]] path = "a.bin", weight = 0.7, split = "both"|"train"|"val"
    mixture: list = field(default_factory=list)
    packing: str = "windows"  # "windows" (random windows across documents) | "documents" (rows of whole documents)
    document_mask: bool = False  # packing = "documents": attention and positions kept inside each document
    # named held-out sets, each reported at train.eval_interval: [[data.eval]] name = "code", path = "c.bin"
    eval: list = field(default_factory=list)


OUT_DIR = "{out_dir}"  # in checkpoint.dir: replaced by train.out_dir


@dataclass
class CheckpointConfig:
    dir: str = OUT_DIR + "/checkpoints"  # on by default; "" turns checkpoints off
    interval: int = 500  # also at the end and on SIGTERM/SIGINT; 0: only then
    async_: bool = False  # spelled `async` in TOML and on the command line
    keep_last: int = 0  # 0: keep every checkpoint
    resume: str = "auto"  # "auto" (continue the run in checkpoint.dir, if any), "none" (fresh), or a path
    on_error: str = "stop"  # a failed save: "stop" (raise) or "continue" (warn, keep training)
    signal_grace_s: float = 0.0  # seconds from SIGTERM/SIGINT to SIGKILL; 0: TORCH_ELASTIC_SHUTDOWN_TIMEOUT
    direct_io: str = "auto"  # files written around the page cache (O_DIRECT): "auto" (on GPU hosts), "on", "off"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    named = frozenset()  # the `section.key`s its file and command line set (load_config); not a field

    def to_dict(self) -> dict:
        return {s.name: {_key(f.name): getattr(getattr(self, s.name), f.name)
                         for f in dataclasses.fields(getattr(self, s.name))}
                for s in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: dict, source: str = "config", family_defaults: bool = True) -> "Config":
        cfg = cls()
        for section, values in d.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{source}: [{section}] must be a table of keys, got {values!r}")
            for key, value in values.items():
                _set(cfg, f"{section}.{key}", value, source)
        if family_defaults:
            apply_family_defaults(cfg, given(d))
        return cfg


def given(d: dict) -> set:
    """The `section.key`s a raw table sets."""
    return {f"{sec}.{k}" for sec, values in d.items() if isinstance(values, dict) for k in values}


def apply_family_defaults(cfg: Config, named: set) -> None:
    """The model family's own defaults for the keys the config did not name (Llama's LM head is untied,
    GPT-2's tied), so `--model.arch=llama` on a GPT-2 config is a Llama as transformers makes one."""
    if cfg.model.arch not in models.FAMILIES:
        return  # validate names the field
    for key, value in cfg.model.spec.defaults.items():
        if f"model.{key}" not in named:
            setattr(cfg.model, key, value)


def _key(name: str) -> str:
    return name.rstrip("_")  # `async_` is `async` to the user


def _field(cfg: Config, dotted: str, source: str):
    section, _, key = dotted.partition(".")
    sections = {f.name for f in dataclasses.fields(Config)}
    if section not in sections:
        raise ConfigError(f"{source}: unknown section '{section}' (expected one of {', '.join(sorted(sections))})")
    sec = getattr(cfg, section)
    names = {_key(f.name): f for f in dataclasses.fields(sec)}
    if key not in names:
        raise ConfigError(f"{source}: unknown key '{dotted}' (section [{section}] has {', '.join(sorted(names))})")
    return sec, names[key]


def _coerce(value, typ, dotted: str, source: str, from_text: bool = False):
    """Turn a command-line string into the field's declared type; TOML values must already have it."""
    want = {"int": int, "float": float, "bool": bool, "str": str, "dict": dict, "list": list}[typ]
    if from_text and isinstance(value, str) and want in (dict, list):  # TOML inline; "none" or "" for empty
        text = value.strip()
        if text.lower() in ("", "none", "{}", "[]"):
            return want()
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            example = '{rope_type = "llama3", factor = 32.0}' if want is dict else \
                '[{path = "a.bin", weight = 0.7}, {path = "b.bin", weight = 0.3}]'
            kind = "inline table" if want is dict else "inline array"
            raise ConfigError(f"{source}: {dotted} = {text!r} is not a TOML {kind} (e.g. {example}) "
                              f"or 'none'") from None
    elif from_text and isinstance(value, str) and want is not str:
        text = value.strip()
        try:
            if want is bool:
                if text.lower() not in ("true", "false", "1", "0", "on", "off", "yes", "no"):
                    raise ValueError
                return text.lower() in ("true", "1", "on", "yes")
            return want(text)
        except ValueError:
            raise ConfigError(f"{source}: {dotted} = {value!r} is not a valid {typ}") from None
    if want in (int, float) and type(value) is int and abs(value) > MAX_INT:  # 10**400 is no float, no int64
        raise ConfigError(f"{source}: {dotted} = {describe(value)}, expected {'an int' if want is int else 'a float'} "
                          f"of at most {MAX_INT:.3g} in size")
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not want:
        raise ConfigError(f"{source}: {dotted} = {describe(value)} has type {type(value).__name__}, expected {typ}")
    return value


def _set(cfg: Config, dotted: str, value, source: str, from_text: bool = False) -> None:
    sec, f = _field(cfg, dotted, source)
    typ = f.type if isinstance(f.type, str) else f.type.__name__
    setattr(sec, f.name, _coerce(value, typ, dotted, source, from_text))


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Read a TOML file (or the defaults when path is None), then apply `--section.key=value` overrides."""
    if path is None:
        cfg = Config()
    else:
        p = Path(path)
        if not p.exists() and not p.is_symlink():
            raise ConfigError(f"--config: file '{p}' does not exist")
        if not p.is_file():  # /dev/null, a folder, a FIFO, a broken symlink: say what it is
            raise ConfigError(f"--config: '{p}' is {path_kind(p)}, expected a TOML file")
        try:
            raw = tomllib.loads(read_all(p, follow=True).decode("utf-8"))  # a FIFO refused at open, never waited on
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p}: not valid TOML ({e})") from None
        cfg = Config.from_dict(raw, source=str(p), family_defaults=False)
    named = given(raw) if path is not None else set()
    for item in overrides:
        text = item[2:] if item.startswith("--") else item
        if "=" not in text or "." not in text.split("=", 1)[0]:
            raise ConfigError(f"override '{item}': expected --section.key=value")
        key, value = text.split("=", 1)
        _set(cfg, key, value, "command line", from_text=True)
        named.add(key)
    apply_family_defaults(cfg, named)
    cfg.named = frozenset(named)
    return cfg


def model_from(raw, source: str) -> dict:
    """A [model] table read from outside a run (a model file's metadata, an HF config.json), checked like a
    config: every field present, with its type, finite and in range; one-line ConfigError naming `source`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a table of model fields, got {type(raw).__name__}")
    missing = [k for k in SIZE_FIELDS + ("dropout",) if k not in raw]  # the options have GPT-2's defaults
    if missing:
        raise ConfigError(f"{source}: model field '{missing[0]}' is missing")
    cfg = Config.from_dict({"model": raw}, source)
    m = cfg.model
    for name in SIZE_FIELDS:
        if getattr(m, name) <= 0:
            raise ConfigError(f"{source}: model.{name} = {getattr(m, name)}: must be a positive integer")
    check_numbers(cfg)
    if m.activation not in ACTIVATIONS:
        raise ConfigError(f"{source}: model.activation = '{m.activation}': expected one of {', '.join(ACTIVATIONS)}")
    if not m.layer_norm_eps > 0:
        raise ConfigError(f"{source}: model.layer_norm_eps = {m.layer_norm_eps}: must be positive")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"{source}: model.dropout = {m.dropout}: expected a value in [0, 1)")
    check_family(m, f"{source}: ")
    return dataclasses.asdict(m)


def check_family(m: ModelConfig, where: str = "") -> None:
    """The family and its keys, asked of its spec (megalite/models/): one line naming the field. A key the family
    does not take must stay at its default (a GPT-2 with grouped-query attention, or a Llama with GPT-2's
    activation, is not a model megalite has)."""
    if not isinstance(m.arch, str) or m.arch not in ARCHS:
        raise ConfigError(f"{where}model.arch = {m.arch!r}: expected one of {', '.join(ARCHS)}")
    spec = m.spec
    for name in ("n_kv_head", "intermediate_size", "head_size", "sliding_window"):
        if getattr(m, name) < 0:
            raise ConfigError(f"{where}model.{name} = {getattr(m, name)}: must not be negative (0: the default)")
    # values that mean "not used" for a family without the key (n_kv_head = n_head, GPT-2's own MLP width)
    same = {"n_kv_head": (m.n_head,), "intermediate_size": (spec.ffn_size({"n_embd": m.n_embd}),),
            "head_size": (m.n_embd // m.n_head,)}
    for name, default in models.OPTIONAL_KEYS.items():
        v = getattr(m, name)
        if not spec.takes(name) and v != default and v not in same.get(name, ()):
            takers = [f for f, s in models.FAMILIES.items() if s.takes(name)]
            raise ConfigError(f"{where}model.{name} = {v!r} applies to model.arch = {' | '.join(takers)} only "
                              f"(model.arch is '{m.arch}')")
    if not m.head_size and m.n_embd % m.n_head:
        raise ConfigError(f"{where}model.n_embd = {m.n_embd} is not divisible by model.n_head = {m.n_head}")
    if m.n_head % m.kv_heads:
        raise ConfigError(f"{where}model.n_kv_head = {m.n_kv_head} does not divide model.n_head = {m.n_head} "
                          f"(each key/value head serves n_head / n_kv_head query heads)")
    if spec.features.positions != "rope":
        return
    if m.head_dim % 2:
        raise ConfigError(f"{where}model head width {m.head_dim} (model.head_size, or n_embd / n_head) is odd: "
                          f"rotary positions rotate pairs of a head's dims")
    if not (math.isfinite(m.rope_theta) and m.rope_theta > 1.0):
        raise ConfigError(f"{where}model.rope_theta = {m.rope_theta}: expected a finite number above 1")
    check_rope_scaling(m.rope_scaling, where)


def check_rope_scaling(rs: dict, where: str = "") -> None:
    """{} or transformers' llama3 / yarn rope_scaling with every number it needs (positive, finite; high > low)."""
    if not rs:
        return
    kind = rs.get("rope_type", rs.get("type"))
    if kind not in ROPE_SCALING:
        raise ConfigError(f"{where}model.rope_scaling.rope_type = {kind!r}: megalite models none ({{}}) or "
                          f"{', '.join(repr(k) for k in ROPE_SCALING)}")
    need, optional = ROPE_SCALING[kind], ROPE_OPTIONAL[kind]
    extra = sorted(set(rs) - set(need) - set(optional) - {"rope_type", "type"})
    if extra:
        raise ConfigError(f"{where}model.rope_scaling.{extra[0]}: not a key of rope_type '{kind}' "
                          f"(expected {', '.join(need + optional)})")
    for key in need + optional:
        v = rs.get(key)
        if key not in need and (v is None or key == "truncate"):
            if key == "truncate" and v is not None and not isinstance(v, bool):
                raise ConfigError(f"{where}model.rope_scaling.truncate = {describe(v)}: expected true or false")
            continue
        finite(v, f"{where}model.rope_scaling.{key}", ConfigError, positive=True)
    if kind == "llama3" and not rs["high_freq_factor"] > rs["low_freq_factor"]:
        raise ConfigError(f"{where}model.rope_scaling.high_freq_factor = {rs['high_freq_factor']}: must be larger "
                          f"than low_freq_factor = {rs['low_freq_factor']}")


# The ranges the numbers' consumers can take, checked where a number enters (config, CLI, manifest, state.json).
# MAX_COUNT (steps, seeds, stored counters) and MAX_SIZE (model sizes) are limits.py's, with every other bound.
MAX_TIMEOUT_S = (2**63 - 1) // 10**9  # parallel.timeout_s: gloo and NCCL hold it in int64 nanoseconds
FLOAT32_MAX = 3.4028234663852886e38  # the optimizer's scalars meet float32 tensors (torch.addcdiv's value)
EVAL_STREAMS = 2**31  # eval batch i draws from PCG64([seed, 2**32 - 1 - i]), apart from training's [seed, k]


def check_numbers(cfg: Config) -> None:
    """Every number is finite and in the range its consumer can take, with the field named: a NaN learning rate
    must not train, and a value too large for the C type it ends in must not fail an hour later."""
    for s in dataclasses.fields(cfg):
        sec = getattr(cfg, s.name)
        for f in dataclasses.fields(sec):
            v, name = getattr(sec, f.name), f"{s.name}.{_key(f.name)}"
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{name} = {v}: expected a finite number")
            limit = MAX_SIZE if s.name == "model" else MAX_COUNT
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > limit:
                why = "torch's indexing kernels take sizes below 2**31" if s.name == "model" else \
                    "counters and seeds stay exact in JSON and within int64"
                raise ConfigError(f"{name} = {v}: too large, expected at most {limit} ({why})")
    t, par = cfg.train, cfg.parallel
    for name, value in (("train.beta1", t.beta1), ("train.beta2", t.beta2)):
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{name} = {value}: expected a value in [0, 1)")
    if abs(t.lr) / (1.0 - t.beta1) > FLOAT32_MAX:  # AdamW's first update scales lr by 1 / (1 - beta1)
        raise ConfigError(f"train.lr = {t.lr}: too large for the optimizer's float32 arithmetic (its first update "
                          f"is lr / (1 - train.beta1) = {abs(t.lr) / (1.0 - t.beta1):.3g}, above {FLOAT32_MAX:.3g})")
    if par.timeout_s > MAX_TIMEOUT_S:
        raise ConfigError(f"parallel.timeout_s = {par.timeout_s}: too large, expected at most {MAX_TIMEOUT_S} "
                          f"seconds (gloo and NCCL hold it in int64 nanoseconds)")
    if t.eval_batches > EVAL_STREAMS:
        raise ConfigError(f"train.eval_batches = {t.eval_batches}: too large, expected at most {EVAL_STREAMS} "
                          f"(validation batches draw from streams apart from the training batches')")
    if par.bucket_mb <= 0:
        raise ConfigError(f"parallel.bucket_mb = {par.bucket_mb}: must be positive")
    if t.seed < 0:
        raise ConfigError(f"train.seed = {t.seed}: must not be negative")
    if t.on_nonfinite not in ("stop", "skip"):
        raise ConfigError(f"train.on_nonfinite = '{t.on_nonfinite}': expected 'stop' or 'skip'")
    if t.fused_adamw not in ("auto", "on", "off"):
        raise ConfigError(f"train.fused_adamw = '{t.fused_adamw}': expected 'auto', 'on' or 'off'")
    for name, value in (("data.path", cfg.data.path), ("train.out_dir", t.out_dir)):
        if not value.strip():
            raise ConfigError(f"{name} is empty: expected a path")


def resolve(cfg: Config, world_size: int | None = None) -> Config:
    """Fill in what the config leaves to the run, in place, before `validate` checks it: parallel.dp = 0 from
    the world size (when it divides; else left at 0 for validate to name), checkpoint.resume = "" as "none"
    (its spelling before "auto" became the default), `{out_dir}` in checkpoint.dir. Idempotent; never raises."""
    infer_dp(cfg, world_size)
    if cfg.checkpoint.resume == "":
        cfg.checkpoint.resume = "none"
    cfg.checkpoint.dir = checkpoint_dir(cfg)
    return cfg


def validate(cfg: Config, world_size: int | None = None) -> Config:
    """Check every cross-field rule of a resolved config (`resolve`); raise ConfigError with a one-line message
    on the first failure. Only reads: the config comes back as it went in."""
    check_numbers(cfg)
    m, par, t = cfg.model, cfg.parallel, cfg.train
    if par.dp == 0 and world_size is not None and par.tp > 0 and par.pp > 0 and par.cp > 0 \
            and world_size % (par.tp * par.cp * par.pp):
        what, sizes, prod = _model_axes(par)
        if world_size == 1:  # one process: the user meant a parallel run and forgot the launcher
            raise ConfigError(f"world size 1: parallel.{what} = {sizes} needs {prod} processes (dp = 1); "
                              f"{launch_hint(prod)}")
        raise ConfigError(f"parallel.dp is not set and world size {world_size} is not divisible by "
                          f"parallel.{what} = {sizes}; set {what.replace('*', ', ')} (and dp) so that "
                          f"{what}*dp = {world_size}")
    positive = [("model.n_layer", m.n_layer), ("model.n_head", m.n_head), ("model.n_embd", m.n_embd),
                ("model.block_size", m.block_size), ("model.vocab_size", m.vocab_size),
                ("parallel.tp", par.tp), ("parallel.pp", par.pp), ("parallel.dp", par.dp), ("parallel.cp", par.cp),
                ("train.steps", t.steps), ("train.global_batch_size", t.global_batch_size),
                ("train.micro_batch_size", t.micro_batch_size), ("train.log_interval", t.log_interval),
                ("train.eval_interval", t.eval_interval), ("train.eval_batches", t.eval_batches)]
    for name, value in positive:
        if value <= 0:
            raise ConfigError(f"{name} = {value}: must be a positive integer")
    for name, value in [("train.lr", t.lr), ("train.min_lr", t.min_lr), ("train.weight_decay", t.weight_decay),
                        ("train.grad_clip", t.grad_clip), ("train.warmup_steps", t.warmup_steps),
                        ("checkpoint.interval", cfg.checkpoint.interval), ("train.stop_at_step", t.stop_at_step),
                        ("checkpoint.keep_last", cfg.checkpoint.keep_last),
                        ("checkpoint.signal_grace_s", cfg.checkpoint.signal_grace_s)]:
        if value < 0:
            raise ConfigError(f"{name} = {value}: must not be negative")
    if m.activation not in ACTIVATIONS:
        raise ConfigError(f"model.activation = '{m.activation}': expected one of {', '.join(ACTIVATIONS)}")
    if not m.layer_norm_eps > 0:
        raise ConfigError(f"model.layer_norm_eps = {m.layer_norm_eps}: must be positive")
    if not 0 <= t.seq_len <= m.block_size:
        raise ConfigError(f"train.seq_len = {t.seq_len}: expected 1..model.block_size = {m.block_size} "
                          f"(0 means model.block_size)")
    if not par.timeout_s > 0:
        raise ConfigError(f"parallel.timeout_s = {par.timeout_s}: must be a positive number of seconds")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout = {m.dropout}: expected a value in [0, 1)")
    if not 0.0 <= cfg.data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction = {cfg.data.val_fraction}: expected 0 (the token file's own split) "
                          f"or a value in (0, 1)")
    check_mixture(cfg.data.mixture)
    check_packing(cfg)
    check_backend(t.attn_backend, m.dropout, par.cp)
    check_evals(cfg.data.eval)
    if par.zero not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero = {par.zero}: expected 0, 1, 2 or 3")
    if par.zero1 and par.zero not in (0, 1):
        raise ConfigError(f"parallel.zero1 = true contradicts parallel.zero = {par.zero}: zero1 = true means zero = 1; "
                          f"drop parallel.zero1 to use zero = {par.zero}")
    if par.dp_shard and (par.dp_shard < 2 or par.zero_level < 2 or (par.dp * par.cp) % par.dp_shard):
        raise ConfigError(f"parallel.dp_shard = {par.dp_shard}: expected 0 (cut over all dp x cp ranks) or a divisor "
                          f">= 2 of parallel.dp * parallel.cp = {par.dp * par.cp}, with parallel.zero 2 or 3 "
                          f"(zero = {par.zero_level})")
    if par.schedule not in ("1f1b", "afab"):
        raise ConfigError(f"parallel.schedule = '{par.schedule}': expected '1f1b' or 'afab'")
    if cfg.checkpoint.on_error not in ("stop", "continue"):
        raise ConfigError(f"checkpoint.on_error = '{cfg.checkpoint.on_error}': expected 'stop' or 'continue'")
    if cfg.checkpoint.direct_io not in ("auto", "on", "off"):
        raise ConfigError(f"checkpoint.direct_io = '{cfg.checkpoint.direct_io}': expected 'auto', 'on' or 'off'")
    if t.precision not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"train.precision = '{t.precision}': expected 'auto', 'fp32' or 'bf16'")
    _validate_memory_features(cfg)
    check_family(m)
    try:
        par.layout.validate(m, "parallel.")
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    if world_size is not None and world_size != par.tp * par.cp * par.pp * par.dp:
        what, sizes, prod = _model_axes(par)
        raise ConfigError(f"world size {world_size} != parallel.{what}*dp = {sizes}*{par.dp} = {prod * par.dp}; "
                          f"{launch_hint(prod * par.dp)}")
    per_step = t.micro_batch_size * par.dp
    if t.global_batch_size % per_step:
        raise ConfigError(f"train.global_batch_size = {t.global_batch_size} is not divisible by "
                          f"train.micro_batch_size * parallel.dp = {t.micro_batch_size}*{par.dp}")
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr = {t.min_lr} is larger than train.lr = {t.lr}")
    if t.init_from and cfg.checkpoint.resume not in ("auto", "none", ""):
        raise ConfigError(f"train.init_from = '{t.init_from}' and checkpoint.resume = '{cfg.checkpoint.resume}': "
                          f"choose one (init_from starts a fresh run from a model's weights; resume continues a run)")
    return cfg


MIXTURE_SPLITS = ("both", "train", "val")  # which of a source's splits feed the training / validation blend


def _file_table(e, where: str, keys: tuple, what: str, example: str) -> None:
    """One entry of an array of tables that names a token file: a table, of `keys` only, with a `path`."""
    if not isinstance(e, dict):
        raise ConfigError(f"{where} = {e!r}: expected a table {example}")
    extra = sorted(set(e) - set(keys))
    if extra:
        raise ConfigError(f"{where}.{extra[0]}: unknown key ({what} has {', '.join(keys[:-1])} and {keys[-1]})")
    if not isinstance(e.get("path"), str) or not e["path"].strip():
        raise ConfigError(f"{where}.path = {e.get('path')!r}: expected the path of a token file")


def check_mixture(entries: list) -> None:
    """data.mixture: tables of `path` (a token file), `weight` (a finite number >= 0) and optionally `split`;
    the training weights (split both or train) and the validation weights (both or val) each sum above 0."""
    for i, e in enumerate(entries):
        where = f"data.mixture[{i}]"
        _file_table(e, where, ("path", "weight", "split"), "a source", '{path = "a.bin", weight = 0.5}')
        w = e.get("weight")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ConfigError(f"{where}.weight = {w!r}: expected a finite number >= 0")
        if e.get("split", "both") not in MIXTURE_SPLITS:
            raise ConfigError(f"{where}.split = {e.get('split')!r}: expected one of {', '.join(MIXTURE_SPLITS)}")
    if not entries:
        return
    for split in ("train", "val"):
        if not sum(e["weight"] for e in entries if e.get("split", "both") in ("both", split)) > 0:
            raise ConfigError(f"data.mixture: the weights of the sources that feed {split} (split = 'both' or "
                              f"'{split}') sum to 0, expected a positive total")


PACKINGS = ("windows", "documents")
EVAL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def check_evals(entries: list) -> None:
    """data.eval: tables of `name` (letters, digits, _ . -; unique), `path` (a token file) and optionally `split`
    ("val", the default, or "train": which split of the file is the set)."""
    seen = set()
    for i, e in enumerate(entries):
        where = f"data.eval[{i}]"
        _file_table(e, where, ("name", "path", "split"), "an evaluation set", '{name = "code", path = "c.bin"}')
        name = e.get("name")
        if not isinstance(name, str) or not EVAL_NAME.fullmatch(name) or name in seen:
            raise ConfigError(f"{where}.name = {name!r}: expected a new name of 1-64 letters, digits, _ . or - "
                              f"(it names the set's metrics: eval/NAME/loss)")
        seen.add(name)
        if e.get("split", "val") not in ("val", "train"):
            raise ConfigError(f"{where}.split = {e.get('split')!r}: expected 'val' or 'train'")


def check_packing(cfg: Config) -> None:
    """data.packing and data.document_mask (one line each)."""
    d = cfg.data
    if d.packing not in PACKINGS:
        raise ConfigError(f"data.packing = '{d.packing}': expected one of {', '.join(PACKINGS)}")
    if d.document_mask and d.packing != "documents":
        raise ConfigError("data.document_mask = true needs data.packing = 'documents' (windows cross documents)")


def settings(cfg: Config) -> dict:
    """What every rank of a run must agree on (train's start-up agreement), as text: every field of the
    resolved config, and the paths as this process resolves them (against its own working directory,
    symlinks followed): `train.out_dir (resolved)`, `checkpoint.dir (resolved)`, `data.path (resolved)` and
    `checkpoint.resume (resolved)` when it is a path."""
    out = {f"{sec}.{key}": repr(v) for sec, values in cfg.to_dict().items() for key, v in values.items()}
    paths = [("train.out_dir", cfg.train.out_dir), ("checkpoint.dir", cfg.checkpoint.dir), ("data.path", cfg.data.path)]
    if cfg.checkpoint.resume not in ("auto", "none", ""):
        paths.append(("checkpoint.resume", cfg.checkpoint.resume))
    paths += [(f"data.mixture[{i}].path", e["path"]) for i, e in enumerate(cfg.data.mixture)
              if isinstance(e, dict) and isinstance(e.get("path"), str)]
    if cfg.train.init_from:
        paths.append(("train.init_from", cfg.train.init_from))
    for name, value in paths:
        if value:
            out[f"{name} (resolved)"] = os.path.realpath(value)
    return out


def _model_axes(par: ParallelConfig) -> tuple[str, str, int]:
    """("tp*pp", "2*2", 4), or with cp > 1 ("tp*cp*pp", "2*2*2", 8): the axes a world is divided by before dp,
    for error messages (cp named only when it is used, so cp = 1 runs read as they always did)."""
    axes = [("tp", par.tp)] + ([("cp", par.cp)] if par.cp != 1 else []) + [("pp", par.pp)]
    return "*".join(a for a, _ in axes), "*".join(str(v) for _, v in axes), math.prod(v for _, v in axes)


def seq_len(cfg: Config) -> int:
    """Tokens per training sequence: train.seq_len, or the whole position table when it is 0."""
    return cfg.train.seq_len or cfg.model.block_size


def _validate_memory_features(cfg: Config) -> None:
    """Sequence parallelism, virtual pipeline stages and activation recomputation (issue 13's knobs)."""
    m, par, t = cfg.model, cfg.parallel, cfg.train
    if t.recompute not in ("none", "selective", "full"):
        raise ConfigError(f"train.recompute = '{t.recompute}': expected 'none', 'selective' or 'full'")
    if par.vpp <= 0:
        raise ConfigError(f"parallel.vpp = {par.vpp}: must be a positive integer")
    if par.vpp > 1:
        if par.pp < 2:
            raise ConfigError(f"parallel.vpp = {par.vpp} needs parallel.pp >= 2 (virtual stages interleave "
                              f"pipeline ranks), got parallel.pp = {par.pp}")
        if par.pp * par.vpp > m.n_layer:
            raise ConfigError(f"parallel.pp * parallel.vpp = {par.pp}*{par.vpp} is larger than model.n_layer = "
                              f"{m.n_layer} (every model chunk needs at least one layer)")
        per_step = t.micro_batch_size * par.dp
        if t.global_batch_size % per_step == 0 and (t.global_batch_size // per_step) % par.pp:
            raise ConfigError(f"parallel.vpp = {par.vpp}: the interleaved schedule needs the micro-batches per "
                              f"step ({t.global_batch_size // per_step}) to be a multiple of parallel.pp = {par.pp}")
    if par.cp > 1 and seq_len(cfg) % (2 * par.cp):
        raise ConfigError(f"parallel.cp = {par.cp}: the sequence length (train.seq_len, 0: model.block_size) = "
                          f"{seq_len(cfg)} is not divisible by 2 * parallel.cp = {2 * par.cp} (each sequence is cut "
                          f"into 2*cp equal chunks, two per cp rank)")
    if par.sp and par.cp > 1 and (seq_len(cfg) // par.cp) % par.tp:
        raise ConfigError(f"parallel.sp with parallel.cp = {par.cp}: a cp rank's {seq_len(cfg) // par.cp} tokens "
                          f"(train.seq_len, 0: model.block_size, / cp) are not divisible by parallel.tp = {par.tp}")
    if par.sp and seq_len(cfg) % par.tp:
        raise ConfigError(f"parallel.sp: the sequence length (train.seq_len, 0: model.block_size) = {seq_len(cfg)} "
                          f"is not divisible by parallel.tp = {par.tp}")


def checkpoint_dir(cfg: Config) -> str:
    """checkpoint.dir with `{out_dir}` replaced by train.out_dir ("" stays "": no checkpoints)."""
    return cfg.checkpoint.dir.replace(OUT_DIR, cfg.train.out_dir.rstrip("/") or ".")


def launch_hint(processes: int) -> str:
    """What to type for a layout of `processes` ranks: torchrun starts them (on one machine; several machines
    split them with --nnodes, docs/training.md)."""
    return (f"launch {processes} processes with `torchrun --nproc-per-node {processes} -m megalite train ...` "
            f"(the same arguments after `train`)")


def infer_dp(cfg: Config, world_size: int | None) -> None:
    """parallel.dp = 0 means "whatever the world leaves": world_size / (tp * cp * pp), or 1 without a world. A
    world that tp * cp * pp does not divide leaves it at 0 (validate says so)."""
    par = cfg.parallel
    if par.dp != 0:
        return
    if world_size is None:
        par.dp = 1
    elif par.tp > 0 and par.pp > 0 and par.cp > 0 and world_size % (par.tp * par.cp * par.pp) == 0:
        par.dp = world_size // (par.tp * par.cp * par.pp)


def num_microbatches(cfg: Config) -> int:
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * cfg.parallel.dp)


# ---------------------------------------------------------------- documentation of every field
# One line per field: `megalite train --help` and `megalite config show` print these next to the type and
# default read from the dataclasses above (a test checks that every field has a line here).
DOCS = {
    "model.n_layer": "transformer blocks",
    "model.n_head": "attention heads (divisible by parallel.tp)",
    "model.n_embd": "model width (divisible by model.n_head)",
    "model.block_size": "context length: the position table and the training window",
    "model.vocab_size": "token ids 0..vocab_size-1 (byte tokens: 256)",
    "model.dropout": "dropout probability in [0, 1); a training setting (may change on resume or fine-tuning)",
    "model.tie_embeddings": "the LM head is wte.weight; false: a separate lm_head.weight (default: gpt2 true, "
                            "llama false)",
    "model.layer_norm_eps": "LayerNorm's epsilon (GPT-2: 1e-5); RMSNorm's for llama",
    "model.activation": "GPT-2's MLP activation: gelu_new (tanh approximation) | gelu (exact) | relu",
    "model.arch": "model family: " + " | ".join(models.FAMILIES) + " (docs/families.md)",
    "model.n_kv_head": "llama: key/value heads, dividing model.n_head (1: MQA); 0 = model.n_head",
    "model.intermediate_size": "llama: SwiGLU hidden width; 0 = two thirds of 4*n_embd rounded up to 256",
    "model.rope_theta": "llama: rotary base (Llama 3: 500000)",
    "model.rope_scaling": "llama: {} or {rope_type = \"llama3\", factor, low_freq_factor, high_freq_factor, "
                          "original_max_position_embeddings} or {rope_type = \"yarn\", factor, "
                          "original_max_position_embeddings, ...}",
    "model.head_size": "rotary families: a head's width; 0 = model.n_embd / model.n_head (Qwen3: 128)",
    "model.sliding_window": "mistral: attention sees at most this many keys back; 0 = the whole sequence",
    "parallel.tp": "tensor-parallel size (splits heads and the MLP across ranks)",
    "parallel.pp": "pipeline-parallel size (splits the blocks into stages)",
    "parallel.dp": "data-parallel replicas; 0 = world_size / (tp * cp * pp)",
    "parallel.cp": "context-parallel size: each sequence cut into 2*cp chunks over cp ranks (ring attention)",
    "parallel.schedule": "pipeline schedule: 1f1b | afab",
    "parallel.zero1": "shard the AdamW moments across dp (x cp) (ZeRO-1); the same as parallel.zero = 1",
    "parallel.zero": "ZeRO level over dp (x cp): 0 none, 1 AdamW moments, 2 + gradients, 3 + parameters",
    "parallel.reshard_after_forward": "zero 3: free each block's gathered parameters after its forward (gathered "
                                      "again for its backward)",
    "parallel.dp_shard": "zero 2/3 hybrid sharding: cut within groups of N dp x cp ranks, all-reduce across groups; "
                         "0 = all",
    "parallel.bucket_mb": "size of one data-parallel gradient all-reduce bucket, MiB",
    "parallel.sp": "sequence parallelism: LayerNorm/dropout regions hold seq/tp of the tokens (needs tp > 1)",
    "parallel.vpp": "virtual pipeline stages per rank (> 1: the interleaved 1F1B schedule)",
    "parallel.overlap_grad_reduce": "all-reduce dp gradient buckets during backward, as soon as each is full",
    "parallel.timeout_s": "seconds a collective waits for a silent peer (a lost host) before the run fails",
    "train.steps": "optimizer steps in the run (the LR schedule spans them)",
    "train.seq_len": "tokens per training window, <= model.block_size (0: model.block_size)",
    "train.stop_at_step": "stop early, with a checkpoint, after this step (0: run to train.steps)",
    "train.global_batch_size": "sequences per optimizer step over all dp replicas",
    "train.micro_batch_size": "sequences per micro-batch per dp replica",
    "train.lr": "peak learning rate (after warm-up)",
    "train.min_lr": "learning rate at the end of the cosine decay",
    "train.warmup_steps": "linear warm-up steps",
    "train.weight_decay": "AdamW decoupled weight decay",
    "train.beta1": "AdamW beta1, in [0, 1)",
    "train.beta2": "AdamW beta2, in [0, 1)",
    "train.grad_clip": "clip the global gradient norm to this (0: no clipping)",
    "train.on_nonfinite": "a NaN/inf loss or grad-norm: stop (one-line error) | skip (drop that update)",
    "train.attn_backend": "masked attention: auto (flex on CUDA for document masks and windows) | sdpa | flex",
    "train.recompute": "activation recomputation: none | selective (attention core) | full (each block)",
    "train.compile": "torch.compile each transformer block (the first step pays the compilation)",
    "train.fused_adamw": "torch's fused AdamW kernel: auto = on (wherever torch has it: CUDA, the CPU) | off",
    "train.tensorboard": "also write TensorBoard event files to <out_dir>/tensorboard (pip install tensorboard)",
    "train.wandb": "also log the same scalars to a Weights & Biases run, its files in <out_dir>/wandb (pip install "
                   "wandb; WANDB_MODE=offline works without a login)",
    "train.wandb_project": "the W&B project of train.wandb's runs",
    "train.init_from": "a fresh run from a model: a transformers folder, a megalite model file or a checkpoint; its "
                       "weights, [model] section and tokenizer (docs/converting.md); '' = from train.seed",
    "train.seed": "seed of the initial weights, the data order and dropout",
    "train.log_interval": "print a log line every N steps",
    "train.eval_interval": "validation loss every N steps (and at the end)",
    "train.eval_batches": "validation batches per evaluation",
    "train.out_dir": "run folder (metrics.jsonl)",
    "train.precision": "auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16",
    "data.path": "token file written by `megalite prepare` (uint16 .bin + .json)",
    "data.val_fraction": "0: the validation split the token file records (prepare's: whole documents drawn "
                         "across the corpus); in (0, 1): that share of its last tokens instead",
    "data.mixture": "several token files at fixed shares: [[data.mixture]] path, weight (>= 0), split (both | "
                    "train | val); [] = data.path alone (docs/training.md#a-mixture-of-token-files)",
    "data.packing": "windows (random windows of the token stream) | documents (rows of whole documents, cut only "
                    "when longer than a row, padded; needs an end-of-text token)",
    "data.document_mask": "packing = documents: attention block-causal inside each document, positions restarting "
                          "at each, the target across a boundary not counted",
    "data.eval": "named held-out sets, loss and bits per byte of each at train.eval_interval (eval/NAME/loss): "
                 "[[data.eval]] name, path, split (val | train)",
    "data.auto_prepare": f"build the default corpus (stdlib sources) when data.path is '{DEFAULT_DATA_PATH}' and missing",
    "checkpoint.dir": "checkpoint root; {out_dir} is train.out_dir; '' turns checkpoints off",
    "checkpoint.interval": "save every N steps, and always at the end and on SIGTERM/SIGINT (0: only then)",
    "checkpoint.async": "write checkpoints in the background while training goes on",
    "checkpoint.keep_last": "keep the newest N checkpoints (0: keep all)",
    "checkpoint.resume": "auto (continue from checkpoint.dir if it has a checkpoint), none (fresh start), or a path",
    "checkpoint.on_error": "a failed save: stop (raise) or continue (warn, keep training)",
    "checkpoint.direct_io": "write checkpoint files with O_DIRECT, around the page cache: auto (on when training on "
                            "GPUs, whose host threads wait), on, off (the files are the same bytes either way)",
    "checkpoint.signal_grace_s": "seconds the launcher waits between SIGTERM/SIGINT and SIGKILL (0: read torchrun's "
                                 "TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s if unset); a warning says when a step + save "
                                 "is longer",
}


def fields() -> list[tuple[str, str, object, str]]:
    """(section.key, type name, default, doc) for every config field, in declaration order."""
    out = []
    defaults = Config()
    for s in dataclasses.fields(Config):
        sec = getattr(defaults, s.name)
        for f in dataclasses.fields(sec):
            typ = f.type if isinstance(f.type, str) else f.type.__name__
            dotted = f"{s.name}.{_key(f.name)}"
            out.append((dotted, typ, getattr(sec, f.name), DOCS.get(dotted, "")))
    return out


def help_text() -> str:
    """Every field as `--section.key=TYPE  doc (default: X)`, grouped by section."""
    rows = [(f"--{dotted}={typ.upper()}", doc, default, dotted.split(".")[0])
            for dotted, typ, default, doc in fields()]
    width = max(len(flag) for flag, *_ in rows)
    lines, section = [], None
    for flag, doc, default, sec in rows:
        if sec != section:
            section = sec
            lines.append(f"[{sec}]")
        lines.append(f"  {flag:<{width}}  {doc} (default: {_toml_value(default)})")
    return "\n".join(lines)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, dict):  # an inline table
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):  # an inline array (of inline tables: data.mixture)
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def model_toml(model: dict) -> str:
    """A [model] section as TOML a user can paste into a config (`inspect` of a model prints it)."""
    full = {**dataclasses.asdict(ModelConfig()), **model}
    return "[model]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in full.items())


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML that `load_config` reads back to the same Config."""
    d = cfg.to_dict()
    out = []
    for section, values in d.items():
        out.append(f"[{section}]")
        for key, value in values.items():
            doc = DOCS.get(f"{section}.{key}", "")
            out.append(f"{key} = {_toml_value(value)}" + (f"  # {doc}" if doc else ""))
        out.append("")
    return "\n".join(out)
