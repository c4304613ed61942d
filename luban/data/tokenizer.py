"""Tokenisers: a built-in byte-level one and a byte-level BPE trained locally.

Both expose ``encode(str) -> list[int]``, ``decode(list[int]) -> str`` (the end-of-document id
is dropped), ``vocab_size``, ``eos_id``, ``kind``, plus ``encode_batch`` (numpy arrays, used
by the builder) and ``manifest_entry()``. ``load_tokenizer(dataset_dir)`` returns the one a
dataset was built with. The BPE uses the Hugging Face ``tokenizers`` library with a GPT-2
style byte-level alphabet, so every string round-trips and nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from luban.errors import LubanError, bad_value

EOS_TOKEN = "<|endoftext|>"
BPE_FILE = "tokenizer.json"
MIN_BPE_VOCAB = 258
MAX_BPE_VOCAB = 1 << 20


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255; id 256 ends a document."""

    kind = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i != self.eos_id).decode("utf-8", errors="replace")

    def manifest_entry(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "file": None}

    def hf_json(self) -> str:
        """This tokenizer as a Hugging Face ``tokenizer.json``: a byte-level BPE with no merges, byte b
        (in GPT-2's printable byte alphabet) at id b, so it encodes every text to the same ids."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        vocab = {char: byte for byte, char in _byte_alphabet().items()}
        model = Tokenizer(models.BPE(vocab={**vocab, EOS_TOKEN: self.eos_id}, merges=[]))
        model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        model.decoder = decoders.ByteLevel()
        model.add_special_tokens([EOS_TOKEN])
        return model.to_str()


class BpeTokenizer:
    """A byte-level BPE model (``tokenizers.Tokenizer``) with ``EOS_TOKEN`` as a special id."""

    kind = "bpe"

    def __init__(self, model):
        self._model = model
        self.vocab_size = model.get_vocab_size()
        self.eos_id = model.token_to_id(EOS_TOKEN)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BpeTokenizer:
        """Learn merges from ``texts`` locally (deterministic for the same texts)."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        if not MIN_BPE_VOCAB <= vocab_size <= MAX_BPE_VOCAB:
            raise bad_value("--vocab-size", vocab_size,
                            f"an integer from {MIN_BPE_VOCAB} to {MAX_BPE_VOCAB}")
        model = Tokenizer(models.BPE())
        model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        model.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        model.train_from_iterator(texts, trainer=trainer)
        return cls(model)

    @classmethod
    def load(cls, path: Path) -> BpeTokenizer:
        from tokenizers import Tokenizer

        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as err:  # missing or unparsable file: name it
            raise LubanError(f"{path}: cannot load the BPE tokenizer ({err})") from None

    def save(self, path: Path) -> None:
        from luban.data.atomic import write_bytes

        write_bytes(path, self._model.to_str().encode("utf-8"))

    def encode(self, text: str) -> list[int]:
        return self._model.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.uint32) for e in self._model.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._model.decode([int(i) for i in ids])

    def manifest_entry(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "file": BPE_FILE, "sha256": hashlib.sha256(self._model.to_str().encode("utf-8")).hexdigest()}

    def hf_json(self) -> str:
        return self._model.to_str()


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what ``pre_tokenizers.ByteLevel`` uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def hf_tokenizer_files(tok, max_len: int) -> dict[str, str]:
    """The files ``transformers.AutoTokenizer`` loads ``tok`` from: ``tokenizer.json``, ``tokenizer_config.json``
    and ``special_tokens_map.json``; the end-of-document token is also the start and the padding token (as
    GPT-2's), and nothing is added around a text (luban's ``encode``)."""
    import json

    special = {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "model_max_length": max_len,
              "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False}
    return {"tokenizer.json": tok.hf_json(), "tokenizer_config.json": json.dumps(config, indent=1),
            "special_tokens_map.json": json.dumps(special, indent=1)}


Tokenizer = ByteTokenizer | BpeTokenizer


def tokenizer_from_entry(dataset_dir: Path, entry: dict) -> Tokenizer:
    """The tokenizer a manifest's ``tokenizer`` entry describes, checked against it: the file
    exists and has the recorded SHA-256 (manifests since it was recorded), and its vocabulary
    size and end-of-document id are the entry's. ``LubanError`` naming the file otherwise."""
    where = Path(dataset_dir) / "manifest.json"
    if not isinstance(entry, dict):
        raise bad_value(f"{where}: tokenizer", entry, "an object with kind, vocab_size, eos_id, file")
    if entry.get("kind") == "byte":
        tok = ByteTokenizer()
    elif entry.get("kind") == "bpe":
        if entry.get("file") != BPE_FILE:
            raise bad_value(f"{where}: tokenizer.file", entry.get("file"), repr(BPE_FILE))
        path = Path(dataset_dir) / BPE_FILE
        if not path.is_file():  # a folder, a named pipe (never opened: a read would wait), a link to a device
            what = "not a regular file" if os.path.lexists(path) else "missing"
            raise LubanError(f"{path}: cannot load the BPE tokenizer ({what}, but {where.name} names it): the "
                             "dataset cannot be decoded or trained on; rebuild it with `luban data build`")
        try:
            text = path.read_bytes()
        except OSError as err:
            raise LubanError(f"{path}: unreadable ({err.strerror or err})") from None
        if "sha256" in entry and hashlib.sha256(text).hexdigest() != entry["sha256"]:
            raise LubanError(f"{path}: SHA-256 {hashlib.sha256(text).hexdigest()[:12]}... is not the "
                             f"{entry['sha256'][:12]}... {where.name} records (replaced or damaged); "
                             "rebuild the dataset with `luban data build`")
        tok = BpeTokenizer.load(path)
    else:
        raise bad_value(f"{where}: tokenizer.kind", entry.get("kind"), "one of 'byte', 'bpe'")
    for key in ("vocab_size", "eos_id"):
        if entry.get(key) != getattr(tok, key):
            raise LubanError(f"{where}: tokenizer.{key} = {entry.get(key)!r} but the {tok.kind} tokenizer "
                             f"has {getattr(tok, key)!r}; rebuild the dataset with `luban data build`")
    return tok


def load_tokenizer(dataset_dir: str | Path) -> Tokenizer:
    """The tokenizer ``luban data build`` recorded in ``dataset_dir/manifest.json`` (checked)."""
    from luban.data.manifest import load_manifest

    return tokenizer_from_entry(Path(dataset_dir), load_manifest(dataset_dir)["tokenizer"])


def tokenizer_identity(dataset_dir: str | Path) -> dict:
    """What makes a dataset's ids mean the same text: kind, vocab_size, eos_id and, for a BPE,
    the SHA-256 of its tokenizer file (checked by ``load_tokenizer``). A run records it."""
    from luban.data.manifest import load_manifest

    entry = load_manifest(dataset_dir)["tokenizer"]
    tok = tokenizer_from_entry(Path(dataset_dir), entry)
    out = {"kind": tok.kind, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id}
    if tok.kind == "bpe":
        out["sha256"] = hashlib.sha256((Path(dataset_dir) / BPE_FILE).read_bytes()).hexdigest()
    return out
