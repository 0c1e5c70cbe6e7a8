"""data.packing = "documents": rows of whole documents, each token with its document's id.

A document is the tokens after one end-of-text token up to and including the next (the first starts at the
split's first token), so the model learns to end a document. Each epoch takes the split's documents in a keyed
order (keyed.permute, keyed by seed and epoch: nothing stored) and fills rows of seq_len + 1 tokens greedily:
a document goes into the current row when it fits, else the row is closed (its rest padded) and a new one
begins. A document longer than a row starts a new row and is cut into pieces of a row each (the last piece
packs like a document of its own): the only cut. Padding is the end-of-text id with document id -1; targets in
padding never count.

Batch k holds rows kB .. (k+1)B - 1 of the run's row sequence (epochs one after another), so the batches, like
the windows', are a pure function of (seed, k) and the same at every layout. Each row's document ids (B, T)
travel with the batch (data.Batch.docs); with data.document_mask the model keeps attention and positions inside
each document (model.py) and a target that crosses a boundary (predicting a document's first token from the
one before) is not counted; a token file with a loss mask (data/masks.py) also counts only what it marks.

With data.mixture the blend (data/mixture.py) draws rows instead of windows: its j-th sample from source s is
row j of that source's own run of packed rows (DocumentRows, keyed by the source index too), so each row holds
documents of one source and each source's cursor counts its rows.
"""
from __future__ import annotations

import numpy as np

from ..base.errors import DataError
from . import Batch, TokenDataset, rows_to_batch
from .keyed import key, permute

SCAN = 1 << 24  # tokens read at a time when finding the end-of-text tokens


def document_starts(dataset: TokenDataset) -> np.ndarray:
    """The first token of every document of the split, plus its length at the end: (documents + 1,)."""
    eot = dataset.meta.get("eot_id")
    if not isinstance(eot, int):
        raise DataError(f"data.packing = 'documents': '{dataset.path}' was made by a tokenizer without an end-of-text "
                        f"token (the byte tokenizer separates documents by two newlines, which text holds too); "
                        f"prepare it with a BPE tokenizer (docs/tokenizers.md)")
    ends = [np.flatnonzero(np.asarray(dataset.tokens[i:i + SCAN]) == eot) + i + 1
            for i in range(0, len(dataset), SCAN)]
    starts = np.concatenate([[0], *ends]).astype(np.int64)
    if starts[-1] != len(dataset):
        starts = np.append(starts, len(dataset))
    return starts


def pack(lengths: np.ndarray, row: int) -> list[list[tuple[int, int, int]]]:
    """Rows of `row` tokens from documents of `lengths`, in order: each row a list of (document, offset into it,
    tokens); a document longer than a row is cut into row-long pieces, each starting a row."""
    rows, cur, used = [], [], 0
    for d, n in enumerate(lengths.tolist()):
        off = 0
        while n - off > row:  # a long document: close the row, then whole rows of it
            if cur:
                rows.append(cur)
            rows.append([(d, off, row)])
            cur, used, off = [], 0, off + row
        piece = n - off
        if used + piece > row and cur:
            rows.append(cur)
            cur, used = [], 0
        cur.append((d, off, piece))
        used += piece
    if cur:
        rows.append(cur)
    return rows


