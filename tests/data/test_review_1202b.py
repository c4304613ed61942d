"""Review 2026-12-02 (b) of the sample order: each test is one defect, and fails without its fix."""

from __future__ import annotations

import warnings

import numpy as np

from luban.data.order import ORDER_RULES


def test_every_version_maps_one_position_as_it_maps_an_array():
    """A rule is a function of positions; version 1 takes one position (a tool asking for one sample's index,
    ``ORDER_RULES[v](seed, e, n)(g % n)``). Version 2 warned "overflow encountered in scalar multiply" (numpy's
    0-d arithmetic is a scalar's) and raised IndexError where the first pass fell outside [0, n)."""
    n = 10
    for version, rule in ORDER_RULES.items():
        order = rule(0, 0, n)
        whole = order(np.arange(n))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ones = [int(order(p)) for p in range(n)] + [int(order(np.int64(p))) for p in range(n)]
        assert ones == list(whole) * 2, version
        np.testing.assert_array_equal(order(np.arange(n).reshape(2, 5)), whole.reshape(2, 5))
