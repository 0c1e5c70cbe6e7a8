"""What a training run reads: the training sampler, the validation batches and data.eval's named sets, from
data.path or data.mixture, in windows or whole documents (data/). run/train.py builds its Trainer from these."""
from __future__ import annotations

import functools

from ..base.errors import DataError
from ..config import Config, seq_len
from ..data import (BatchSampler, TokenDataset, check_vocab, documents, eval_batches, eval_tokens_per_byte, mixture,
                    tokens_per_byte)
from ..tokenizer import Tokenizer


def open_data(cfg: Config, dp_rank: int, dp: int) -> tuple:
    """(the training sampler, the validation batches, their tokens per byte, the tokenizer) of data.path alone,
    or of data.mixture's sources (data/mixture.py) when it names any."""
    t, frac = cfg.train, cfg.data.val_fraction or None  # 0: the file's own split; else the last share of its tokens
    if cfg.data.mixture:
        train_src, w = mixture.open_sources(cfg.data.mixture, "train", seq_len(cfg), frac)
        val_src, vw = mixture.open_sources(cfg.data.mixture, "val", seq_len(cfg), frac)
        tok = mixture.one_tokenizer(train_src + val_src, cfg.model.vocab_size)
        pk = cfg.data.packing
        sampler = mixture.MixtureSampler(train_src, w, t.global_batch_size, dp_rank, dp, t.seed, pk)
        val = mixture.eval_batches(val_src, vw, t.global_batch_size, dp_rank, dp, t.eval_batches, t.seed, pk)
        every = mixture.eval_batches(val_src, vw, t.global_batch_size, 0, 1, t.eval_batches, t.seed, pk)
        return sampler, val, tokens_per_byte((y for _, y in every), tok), tok
    train_ds, val_ds = TokenDataset(cfg.data.path, "train", frac), TokenDataset(cfg.data.path, "val", frac)
    check_vocab(train_ds, cfg.model.vocab_size)
    check_vocab(val_ds, cfg.model.vocab_size)
    tok = train_ds.tokenizer()
    if cfg.data.packing == "documents":  # rows of whole documents (data/documents.py)
        sampler = documents.DocumentSampler(train_ds, seq_len(cfg), t.global_batch_size, dp_rank, dp, t.seed)
        val = documents.eval_batches(val_ds, seq_len(cfg), t.global_batch_size, dp_rank, dp, t.eval_batches, t.seed)
        every = documents.eval_batches(val_ds, seq_len(cfg), t.global_batch_size, 0, 1, t.eval_batches, t.seed)
        return sampler, val, tokens_per_byte((y for _, y in every), tok), tok
    sampler = BatchSampler(train_ds, seq_len(cfg), t.global_batch_size, dp_rank, dp, t.seed)
    val = eval_batches(val_ds, seq_len(cfg), t.global_batch_size, dp_rank, dp, t.eval_batches, t.seed)
    return sampler, val, eval_tokens_per_byte(val_ds, seq_len(cfg), t.global_batch_size, t.eval_batches, t.seed,
                                              tok), tok


def open_evals(cfg: Config, dp_rank: int, dp: int, tok: Tokenizer) -> list:
    """data.eval's named sets: (name, fixed batches, tokens per byte) each, drawn as validation is (the same
    packing, seed and batch size); each file made by the training data's tokenizer (one line otherwise)."""
    t, out = cfg.train, []
    for i, e in enumerate(cfg.data.eval):
        ds = TokenDataset(e["path"], e.get("split", "val"), what=f"data.eval[{i}].path")
        theirs = ds.tokenizer()
        if theirs.sha256 != tok.sha256:
            raise DataError(f"data.eval[{i}].path: '{e['path']}' was made by another tokenizer ({theirs.kind}, vocab "
                            f"{theirs.vocab_size}, sha256 {theirs.sha256[:12]}) than the training data ({tok.kind}, "
                            f"vocab {tok.vocab_size}, sha256 {tok.sha256[:12]}); prepare it with the same tokenizer")
        check_vocab(ds, cfg.model.vocab_size)
        draw = documents.eval_batches if cfg.data.packing == "documents" else \
            functools.partial(eval_batches, batch_field=f"data.eval[{i}] (train.global_batch_size)")
        batches = draw(ds, seq_len(cfg), t.global_batch_size, dp_rank, dp, t.eval_batches, t.seed)
        every = draw(ds, seq_len(cfg), t.global_batch_size, 0, 1, t.eval_batches, t.seed)
        out.append((e["name"], batches, tokens_per_byte((y for _, y in every), tok)))
    return out
