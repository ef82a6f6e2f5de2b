"""Learned estimators on frozen embeddings (NCR, DisNCL, SDCMR, an ensemble) and ``refine``.

Each method module exposes ``fit(img, txt, seed, settings) -> Heads`` and
``apply(heads, img, txt) -> (raw, p_clean)`` over (N, D) L2-normalised embeddings, and
``SCORE_COLUMN``, the name of its raw-score column. ``pairclean.refine.run`` applies them
to a scored job's output folder. See ``docs/methods.md``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from . import disncl, ensemble, ncr, sdcmr
from .common import Heads, heads_bytes, heads_from_bytes

__all__ = ["METHODS", "DEFAULT_METHOD", "METHOD_MODULES", "Heads", "fit", "apply", "score_column", "settings_for", "heads_bytes", "heads_from_bytes"]

METHOD_MODULES: dict[str, ModuleType] = {"ncr": ncr, "disncl": disncl, "sdcmr": sdcmr, "ensemble": ensemble}
METHODS = tuple(METHOD_MODULES)
#: The method ``pairclean refine`` uses by default: the ensemble, the only method that beat
#: OSA alone at both 20% and 50% noise in benchmarks/estimators.py (Flickr8k dev, AUC 0.984
#: vs 0.971 and 0.974 vs 0.972); see the README section "Refining with learned estimators".
DEFAULT_METHOD = "ensemble"

_SETTINGS = {"ncr": ncr.NcrSettings, "disncl": disncl.DisnclSettings, "sdcmr": sdcmr.SdcmrSettings}


def settings_for(method: str, overrides: dict[str, Any] | None = None) -> Any:
    """The settings object of ``method`` with ``overrides`` (field -> value) applied.

    For ``ensemble``, a key naming a member maps to that member's overrides; any other key
    applies to every member that has that field (``epochs=2`` shortens them all).
    """
    import dataclasses

    overrides = overrides or {}
    if method == "ensemble":
        flat = {k: v for k, v in overrides.items() if k not in _SETTINGS}
        unknown = set(flat) - {f.name for cls in _SETTINGS.values() for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"no member has the setting(s) {', '.join(sorted(unknown))}")
        out = {}
        for name, cls in _SETTINGS.items():
            fields = {f.name for f in dataclasses.fields(cls)}
            out[name] = cls(**{**{k: v for k, v in flat.items() if k in fields}, **overrides.get(name, {})})
        return out
    if method not in _SETTINGS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    return _SETTINGS[method](**overrides)


def fit(method: str, img: Any, txt: Any, seed: int, overrides: dict[str, Any] | None = None) -> Heads:
    """Fit ``method`` on (N, D) embeddings; deterministic given ``seed``."""
    return METHOD_MODULES[method].fit(img, txt, seed, settings_for(method, overrides))


def apply(heads: Heads, img: Any, txt: Any) -> Any:
    """(raw score, p_clean) of (N, D) ok pairs under fitted ``heads``: (N,) float32 each.

    NaN guard: a pair with a non-finite embedding gets ``p_clean`` 0 and the lowest raw
    score of the batch (it is scored on zeros so it cannot poison the others).
    """
    import numpy as np

    img, txt = np.asarray(img, dtype=np.float32), np.asarray(txt, dtype=np.float32)
    bad = ~(np.isfinite(img).all(1) & np.isfinite(txt).all(1)) if len(img) else np.zeros(0, bool)
    if bad.any():
        img, txt = np.where(bad[:, None], 0.0, img).astype(np.float32), np.where(bad[:, None], 0.0, txt).astype(np.float32)
    raw, p = METHOD_MODULES[heads.method].apply(heads, img, txt)
    if bad.any():
        raw[bad] = float(raw[~bad].min()) if (~bad).any() else -1.0
        p[bad] = 0.0
    return raw, p


def score_column(method: str) -> str:
    """The raw-score column ``method`` adds to a score table."""
    return str(METHOD_MODULES[method].SCORE_COLUMN)
