"""`megalite prepare --chat`: jsonl conversations rendered with the model's chat template, only the assistant's
turns counted by the loss (a token file plus its loss mask, data/masks.py).

Each line is a JSON object whose `messages` field is a list of {"role", "content"} (transformers' chat format).
transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)` renders and tokenizes it and marks
the tokens the template wraps in `{% generation %} ... {% endgeneration %}`; a template without that marker
cannot say which tokens are the assistant's, so it is refused (rather than counting every token, or none).
Conversations are documents: separated by the end-of-text token (never counted), held out for validation by
the same fixed draw as `prepare`'s documents (data.is_val_document), written [train | val]. The conversations are
held in memory while they are rendered (8 bytes a token: chat corpora are small next to pretraining text).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

from ..base import limits
from ..base.errors import DataError
from ..base.fs import identity as file_identity, open_read, special_entries_refused, write_new
from . import (FORMAT, VERSION, _commit, check_out, expand_sources, is_val_document, meta_path, outputs,
               token_dtype, tokenizer_path)
from .masks import attach

GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def chat_tokenizer(folder):
    """transformers' tokenizer of `folder` with a chat template that marks the assistant's turns, else one line."""
    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file():
        raise DataError(f"prepare --chat: --tokenizer '{folder}' is not a transformers tokenizer folder "
                        f"(tokenizer.json and its chat template)")
    from transformers import AutoTokenizer
    special_entries_refused(folder)  # the library reads the folder's files by name: never a FIFO
    hf = AutoTokenizer.from_pretrained(folder)
    template = hf.chat_template if isinstance(hf.chat_template, str) else json.dumps(hf.chat_template or "")
    if not template:
        raise DataError(f"prepare --chat: the tokenizer in '{folder}' has no chat template")
    if not GENERATION.search(template):
        raise DataError(f"prepare --chat: the chat template of '{folder}' does not mark the assistant's turns "
                        f"({{% generation %}} ... {{% endgeneration %}}), so which tokens count cannot be known; "
                        f"add the markers around the assistant's content (transformers' chat-template guide)")
    return hf


def _conversations(files: list[Path], field: str):
    """(line number, file, messages) of every non-empty line, each checked to be a list of role/content tables."""
    for path in files:
        with open_read(path, follow=True) as f:
            for n, line in enumerate(f, 1):
                if len(line) > limits.FILE_BYTES["json"]:
                    raise DataError(f"prepare --chat: '{path}' line {n} is longer than {limits.FILE_BYTES['json']} bytes")
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError as e:
                    raise DataError(f"prepare --chat: '{path}' line {n} is not JSON ({e})") from None
                msgs = rec.get(field) if isinstance(rec, dict) else None
                if not (isinstance(msgs, list) and msgs and all(
                        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                        for m in msgs)):
                    raise DataError(f"prepare --chat: '{path}' line {n}: field '{field}' must be a list of "
                                    f"{{\"role\": ..., \"content\": ...}} messages")
                yield n, path, msgs


def prepare_chat(sources, out, tokenizer, val_fraction: float = 0.1, log=print, force: bool = False,
                 field: str = "messages") -> dict:
    """Render `sources`' conversations into token file `out` and its loss mask; return the .json's contents."""
    from ..tokenizer import load as load_tokenizer
    out = Path(out)
    check_out(out, force, sidecar=True)
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"prepare: val_fraction must be in [0, 1), got {val_fraction}")
    hf, tok = chat_tokenizer(tokenizer), load_tokenizer(tokenizer)
    if tok.eot_id is None:
        raise DataError(f"prepare --chat: the tokenizer in '{tokenizer}' has no end-of-text token to separate "
                        f"conversations")
    found = {p: file_identity(p) for p in outputs(out, True)}
    parts = {"train": ([], []), "val": ([], [])}
    for doc, (n, path, msgs) in enumerate(_conversations(expand_sources(list(sources)), field)):
        enc = hf.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = np.asarray(enc["input_ids"], dtype=np.int64), np.asarray(enc["assistant_masks"], dtype=np.uint8)
        if any(m["role"] == "assistant" and m["content"] for m in msgs) and not mask.any():
            raise DataError(f"prepare --chat: '{path}' line {n}: the chat template marked none of the assistant's "
                            f"tokens; check its {{% generation %}} markers")
        ids_out, mask_out = parts["val" if val_fraction and is_val_document(doc, val_fraction) else "train"]
        if ids_out:
            ids_out.append(np.array([tok.eot_id]))
            mask_out.append(np.zeros(1, dtype=np.uint8))
        ids_out.append(ids)
        mask_out.append(mask)
    if not parts["train"][0]:
        raise DataError(f"prepare --chat: no conversation for training in {[str(s) for s in sources]}")
    sep = [[np.array([tok.eot_id])], [np.zeros(1, dtype=np.uint8)]] if parts["val"][0] else [[], []]
    ids = np.concatenate(parts["train"][0] + sep[0] + parts["val"][0]).astype(token_dtype(tok.vocab_size))
    mask = np.concatenate(parts["train"][1] + sep[1] + parts["val"][1])
    val_start = int(sum(a.size for a in parts["train"][0]) + len(sep[0])) if parts["val"][0] else \
        ids.size - int(ids.size * val_fraction)
    meta = {"format": FORMAT, "version": VERSION, "tokenizer": tok.kind, "tokenizer_sha256": tok.sha256,
            "vocab_size": tok.vocab_size, "eot_id": tok.eot_id, "max_token": int(ids.max()),
            "dtype": np.dtype(ids.dtype).name, "num_tokens": int(ids.size), "val_start": val_start,
            "val_split": "documents" if parts["val"][0] else "tail", "val_fraction": val_fraction,
            "val_documents": (len(parts["val"][0]) + 1) // 2, "documents": (len(parts["train"][0]) + 1) // 2
            + (len(parts["val"][0]) + 1) // 2, "sources": [str(s) for s in sources],
            "tokenizer_file": tokenizer_path(out).name, "chat_template": "assistant turns counted"}
    run_id = f"{os.getpid()}-{os.urandom(3).hex()}"
    temps = {p: p.with_name(f".{p.name}.tmp-{run_id}") for p in outputs(out, True)}
    try:
        write_new(temps[out], ids.tobytes())
        write_new(temps[tokenizer_path(out)], tok.json.encode("utf-8"))
        write_new(temps[meta_path(out)], (json.dumps(meta, indent=2) + "\n").encode("utf-8"))
        _commit(out, temps, found)
    except BaseException:
        for t in temps.values():
            t.unlink(missing_ok=True)
        raise
    meta = attach(out, mask)
    log(f"prepare --chat: wrote {ids.size:,} tokens of {meta['documents']:,} conversations to {out}, "
        f"{int(mask.sum()):,} of them the assistant's (counted by the loss, {out.stem}.mask.bin)")
    return meta
