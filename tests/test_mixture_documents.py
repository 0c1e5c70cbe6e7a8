"""data.mixture with data.packing = "documents" (data/mixture.py, data/documents.py): the blend draws rows, each
row packed from one source's whole documents; the same rows at every dp; the cursors (rows per source) in the
checkpoint, and a run resumed at another dp, cp and micro-batch size shows the uninterrupted run's batch_hash at
every step (3 sources, document_mask on)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import helpers as H
from megalite.base.errors import DataError
from megalite.data import documents as D, masks, mixture as M

WEIGHTS = (0.5, 0.3, 0.2)


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """Three BPE token files of documents (every third document of one synthetic text each), one tokenizer."""
    return H.document_corpora(tmp_path_factory.mktemp("mixdocs"), parts=3)


def _sampler(files, dp_rank=0, dp=1, seq=32, batch=8):
    entries = [{"path": str(f), "weight": w} for f, w in zip(files, WEIGHTS)]
    sources, w = M.open_sources(entries, "train", seq)
    M.one_tokenizer(sources, 300)
    return M.MixtureSampler(sources, w, batch, dp_rank, dp, seed=5, packing="documents")


def test_each_row_is_whole_documents_of_the_source_the_blend_draws(three):
    """Rows of the blend's samples: row i of a batch holds whole documents (or a row-long piece of a longer one)
    of source src[i] only, in the rows order that source's own packing gives; counted targets stay inside
    documents; dp = 2 holds the same rows; the cursors count rows per source at the blend's shares."""
    files, _ = three
    one = _sampler(files)
    eot = one.sources[0].dataset.meta["eot_id"]
    wholes = []
    for s in one.sources:  # every source's documents, as token strings
        starts = D.document_starts(s.dataset)
        toks = np.asarray(s.dataset.tokens)
        wholes.append({toks[a:b].tobytes() for a, b in zip(starts[:-1], starts[1:])})
    halves = [_sampler(files, r, 2) for r in range(2)]
    for k in range(4):
        src, idx, _ = M.blend(one.weights, 8, one.cursors)
        batch = one.next_batch()
        ids = np.concatenate([batch.x.numpy(), batch.y.numpy()[:, -1:]], axis=1)
        docs = batch.docs.numpy()
        for r in range(8):
            want, want_docs, _ = one.sources[src[r]].packed(5, M.TRAIN).rows([idx[r]])
            assert np.array_equal(ids[r], want[0]) and np.array_equal(docs[r], want_docs[0, :-1])
            for d in set(docs[r].tolist()) - {-1}:
                piece = ids[r][:-1][docs[r] == d]
                if piece[-1] == eot:  # a document of the source the blend drew (the last piece of a long one)
                    tail = piece.astype(np.uint16).tobytes()
                    assert any(w.endswith(tail) for w in wholes[src[r]])
        same = (docs[:, 1:] == docs[:, :-1]) & (docs[:, 1:] >= 0)
        assert np.array_equal(batch.mask.numpy()[:, :-1].astype(bool), same)
        parts = [h.next_batch() for h in halves]  # dp = 2: each rank's half of the same rows
        assert np.array_equal(np.concatenate([p.x.numpy() for p in parts]), batch.x.numpy())
        assert np.array_equal(np.concatenate([p.docs.numpy() for p in parts]), docs)
    assert one.cursors == np.bincount(M.blend(one.weights, 32)[0], minlength=3).tolist()
    assert one.state_dict()["mixture"]["packing"] == "documents"
    with pytest.raises(DataError, match="data.packing = 'documents', this run's is 'windows'"):
        w = _sampler(files)
        w.packing = "windows"
        w.load_state_dict(one.state_dict())


def test_a_sources_loss_mask_counts_inside_its_documents(three, tmp_path):
    """A source with a loss mask (masks.attach) packed in documents: a target counts when it is inside its
    document and its mask marks it; a source without one counts every in-document target."""
    files, _ = three
    import shutil
    for f in files:
        for suffix in (".bin", ".json", ".tokenizer.json"):
            shutil.copy(f.with_name(f.stem + suffix), tmp_path / (f.stem + suffix))
    copies = [tmp_path / f.name for f in files]
    n = json.loads(copies[0].with_suffix(".json").read_text())["num_tokens"]
    masks.attach(copies[0], np.arange(n) % 2)  # every other token of source 0 counts
    one = _sampler(copies)
    src, idx, _ = M.blend(one.weights, 8)
    batch = one.next_batch()
    docs = batch.docs.numpy()
    inside = np.concatenate([(docs[:, 1:] == docs[:, :-1]) & (docs[:, 1:] >= 0), np.zeros((8, 1), bool)], axis=1)
    for r in range(8):  # target t (token t + 1) counts inside its document where the mask marks token t + 1
        _, _, m = one.sources[src[r]].packed(5, M.TRAIN).rows([idx[r]])
        want = inside[r, :-1] & (m[0, 1:-1].astype(bool) if m is not None else True)
        assert np.array_equal(batch.mask.numpy()[r, :-1].astype(bool), want)
    assert 0 < batch.counted < int(inside.sum())


def test_a_document_packed_mixture_resumes_at_another_dp_cp_and_micro_batch_with_the_same_batch_hash(three, tmp_path):
    """3 sources packed in documents with document_mask: one process, micro-batch 2, 4 steps is the reference.
    2 ranks at dp = 2 (micro-batch 4) stop at step 2, resume at cp = 2 (micro-batch 8) to step 3, one process
    (micro-batch 1) finishes step 4: every step's batch_hash is the reference's, the checkpoint holds the cursors."""
    files, vocab = three
    mix = [{"path": str(f), "weight": w} for f, w in zip(files, WEIGHTS)]
    base = {"data.mixture": mix, "data.packing": "documents", "data.document_mask": True, "train.steps": 4,
            "model.n_layer": 2, "model.block_size": 32, "model.vocab_size": vocab,
            "checkpoint.dir": str(tmp_path / "ck")}
    ref = H.train_in_process(H.TINY.config(files[0], tmp_path / "a", **{**base, "checkpoint.dir": ""}))
    got, last, _ = H.resumed_across_layouts(files[0], tmp_path, base)
    assert got == [r["batch_hash"] for r in ref.history]
    state = json.loads(next((tmp_path / "ck").glob("step_*3/*/state.json")).read_text())
    assert state["data"]["mixture"]["packing"] == "documents" and sum(state["data"]["mixture"]["cursors"]) == 48
    assert [r["loss"] for r in last.history] == pytest.approx([r["loss"] for r in ref.history[3:]], rel=1e-4)
