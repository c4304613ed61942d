"""Review of 2026-12-02: the rope table under context parallel.

A cp rank's stage gets its tokens' global positions from ``feed_positions``; the model built its
rope table of every ``seq_len`` position whenever positions were given (reading their largest would
wait for the device), so an imported model with ``max_position_embeddings`` 2^24 under cp built a
17 GB table on each rank whatever the sequence. The hook now passes the whole sequence's length as
``span``: the table covers that sequence, rounded up to a power of two, and its rows are unchanged.
"""

from __future__ import annotations

import dataclasses

import torch

from luban.model.presets import get_preset
from luban.model.transformer import Transformer, rope_tables
from luban.parallel.context_parallel import chunk_positions, feed_positions, shard_sequence


def test_cp_rope_table_covers_the_sequence_not_every_position():
    cfg = dataclasses.replace(get_preset("tiny-llama"), seq_len=1 << 24)
    cpu = torch.device("cpu")
    seen = {}
    for cp, rank, seq, rows in ((2, 1, 16, 16), (2, 0, 24, 32), (4, 3, 40, 64)):
        model = Transformer(cfg)
        feed_positions(model, cp, rank, seq_factor=cp)
        block = model.layers["0"]
        block.register_forward_pre_hook(lambda _m, args: seen.update(rope=args[1]))
        x = shard_sequence(torch.randint(0, cfg.vocab, (1, seq)), cp, rank)
        model(x)
        assert model._rope_cache[cpu][0].shape[0] == rows
        want = rope_tables(dataclasses.replace(cfg, seq_len=rows), chunk_positions(seq, cp, rank))
        assert torch.equal(seen["rope"][0], want[0]) and torch.equal(seen["rope"][1], want[1])


def test_positions_without_a_span_still_get_the_whole_table():
    cfg = dataclasses.replace(get_preset("tiny-llama"), seq_len=48)
    model = Transformer(cfg)
    cos, _sin = model.rope(torch.tensor([0, 47]), 2, torch.device("cpu"))
    assert model._rope_cache[torch.device("cpu")][0].shape[0] == 48 and cos.shape[0] == 2
