"""``luban data build | verify | info``: make, check and describe packed token datasets."""

from __future__ import annotations

import argparse
import json
import time

from luban import schema

DATASET_DIR = schema.text(allowed="a dataset folder")  # not '' (which would be the current folder)


def register(subparsers) -> None:
    from luban.data.build import DEFAULT_BPE_VOCAB, DEFAULT_SHARD_MB, DEFAULT_VAL_FRACTION, OPTIONS
    from luban.data.corpus import DEFAULT_MAX_BYTES
    from luban.data.shards import DEFAULT_CHUNK_TOKENS, MAX_BUILD_CHUNK_TOKENS

    data = subparsers.add_parser("data", help="build, verify and inspect token datasets",
                                 description=__doc__)
    sub = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")

    build = sub.add_parser(
        "build", help="tokenise text files into packed shards",
        description="Tokenise INPUTS (files or folders, each file one document) into a few "
        "large checksummed shards plus manifest.json. With no INPUTS, builds the default "
        "corpus: the Python standard library's .py sources. See docs/data.md.")
    build.add_argument("inputs", nargs="*", metavar="INPUTS", help="text files or folders")
    build.add_argument("--out", required=True, metavar="DIR", type=OPTIONS["out"], help="dataset directory to write")
    build.add_argument("--tokenizer", default="byte", metavar="byte|bpe", type=OPTIONS["tokenizer"],
                       help="byte-level (257 ids) or a BPE trained here (default: byte)")
    build.add_argument("--vocab-size", metavar="N", type=OPTIONS["vocab_size"],
                       help=f"BPE vocabulary size (default {DEFAULT_BPE_VOCAB}; bpe only)")
    build.add_argument("--shard-size-mb", default=DEFAULT_SHARD_MB, metavar="N", type=OPTIONS["shard_size_mb"],
                       help=f"target tokens per shard in MiB (default {DEFAULT_SHARD_MB:g})")
    build.add_argument("--val-fraction", default=DEFAULT_VAL_FRACTION, metavar="F", type=OPTIONS["val_fraction"],
                       help=f"fraction of documents held out (default {DEFAULT_VAL_FRACTION})")
    build.add_argument("--seed", default=0, metavar="N", type=OPTIONS["seed"], help="split seed (default 0)")
    build.add_argument("--max-bytes", metavar="N", type=OPTIONS["max_bytes"],
                       help=f"cap on input bytes (default {DEFAULT_MAX_BYTES} for the default "
                       "corpus, none for INPUTS)")
    build.add_argument("--chunk-tokens", default=DEFAULT_CHUNK_TOKENS, metavar="N", type=OPTIONS["chunk_tokens"],
                       help=f"tokens per CRC chunk (default {DEFAULT_CHUNK_TOKENS}, at most {MAX_BUILD_CHUNK_TOKENS})")
    build.set_defaults(func=_build)

    verify = sub.add_parser("verify", help="check everything training reads from a dataset",
                            description="Check the manifest; every shard's sizes, header, chunk-CRC table, document "
                            "index, token-chunk CRCs and token ids; the tokenizer file, its SHA-256 and vocabulary; exit 2 "
                            "naming the file on error.")
    verify.add_argument("dir", metavar="DIR", type=DATASET_DIR)
    verify.set_defaults(func=_verify)

    info = sub.add_parser("info", help="describe a dataset",
                          description="Print a dataset's tokenizer, splits, shards and sizes.")
    info.add_argument("dir", metavar="DIR", type=DATASET_DIR)
    info.add_argument("--json", action="store_true", help="print the manifest as JSON")
    info.set_defaults(func=_info)


def _build(args: argparse.Namespace) -> int:
    from luban.data.build import build_dataset

    from luban import interrupt

    started = time.perf_counter()
    with interrupt.sigterm_unwinds():  # SIGTERM (a job's stop): the stage is removed, then 143 (it was left behind)
        manifest = build_dataset(args.inputs, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                                 shard_size_mb=args.shard_size_mb, val_fraction=args.val_fraction, seed=args.seed,
                                 max_bytes=args.max_bytes, chunk_tokens=args.chunk_tokens)
    seconds = time.perf_counter() - started
    src = manifest["source"]
    print(f"built {args.out}: {src['files']} files, {src['bytes']} bytes in {seconds:.2f} s "
          f"({src['bytes'] / seconds / 1e6:.1f} MB/s)")
    _print_splits(manifest)
    return 0


def _print_splits(manifest: dict) -> None:
    tok = manifest["tokenizer"]
    print(f"tokenizer {tok['kind']} (vocab {tok['vocab_size']}, eos {tok['eos_id']}), "
          f"dtype {manifest['dtype']}, format v{manifest['format_version']}")
    for name, split in manifest["splits"].items():
        size = sum(s["bytes"] for s in split["shards"])
        print(f"  {name:5s} {split['tokens']:>12,d} tokens {split['documents']:>8,d} documents "
              f"{len(split['shards']):>4d} shards {size / 2**20:>9.1f} MiB")


def _verify(args: argparse.Namespace) -> int:
    """Everything training reads: the manifest, every shard (sizes, header, chunk-CRC table, document index
    (``ShardReader.verify``: training reads none of it), chunk CRCs, and
    token ids below the tokenizer's vocabulary) and the tokenizer (its file, SHA-256, vocabulary)."""
    from luban.data.manifest import open_dataset
    from luban.data.tokenizer import load_tokenizer
    from luban.errors import LubanError

    started = time.perf_counter()
    manifest, splits = open_dataset(args.dir, "DIR")
    tok = load_tokenizer(args.dir)
    entry = manifest["tokenizer"]
    print(f"ok tokenizer {tok.kind} (vocab {tok.vocab_size}, eos {tok.eos_id}"
          + (f", {entry['file']} sha256 {entry['sha256'][:12]}..." if entry.get("sha256") else "") + ")")
    total = 0
    for readers in splits.values():
        for reader in readers:
            try:  # one shard open at a time: a dataset has more shards than a process may open files
                reader.verify()
                top = max((int(reader.read(i, min(i + (1 << 24), reader.tokens)).max())
                           for i in range(0, reader.tokens, 1 << 24)), default=-1)
            finally:
                reader.close()
            if top >= tok.vocab_size:
                raise LubanError(f"{reader.path}: token id {top} is outside the tokenizer's vocabulary "
                                 f"({tok.vocab_size} ids); rebuild the dataset with `luban data build`")
            total += reader.size
            print(f"ok {reader.path} ({reader.tokens} tokens, {reader.size} bytes)")
    print(f"verified {args.dir}: {total} bytes in {time.perf_counter() - started:.2f} s")
    return 0


def _info(args: argparse.Namespace) -> int:
    from luban.data.manifest import load_manifest

    manifest = load_manifest(args.dir, "DIR")
    if args.json:
        print(json.dumps(manifest, indent=2))
        return 0
    src = manifest["source"]
    print(f"{args.dir}: {src['kind']} ({src['files']} files, {src['bytes']} bytes), "
          f"val fraction {manifest['val_fraction']}, seed {manifest['seed']}")
    _print_splits(manifest)
    return 0
