"""Loss masks (megalite/data/masks.py) and the token-weighted loss (run/train.py: token_weighted_loss): a masked
target's gradient is exactly zero, the loss is torch's cross-entropy mean over the counted targets, and a run's
losses and gradients are the same at every micro-batch split however unevenly the counted tokens fall."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import helpers as H
from megalite.base.errors import DataError
from megalite.data import TokenDataset, masks
from megalite.parallel.grid import Axis
from megalite.run.train import token_weighted_loss


def _fake_trainer(vocab: int, replicas: int = 1):
    model = SimpleNamespace(cfg=SimpleNamespace(vocab_size=vocab), tp=Axis(1, 0), real_vocab=vocab)
    return SimpleNamespace(model=model, grid=SimpleNamespace(layout=SimpleNamespace(replicas=replicas)))


def test_masked_targets_have_exactly_zero_gradient_and_the_loss_is_torchs_mean_over_counted():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11, dtype=torch.float32, requires_grad=True)
    targets = torch.randint(0, 11, (3, 7))
    mask = (torch.rand(3, 7) < 0.4).float()
    mask[0, 0] = 1.0
    tr = _fake_trainer(11)
    loss = token_weighted_loss(tr, logits, targets, mask, int(mask.sum()))
    loss.backward()
    assert torch.all(logits.grad[mask == 0] == 0)  # exactly
    assert logits.grad[mask == 1].abs().sum() > 0
    on = mask.bool()
    torch.testing.assert_close(loss, F.cross_entropy(logits[on], targets[on]))  # torch's mean over the counted


@pytest.fixture(scope="module")
def masked_tokens(tmp_path_factory):
    """A token file with a mask whose counted tokens fall unevenly: runs of 37 tokens, every third counted."""
    d = tmp_path_factory.mktemp("masked")
    path = H.make_token_file(d, H.stdlib_text()[:20000])
    n = json.loads(path.with_suffix(".json").read_text())["num_tokens"]
    mask = ((np.arange(n) // 37) % 3 == 0).astype(np.uint8)
    masks.attach(path, mask)
    return path, mask


def test_a_token_file_carries_its_mask_and_a_mask_that_disagrees_is_one_line(masked_tokens, tmp_path):
    path, mask = masked_tokens
    ds = TokenDataset(path, "train")
    assert np.array_equal(np.asarray(ds.mask), mask[:len(ds)])
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["loss_mask"] == {"file": "tokens.mask.bin", "counted": int(mask.sum())}
    for f in ("tokens.bin", "tokens.json", "tokens.mask.bin"):
        (tmp_path / f).write_bytes((path.parent / f).read_bytes())
    (tmp_path / "tokens.mask.bin").write_bytes(mask[:-3].tobytes())
    with pytest.raises(DataError, match=r"has \d+ bytes, but .* holds \d+ tokens .*disagrees with its tokens"):
        TokenDataset(tmp_path / "tokens.bin", "train")
    with pytest.raises(DataError, match="one per token"):
        masks.attach(tmp_path / "tokens.bin", mask[:-1])


def test_the_loss_is_the_same_at_every_micro_batch_split_with_uneven_counts(masked_tokens, tmp_path, train_single):
    """Global batch 8 at micro-batch sizes 1, 2 and 8: the first step's loss and every gradient agree to float
    rounding, though the counted targets per row differ (so a mean of per-micro-batch means would not:
    planted, it fails here)."""
    path, mask = masked_tokens
    runs = {}
    for mb in (1, 2, 8):
        cfg = H.TINY.config(path, tmp_path / f"mb{mb}", **{"train.global_batch_size": 8, "train.micro_batch_size": mb,
                                                           "train.steps": 1, "model.n_layer": 2})
        runs[mb] = train_single(cfg)
    for mb in (1, 2):
        assert runs[mb]["loss"] == pytest.approx(runs[8]["loss"], rel=1e-6)
        for name, g in runs[8]["grads"].items():
            torch.testing.assert_close(runs[mb]["grads"][name], g, rtol=1e-5, atol=1e-8)
    # the counted targets are uneven across the rows of a batch, so the split matters for a mean of means
    from megalite.data import BatchSampler
    ds = TokenDataset(path, "train")
    batch = BatchSampler(ds, 16, 8, 0, 1, 1234).next_batch()
    per_row = batch.mask.sum(dim=1)
    assert per_row.min() < per_row.max() and batch.counted == int(per_row.sum())


def _layouts_worker(rank, world_size, tmp_dir, cfg, layouts):
    from megalite.run.train import train
    for tp, pp, dp, cp in layouts:
        cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.cp = tp, pp, dp, cp
        tr = train(cfg, log=lambda *a: None)
        if rank == 0:
            torch.save([r["loss"] for r in tr.history], f"{tmp_dir}/{tp}{pp}{dp}{cp}.pt")


def test_the_masked_loss_is_the_same_at_dp_cp_and_pp(masked_tokens, tmp_path, train_single):
    """One 2-rank launch: dp = 2, cp = 2 and pp = 2 each give the single process's losses on the masked data
    (a mean of per-rank means would not: the ranks' rows count different numbers of targets)."""
    from megalite.testing import run_parallel
    path, _ = masked_tokens
    cfg = H.TINY.config(path, tmp_path / "run", **{"train.global_batch_size": 8, "train.micro_batch_size": 2,
                                                   "train.steps": 2, "model.n_layer": 2})
    ref = train_single(cfg)["loss"]
    layouts = [(1, 1, 2, 1), (1, 1, 1, 2), (1, 2, 1, 1)]
    run_parallel(_layouts_worker, 2, tmp_path, args=(cfg, layouts))
    for layout in layouts:
        got = torch.load(tmp_path / f"{''.join(map(str, layout))}.pt")
        assert got == pytest.approx(ref, rel=1e-5), layout


TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>\n{% generation %}"
            "{{ m['content'] }}{% endgeneration %}\n{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endif %}"
            "{% endfor %}")


