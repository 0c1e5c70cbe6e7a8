"""What a model's own files say about its prompts and its end, read as transformers reads them:

    end_ids       the ids that end a sample: generation_config.json's eos_token_id (an id or a list of ids),
                  config.json's, the tokenizer's eos_token (tokenizer_config.json, special_tokens_map.json) and
                  `<|endoftext|>` where the vocabulary has it: their union
    chat_prompt   --chat: the model's chat template (chat_template.jinja, else tokenizer_config.json's
                  `chat_template`) rendered with jinja2 as transformers' apply_chat_template renders it (a
                  sandbox, trim_blocks and lstrip_blocks, loop controls, raise_exception, strftime_now, a tojson
                  that keeps non-ASCII, the tokenizer's special tokens as variables), add_generation_prompt=True

The files (name -> bytes) are a transformers folder's (folder_files), or those a megalite checkpoint or model
file carries in its origin (origin_files); one without an origin ends at `<|endoftext|>` and has no chat template.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Optional

from ..base.errors import ConfigError, ConvertError
from ..base.fs import read_all
from ..base.jsonio import loads
from ..base.limits import FILE_BYTES, describe, within
from ..tokenizer import EOT, Tokenizer

GENERATION, CONFIG, TOKENIZER_CONFIG, SPECIAL_MAP = ("generation_config.json", "config.json", "tokenizer_config.json",
                                                     "special_tokens_map.json")
TEMPLATE_FILE = "chat_template.jinja"
FILES = (GENERATION, CONFIG, TOKENIZER_CONFIG, SPECIAL_MAP, TEMPLATE_FILE)
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass
class ModelText:
    """The end ids and the chat template of one model, and where they were read."""
    where: str
    end_ids: list[int] = field(default_factory=list)
    chat_template: Optional[str] = None
    special_tokens: dict = field(default_factory=dict)  # bos_token ... as strings: the template's variables


def read_model_text(where: str, tok: Tokenizer, files: dict) -> ModelText:
    """The end ids and chat template of a model whose files (name -> bytes: FILES, those it has) are `files`;
    without them, only the tokenizer's `<|endoftext|>`."""
    out = ModelText(where)
    json_files = {}
    for name in (GENERATION, CONFIG, TOKENIZER_CONFIG, SPECIAL_MAP):
        if name in files:
            d = loads(files[name], f"{where}/{name}", ConvertError, kind="json")
            json_files[name] = d if isinstance(d, dict) else {}
    for name in (GENERATION, CONFIG):
        if "eos_token_id" in json_files.get(name, {}):
            out.end_ids += _ids(json_files[name]["eos_token_id"], f"{where}/{name}: eos_token_id")
    config = {**json_files.get(SPECIAL_MAP, {}), **json_files.get(TOKENIZER_CONFIG, {})}
    for name in SPECIAL_NAMES:
        text = _token_text(config.get(name))
        if text is not None:
            out.special_tokens[name] = text
    for text in (out.special_tokens.get("eos_token"), EOT):
        i = tok.backend.token_to_id(text) if text is not None and not tok.is_byte else None
        if i is not None:
            out.end_ids.append(i)
    out.end_ids = sorted(set(out.end_ids))
    out.chat_template = _template(files, config)
    return out


def folder_files(path) -> dict:
    """FILES of a transformers folder (name -> bytes, those it has; each within its size budget); {} for
    anything else."""
    p = Path(path)
    out = {}
    for name in FILES if p.is_dir() else ():
        f = p / name
        if f.exists():  # a FIFO there is refused at open (never skipped, never waited on)
            out[name] = read_all(f, FILE_BYTES["json"] + 1, follow=True)
            within(len(out[name]), "json", str(f), ConvertError)
    return out


def origin_files(path, tok: Tokenizer) -> dict:
    """The same FILES for a megalite checkpoint or model file: those its origin carries (base/origin.py: the
    transformers folder it came from, where they belong to `tok`), with config.json's ids as a config.json."""
    from ..convert.sources import open_source
    origin = open_source(path).origin()
    if origin is None:
        return {}
    origin = origin.beside(tok.sha256)
    files = {k: v for k, v in origin.files.items() if k in FILES}
    if origin.ids:
        files[CONFIG] = json.dumps(origin.ids).encode()
    return files


def _ids(v, where: str) -> list[int]:
    """eos_token_id: an id, a list of ids, or null (none)."""
    items = [] if v is None else v if isinstance(v, list) else [v]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise ConvertError(f"{where} = {describe(v)}, expected a token id or a list of token ids")
    return list(items)


def _token_text(v) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: its text, or an AddedToken's dict with 'content'."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _template(files: dict, config: dict) -> Optional[str]:
    """chat_template.jinja (transformers 5's file), else tokenizer_config.json's chat_template: a text, or a
    list of named templates (the one named 'default')."""
    if TEMPLATE_FILE in files:
        return files[TEMPLATE_FILE].decode("utf-8", errors="replace")
    t = config.get("chat_template")
    if isinstance(t, list):
        t = next((d.get("template") for d in t if isinstance(d, dict) and d.get("name") == "default"), None)
    return t if isinstance(t, str) else None


def chat_prompt(text: ModelText, prompt: str, system: Optional[str]) -> str:
    """The prompt as one user turn (after a system turn with `system`), rendered with the model's chat template
    and add_generation_prompt=True: the text whose ids (encoded without the tokenizer's own special tokens, as
    apply_chat_template does) the model continues. No template: one ConfigError."""
    if text.chat_template is None:
        raise ConfigError(f"--chat: {text.where} has no chat template (expected {TEMPLATE_FILE} or "
                          f"'chat_template' in {TOKENIZER_CONFIG}); leave out --chat to continue the prompt as text")
    messages = ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": "user", "content": prompt}]
    import jinja2
    try:
        template = _environment().from_string(text.chat_template)
        return template.render(messages=messages, add_generation_prompt=True, **text.special_tokens)
    except jinja2.TemplateError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"--chat: the chat template of {text.where} failed: {first}") from None


def _environment():
    """jinja2 as transformers' chat templates expect it (utils/chat_template_utils.py): a sandbox, whitespace
    control, loop controls, `{% generation %}` blocks (rendered as their body), three helpers."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # transformers marks the assistant's tokens with it; the text is the body's
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env
