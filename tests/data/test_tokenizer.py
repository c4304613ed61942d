"""Byte-level and BPE tokenisers: round trips, EOS, persistence next to the shards."""

from __future__ import annotations

import pytest

from luban.data.build import build_dataset
from luban.data.tokenizer import BpeTokenizer, ByteTokenizer, load_tokenizer
from luban.errors import LubanError

TEXTS = ["def f(x):\n    return x + 1\n", "héllo wörld 🙂 — “quotes”\ttabs\n", "", "a" * 50]


def test_byte_round_trip_and_eos():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text
        assert tok.decode(ids + [tok.eos_id]) == text
    assert [a.tolist() for a in tok.encode_batch(TEXTS)] == [tok.encode(t) for t in TEXTS]


def test_bpe_trains_locally_and_round_trips():
    tok = BpeTokenizer.train(TEXTS * 20, vocab_size=300)
    assert 257 < tok.vocab_size <= 300
    assert tok.eos_id == 0
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.eos_id not in ids
    assert len(tok.encode(TEXTS[0])) < len(TEXTS[0])  # merges were learnt
    assert [a.tolist() for a in tok.encode_batch(TEXTS)] == [tok.encode(t) for t in TEXTS]


@pytest.mark.parametrize("vocab_size", [100, 257, 1 << 21])
def test_bpe_vocab_size_range(vocab_size):
    with pytest.raises(LubanError, match=f"--vocab-size = {vocab_size}: an integer from 258"):
        BpeTokenizer.train(TEXTS, vocab_size)


def test_load_tokenizer_returns_what_the_build_used(tmp_path):
    (tmp_path / "in").mkdir()
    for i, text in enumerate(TEXTS * 3):
        (tmp_path / "in" / f"{i:02d}.txt").write_text(text * 5, encoding="utf-8")
    manifest = build_dataset([tmp_path / "in"], tmp_path / "bpe", tokenizer="bpe",
                             vocab_size=320, val_fraction=0)
    assert manifest["tokenizer"]["file"] == "tokenizer.json"
    tok = load_tokenizer(tmp_path / "bpe")
    assert isinstance(tok, BpeTokenizer) and tok.vocab_size == manifest["tokenizer"]["vocab_size"]
    assert tok.decode(tok.encode(TEXTS[1])) == TEXTS[1]
    build_dataset([tmp_path / "in"], tmp_path / "byte", val_fraction=0)
    assert isinstance(load_tokenizer(tmp_path / "byte"), ByteTokenizer)


def test_missing_bpe_file_is_named(tmp_path):
    (tmp_path / "in.txt").write_text("some text " * 50)
    build_dataset([tmp_path / "in.txt"], tmp_path / "ds", tokenizer="bpe", vocab_size=300)
    (tmp_path / "ds" / "tokenizer.json").unlink()
    with pytest.raises(LubanError, match="tokenizer.json: cannot load the BPE tokenizer"):
        load_tokenizer(tmp_path / "ds")
