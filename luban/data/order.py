"""The sample-order rules: which sample of an epoch comes at each position, by order version.

A rule maps ``(seed, epoch, N)`` to a function from positions in ``[0, N)`` (a numpy array) to the sample
indices at those positions: a permutation of ``[0, N)`` that depends on nothing else. ``ORDER_RULES`` holds
one rule per version; a run keeps the version it started with (``TokenLoader.state_dict()["order_version"]``,
stored in every checkpoint), and new runs use ``ORDER_VERSION``.

* Version 1, ``permutation_order``: ``numpy.random.default_rng([seed, epoch]).permutation(N)``, built whole
  (8 bytes a sample: 29 GB a rank for an epoch of 3.66e9 samples, 15T tokens at seq 4096).
* Version 2, ``feistel_order``: a keyed bijection computed per position, O(1) memory and time a sample
  whatever ``N`` (``FEISTEL_ROUNDS`` 64-bit keys an epoch).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

ORDER_VERSION = 2  # the order of a new run
UNVERSIONED_ORDER = 1  # the order of a loader state (a checkpoint's meta.json) saved before order versions
FEISTEL_ROUNDS = 6  # Luby-Rackoff: 4 rounds already give a pseudorandom permutation; 6 for a margin, still cheap

Order = Callable[[np.ndarray], np.ndarray]


def permutation_order(seed: int, epoch: int, n: int) -> Order:
    """Version 1: the whole permutation, materialised (O(N) memory and time at each epoch start)."""
    permutation = np.random.default_rng([seed, epoch]).permutation(n)
    return lambda positions: permutation[positions]


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (Steele, Lea & Flood 2014): a bijection of uint64 that spreads every input bit."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _feistel(x: np.ndarray, keys: np.ndarray, half: int, inverse: bool = False) -> np.ndarray:
    """A balanced Feistel network on ``[0, 4**half)``: ``x`` is ``(L, R)``, ``half`` bits each; a round is
    ``(L, R) -> (R, L ^ F(R))`` with ``F(R) = mix(R ^ key)``, a bijection for any ``F`` (Luby & Rackoff 1988)."""
    bits, mask = np.uint64(half), np.uint64((1 << half) - 1)
    left, right = x >> bits, x & mask
    for key in (keys[::-1] if inverse else keys):
        if inverse:  # undo (L, R) -> (R, L ^ F(R)): (L', R') -> (R' ^ F(L'), L')
            left, right = right ^ (_mix(left ^ key) & mask), left
        else:
            left, right = right, left ^ (_mix(right ^ key) & mask)
    return (left << bits) | right


def _walk(positions, keys: np.ndarray, half: int, n: int, inverse: bool) -> np.ndarray:
    """Cycle-walking (Black & Rogaway 2002, "Ciphers with Arbitrary Finite Domains", section 6): apply the
    permutation of ``[0, 4**half)`` again to each value until it falls inside ``[0, n)``: a permutation of
    ``[0, n)``. ``4**half < 4n``, so a value takes fewer than 4 passes on average. ``positions`` of any shape
    (one position too, as version 1 takes it), walked flat: numpy's 0-d arithmetic is a scalar's, which warns
    on the wrap-around the mix relies on and cannot be indexed."""
    x = np.asarray(positions, dtype=np.int64)
    if x.size and (x.min() < 0 or x.max() >= n):  # (outside, a walk could cycle outside [0, n) for ever)
        raise ValueError(f"positions must lie in [0, {n})")
    y = _feistel(x.reshape(-1).astype(np.uint64), keys, half, inverse)
    left = np.flatnonzero(y >= n)
    while left.size:
        y[left] = _feistel(y[left], keys, half, inverse)
        left = left[y[left] >= n]
    return y.astype(np.int64).reshape(x.shape)


def feistel_keys(seed: int, epoch: int, n: int) -> tuple[np.ndarray, int]:
    """The round keys of ``(seed, epoch)`` and the half width: the smallest ``half >= 1`` with ``4**half >= n``."""
    keys = np.random.SeedSequence([seed, epoch], spawn_key=(2,)).generate_state(FEISTEL_ROUNDS, np.uint64)
    return keys, max(1, ((int(n) - 1).bit_length() + 1) // 2)


def feistel_order(seed: int, epoch: int, n: int, inverse: bool = False) -> Order:
    """Version 2: a keyed Feistel permutation of ``[0, 4**half)``, cycle-walked into ``[0, n)``; keys from
    ``SeedSequence([seed, epoch])`` (its child stream 2, not version 1's generator). ``inverse``: the inverse
    (from a sample index to its position)."""
    keys, half = feistel_keys(seed, epoch, n)
    return lambda positions: _walk(positions, keys, half, n, inverse)


ORDER_RULES: dict[int, Callable[[int, int, int], Order]] = {1: permutation_order, 2: feistel_order}


ORDER_ALLOWED = (f"a sample-order version this luban knows ({', '.join(map(str, ORDER_RULES))}); "
                 "saved by another luban: resume it with that one")


def known_order(version) -> bool:
    """Whether ``version`` names a rule of ``ORDER_RULES`` (else refuse it with ``ORDER_ALLOWED``)."""
    return not isinstance(version, bool) and isinstance(version, (int, np.integer)) and int(version) in ORDER_RULES


def epoch_order(seed: int, epoch: int, n: int, version: int = ORDER_VERSION) -> np.ndarray:
    """The whole order of ``epoch`` (O(N): for tests and tools; the loader asks for a batch's positions only)."""
    return ORDER_RULES[version](seed, epoch, n)(np.arange(n))
