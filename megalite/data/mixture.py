"""A mixture of token files drawn at fixed shares (`[[data.mixture]]`): the blend, each source's windows, the sampler.

The blend is Megatron's (megatron-core's `build_blending_indices`, datasets/helpers.cpp), written again here:
global sample i (i = 0, 1, ...) goes to the source furthest behind its target share,

    s(i) = the first s maximising  w_s * max(i, 1) - c_s(i)     (c_s(i): samples given to s before i)

with the weights normalised to sum 1. It is exact by construction: after n samples no source is more than one
sample from n * w_s (|c_s(n) - n w_s| < 1, tested at every n; tests/test_mixture.py). The rule's whole state
is the counts c_s (each source's cursor) and i = sum(c_s), so a run extends the blend step by step from the
cursors its checkpoint records (`blend`), never building an index of the whole run, and a resumed run draws
exactly what the uninterrupted run drew: O(number of sources) memory, ~1 us per sample in Python (docs/
performance.md has the row against megatron-core's C++ helper).

Source s's j-th sample is one window of seq_len + 1 tokens: its split is cut into n_s = (len - 1) // seq_len
windows that share one token at each seam, and epoch e = j // n_s visits them in the order of a keyed
permutation of [0, n_s) (`permute`: a Feistel network on the next even power of two, cycle-walking back into
range), keyed by (seed, source, epoch, stream): every epoch another order, the same on every machine and
layout, nothing stored. Windows are the same for every dp size (all ranks draw the global batch and keep
their rows), so `batch_hash` is layout-free as for one source. With data.packing = "documents" a sample is
instead a row of whole documents of that source (data/documents.py's DocumentRows: its documents in a keyed
order per epoch, packed): each row comes from one source, the blend's shares are shares of rows, and a
cursor counts rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..base.errors import DataError
from ..config import MAX_COUNT
from . import TokenDataset, check_vocab, rows_to_batch
from .documents import DocumentRows, document_batch
from .keyed import key as _key, permute

TRAIN, VAL = 0, 1  # the permutation streams of training and validation samples


# ---------------------------------------------------------------- the blend (Megatron's rule)
def normalise(weights) -> np.ndarray:
    """The weights as float64 shares summing to 1, as megatron-core's BlendedDataset normalises them."""
    w = np.asarray(weights, dtype=np.float64)
    return w / w.sum()


def blend(weights: np.ndarray, n: int, counts=None) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """The next `n` samples of the blend from the cursors `counts` (None: the start): (the source of each,
    int16; its index within that source, int64; the cursors after them). Bit-for-bit megatron-core's
    build_blending_indices (float64 errors w_s * max(i, 1) - c_s, the first source on a tie), continued."""
    w = [float(x) for x in weights]
    c = [0] * len(w) if counts is None else [int(x) for x in counts]
    src, idx = np.empty(n, dtype=np.int16), np.empty(n, dtype=np.int64)
    sources, i = range(len(w)), sum(c)
    for k in range(n):
        t = float(max(i + k, 1))
        best, top = 0, w[0] * t - c[0]
        for s in sources:
            err = w[s] * t - c[s]
            if err > top:
                best, top = s, err
        src[k], idx[k] = best, c[best]
        c[best] += 1
    return src, idx, c


# ---------------------------------------------------------------- each source's windows
class Source:
    """One split of one mixture entry: its token file and its windows of `seq` + 1 tokens."""

    def __init__(self, index: int, path: str, split: str, seq: int, where: str, val_fraction: float | None = None):
        self.index, self.where = index, where
        self.dataset = TokenDataset(path, split, val_fraction, what=f"{where}.path")
        self.windows = (len(self.dataset) - 1) // seq
        if self.windows < 1:
            raise DataError(f"{where}.path: the {split} split of '{path}' has {len(self.dataset)} tokens, fewer "
                            f"than one window of train.seq_len + 1 = {seq + 1}")
        self.seq, self._packed = seq, {}

    def packed(self, seed: int, stream: int):
        """This source's rows of whole documents (data.packing = "documents"), keyed by its index too."""
        if (seed, stream) not in self._packed:
            self._packed[(seed, stream)] = DocumentRows(self.dataset, self.seq, seed, stream, source=self.index)
        return self._packed[(seed, stream)]

    def samples(self, j: np.ndarray, seed: int, stream: int, packing: str) -> tuple:
        """This source's samples `j` as (token rows, document ids or None, loss-mask rows or None), each
        (len(j), seq + 1): windows, or rows of whole documents."""
        if packing == "documents":
            return self.packed(seed, stream).rows(j)
        at = self.starts(j, seed, stream)[:, None] + np.arange(self.seq + 1)
        return self.dataset.tokens[at], None, None if self.dataset.mask is None else self.dataset.mask[at]

    def starts(self, j: np.ndarray, seed: int, stream: int) -> np.ndarray:
        """The first token of this source's samples `j`: epoch j // windows, in that epoch's permuted order."""
        epoch, at = np.divmod(j, self.windows)
        out = np.empty(j.shape, dtype=np.int64)
        for e in np.unique(epoch):
            mine = epoch == e
            out[mine] = permute(at[mine], self.windows, _key(seed, self.index, int(e), stream)) * self.seq
        return out


