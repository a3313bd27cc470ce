"""Id sets for benchmarks: uniform (cold) and Zipf (like real text)."""
from __future__ import annotations

import math

import numpy as np

REFERENCE_IDS = np.array([5237, 23872, 301, 16652, 19602, 1148], dtype=np.int64)
ZIPF_EXPONENT = 1.1
DISTRIBUTIONS = ("uniform", "zipf")


def id_sets(distribution: str, n: int, vocab_size: int, count: int, seed: int = 0) -> list[np.ndarray]:
    """`count` fresh int64 id arrays of length n, so repetitions read the table from memory.

    Zipf: rank r (1 to `vocab_size`) has probability proportional to r**-1.1,
    the distribution truncated to the vocabulary; rank r is row
    ``(a * (r - 1) + b) % vocab_size`` for a random `a` prime to the vocabulary's
    size and a random `b`: a fixed bijection that spreads the frequent ids
    over the table, and takes no memory or time of the vocabulary's size.
    The reference sentence (n == 6, uniform) is always the reference ids.
    """
    rng = np.random.default_rng(seed)
    if n == len(REFERENCE_IDS) and distribution == "uniform" and vocab_size > REFERENCE_IDS.max():
        return [REFERENCE_IDS.copy() for _ in range(count)]
    if distribution == "uniform":
        return [rng.integers(0, vocab_size, n) for _ in range(count)]
    if distribution == "zipf":
        step, shift = _rank_map(rng, vocab_size)
        return [(step * (_truncated_zipf_ranks(rng, n, vocab_size) - 1) + shift) % vocab_size for _ in range(count)]
    raise ValueError(f"unknown distribution {distribution!r}; known: {', '.join(DISTRIBUTIONS)}")


def _rank_map(rng: np.random.Generator, vocab_size: int) -> tuple[int, int]:
    """A step prime to `vocab_size` (so that ``step * k % vocab_size`` takes every value once) and a shift, both
    random; the step is at most ``(2**63 - vocab_size) // vocab_size``, so that ``step * rank + shift`` fits int64
    (a vocabulary of up to 2**62 rows: a table of more rows would not fit any machine's memory)."""
    bound = max(2, min(vocab_size, (2**63 - vocab_size) // max(1, vocab_size) + 1))
    while True:
        step = int(rng.integers(1, bound))
        if math.gcd(step, vocab_size) == 1:
            return step, int(rng.integers(0, max(1, vocab_size)))


def _truncated_zipf_ranks(rng: np.random.Generator, n: int, vocab_size: int) -> np.ndarray:
    """`n` Zipf ranks from 1 to `vocab_size`: numpy's unbounded draws, those beyond the vocabulary drawn again.

    Drawing again keeps each rank's probability proportional to r**-1.1 (a
    wrap-around modulo the vocabulary would spread the tail's mass, about
    29% of it at 129,280 ranks, evenly over every row); it takes no table of
    the vocabulary's size.

    Raises:
        ValueError: a vocabulary of no rows, from which no rank can be drawn.
    """
    if vocab_size < 1:
        raise ValueError(f"Zipf ids need a vocabulary of 1 row or more, got {vocab_size}")
    ranks = rng.zipf(ZIPF_EXPONENT, n)
    beyond = np.flatnonzero(ranks > vocab_size)
    while beyond.size:
        ranks[beyond] = rng.zipf(ZIPF_EXPONENT, beyond.size)
        beyond = beyond[ranks[beyond] > vocab_size]
    return ranks
