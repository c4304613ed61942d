"""Data layer: packed token shards, tokenisers, the default corpus and the resumable loader.

Modules (one concept each): ``atomic`` (crash-safe writes), ``shards`` (the shard file
format), ``tokenizer`` (byte-level and BPE), ``corpus`` (input files and the embedded default
corpus), ``manifest`` (the dataset description), ``build`` (text -> shards), ``order`` (the
sample-order rules, by version), ``loader`` (deterministic, dp-independent batches; imports torch)
and ``cli`` (``luban data ...``).
The byte layout and policies are documented in docs/data.md.
"""