class DocumentRows:
    """One split's run of packed rows: epoch after epoch, each its documents in a keyed order (seed, epoch,
    stream, and the mixture source index when there is one) packed by `pack`. Row j is a pure function of the
    key and j; one epoch's packing is held at a time (rows are asked for in increasing order)."""

    def __init__(self, dataset: TokenDataset, seq: int, seed: int, stream: int = 0, source: int | None = None):
        self.dataset, self.seq, self.seed, self.stream, self.source = dataset, seq, seed, stream, source
        self.starts = document_starts(dataset)
        self.pad = int(dataset.meta["eot_id"])
        self._epochs, self._sizes = {}, {}  # one epoch's rows held; every epoch's count

    def _epoch(self, e: int) -> tuple:
        if e not in self._epochs:
            n = self.starts.size - 1
            parts = (self.seed, e, self.stream, 7) + (() if self.source is None else (self.source,))
            order = permute(np.arange(n), n, key(*parts))
            self._epochs = {e: (order, pack(np.diff(self.starts)[order], self.seq + 1))}
            self._sizes[e] = len(self._epochs[e][1])
        return self._epochs[e]

    def _locate(self, j: int) -> tuple[int, int]:
        """(epoch, row within it) of the run's row j."""
        e = 0
        while True:
            n = self._sizes[e] if e in self._sizes else len(self._epoch(e)[1])
            if j < n:
                return e, j
            e, j = e + 1, j - n

    def rows(self, which) -> tuple:
        """The run's rows `which` (increasing): token ids and document ids (len(which), seq + 1), and the loss
        mask's rows when the token file has one (else None; padding 0)."""
        count = len(which)
        ids = np.full((count, self.seq + 1), self.pad, dtype=np.int64)
        docs = np.full((count, self.seq + 1), -1, dtype=np.int64)
        mask = None if self.dataset.mask is None else np.zeros((count, self.seq + 1), dtype=np.uint8)
        for r, j in enumerate(which):
            e, k = self._locate(int(j))
            order, packed = self._epoch(e)
            at = 0
            for d, (doc, off, n) in enumerate(packed[k]):
                s = int(self.starts[order[doc]]) + off
                ids[r, at:at + n] = self.dataset.tokens[s:s + n]
                docs[r, at:at + n] = d
                if mask is not None:
                    mask[r, at:at + n] = self.dataset.mask[s:s + n]
                at += n
        return ids, docs, mask


class DocumentSampler:
    """Training batches of whole documents: state = the batch index (as BatchSampler's)."""

    def __init__(self, dataset: TokenDataset, seq: int, global_batch_size: int, dp_rank: int, dp_size: int,
                 seed: int, stream: int = 0):
        if global_batch_size % dp_size:
            raise DataError(f"train.global_batch_size: {global_batch_size} must be a positive multiple of the "
                            f"data-parallel size {dp_size}")
        self.dataset, self.seq, self.global_batch_size = dataset, seq, global_batch_size
        self.dp_rank, self.dp_size, self.seed, self.stream = dp_rank, dp_size, seed, stream
        self.packed = DocumentRows(dataset, seq, seed, stream)
        self.batch_index = 0

    def rows(self, first: int, count: int) -> tuple:
        """Rows first .. first + count - 1 of the run: token ids, document ids, loss-mask rows or None."""
        return self.packed.rows(range(first, first + count))

    def batch_at(self, k: int) -> Batch:
        ids, docs, mask = self.rows(k * self.global_batch_size, self.global_batch_size)
        return document_batch(ids, docs, self.dp_rank, self.dp_size, self.dataset.limit, self.dataset.path, mask)

    def next_batch(self) -> Batch:
        batch = self.batch_at(self.batch_index)
        self.batch_index += 1
        return batch

    def state_dict(self) -> dict:
        return {"batch_index": self.batch_index, "packing": "documents"}

    def load_state_dict(self, state: dict) -> None:
        from . import BatchSampler
        BatchSampler.load_state_dict(self, state)  # the same check of the one integer


def document_batch(ids: np.ndarray, docs: np.ndarray, dp_rank: int, dp_size: int, limit, path,
                   mask: np.ndarray | None = None) -> Batch:
    """This rank's Batch of packed rows: a target counts when it is no padding, in its input's document and
    (with a loss mask, (B, T + 1) per token) marked by the mask; `docs` (B, T + 1): each token's document
    within its row (-1: padding)."""
    if limit is not None and ids.size and int(ids.max()) >= limit:
        raise DataError(f"data.path: token file '{path}' holds token id {int(ids.max())}, expected ids below "
                        f"model.vocab_size = {limit}; the file is corrupt").everywhere()
    counted = (docs[:, 1:] == docs[:, :-1]) & (docs[:, 1:] >= 0)
    if mask is not None:
        counted &= mask[:, 1:].astype(bool)
    counted = counted.astype(np.uint8)
    batch = rows_to_batch(ids, np.concatenate([counted[:, :1], counted], axis=1), dp_rank, dp_size)
    per = ids.shape[0] // dp_size
    import torch
    batch.docs = torch.from_numpy(docs[dp_rank * per:(dp_rank + 1) * per, :-1].copy())
    return batch


def eval_batches(dataset: TokenDataset, seq: int, batch_size: int, dp_rank: int, dp_size: int, num_batches: int,
                 seed: int) -> list:
    """Fixed validation batches of whole documents (their own key stream), so every evaluation compares the same."""
    s = DocumentSampler(dataset, seq, batch_size, dp_rank, dp_size, seed, stream=1)
    return [s.batch_at(i) for i in range(num_batches)]
