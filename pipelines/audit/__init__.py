"""The audit loop (issue 22): a few hundred human labels turn scores into trustworthy numbers.

- ``design``: which pairs to label (stratified by score, known inclusion probabilities);
- ``stats``: what the labels say (noise rate, precision / recall / F1 with intervals,
  thresholds, reliability, recalibration (isotonic and Platt), self-agreement): pure functions;
- ``run``: the same on a job's output folder (queue, labels file, report, writing the
  recalibrated ``p_clean`` into the score tables).
"""

from __future__ import annotations

from .design import Design, draw_design
from .stats import Interval, noise_rate

__all__ = ["Design", "Interval", "draw_design", "noise_rate"]