def _chat_folder(folder, template):
    from megalite.tokenizer import train_bpe, write_hf_folder
    folder.mkdir()
    tok = train_bpe([H.synthetic_text(20000)], 300)
    write_hf_folder(tok, folder, 64)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return folder, tok


def test_prepare_chat_counts_only_the_assistants_turns(tmp_path):
    """The counted tokens decode to exactly the assistant's contents, conversation by conversation; the
    separators and every user/system token are not counted; a template without generation markers is refused
    in one line and writes nothing."""
    pytest.importorskip("jinja2")
    folder, tok = _chat_folder(tmp_path / "tok", TEMPLATE)
    words = H.synthetic_text(6000).split()
    convs = [[{"role": "system", "content": " ".join(words[i:i + 3])},
              {"role": "user", "content": " ".join(words[i + 3:i + 9])},
              {"role": "assistant", "content": " ".join(words[i + 9:i + 14])},
              {"role": "user", "content": "and then"},
              {"role": "assistant", "content": " ".join(words[i + 14:i + 16])}] for i in range(0, 400, 16)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    rc, out, err = H.cli_in_process("prepare", tmp_path / "chat.jsonl", "--chat", "--tokenizer", folder,
                                    "--out", tmp_path / "chat.bin", "--val-fraction", "0")
    assert rc == 0, err
    ds = TokenDataset(tmp_path / "chat.bin", "train")
    ids, mask = np.asarray(ds.tokens, dtype=np.int64), np.asarray(ds.mask, dtype=bool)
    assert "assistant" in out and 0 < mask.sum() < mask.size / 2
    docs = np.split(np.arange(ids.size), np.flatnonzero(ids == tok.eot_id))
    assert len(docs) == len(convs)
    for conv, at in zip(convs, docs):
        at = at[ids[at] != tok.eot_id]
        assert tok.decode(ids[at][mask[at]].tolist()) == "".join(m["content"] for m in conv if m["role"] == "assistant")
    assert not mask[ids == tok.eot_id].any()
    bad, _ = _chat_folder(tmp_path / "bad", TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    rc, _, err = H.cli_in_process("prepare", tmp_path / "chat.jsonl", "--chat", "--tokenizer", bad,
                                  "--out", tmp_path / "bad.bin")
    assert rc == 2 and "does not mark the assistant's turns" in err and len(err.strip().splitlines()) == 1, err
    assert not list(tmp_path.glob("bad.*"))
