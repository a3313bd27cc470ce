"""Id sets for benchmarks: uniform (cold) and Zipf (like real text)."""
from __future__ import annotations

import numpy as np

REFERENCE_IDS = np.array([5237, 23872, 301, 16652, 19602, 1148], dtype=np.int64)
ZIPF_EXPONENT = 1.1
DISTRIBUTIONS = ("uniform", "zipf")


def id_sets(distribution: str, n: int, vocab_size: int, count: int, seed: int = 0) -> list[np.ndarray]:
    """`count` fresh int64 id arrays of length n, so repetitions read the table from memory.

    Zipf: rank r (1 to `vocab_size`) has probability proportional to r**-1.1,
    the distribution truncated to the vocabulary; ranks map to rows through
    a fixed random permutation, so frequent ids are spread over the table.
    The reference sentence (n == 6, uniform) is always the reference ids.
    """
    rng = np.random.default_rng(seed)
    if n == len(REFERENCE_IDS) and distribution == "uniform" and vocab_size > REFERENCE_IDS.max():
        return [REFERENCE_IDS.copy() for _ in range(count)]
    if distribution == "uniform":
        return [rng.integers(0, vocab_size, n) for _ in range(count)]
    if distribution == "zipf":
        rows_by_rank = rng.permutation(vocab_size)
        return [rows_by_rank[_truncated_zipf_ranks(rng, n, vocab_size) - 1] for _ in range(count)]
    raise ValueError(f"unknown distribution {distribution!r}; known: {', '.join(DISTRIBUTIONS)}")


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
