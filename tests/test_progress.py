"""Long commands are not silent: `megalite generate` streams its tokens as they are drawn (the start-up progress
of a torchrun launch is tested in test_error_contract_torchrun.py, the gpu-check phases in test_gpu_check.py,
bench tables row by row in test_bench.py)."""
from __future__ import annotations

import dataclasses
import io
import json

import torch
from safetensors.torch import save_file

import megalite.generate as gen
from megalite.config import ModelConfig
from megalite.tokenizer import byte_tokenizer
from megalite.model import GPTStage
from megalite.parallel.grid import ParallelGrid


def _model_file(path, std: float = 0.0):
    """A random one-layer model as a `megalite convert` file; std > 0 makes its weights large, so that sampling
    draws arbitrary bytes (invalid UTF-8 included)."""
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=64, vocab_size=256, dropout=0.0)
    model = GPTStage(cfg, ParallelGrid.single())
    model.init_weights(0)
    tensors = {}
    with torch.no_grad():
        for name, p in model.global_parameters():
            if std:
                p.normal_(0, std, generator=torch.Generator().manual_seed(len(name)))
            tensors[name] = p.detach().clone().contiguous()
    save_file(tensors, str(path), metadata={"megalite.model_config": json.dumps(dataclasses.asdict(cfg))})
    return path


class _Watched(io.StringIO):
    """A stream that records, at every flush, how many forward passes the model had run and the text so far."""

    def __init__(self, forwards):
        super().__init__()
        self.forwards, self.flushes = forwards, []

    def flush(self):
        self.flushes.append((self.forwards[0], self.getvalue()))


def test_generate_streams_each_token_before_drawing_the_next(tmp_path, monkeypatch):
    path = _model_file(tmp_path / "m.safetensors", std=1.0)
    forwards = [0]
    real = gen.load_model

    def counted(p, *check):
        m = real(p, *check)
        m.register_forward_hook(lambda *a: forwards.__setitem__(0, forwards[0] + 1))
        return m

    monkeypatch.setattr(gen, "load_model", counted)
    n, prompt = 24, "déf "
    stream = _Watched(forwards)
    text = gen.sample_text(path, prompt, max_new_tokens=n, temperature=1.0, seed=3, stream=stream)
    assert stream.getvalue() == text  # the streamed text is the text, byte for byte
    assert text == gen.sample_text(path, prompt, max_new_tokens=n, temperature=1.0, seed=3)  # as without streaming
    # the prompt is out before the first forward pass; token k is out after forward k, before forward k + 1
    assert [f for f, _ in stream.flushes[:n + 1]] == list(range(n + 1)), stream.flushes
    assert stream.flushes[0][1] == prompt
    grew = [len(b) > len(a) for (_, a), (_, b) in zip(stream.flushes, stream.flushes[1:n + 1])]
    assert sum(grew) >= n // 2, stream.flushes  # most bytes complete a character at once (multi-byte ones wait)
    assert "\ufffd" in text  # large random weights draw invalid UTF-8: replaced the same way streamed or not
    ids = io.StringIO()
    out = gen.sample_text(path, prompt, max_new_tokens=5, temperature=0, as_ids=True, stream=ids)
    assert ids.getvalue() == out and out.split()[:len(prompt.encode())] == [str(b) for b in prompt.encode()]
    assert byte_tokenizer().decode(map(int, out.split())).startswith(prompt)