def open_sources(entries: list, split: str, seq: int, val_fraction: float | None = None):
    """The sources of `entries` (config.data.mixture) that feed `split` (each its token file's `split`, cut at
    `val_fraction` as data.val_fraction says), with their normalised weights."""
    sources, weights = [], []
    for i, e in enumerate(entries):
        if e.get("split", "both") not in ("both", split) or e["weight"] == 0:
            continue
        src = Source(i, e["path"], split, seq, f"data.mixture[{i}]", val_fraction)
        sources.append(src)
        weights.append(float(e["weight"]))
    return sources, normalise(weights)


def one_tokenizer(sources: list, model_vocab: int):
    """The tokenizer every source was made by (a mixture of ids from two tokenizers means nothing): one line
    naming the first source made by another; then each file checked against the model's vocab."""
    first = sources[0].dataset.tokenizer()
    for src in sources[1:]:
        tok = src.dataset.tokenizer()
        if tok.sha256 != first.sha256:
            raise DataError(f"{src.where}.path: '{src.dataset.path}' was made by another tokenizer ({tok.kind}, vocab "
                            f"{tok.vocab_size}, sha256 {tok.sha256[:12]}) than {sources[0].where} "
                            f"'{sources[0].dataset.path}' ({first.kind}, vocab {first.vocab_size}, sha256 "
                            f"{first.sha256[:12]}); prepare every source with one tokenizer")
    for src in sources:
        check_vocab(src.dataset, model_vocab)
    return first


def _check_ids(source: Source, rows: np.ndarray, limit: int | None) -> None:
    """Every id of a source's rows below the model's vocab size (`limit`; None: not checked), on every rank."""
    if limit is not None and rows.size and int(rows.max()) >= limit:
        raise DataError(f"{source.where}.path: token file '{source.dataset.path}' holds token id {int(rows.max())}, "
                        f"expected ids below model.vocab_size = {limit}; the file is corrupt").everywhere()


def _rows(sources: list, src: np.ndarray, idx: np.ndarray, seed: int, stream: int, limit: int | None,
          packing: str = "windows"):
    """The (n, seq + 1) token rows of the blend's samples (source `src`, index `idx` within it), their document
    ids with packing "documents" (else None), and their loss-mask rows when any source has a mask (a source
    without one counts every target), else None."""
    shape = (src.size, sources[0].seq + 1)
    rows = np.empty(shape, dtype=np.int64)
    docs = np.empty(shape, dtype=np.int64) if packing == "documents" else None
    masked = any(s.dataset.mask is not None for s in sources)
    masks = np.ones(shape, dtype=np.uint8) if masked else None
    for s, source in enumerate(sources):
        mine = np.flatnonzero(src == s)
        if mine.size:
            ids, doc_ids, m = source.samples(idx[mine], seed, stream, packing)
            rows[mine] = ids
            if docs is not None:
                docs[mine] = doc_ids
            if m is not None:
                masks[mine] = m
            _check_ids(source, ids, limit)
    return rows, docs, masks


def _batch(sources, src, idx, seed, stream, packing, dp_rank, dp_size):
    """This rank's Batch of the blend's samples (src, idx): windows, or rows of whole documents."""
    rows, docs, masks = _rows(sources, src, idx, seed, stream, sources[0].dataset.limit, packing)
    if docs is not None:
        return document_batch(rows, docs, dp_rank, dp_size, None, None, masks)
    return rows_to_batch(rows, masks, dp_rank, dp_size)


