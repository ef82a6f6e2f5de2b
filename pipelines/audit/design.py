"""Choosing which pairs a person labels: a stratified sample by score with known inclusion
probabilities.

Pure functions, arrays in and out. The population is the job's ok pairs; each is put in a
*stratum* by its model ``p_clean`` (fixed score bands, ``EDGES``). Labels are spent where
the decision is uncertain: stratum ``h`` gets a share of the sample proportional to
``N_h * S_h`` (Neyman allocation) with ``S_h`` the Bernoulli standard deviation the model
predicts there, floored at ``S_FLOOR`` because the model is exactly what is being checked:
a band the model calls certain still gets labels, so a confidently wrong model is caught.
Within a stratum the pairs are a simple random sample without replacement, so every pair
of stratum ``h`` has inclusion probability ``pi_h = n_h / N_h`` and no pair is drawn twice.

The queue's order interleaves the strata (each stratum's draws spread evenly over the
queue, ``_interleave``), so a person who stops early has labelled a prefix that is still
a stratified random sample: the estimators (``pairclean.audit.stats``) use the number
actually labelled in each stratum, never the number planned.

Reproducible: the same scores, ``n`` and ``seed`` give the same queue.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["EDGES", "MIN_PER_STRATUM", "S_FLOOR", "Design", "allocate", "draw_design", "stratum_of"]

#: Score bands of model ``p_clean``: narrow at the ends (where most pairs are and the model
#: claims certainty) and around 0.5 (where the flag flips).
EDGES: tuple[float, ...] = (0.0, 0.02, 0.1, 0.3, 0.5, 0.7, 0.9, 0.98, 1.0)
#: The smallest per-stratum standard deviation the allocation assumes (see the module doc).
S_FLOOR = 0.2
#: Every non-empty stratum gets at least this many draws (or all its pairs, when fewer):
#: a stratum's noise rate needs two labels to have any spread at all.
MIN_PER_STRATUM = 2


def stratum_of(p_clean: np.ndarray, edges: tuple[float, ...] = EDGES) -> np.ndarray:
    """Stratum index (0 .. len(edges) - 2) of each score; the last band includes 1.0."""
    p = np.clip(np.nan_to_num(np.asarray(p_clean, dtype=np.float64), nan=0.0), 0.0, 1.0)
    return np.clip(np.searchsorted(np.asarray(edges), p, side="right") - 1, 0, len(edges) - 2).astype(np.int64)


def allocate(sizes: np.ndarray, spreads: np.ndarray, n: int, minimum: int = MIN_PER_STRATUM) -> np.ndarray:
    """Draws per stratum: ``n`` in total (or every pair, when ``n >= sum(sizes)``), about
    proportional to ``sizes * spreads``, at least ``min(minimum, N_h)`` per non-empty
    stratum, never more than ``N_h``. Largest remainders decide the rounding."""
    sizes = np.asarray(sizes, dtype=np.int64)
    total = int(sizes.sum())
    if n >= total:
        return sizes.copy()
    alloc = np.minimum(sizes, minimum)
    if int(alloc.sum()) >= n:  # fewer draws than strata can take their minimum: biggest strata first
        alloc = np.zeros_like(sizes)
        for h in np.argsort(-sizes * np.asarray(spreads), kind="stable")[:n]:
            alloc[h] = 1 if sizes[h] else 0
        return alloc
    while int(alloc.sum()) < n:
        room = sizes - alloc
        open_ = room > 0
        want = np.where(open_, sizes * np.asarray(spreads, dtype=np.float64), 0.0)
        left = n - int(alloc.sum())
        share = want / want.sum() * left if want.sum() > 0 else open_ / open_.sum() * left
        add = np.minimum(np.floor(share).astype(np.int64), room)
        if add.sum() == 0:  # distribute the remainder one by one, largest fractional share first
            order = np.argsort(-(share - np.floor(share)) - open_ * 1e-9, kind="stable")
            for h in order:
                if left == 0:
                    break
                if room[h] > 0:
                    alloc[h] += 1
                    left -= 1
            continue
        alloc += add
    return np.asarray(alloc)


@dataclass(frozen=True)
class Design:
    """A drawn audit sample.

    ``rows``: indices into the population arrays, in queue order. ``strata``: each queued
    pair's stratum; ``inclusion``: its inclusion probability ``n_h / N_h``. ``sizes`` /
    ``drawn``: ``N_h`` and ``n_h`` per stratum; ``edges``: the score bands.
    """

    rows: np.ndarray
    strata: np.ndarray
    inclusion: np.ndarray
    sizes: np.ndarray
    drawn: np.ndarray
    edges: tuple[float, ...]
    seed: int
    population: int
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The design without the queue (what the estimators need besides the labels)."""
        return {"edges": list(self.edges), "sizes": [int(x) for x in self.sizes], "drawn": [int(x) for x in self.drawn],
                "seed": self.seed, "population": self.population, "sample": len(self.rows), **self.extra}


def _interleave(groups: list[np.ndarray], rng: np.random.Generator, front: int = 2) -> np.ndarray:
    """Merge per-stratum lists so each is spread evenly over the result (a prefix of any
    length holds about its share of every stratum), after a front of the first ``front``
    draws of every stratum (round by round, strata in random order): the estimate needs
    two labels per stratum drawn from, and a stratum of two draws spread evenly had its
    second half-way down the queue (a 400-pair queue gave its first estimate after a
    median 129-202 labels). Within a stratum the order stays random, so any prefix is
    still a stratified sample (with more of the small strata)."""
    keys, items = [], []
    for g in groups:
        if len(g):
            head, rest = min(front, len(g)), max(len(g) - front, 0)
            key = np.empty(len(g))
            key[:head] = (np.arange(head) + rng.random()) / front - 1.0  # round r of the front in [r/front - 1, ...): before 0
            if rest:
                key[head:] = (np.arange(rest) + rng.random()) / rest
            keys.append(key)
            items.append(g)
    if not items:
        return np.zeros(0, dtype=np.int64)
    key, item = np.concatenate(keys), np.concatenate(items)
    return item[np.argsort(key, kind="stable")]


def draw_design(p_clean: np.ndarray, n: int, seed: int, edges: tuple[float, ...] = EDGES, s_floor: float = S_FLOOR) -> Design:
    """Draw ``min(n, len(p_clean))`` distinct pairs, stratified by ``p_clean`` (see the module doc).

    Raises ``ValueError`` for ``n < 1``.
    """
    if n < 1:
        raise ValueError("the sample needs at least one pair")
    p = np.asarray(p_clean, dtype=np.float64)
    strata = stratum_of(p, edges)
    k = len(edges) - 1
    sizes = np.bincount(strata, minlength=k).astype(np.int64)
    means = np.array([p[strata == h].mean() if sizes[h] else 0.5 for h in range(k)])
    spreads = np.maximum(np.sqrt(means * (1 - means)), s_floor)
    drawn = allocate(sizes, spreads, n)
    rng = np.random.default_rng(seed)
    groups = []
    for h in range(k):
        members = np.flatnonzero(strata == h)
        groups.append(np.sort(rng.choice(members, size=int(drawn[h]), replace=False)) if drawn[h] < sizes[h] else members)
    # shuffle inside each stratum before interleaving, so the queue order is random too
    groups = [rng.permutation(g) for g in groups]
    rows = _interleave(groups, rng)
    inclusion = np.where(sizes > 0, drawn / np.maximum(sizes, 1), 0.0)
    return Design(rows=rows, strata=strata[rows], inclusion=inclusion[strata[rows]], sizes=sizes, drawn=drawn,
                  edges=tuple(edges), seed=seed, population=len(p))
