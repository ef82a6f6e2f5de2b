"""Learned estimators on frozen embeddings (NCR, DisNCL, SDCMR, an ensemble) and ``refine``.

Each method module exposes ``fit(img, txt, seed, settings) -> Heads`` and
``apply(heads, img, txt) -> (raw, p_clean)`` over (N, D) L2-normalised embeddings, and
``SCORE_COLUMN``, the name of its raw-score column. ``pairclean.refine.run`` applies them
to a scored job's output folder. See ``docs/methods.md``.

``p_clean`` of every method (what ``fit`` and ``apply`` here return) is calibrated the way
OSA's is: a 2-component mixture on the method's raw scores of the fit sample whose noise
component is pinned to the raw scores of random mismatched pairs of the same sample
(``osa.fit_gmm`` with ``noise_sims``), so only the mixing weight and the clean component are
fitted. A free mixture (each module's own ``p_clean``) mis-sizes the components when noise
is far from 50%: NCR's never exceeded 0.45 at 20% noise and the ensemble's expected
calibration error was 0.094 at 80% (benchmarks/estimators.py).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from . import disncl, ensemble, ncr, sdcmr
from .common import Heads, heads_bytes, heads_from_bytes

__all__ = ["METHODS", "DEFAULT_METHOD", "METHOD_MODULES", "Heads", "fit", "apply", "apply_raw", "pinned_mixture", "score_column", "settings_for", "heads_bytes", "heads_from_bytes"]

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


#: Random mismatched pairs of the fit sample that pin the noise side of ``p_clean``'s mixture.
NOISE_PAIRS = 65_536


def fit(method: str, img: Any, txt: Any, seed: int, overrides: dict[str, Any] | None = None) -> Heads:
    """Fit ``method`` on (N, D) embeddings (N >= 2), then its ``p_clean`` mixture (see the
    module docstring); deterministic given ``seed``."""
    heads = METHOD_MODULES[method].fit(img, txt, seed, settings_for(method, overrides))
    heads.doc["p_clean"] = pinned_mixture(heads, img, txt, seed)
    return heads


def pinned_mixture(heads: Heads, img: Any, txt: Any, seed: int) -> dict[str, Any]:
    """``p_clean``'s mixture for fitted ``heads`` on their (N, D) fit sample: raw scores of the
    sample, noise pinned to the raw scores of seeded random mismatched pairs of it."""
    import numpy as np

    from .. import osa

    n = len(img)
    rng = np.random.default_rng([seed, 7])
    i = rng.integers(0, n, size=min(NOISE_PAIRS, n))
    j = (i + rng.integers(1, n, size=i.size)) % n  # j != i: a mismatched pair
    raw = apply_raw(heads, img, txt)
    noise = apply_raw(heads, np.asarray(img)[i], np.asarray(txt)[j])
    gmm = osa.fit_gmm(raw, seed, noise_sims=noise)
    return {"means": list(gmm.means), "stds": list(gmm.stds), "noise_weight": gmm.noise_rate, "noise_pairs": int(i.size),
            "rule": "pinned noise: raw scores of random mismatched pairs of the sample"}


def apply_raw(heads: Heads, img: Any, txt: Any) -> Any:
    """The raw score alone (see ``apply``): (N,) float32."""
    return apply(heads, img, txt)[0]


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
    pinned = heads.doc.get("p_clean")
    if pinned is not None:
        from .. import osa

        p = osa.mixture_posterior_clean(raw, tuple(pinned["means"]), tuple(pinned["stds"]), pinned["noise_weight"])
    if bad.any():
        raw[bad] = float(raw[~bad].min()) if (~bad).any() else -1.0
        p[bad] = 0.0
    return raw, p


def score_column(method: str) -> str:
    """The raw-score column ``method`` adds to a score table."""
    return str(METHOD_MODULES[method].SCORE_COLUMN)