# ---------------------------------------------------------------- the training sampler
@dataclass
class MixtureSampler:
    """Training batches of a mixture: batch k is the blend's samples k*B .. (k+1)*B - 1; the state to
    checkpoint is k and each source's cursor (samples drawn from it so far)."""
    sources: list
    weights: np.ndarray
    global_batch_size: int
    dp_rank: int
    dp_size: int
    seed: int
    packing: str = "windows"  # data.packing: a sample is a window, or a row of whole documents

    def __post_init__(self):
        if self.global_batch_size % self.dp_size:
            raise DataError(f"train.global_batch_size: {self.global_batch_size} must be a positive multiple of "
                            f"the data-parallel size {self.dp_size}")
        self.batch_index, self.cursors = 0, [0] * len(self.sources)

    def next_batch(self):
        src, idx, self.cursors = blend(self.weights, self.global_batch_size, self.cursors)
        self.batch_index += 1
        return _batch(self.sources, src, idx, self.seed, TRAIN, self.packing, self.dp_rank, self.dp_size)

    def shares(self) -> str:
        """`a.bin 0.700 (0.700 realised of 1,600 samples), ...`: the start-up line's account of the blend."""
        n = sum(self.cursors)
        return ", ".join(f"{s.dataset.path.name} {w:.3f} ({c / max(n, 1):.3f} realised)"
                         for s, w, c in zip(self.sources, self.weights, self.cursors)) + f" of {n:,} samples"

    def state_dict(self) -> dict:
        return {"batch_index": self.batch_index, "mixture": {
            "sources": [str(s.dataset.path) for s in self.sources], "weights": [float(w) for w in self.weights],
            "cursors": list(self.cursors), "packing": self.packing}}

    def load_state_dict(self, state: dict) -> None:
        """The checkpoint's position: its batch index and cursors, for the same sources at the same weights
        (another mixture would continue a different blend: refused in one line)."""
        k = state.get("batch_index") if isinstance(state, dict) else None
        mix = state.get("mixture") if isinstance(state, dict) else None
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_COUNT:
            raise DataError(f"sampler state: 'batch_index' must be an integer in [0, {MAX_COUNT}], got {k!r}")
        if not isinstance(mix, dict):
            raise DataError("checkpoint.resume: the checkpoint was trained on data.path alone, not on this "
                            "data.mixture; resume it with its own data or start a new run (checkpoint.resume=none)")
        ours = self.state_dict()["mixture"]
        if mix.get("weights") != ours["weights"] or len(mix.get("sources") or []) != len(self.sources):
            raise DataError(f"checkpoint.resume: the checkpoint's data.mixture has weights {mix.get('weights')} "
                            f"over {len(mix.get('sources') or [])} sources, this run's {ours['weights']} over "
                            f"{len(self.sources)}: a resumed run continues the same blend; start a new run to change it")
        if mix.get("packing", "windows") != self.packing:
            raise DataError(f"checkpoint.resume: the checkpoint's mixture was drawn with data.packing = "
                            f"'{mix.get('packing', 'windows')}', this run's is '{self.packing}' (a source's cursor "
                            f"counts its windows or its rows of documents); resume with its packing or start a new run")
        cursors = mix.get("cursors")
        if not (isinstance(cursors, list) and len(cursors) == len(self.sources)
                and all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c for c in cursors)
                and sum(cursors) == k * self.global_batch_size):
            raise DataError(f"sampler state: mixture cursors {cursors!r} are not {len(self.sources)} counts summing "
                            f"to batch_index * train.global_batch_size = {k * self.global_batch_size}")
        self.batch_index, self.cursors = k, list(cursors)


def eval_batches(sources: list, weights: np.ndarray, batch_size: int, dp_rank: int, dp_size: int,
                 num_batches: int, seed: int, packing: str = "windows") -> list:
    """Fixed validation batches of a mixture: the blend of the sources' val splits from its start, the windows
    (or rows of documents) in the permutation stream VAL (apart from training's), so every evaluation compares
    the same tokens."""
    src, idx, _ = blend(weights, batch_size * num_batches)
    part = lambda i: slice(i * batch_size, (i + 1) * batch_size)  # noqa: E731
    return [_batch(sources, src[part(i)], idx[part(i)], seed, VAL, packing, dp_rank, dp_size)
            for i in range(num_batches)]
