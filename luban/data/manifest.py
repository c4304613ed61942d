"""``manifest.json``: the one file that says what a dataset directory contains.

The manifest is written last (atomically), so it is the commit point of ``luban data build``:
a directory without one is not a dataset, and a crashed rebuild (which deletes the old
manifest first) never looks valid. Schema (docs/data.md)::

    {"format": "luban-tokens", "format_version": 2, "dtype": "uint16", "chunk_tokens": N,
     "tokenizer": {"kind", "vocab_size", "eos_id", "file"},
     "source": {"kind": "default-corpus" | "files", "files", "bytes", "max_bytes"},
     "val_fraction": F, "seed": S,
     "splits": {"train"|"val": {"tokens", "documents",
                                "shards": [{"file", "tokens", "documents", "bytes", "header_crc32"}]}},
     "checksum": SHA-256 of the rest}

``load_manifest`` checks the checksum, then the structure: split names, shard names exactly
``SPLIT-00000.bin``, ``SPLIT-00001.bin``... in order (so no path can leave the folder and no
shard can be dropped or reordered unnoticed), integer counts, and totals equal to the sums.
``format_version`` is the shards' format version: 2 is written, 1 and 2 are read (``open_split``
checks every shard is of that version).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from luban.data.atomic import write_bytes
from luban.data.shards import DTYPES, MAX_CHUNK_TOKENS, READ_VERSIONS, ShardReader, dtype_for_vocab
from luban.data.tokenizer import BPE_FILE
from luban.errors import LubanError, bad_value

MANIFEST = "manifest.json"
FORMAT = "luban-tokens"
_REQUIRED = ("format_version", "dtype", "tokenizer", "splits")


SPLIT_NAMES = ("train", "val")
SHARD_NAME = re.compile(r"^(train|val)-\d{5,}\.bin$")  # {:05d}: a 100001st shard has 6 digits
COUNTS = ("tokens", "documents", "bytes")
SHARD_CRC = "header_crc32"  # ShardInfo's; manifests written before it was recorded are checked without it
SOURCE_KINDS = ("default-corpus", "files")
MAX_COUNT = (1 << 63) - 1  # a count or size of bytes: what a file offset (off_t) holds
# a manifest is 5 levels deep (splits.train.shards[i].file); deeper is not one, and deep enough
# (~990 levels) passed json.loads only to overflow the stack in content_checksum's json.dumps
MAX_DEPTH = 16
TOKENIZER_FILES = {"byte": None, "bpe": BPE_FILE}  # what ``tokenizer.file`` names, by kind


def content_checksum(manifest: dict) -> str:
    """SHA-256 of the manifest's content (every key but ``checksum``, canonical JSON)."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_manifest(dataset_dir: Path, manifest: dict) -> dict:
    """Write ``manifest`` with its checksum (atomically); returns what was written."""
    manifest = {**manifest, "checksum": content_checksum(manifest)}
    write_bytes(Path(dataset_dir) / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    return manifest


def _check_splits(path: Path, splits) -> None:
    """Splits, shard order, names (confined to the dataset folder), counts and totals."""
    def bad(where: str, value, allowed: str):
        return bad_value(f"{path}: {where}", value, allowed)

    if not isinstance(splits, dict) or not splits or not set(splits) <= set(SPLIT_NAMES):
        raise bad("splits", splits if not isinstance(splits, dict) else sorted(splits),
                  "a mapping of train/val to their shards")
    for split, entry in splits.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("shards"), list):
            raise bad(f"splits.{split}", entry, "a mapping with tokens, documents and a list of shards")
        totals = dict.fromkeys(("tokens", "documents"), 0)
        for i, shard in enumerate(entry["shards"]):
            want = f"{split}-{i:05d}.bin"  # order and confinement: names are exactly these, in this order
            if not isinstance(shard, dict) or shard.get("file") != want:
                raise bad(f"splits.{split}.shards[{i}].file", shard.get("file") if isinstance(shard, dict) else shard,
                          f"{want!r} (shards are named in order inside the dataset folder)")
            for key in COUNTS:
                if not _count(shard.get(key)):
                    raise bad(f"splits.{split}.shards[{i}].{key}", shard.get(key), f"an integer from 0 to {MAX_COUNT}")
            if SHARD_CRC in shard and not (_whole(shard[SHARD_CRC]) and 0 <= shard[SHARD_CRC] < 1 << 32):
                raise bad(f"splits.{split}.shards[{i}].{SHARD_CRC}", shard[SHARD_CRC],
                          "an integer from 0 to 4294967295")
            for key in totals:
                totals[key] += shard[key]
        for key, total in totals.items():
            if not _whole(entry.get(key)) or entry[key] != total:  # (9407.0 and true passed as totals)
                raise bad(f"splits.{split}.{key}", entry.get(key), f"{total}, the sum over its shards")


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(value) -> bool:
    return _whole(value) and 0 <= value <= MAX_COUNT


