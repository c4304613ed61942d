"""``manifest.json``: the one file that says what a dataset directory contains.

The manifest is written last (atomically), so it is the commit point of ``luban data build``:
a directory without one is not a dataset, and a crashed rebuild (which deletes the old
manifest first) never looks valid. Schema (docs/data.md)::

    {"format": "luban-tokens", "format_version": 1, "dtype": "uint16", "chunk_tokens": N,
     "tokenizer": {"kind", "vocab_size", "eos_id", "file"},
     "source": {"kind": "default-corpus" | "files", "files", "bytes", "max_bytes"},
     "val_fraction": F, "seed": S,
     "splits": {"train"|"val": {"tokens", "documents",
                                "shards": [{"file", "tokens", "documents", "bytes"}]}}}
"""

from __future__ import annotations

import json
from pathlib import Path

from luban.data.atomic import write_bytes
from luban.data.shards import FORMAT_VERSION, ShardReader
from luban.errors import LubanError, bad_value

MANIFEST = "manifest.json"
FORMAT = "luban-tokens"
_REQUIRED = ("format_version", "dtype", "tokenizer", "splits")


def write_manifest(dataset_dir: Path, manifest: dict) -> None:
    write_bytes(Path(dataset_dir) / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())


def load_manifest(dataset_dir: str | Path) -> dict:
    """Read and sanity-check ``dataset_dir/manifest.json``; ``LubanError`` if it is unusable."""
    dataset_dir = Path(dataset_dir)
    if not dataset_dir.is_dir():
        raise bad_value("dataset_dir", str(dataset_dir),
                        "no such directory; build one with `luban data build --out DIR`")
    path = dataset_dir / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise LubanError(f"{path}: missing, so {dataset_dir} is not a (complete) luban dataset; "
                         "build one with `luban data build --out DIR`") from None
    except (OSError, ValueError) as err:
        raise LubanError(f"{path}: unreadable ({err})") from None
    missing = [key for key in _REQUIRED if key not in manifest]
    if manifest.get("format") != FORMAT or missing:
        raise LubanError(f"{path}: not a {FORMAT} manifest (missing {missing or 'format'})")
    if manifest["format_version"] != FORMAT_VERSION:
        raise bad_value(f"{path}: format_version", manifest["format_version"],
                        f"this luban reads version {FORMAT_VERSION}; rebuild the dataset")
    return manifest


def open_split(dataset_dir: str | Path, manifest: dict, split: str) -> list[ShardReader]:
    """Open a split's shards in order, checking each against the sizes the manifest records."""
    if split not in manifest["splits"]:
        raise bad_value("split", split, f"one of {sorted(manifest['splits'])}")
    readers = []
    for entry in manifest["splits"][split]["shards"]:
        reader = ShardReader(Path(dataset_dir) / entry["file"])
        found = {"tokens": reader.tokens, "documents": reader.documents, "bytes": reader.size}
        wrong = {k: v for k, v in found.items() if v != entry[k]}
        if wrong:
            raise LubanError(f"{reader.path}: {wrong} disagrees with {MANIFEST} "
                             f"({ {k: entry[k] for k in wrong} }); rebuild the dataset")
        readers.append(reader)
    return readers


def open_dataset(dataset_dir: str | Path) -> tuple[dict, dict[str, list[ShardReader]]]:
    """The manifest and every split's opened (header- and index-checked) shards."""
    manifest = load_manifest(dataset_dir)
    return manifest, {s: open_split(dataset_dir, manifest, s) for s in manifest["splits"]}
