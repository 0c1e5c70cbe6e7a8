"""The HF export ships megalite's byte tokenizer (built with `tokenizers`), so a transformers user can use
the folder as is: AutoTokenizer gives the byte values as ids, pipeline("text-generation") runs and agrees
with the model's own greedy continuation decoded as bytes."""
import pytest
import torch

from megalite.convert import convert
from megalite.tokenizer import build_byte_tokenizer
from megalite.tokenizer import byte_tokenizer

TEXTS = ["def f(x):\n\treturn x  # two  spaces", "héllo ☃ — ünïcode", "\x00\x01 control \x7f bytes", ""]


def test_byte_tokenizer_ids_are_the_bytes_and_decode_back():
    tok = build_byte_tokenizer()
    assert tok.get_vocab_size() == 256
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert ids == list(text.encode("utf-8")) == byte_tokenizer().encode(text)
        assert tok.decode(ids) == text


def test_exported_folder_works_with_auto_tokenizer_and_pipeline(tmp_path, run111):
    transformers = pytest.importorskip("transformers")
    folder = convert(run111["ckpt"], tmp_path / "hf", fmt="hf-gpt2", quiet=True)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS:
        assert tok(text)["input_ids"] == list(text.encode("utf-8")), text
        assert tok.decode(list(text.encode("utf-8"))) == text
    assert tok.all_special_ids == [] and tok.model_max_length == 16
    model = transformers.GPT2LMHeadModel.from_pretrained(str(folder)).eval()
    prompt = "the model "
    gen = transformers.pipeline("text-generation", model=model, tokenizer=tok, device="cpu")
    out = gen(prompt, max_new_tokens=5, do_sample=False, return_full_text=True)[0]["generated_text"]
    with torch.no_grad():  # greedy by hand, decoded as bytes: what the pipeline must have produced
        ids = torch.tensor([list(prompt.encode())])
        for _ in range(5):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert out == bytes(ids[0].tolist()).decode("utf-8", errors="replace")
    assert out.startswith(prompt) and len(out.encode()) >= len(prompt) + 1
