"""`megalite eval`: a model's log-likelihood of every document of a corpus, at any layout, in one process or under
torchrun (the same --parallel.* flags as `megalite train`).

    the model    a transformers folder, a megalite model file or a checkpoint (convert's Source), each rank reading
                 its own region of every tensor at the layout (init_from.load), in fp32
    documents    a text file or folder (each file one document), a .jsonl or .parquet corpus (each record one), as
                 `megalite prepare` reads them, encoded with the model's tokenizer; or a token file `prepare` wrote
                 with it, cut at its end-of-text ids (the token file of a corpus gives the corpus's numbers). A
                 document is the ids of its text; the separators between documents are not part of any
    scored       every token of a document after its first, each predicted from the document's own tokens only,
                 positions from 0 (as transformers scores the document alone). A document longer than
                 block_size + 1 tokens is scored in windows of block_size + 1 tokens that overlap by one (the
                 next window's first token is the last one's final target): every target once, each window from
                 position 0 (lm-eval's loglikelihood_rolling, with one token of context between windows)
    packed       windows go whole into rows of block_size + 1 tokens (data/documents.pack), with data.document_mask
                 keeping attention and positions inside each: a row of several documents gives each document's
                 own numbers; rows are dealt out to dp ranks (cp ranks: their chunks of each), pp micro-batches
                 go through the pipeline (forward_only), and each document's sum is one float64 all-reduce

Reported: the mean loss over all scored tokens (nats), its perplexity, and bits per byte (the loss x tokens /
bytes of their text / ln 2, as data.eval's eval/NAME/bpb); per document, its summed log-likelihood, its
scored tokens and mean loss. Outside models: lm-eval-harness's loglikelihood_rolling and word/byte perplexity,
Megatron-LM's tasks/zeroshot_gpt (perplexity of a corpus at the training layout).
"""
from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from ..base.corpus import DEFAULT_TEXT_FIELD, RECORD_SUFFIXES, records
from ..base.errors import ConfigError, DataError, MegaliteError
from ..base.fs import regular_or_absent, replace_atomically
from ..config import Config, resolve, validate
from ..data import TokenDataset, expand_sources
from ..data.documents import document_starts, pack
from ..model import GPTStage
from ..parallel.agree import agree
from ..parallel.context import split_sequence
from ..parallel.grid import ParallelGrid
from ..parallel.pipeline import P2P, get_schedule
from ..parallel.process_group import joined, world_size_from_env
from ..parallel.tensor import vocab_parallel_cross_entropy
from ..tokenizer import Tokenizer, byte_tokenizer, read_text_pieces
from . import init_from

SPLITS = ("all", "train", "val")


@dataclass
class Scores:
    """Each document's summed log-likelihood (nats, float64) and scored tokens, and the text bytes of those."""
    loglik: np.ndarray
    tokens: np.ndarray
    nbytes: int

    @property
    def loss(self) -> float:
        """The mean loss over every scored token (nats per token)."""
        return float(-self.loglik.sum() / max(int(self.tokens.sum()), 1))

    def summary(self) -> str:
        n, t = len(self.tokens), int(self.tokens.sum())
        bpb = f"{self.loss * t / self.nbytes / math.log(2):.4f}" if self.nbytes else "n/a (no text bytes)"
        return (f"eval: {n:,} documents, {t:,} tokens scored: loss {self.loss:.4f} nats/token, perplexity "
                f"{math.exp(min(self.loss, 700)):.4f}, bits per byte {bpb}")

    def lines(self) -> list[str]:
        """One JSON object per document: its index, summed log-likelihood, scored tokens, mean loss (null for
        a document of one token, which has nothing to score)."""
        return [json.dumps({"document": i, "loglik": float(ll), "tokens": int(n),
                            "mean_loss": float(-ll / n) if n else None})
                for i, (ll, n) in enumerate(zip(self.loglik, self.tokens))]


# ---------------------------------------------------------------- the documents
def _texts(data: str, text_field: str):
    """Each document's text, as `megalite prepare` reads it: a file one, a jsonl or parquet record one."""
    for path in expand_sources([data]):
        items = (io.BytesIO(t) for t in records(path, text_field)) if path.suffix in RECORD_SUFFIXES else [path]
        for item in items:
            yield "".join(read_text_pieces(item, 1 << 62))


def _token_file(path: Path, split: str, tok: Tokenizer) -> list[np.ndarray]:
    """The documents of a token file's split ("all": the whole file, which is the corpus with its documents in
    prepare's order, training documents first), cut at its end-of-text ids (dropped); a file of the byte
    tokenizer, which has none, is one document."""
    ds = TokenDataset(path, split, what="--data") if split != "all" else \
        TokenDataset(path, "train", val_fraction=0.0, what="--data")
    theirs = ds.tokenizer()
    if theirs.sha256 != tok.sha256:
        raise DataError(f"--data: '{path}' was made by another tokenizer ({theirs.kind}, vocab {theirs.vocab_size}, "
                        f"sha256 {theirs.sha256[:12]}) than the model's ({tok.kind}, vocab {tok.vocab_size}, sha256 "
                        f"{tok.sha256[:12]}); prepare it with --tokenizer MODEL, or pass the text itself")
    ids, eot = np.asarray(ds.tokens, dtype=np.int64), ds.meta.get("eot_id")
    if not isinstance(eot, int):
        return [ids]
    starts = document_starts(ds)
    return [ids[a:b - 1] if ids[b - 1] == eot else ids[a:b] for a, b in zip(starts[:-1], starts[1:])]


