"""Typed configuration: five dataclass sections loaded from TOML, overridable as --section.key=value.

All validation lives in `validate()`; every error is one line that names the field, the value and what
was expected, so a typo on the command line never trains the wrong thing silently.
"""
from __future__ import annotations

import dataclasses
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

from .parallel.grid import Layout, LayoutError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A bad configuration value. The message is one line naming the field."""


@dataclass
class ModelConfig:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 64
    vocab_size: int = 256
    dropout: float = 0.0


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    schedule: str = "1f1b"  # "1f1b" | "afab"
    zero1: bool = False
    bucket_mb: float = 25.0  # size of a data-parallel gradient all-reduce bucket
    timeout_s: float = 1800.0  # how long a collective waits for a silent peer (the process-group timeout)


@dataclass
class TrainConfig:
    steps: int = 100
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
    seed: int = 1234
    log_interval: int = 10
    eval_interval: int = 50
    eval_batches: int = 4
    out_dir: str = "runs/tiny"
    precision: str = "auto"  # "auto" (bf16 autocast on GPU, fp32 on CPU) | "fp32" | "bf16"


@dataclass
class DataConfig:
    path: str = "data/stdlib.bin"
    val_fraction: float = 0.1
    auto_prepare: bool = False  # build `path` from the default corpus (stdlib sources) when it is missing


@dataclass
class CheckpointConfig:
    dir: str = ""  # empty: no checkpoints
    interval: int = 0  # 0: only at the end (and on SIGTERM/SIGINT)
    async_: bool = False  # spelled `async` in TOML and on the command line
    keep_last: int = 0  # 0: keep every checkpoint
    resume: str = ""  # "" (fresh), "auto", or a checkpoint path
    on_error: str = "stop"  # a failed save: "stop" (raise) or "continue" (warn, keep training)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict:
        return {s.name: {_key(f.name): getattr(getattr(self, s.name), f.name)
                         for f in dataclasses.fields(getattr(self, s.name))}
                for s in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> "Config":
        cfg = cls()
        for section, values in d.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{source}: [{section}] must be a table of keys, got {values!r}")
            for key, value in values.items():
                _set(cfg, f"{section}.{key}", value, source)
        return cfg


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
    want = {"int": int, "float": float, "bool": bool, "str": str}[typ]
    if from_text and isinstance(value, str) and want is not str:
        text = value.strip()
        try:
            if want is bool:
                if text.lower() not in ("true", "false", "1", "0", "on", "off", "yes", "no"):
                    raise ValueError
                return text.lower() in ("true", "1", "on", "yes")
            return want(text)
        except ValueError:
            raise ConfigError(f"{source}: {dotted} = {value!r} is not a valid {typ}") from None
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not want:
        raise ConfigError(f"{source}: {dotted} = {value!r} has type {type(value).__name__}, expected {typ}")
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
        if not p.is_file():
            raise ConfigError(f"--config: '{p}' is a folder, expected a TOML file" if p.is_dir()
                              else f"--config: file '{p}' does not exist")
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML ({e})") from None
        cfg = Config.from_dict(raw, source=str(p))
    for item in overrides:
        text = item[2:] if item.startswith("--") else item
        if "=" not in text or "." not in text.split("=", 1)[0]:
            raise ConfigError(f"override '{item}': expected --section.key=value")
        key, value = text.split("=", 1)
        _set(cfg, key, value, "command line", from_text=True)
    return cfg


def validate(cfg: Config, world_size: int | None = None) -> Config:
    """Check every cross-field rule; raise ConfigError with a one-line message on the first failure."""
    m, par, t = cfg.model, cfg.parallel, cfg.train
    positive = [("model.n_layer", m.n_layer), ("model.n_head", m.n_head), ("model.n_embd", m.n_embd),
                ("model.block_size", m.block_size), ("model.vocab_size", m.vocab_size),
                ("parallel.tp", par.tp), ("parallel.pp", par.pp), ("parallel.dp", par.dp),
                ("train.steps", t.steps), ("train.global_batch_size", t.global_batch_size),
                ("train.micro_batch_size", t.micro_batch_size), ("train.log_interval", t.log_interval),
                ("train.eval_interval", t.eval_interval), ("train.eval_batches", t.eval_batches)]
    for name, value in positive:
        if value <= 0:
            raise ConfigError(f"{name} = {value}: must be a positive integer")
    for name, value in [("train.lr", t.lr), ("train.min_lr", t.min_lr), ("train.weight_decay", t.weight_decay),
                        ("train.grad_clip", t.grad_clip), ("train.warmup_steps", t.warmup_steps),
                        ("checkpoint.interval", cfg.checkpoint.interval), ("train.stop_at_step", t.stop_at_step),
                        ("checkpoint.keep_last", cfg.checkpoint.keep_last)]:
        if value < 0:
            raise ConfigError(f"{name} = {value}: must not be negative")
    if not par.timeout_s > 0:
        raise ConfigError(f"parallel.timeout_s = {par.timeout_s}: must be a positive number of seconds")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout = {m.dropout}: expected a value in [0, 1)")
    if not 0.0 < cfg.data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction = {cfg.data.val_fraction}: expected a value in (0, 1)")
    if par.schedule not in ("1f1b", "afab"):
        raise ConfigError(f"parallel.schedule = '{par.schedule}': expected '1f1b' or 'afab'")
    if cfg.checkpoint.on_error not in ("stop", "continue"):
        raise ConfigError(f"checkpoint.on_error = '{cfg.checkpoint.on_error}': expected 'stop' or 'continue'")
    if t.precision not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"train.precision = '{t.precision}': expected 'auto', 'fp32' or 'bf16'")
    if m.n_embd % m.n_head:
        raise ConfigError(f"model.n_embd = {m.n_embd} is not divisible by model.n_head = {m.n_head}")
    try:
        Layout(par.tp, par.pp, par.dp).validate(m, "parallel.")
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    if world_size is not None and world_size != par.tp * par.pp * par.dp:
        raise ConfigError(f"world size {world_size} != parallel.tp*pp*dp = {par.tp}*{par.pp}*{par.dp} "
                          f"= {par.tp * par.pp * par.dp}")
    per_step = t.micro_batch_size * par.dp
    if t.global_batch_size % per_step:
        raise ConfigError(f"train.global_batch_size = {t.global_batch_size} is not divisible by "
                          f"train.micro_batch_size * parallel.dp = {t.micro_batch_size}*{par.dp}")
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr = {t.min_lr} is larger than train.lr = {t.lr}")
    return cfg


def num_microbatches(cfg: Config) -> int:
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * cfg.parallel.dp)