def _deeper_than(value, limit: int) -> bool:
    """Whether JSON ``value`` nests more than ``limit`` levels (without recursion)."""
    level = [value]
    for _ in range(limit):
        level = [v for item in level if isinstance(item, (dict, list))
                 for v in (item.values() if isinstance(item, dict) else item)]
        if not level:
            return False
    return any(isinstance(item, (dict, list)) and item for item in level)


def _check_header(path: Path, manifest: dict) -> None:
    """The fields a reader trusts besides the splits: the token dtype (the one the vocabulary
    needs), the chunk size, the tokenizer's kind, vocabulary and end-of-document id."""
    def bad(where: str, value, allowed: str):
        return bad_value(f"{path}: {where}", value, allowed)

    tok = manifest["tokenizer"]
    if not isinstance(tok, dict) or tok.get("kind") not in ("byte", "bpe"):
        raise bad("tokenizer", tok, "a table with kind 'byte' or 'bpe', vocab_size and eos_id")
    vocab, eos = tok.get("vocab_size"), tok.get("eos_id")
    if not _whole(vocab) or not 2 <= vocab <= 1 << 32:
        raise bad("tokenizer.vocab_size", vocab, "an integer from 2 to 4294967296")
    if not _whole(eos) or not 0 <= eos < vocab:
        raise bad("tokenizer.eos_id", eos, f"an integer from 0 to {vocab - 1} (below vocab_size)")
    if manifest["dtype"] != dtype_for_vocab(vocab).name:
        raise bad("dtype", manifest["dtype"], f"{dtype_for_vocab(vocab).name!r}, the token type of a {vocab}-token "
                                              f"vocabulary (one of {sorted(d.name for d in DTYPES.values())})")
    if tok.get("file") != TOKENIZER_FILES[tok["kind"]]:  # (verify printed any text there to the terminal)
        want = TOKENIZER_FILES[tok["kind"]]
        want = "null (no file)" if want is None else repr(want)
        raise bad("tokenizer.file", tok.get("file"), f"{want} for a {tok['kind']} tokenizer")
    if "sha256" in tok and (tok["kind"] != "bpe" or not (isinstance(tok["sha256"], str)
                                                         and re.fullmatch(r"[0-9a-f]{64}", tok["sha256"]))):
        raise bad("tokenizer.sha256", tok["sha256"], "the 64 hex digits of tokenizer.json's SHA-256 (bpe only)")
    chunk = manifest.get("chunk_tokens", 1)
    if not _whole(chunk) or not 1 <= chunk <= MAX_CHUNK_TOKENS:
        raise bad("chunk_tokens", chunk, f"an integer from 1 to {MAX_CHUNK_TOKENS}")


def _check_description(path: Path, manifest: dict) -> None:
    """What ``luban data info`` and ``ensure_default_dataset`` read besides the splits: the source
    (kind, file and byte counts), the validation fraction and the split seed."""
    def bad(where: str, value, allowed: str):
        return bad_value(f"{path}: {where}", value, allowed)

    source = manifest.get("source")
    if not isinstance(source, dict) or source.get("kind") not in SOURCE_KINDS:
        raise bad("source", source, f"a table with kind one of {list(SOURCE_KINDS)}, files and bytes")
    for key in ("files", "bytes"):
        if not _count(source.get(key)):
            raise bad(f"source.{key}", source.get(key), f"an integer from 0 to {MAX_COUNT}")
    fraction = manifest.get("val_fraction")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < 1:
        raise bad("val_fraction", fraction, "a number in [0, 1)")
    if not _whole(manifest.get("seed")) or manifest["seed"] < 0:
        raise bad("seed", manifest.get("seed"), "an integer >= 0")