def read_documents(data: str, tok: Tokenizer, split: str = "all", text_field: str = DEFAULT_TEXT_FIELD) -> list:
    """The documents of --data as arrays of ids (see the module docstring), empty ones left out; at least one with
    a token to score."""
    path = Path(data)
    if split not in SPLITS:
        raise DataError(f"--split {split!r}: expected one of {', '.join(SPLITS)}")
    if path.suffix == ".bin":
        docs = _token_file(path, split, tok)
    else:
        try:
            docs = [np.asarray(ids, dtype=np.int64) for ids in map(tok.encode, _texts(data, text_field))]
        except DataError as e:  # said by the reader prepare shares ("prepare: source ... does not exist")
            raise DataError(f"--data: {str(e).removeprefix('prepare: ')}") from None
    docs = [d for d in docs if d.size]  # an empty text; the separator prepare puts where the val split begins
    if not any(d.size > 1 for d in docs):
        raise DataError(f"--data: '{data}' holds {len(docs)} document(s) and no token to score (a document needs "
                        f"two tokens: the first is only context)")
    return docs


def rows(docs: list, seq: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Packed rows (R, seq + 1): token ids, each token's window within its row (-1: padding) and its document
    (-1: padding). Windows of seq + 1 tokens overlapping by one (see the module docstring), packed in order."""
    pieces = [(d, a, min(a + seq + 1, len(ids))) for d, ids in enumerate(docs) if len(ids) > 1
              for a in range(0, len(ids) - 1, seq)]
    packed = pack(np.array([b - a for _, a, b in pieces], dtype=np.int64), seq + 1)
    ids = np.zeros((len(packed), seq + 1), dtype=np.int64)
    window, owner = np.full_like(ids, -1), np.full_like(ids, -1)
    k = 0
    for r, row in enumerate(packed):
        at = 0
        for j, (_, _, n) in enumerate(row):
            d, a, b = pieces[k]
            ids[r, at:at + n], window[r, at:at + n], owner[r, at:at + n] = docs[d][a:b], j, d
            at, k = at + n, k + 1
    return ids, window, owner


# ---------------------------------------------------------------- the model at a layout
def config_for(model: str, cfg: Config) -> Config:
    """cfg (its [parallel] section: --parallel.* flags) with the model's [model] section, checked as train checks
    a run, document masks on (no dropout: evaluation)."""
    for k, v in init_from.source(model, "--model").model.items():
        setattr(cfg.model, k, v)
    cfg.model.dropout = 0.0
    cfg.data.packing, cfg.data.document_mask = "documents", True
    world, par = world_size_from_env(), cfg.parallel
    ranks = par.tp * par.cp * par.pp * max(par.dp, 1)
    if world == 1 and ranks > 1:  # validate's hint names `megalite train`
        raise ConfigError(f"world size 1: the --parallel.* flags ask for {ranks} processes; launch them with "
                          f"`torchrun --nproc-per-node {ranks} -m megalite eval ...` (the same arguments after `eval`)")
    resolve(cfg, world)
    # what validate checks of the micro-batches: pp of them a batch (_score), as train's 1F1B would have
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 1, max(cfg.parallel.dp, 1) * max(cfg.parallel.pp, 1)
    return validate(cfg, world)


def evaluate(model: str, data: str, cfg: Config, split: str = "all", text_field: str = DEFAULT_TEXT_FIELD,
             batch_rows: int = 8, out: Optional[str] = None, force: bool = False) -> Scores:
    """Score --data with --model at cfg.parallel's layout (joining the torchrun job, or one process); every rank
    returns the same Scores. `out`: rank 0 writes the per-document lines there, once all is computed."""
    try:  # before the job is joined: every rank reads the same flags and files, so says the same (rank 0 prints)
        cfg = config_for(model, cfg)
        if out is not None and regular_or_absent(Path(out), "--out") is not None and not force:
            raise DataError(f"--out {out} already exists (pass --force to replace it)")
    except MegaliteError as e:
        raise e.everywhere() if world_size_from_env() > 1 else e
    with joined(cfg.parallel.timeout_s) as device:
        grid = ParallelGrid.create(cfg.parallel.layout, timeout=timedelta(seconds=cfg.parallel.timeout_s))
        stage, docs, tok = agree(lambda: _setup(model, data, cfg, grid, device, split, text_field), grid)
        scores = _score(stage, docs, tok, cfg, grid, device, batch_rows)
        if out is not None:
            agree(lambda: grid.rank == 0 and replace_atomically(Path(out), "".join(
                f"{line}\n" for line in scores.lines()).encode()), grid)
    return scores


def _setup(model: str, data: str, cfg: Config, grid: ParallelGrid, device, split: str, text_field: str) -> tuple:
    """This rank's stage of the model with its weights, the documents, the tokenizer; every check first."""
    src = init_from.source(model, "--model")
    tok = src.tokenizer() or byte_tokenizer()  # a model that carries none was trained on bytes (generate's rule)
    m = cfg.model
    if tok.vocab_size > m.vocab_size:
        raise DataError(f"--model: its tokenizer has {tok.vocab_size} ids but the model {m.vocab_size} token rows")
    docs = read_documents(data, tok, split, text_field)
    top = max(int(d.max()) for d in docs if d.size)
    if top >= tok.vocab_size:
        raise DataError(f"--data: holds token id {top}, expected ids below the model's tokenizer's {tok.vocab_size}")
    stage = GPTStage(m, grid, vpp=cfg.parallel.vpp, sp=cfg.parallel.sp, real_vocab=tok.vocab_size).to(device)
    params = sorted(stage.global_parameters(), key=lambda np_: np_[0])
    init_from.load(SimpleNamespace(params=params, grid=grid, grads=None, tokenizer=None, cfg=cfg), model, "--model")
    return stage.eval(), docs, tok


def _score(stage: GPTStage, docs: list, tok: Tokenizer, cfg: Config, grid: ParallelGrid, device,
           batch_rows: int) -> Scores:
    """Every row through the pipeline, batch_rows at a time (rounded up to a multiple of dp x pp), each dp rank
    its share as pp micro-batches (one a stage, so the pipeline fills); each document's sum all-reduced over the
    job."""
    ids, window, owner = rows(docs, cfg.model.block_size)
    counted = (window[:, 1:] == window[:, :-1]) & (window[:, 1:] >= 0)  # (R, seq): targets inside a window
    target_doc = np.where(counted, owner[:, 1:], -1)
    nbytes = np.asarray(tok.token_bytes(), dtype=np.int64)
    scores = Scores(np.zeros(len(docs)), np.bincount(target_doc[counted], minlength=len(docs)),
                    int(nbytes[ids[:, 1:][counted]].sum()))
    dp, pp = grid.layout.dp, grid.layout.pp
    per = -(-max(batch_rows, dp * pp) // (dp * pp)) * pp  # rows per dp rank per batch: a multiple of pp
    total = torch.zeros(len(docs), dtype=torch.float64)
    with torch.no_grad():
        for first in range(0, len(ids), dp * per):
            mine = slice(first + grid.coord.dp * per, first + (grid.coord.dp + 1) * per)
            nll = _forward(stage, cfg, grid, device, ids[mine], window[mine], per)
            if nll is not None:  # the last stage's tp-rank-0 members: their rows' sums, each target once
                who = split_sequence(torch.from_numpy(target_doc[mine].copy()), grid.cp)
                keep = who >= 0
                total.index_add_(0, who[keep], nll[:who.shape[0]][keep])
    if grid.layout.world_size > 1:
        dist.all_reduce(total, group=grid.cpu)
    scores.loglik = -total.numpy()
    return scores


def _forward(stage: GPTStage, cfg: Config, grid: ParallelGrid, device, ids, window, per: int):
    """Per-token losses (float64, (rows, seq/cp)) of this dp rank's rows, padded to `per` rows, through the
    pipeline in pp micro-batches; None on ranks that do not hold them (not the last stage, tp rank > 0)."""
    seq = cfg.model.block_size
    pad = per - ids.shape[0]
    ids = np.concatenate([ids, np.zeros((pad, seq + 1), dtype=np.int64)])
    window = np.concatenate([window, np.full((pad, seq + 1), -1, dtype=np.int64)])
    x, y = (split_sequence(torch.from_numpy(a.copy()), grid.cp).to(device) for a in (ids[:, :-1], ids[:, 1:]))
    docs = torch.from_numpy(window[:, :-1].copy()).to(device)  # whole rows: with cp the ring reads each chunk's
    m = grid.layout.pp
    mb = per // m  # rows a micro-batch
    shape = (mb, seq // grid.cp.size // (grid.tp.size if stage.sp else 1), cfg.model.n_embd)
    p2p = P2P(grid, shape, torch.float32, device) if grid.layout.pp > 1 else None
    vpp = len(stage.chunks)

    def stage_fn(inp, i, chunk=0):
        rows_i = slice(i * mb, (i + 1) * mb)
        out = stage(inp, None, chunk=chunk, docs=docs[rows_i])
        if grid.is_last_stage and chunk == vpp - 1:  # (mb, t, V/tp) logits -> (mb, t) losses
            return vocab_parallel_cross_entropy(out, y[rows_i], stage.cfg.vocab_size, stage.tp, stage.real_vocab)
        return out

    losses = get_schedule(cfg.parallel.schedule, vpp, False)(stage_fn, list(x.split(mb)), m, grid, p2p)
    if not (grid.is_last_stage and grid.coord.tp == 0):
        return None
    return torch.cat([l.double().cpu() for l in losses])
