"""How often the audit's 95% noise-rate interval covers the truth, on simulated jobs.

A perfect labeller labels the queue ``pairclean audit`` draws (``draw_design``) from a
simulated job of N pairs whose true noise is known; the interval of ``stats.noise_rate``
is checked against the job's true noisy share. Each setting runs twice in one run: with
Student's t quantile for the labels' degrees of freedom (what ships) and with the normal
quantile (before), so the two columns compare on the same draws.

    python benchmarks/audit_coverage.py [--reps 1000]

Populations (``p`` the model's p_clean, ``y`` the truth):
  calibrated   p ~ Beta(4, 1), noisy with probability 1 - p (about 20% noise)
  overconfident  80% of pairs at p 0.985-1.0 with 5% noise hidden there, the rest calibrated
  poor-flag    p ~ Beta(0.5, 0.5), 30% noise whatever p says
  half         p uniform, noisy with probability 1 - p
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
from pairclean.audit import stats
from pairclean.audit.design import draw_design


def population(kind: str, n_pairs: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(p_clean, truth noisy 0/1) of a simulated job."""
    if kind == "calibrated":
        p = rng.beta(4, 1, n_pairs)
        return p, (rng.random(n_pairs) > p).astype(float)
    if kind == "overconfident":
        p = np.where(rng.random(n_pairs) < 0.8, rng.uniform(0.985, 1.0, n_pairs), rng.uniform(0, 1, n_pairs))
        return p, np.where(p > 0.98, rng.random(n_pairs) < 0.05, rng.random(n_pairs) > p).astype(float)
    if kind == "poor-flag":
        return rng.beta(0.5, 0.5, n_pairs), (rng.random(n_pairs) < 0.3).astype(float)
    p = rng.uniform(0, 1, n_pairs)
    return p, (rng.random(n_pairs) > p).astype(float)


def covered(kind: str, n_pairs: int, n_labels: int, seed: int, quantile: Callable[[float, float], float]) -> tuple[bool, float] | None:
    """(whether the interval holds the truth, its half width); None where the audit refuses."""
    rng = np.random.default_rng(seed)
    p, y = population(kind, n_pairs, rng)
    design = draw_design(p, n_labels, seed)
    if stats.labels_needed(design.drawn, design.strata, population=n_pairs):
        return None
    shipped = stats.t_quantile
    stats.t_quantile = quantile  # type: ignore[assignment]
    try:
        iv = stats.noise_rate(design.sizes, design.strata, y[design.rows])
    finally:
        stats.t_quantile = shipped  # type: ignore[assignment]
    return bool(iv.lower <= y.mean() <= iv.upper), iv.half_width


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=1000, help="simulated jobs per setting")
    args = parser.parse_args()
    settings = [("poor-flag", 5000, 20), ("poor-flag", 5000, 40), ("calibrated", 5000, 20), ("calibrated", 5000, 200),
                ("half", 5000, 400), ("overconfident", 300, 100), ("overconfident", 60, 50)]
    rules: dict[str, Callable[[float, float], float]] = {"t": stats.t_quantile, "normal": lambda z, df: z}
    print("| population | pairs | labels | coverage (t) | half width (t) | coverage (normal) | half width (normal) |")
    print("|---|---|---|---|---|---|---|")
    for kind, n_pairs, n_labels in settings:
        cells = []
        for rule in rules.values():
            got = [c for c in (covered(kind, n_pairs, n_labels, 10_000 + s, rule) for s in range(args.reps)) if c is not None]
            cells += [f"{np.mean([c for c, _ in got]):.3f}", f"{np.mean([h for _, h in got]):.4f}"]
        print(f"| {kind} | {n_pairs} | {n_labels} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