def load_manifest(dataset_dir: str | Path, key: str = "dataset_dir") -> dict:
    """Read and sanity-check ``dataset_dir/manifest.json``; ``LubanError`` if it is unusable (``key``: the
    argument or setting that named the folder, as the error names it)."""
    dataset_dir = Path(dataset_dir)
    if not dataset_dir.is_dir():
        raise bad_value(key, str(dataset_dir),
                        "no such directory; build one with `luban data build --out DIR`")
    path = dataset_dir / MANIFEST
    if path.exists() and not path.is_file():  # a named pipe would block the read, a device never end it
        raise LubanError(f"{path}: not a regular file, so {dataset_dir} is not a luban dataset; "
                         "build one with `luban data build --out DIR`")
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise LubanError(f"{path}: missing, so {dataset_dir} is not a (complete) luban dataset; "
                         "build one with `luban data build --out DIR`") from None
    except (OSError, ValueError, RecursionError) as err:
        raise LubanError(f"{path}: unreadable ({err})") from None
    if not isinstance(manifest, dict):
        raise LubanError(f"{path}: not a {FORMAT} manifest (not a JSON object)")
    if _deeper_than(manifest, MAX_DEPTH):
        raise LubanError(f"{path}: not a {FORMAT} manifest (nested deeper than {MAX_DEPTH} levels)")
    missing = [key for key in _REQUIRED if key not in manifest]
    if manifest.get("format") != FORMAT or missing:
        raise LubanError(f"{path}: not a {FORMAT} manifest (missing {missing or 'format'})")
    if manifest.get("checksum") != content_checksum(manifest):
        raise LubanError(f"{path}: content checksum {'missing' if 'checksum' not in manifest else 'mismatch'} "
                         "(edited or damaged); rebuild the dataset with `luban data build`")
    if not _whole(manifest["format_version"]) or manifest["format_version"] not in READ_VERSIONS:
        raise bad_value(f"{path}: format_version", manifest["format_version"],
                        f"this luban reads versions {' and '.join(map(str, READ_VERSIONS))}; rebuild the dataset")
    _check_header(path, manifest)
    _check_description(path, manifest)
    _check_splits(path, manifest["splits"])
    return manifest


def open_split(dataset_dir: str | Path, manifest: dict, split: str) -> list[ShardReader]:
    """Open a split's shards in order, checking each against the format version, the token dtype and the sizes
    the manifest records; each reader refuses a chunk with an id outside the tokenizer's vocabulary when it
    verifies it (``ShardReader.vocab_size``)."""
    if not isinstance(split, str) or split not in manifest["splits"]:
        raise bad_value("split", split, f"one of {sorted(manifest['splits'])}")
    readers = []
    for entry in manifest["splits"][split]["shards"]:
        path = Path(dataset_dir) / entry["file"]
        if not path.is_file() or path.is_symlink():
            raise LubanError(f"{path}: {'missing' if not path.exists() else 'not a regular file'}, but "
                             f"{MANIFEST} names it; rebuild the dataset")
        reader = ShardReader(path, vocab_size=manifest["tokenizer"]["vocab_size"])
        if reader.version != manifest["format_version"]:
            raise LubanError(f"{reader.path}: format version {reader.version}, but {MANIFEST} says "
                             f"{manifest['format_version']}; rebuild the dataset")
        if reader.dtype.name != manifest["dtype"]:  # (``_check_header``: the manifest's is its vocabulary's)
            raise LubanError(f"{reader.path}: {reader.dtype.name} tokens, but {MANIFEST} says {manifest['dtype']} "
                             f"(a {manifest['tokenizer']['vocab_size']}-token vocabulary); rebuild the dataset")
        found = {"tokens": reader.tokens, "documents": reader.documents, "bytes": reader.size,
                 SHARD_CRC: reader.header_crc}
        wrong = {k: v for k, v in found.items() if k in entry and v != entry[k]}
        if "chunk_tokens" in manifest and reader.chunk_tokens != manifest["chunk_tokens"]:
            wrong["chunk_tokens"], entry = reader.chunk_tokens, {**entry, "chunk_tokens": manifest["chunk_tokens"]}
        if wrong:
            raise LubanError(f"{reader.path}: {wrong} disagrees with {MANIFEST} "
                             f"({ {k: entry[k] for k in wrong} }); rebuild the dataset")
        readers.append(reader)
    return readers


def open_dataset(dataset_dir: str | Path, key: str = "dataset_dir") -> tuple[dict, dict[str, list[ShardReader]]]:
    """The manifest and every split's opened shards (checked at open: header, chunk-CRC table; version 1:
    document index)."""
    manifest = load_manifest(dataset_dir, key)
    return manifest, {s: open_split(dataset_dir, manifest, s) for s in manifest["splits"]}
