"""What a model's source says that its tensors do not, carried whole from an import to an export (issue 38):

    files      the tokenizer's and generation's files of a transformers folder, byte for byte: tokenizer_config.json
               (chat template, added tokens with their flags, special tokens), special_tokens_map.json,
               generation_config.json (bos, a list of eos ids, pad), chat_template.jinja (transformers 5), and
               tokenizer.json itself only where its bytes are not the tokenizer's canonical text (usually they are)
    tokenizer  the sha256 of the canonical tokenizer.json those files belong to (tokenizer.py's identity): an
               export writes them only beside that tokenizer
    dtype      the dtype the source's weights were stored in ("bfloat16", ...): an export's default
    ids        config.json's bos/eos/pad ids as the source gave them (its config.json, else its generation_config)

One Origin travels as one JSON text: `origin.json` in a checkpoint's coordinate-0 folder (beside tokenizer.json),
the safetensors metadata `megalite.origin` of a model file. Torch-free and tokenizer-free: the callers compare
tokenizers (convert/hf.py, run/init_from.py)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from . import limits
from .errors import CheckpointError
from .fs import read_all, write_new
from .jsonio import loads

FORMAT = "megalite-origin/1"
TOKENIZER_JSON = "tokenizer.json"
FILES = (TOKENIZER_JSON, "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
         "chat_template.jinja")
GENERATION = "generation_config.json"
IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
DTYPES = ("float32", "bfloat16", "float16")
_TOP = ("format", "tokenizer", "dtype", "ids", "files")


@dataclass(frozen=True)
class Origin:
    files: dict = field(default_factory=dict)  # name (one of FILES) -> bytes
    tokenizer: Optional[str] = None  # sha256 of the canonical tokenizer.json the files belong to
    dtype: Optional[str] = None  # one of DTYPES
    ids: dict = field(default_factory=dict)  # some of IDS -> an int, a list of ints (eos), or None

    # ------------------------------------------------------------ reading a transformers folder
    @classmethod
    def of_folder(cls, folder: Path, hf_config: dict, canonical: Optional[str], sha256: Optional[str],
                  stored: Optional[str] = None, error: type = CheckpointError) -> "Origin":
        """A transformers folder's origin: its FILES that exist (each within its budget; tokenizer.json kept
        only where it is not `canonical`), the dtype its weights are `stored` in (what it holds, whatever a
        hand-edited config.json says; else config.json's `dtype` or 4.x's `torch_dtype`) and ids (config.json's,
        else generation_config.json's)."""
        files = {}
        for name in FILES:
            p, kind = Path(folder) / name, "tokenizer" if name == TOKENIZER_JSON else "json"
            if p.exists():  # a FIFO there is refused at open (never skipped, never waited on)
                files[name] = read_all(p, limits.FILE_BYTES[kind] + 1, follow=True)
                limits.within(len(files[name]), kind, str(p), error)
        if canonical is not None and files.get(TOKENIZER_JSON) == canonical.encode("utf-8"):
            del files[TOKENIZER_JSON]  # the canonical text: the tokenizer the run carries writes it again
        dtype = next((d for d in (stored, hf_config.get("dtype"), hf_config.get("torch_dtype")) if d in DTYPES), None)
        gen = _json_or_empty(files.get(GENERATION))
        ids = {k: hf_config[k] if k in hf_config else gen[k] for k in IDS if k in hf_config or k in gen}
        return cls(files, sha256, dtype, _checked_ids(ids, str(folder), error))

    # ------------------------------------------------------------ the one JSON text
    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "tokenizer": self.tokenizer, "dtype": self.dtype, "ids": self.ids,
                           "files": {k: v.decode("utf-8", errors="surrogateescape") for k, v in self.files.items()}},
                          sort_keys=True)

    @classmethod
    def from_json(cls, text, where: str, error: type = CheckpointError) -> "Origin":
        """Parsed and checked: every field named in one line on a problem."""
        d = loads(text, where, error, kind="tokenizer")  # tokenizer.json may be inside
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise error(f"{where}: not a megalite origin (expected a JSON object with \"format\": \"{FORMAT}\")")
        extra = sorted(set(d) - set(_TOP))
        if extra:
            raise error(f"{where}: unknown field '{extra[0]}' (expected {', '.join(_TOP)})")
        files = d.get("files")
        if not isinstance(files, dict) or any(k not in FILES or not isinstance(v, str) for k, v in files.items()):
            raise error(f"{where}: field 'files' = {limits.describe(files)}, expected an object of file name -> "
                        f"text, names among {', '.join(FILES)}")
        sha, dtype = d.get("tokenizer"), d.get("dtype")
        if sha is not None and not (isinstance(sha, str) and len(sha) == 64):
            raise error(f"{where}: field 'tokenizer' = {limits.describe(sha)}, expected a sha256 (64 hex digits) "
                        f"or null")
        if dtype is not None and dtype not in DTYPES:
            raise error(f"{where}: field 'dtype' = {limits.describe(dtype)}, expected one of {', '.join(DTYPES)} "
                        f"or null")
        ids = d.get("ids")
        if not isinstance(ids, dict) or set(ids) - set(IDS):
            raise error(f"{where}: field 'ids' = {limits.describe(ids)}, expected an object with keys among "
                        f"{', '.join(IDS)}")
        return cls({k: v.encode("utf-8", errors="surrogateescape") for k, v in files.items()}, sha, dtype,
                   _checked_ids(ids, where, error))

    # ------------------------------------------------------------ writing a transformers folder
    def beside(self, sha256: Optional[str]) -> "Origin":
        """What of it an export writes beside the tokenizer of canonical sha256 `sha256`: all of it where its files
        belong to that tokenizer; where the source named no tokenizer, its generation_config.json and ids (the
        only ids there are); beside another tokenizer only its dtype (its ids would name that tokenizer's tokens)."""
        if self.tokenizer is not None and self.tokenizer == sha256:
            return self
        if self.tokenizer is None:
            return Origin({k: v for k, v in self.files.items() if k == GENERATION}, None, self.dtype, self.ids)
        return Origin(dtype=self.dtype)

    def write(self, folder: Path, files: dict) -> list[Path]:
        """`files` (name -> bytes, some of self.files) written into `folder` as they came."""
        out = []
        for name, data in files.items():
            write_new(Path(folder) / name, data)
            out.append(Path(folder) / name)
        return out

    def chat_template(self) -> Optional[str]:
        """The chat template: chat_template.jinja (transformers 5), else tokenizer_config.json's."""
        if "chat_template.jinja" in self.files:
            return self.files["chat_template.jinja"].decode("utf-8", errors="replace")
        t = _json_or_empty(self.files.get("tokenizer_config.json")).get("chat_template")
        return t if isinstance(t, str) else None

    def eos_ids(self) -> list:
        """Every end-of-sequence id the source names (generation_config.json's list, else config.json's)."""
        gen = _json_or_empty(self.files.get(GENERATION))
        eos = gen.get("eos_token_id", self.ids.get("eos_token_id"))
        eos = eos if isinstance(eos, list) else [eos]
        return [i for i in eos if isinstance(i, int) and not isinstance(i, bool)]


def _json_or_empty(data: Optional[bytes]) -> dict:
    if not data:
        return {}
    try:
        d = json.loads(data)
    except (ValueError, RecursionError):
        return {}
    return d if isinstance(d, dict) else {}


def _checked_ids(ids: dict, where: str, error: type) -> dict:
    """bos/eos/pad: an id, a list of ids (eos), or null."""
    for k, v in ids.items():
        vs = v if isinstance(v, list) and k == "eos_token_id" else [v]
        for i in vs:
            if i is not None:
                limits.number(i, f"{where}: {k}", error, 0, limits.MAX_COUNT)
    return dict(ids)
