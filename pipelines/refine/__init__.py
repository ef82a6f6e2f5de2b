"""Learned estimators on frozen embeddings (NCR, DisNCL, SDCMR, an ensemble) and ``refine``.

Each method module exposes ``fit(img, txt, seed, settings) -> Heads`` and
``apply(heads, img, txt) -> (raw, p_clean)`` over (N, D) L2-normalised embeddings, and
``SCORE_COLUMN``, the name of its raw-score column. ``pairclean.refine.run`` applies them
to a scored job's output folder. See ``docs/methods.md``.

``p_clean`` of every method (what ``fit`` and ``apply`` here return) is calibrated without
labels against OSA, whose own ``p_clean`` (the posterior of its mixture on the estimator's
cosines, noise side pinned to random mismatched pairs) is what ``pairclean score`` writes:

- ``noise_rate`` = OSA's noise-rate estimate on the fit sample (``osa.estimate_noise_rate``);
- a 2-component mixture on the method's raw scores of the sample, the noise component's
  weight *fixed* to ``noise_rate``; EM fits the means and variances. When its components
  are apart (d' >= ``MIN_SEPARATION``: the scores split in two), ``p_clean`` is its
  posterior ("mixture");
- otherwise (one-humped scores, where that mixture collapses to a constant: NCR's always,
  SDCMR's and DisNCL's at some noise levels) ``p_clean`` is a logistic curve of the raw
  score fitted to OSA's ``p_clean`` of the sample as soft targets ("logistic"): the
  method orders the pairs, OSA sets the scale.

Measured (benchmarks/estimators.py in domain, benchmarks/offdomain.py off it; expected
calibration error of the ensemble's ``p_clean`` at 20 / 50 / 80% noise):

- a free mixture (each module's own ``p_clean``): 0.012 / 0.028 / 0.094 in domain, and
  NCR's never exceeded 0.45 at 20% noise, so it flagged every pair;
- a mixture pinned to the method's scores of random mismatched pairs (as OSA's is): 0.183
  at 80%: a fitted method has seen the sample's noisy pairs and scores them well above
  fresh mismatched ones (NCR's called every pair clean);
- the logistic curve alone: in domain 0.035 / 0.025 / 0.017, but off domain 0.111 / 0.112
  / 0.041: where the method ranks far better than OSA it inherits OSA's doubt;
- this rule: in domain 0.012 / 0.025 / 0.019, off domain 0.044 / 0.020 / 0.034.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from pairclean.refine import disncl, ensemble, ncr, sdcmr
from pairclean.refine.common import Heads, Mixture1D, Platt, heads_bytes, heads_from_bytes

__all__ = ["METHODS", "DEFAULT_METHOD", "METHOD_MODULES", "Heads", "fit", "apply", "apply_raw", "p_clean_curve", "score_column", "settings_for", "heads_bytes", "heads_from_bytes"]

METHOD_MODULES: dict[str, ModuleType] = {"ncr": ncr, "disncl": disncl, "sdcmr": sdcmr, "ensemble": ensemble}
METHODS = tuple(METHOD_MODULES)
#: The method ``pairclean refine`` uses by default: the ensemble. Off the estimator's domain
#: (benchmarks/offdomain.py: scenes its heads never saw) it beat OSA alone by +0.068 / +0.055
#: / +0.020 AUC at 20 / 50 / 80% noise with p_clean ECE <= 0.043, where each single method
#: fell below OSA at 80%; in domain (benchmarks/estimators.py) it gained +0.012 / +0.003 /
#: -0.004. See the README section "Refining with learned estimators".
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
            out[name] = _checked(cls(**{**{k: v for k, v in flat.items() if k in fields}, **overrides.get(name, {})}))
        return out
    if method not in _SETTINGS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    return _checked(_SETTINGS[method](**overrides))


#: Integer settings that may be 0 (no warm-up; ``clusters`` 0: SDCMR picks the number itself).
_MAY_BE_ZERO = {"warmup_epochs", "clusters"}


def _checked(settings: Any) -> Any:
    """``settings`` when every value has its field's type and range: an int field a whole
    number >= 1 (>= 0 for ``_MAY_BE_ZERO``), a float field finite and >= 0. ``TypeError``
    naming the field otherwise: ``--set epochs=-3``, ``lr=nan``, ``epochs=1.5`` ended in
    scikit-learn's or torch's traceback, or trained on nonsense."""
    import dataclasses
    import math

    for f in dataclasses.fields(settings):
        value, default = getattr(settings, f.name), f.default
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if isinstance(default, bool):
            ok, kind = isinstance(value, bool), "true or false"
        elif isinstance(default, int):
            least = 0 if f.name in _MAY_BE_ZERO else 1
            ok, kind = number and isinstance(value, int) and value >= least, f"a whole number >= {least}"
        elif isinstance(default, float):
            ok, kind = number and math.isfinite(value) and value >= 0, "a finite number >= 0"
        else:
            continue
        if not ok:
            raise TypeError(f"{f.name} must be {kind}, got {value!r}")
    return settings


#: Random mismatched pairs of the fit sample that pin the noise side of OSA's mixture.
NOISE_PAIRS = 65_536


def fit(method: str, img: Any, txt: Any, seed: int, overrides: dict[str, Any] | None = None, osa: Any = None,
        referee: Any = None) -> Heads:
    """Fit ``method`` on (N, D) embeddings (N >= 2), then its ``p_clean`` mixture (see the
    module docstring); deterministic given ``seed``. ``osa``: (N,) the job's own score of
    each pair, the ensemble's OSA member (default: the cosine); ``referee``: (N,) the judge's
    ratios that an ensemble's blend must agree with (see ``ensemble``). Other methods ignore both."""
    if method == "ensemble":
        heads: Heads = ensemble.fit(img, txt, seed, settings_for(method, overrides), osa=osa, referee=referee)
    else:
        heads = METHOD_MODULES[method].fit(img, txt, seed, settings_for(method, overrides))
    heads.doc["p_clean"] = p_clean_curve(heads, img, txt, seed, scores=osa)
    return heads


#: d' above which a method's own fixed-weight mixture gives ``p_clean`` (module docstring).
MIN_SEPARATION = 1.5


def p_clean_curve(heads: Heads, img: Any, txt: Any, seed: int, scores: Any = None) -> dict[str, Any]:
    """How ``apply`` turns fitted ``heads``' raw scores into ``p_clean`` (module docstring),
    from their (N, D) fit sample (N >= 2). JSON: ``kind`` "mixture" or "logistic" and its
    parameters, plus ``noise_rate``, ``separation`` and ``teacher_mean``. ``scores``: the
    job scores an ensemble was fitted on (``fit``'s ``osa``)."""
    import numpy as np

    from pairclean import osa
    from pairclean.refine.common import fit_mixture_fixed_weight, fit_platt, separation

    img, txt = np.asarray(img, dtype=np.float32), np.asarray(txt, dtype=np.float32)
    sims = osa.cosine_rows(img, txt)
    mismatched = osa.shuffled_similarities(img, txt, min(NOISE_PAIRS, max(4, len(img))), seed)
    noise_rate = osa.estimate_noise_rate(sims, seed, mismatched)
    gmm = osa.fit_gmm(sims, seed, noise_sims=mismatched)
    teacher = osa.mixture_posterior_clean(sims, gmm.means, gmm.stds, gmm.noise_rate)
    raw = apply_raw(heads, img, txt, scores)
    mix = fit_mixture_fixed_weight(raw, noise_rate, seed=seed)
    apart = separation(mix)
    common = {"noise_rate": noise_rate, "separation": apart, "teacher_mean": float(teacher.mean()), "noise_pairs": int(mismatched.size)}
    if apart >= MIN_SEPARATION:
        return {"kind": "mixture", **mix.to_json(), **common}
    return {"kind": "logistic", **fit_platt(raw, teacher).to_json(), **common}


def apply_raw(heads: Heads, img: Any, txt: Any, osa: Any = None) -> Any:
    """The raw score alone (see ``apply``): (N,) float32."""
    return apply(heads, img, txt, osa)[0]


def apply(heads: Heads, img: Any, txt: Any, osa: Any = None) -> Any:
    """(raw score, p_clean) of (N, D) ok pairs under fitted ``heads``: (N,) float32 each.
    ``osa``: (N,) the job's own score of each pair, for an ensemble fitted with one.

    NaN guard: a pair with a non-finite embedding gets ``p_clean`` 0 and the lowest raw
    score of the batch (it is scored on zeros so it cannot poison the others).
    """
    import numpy as np

    img, txt = np.asarray(img, dtype=np.float32), np.asarray(txt, dtype=np.float32)
    bad = ~(np.isfinite(img).all(1) & np.isfinite(txt).all(1)) if len(img) else np.zeros(0, bool)
    if bad.any():
        img, txt = np.where(bad[:, None], 0.0, img).astype(np.float32), np.where(bad[:, None], 0.0, txt).astype(np.float32)
    if heads.method == "ensemble":
        raw, p = ensemble.apply(heads, img, txt, None if osa is None else np.asarray(osa, np.float32))
    else:
        raw, p = METHOD_MODULES[heads.method].apply(heads, img, txt)
    curve = heads.doc.get("p_clean")
    if curve is not None:
        p = Mixture1D.from_json(curve).posterior_clean(raw) if curve["kind"] == "mixture" else Platt.from_json(curve)(raw)
    if bad.any():
        raw[bad] = float(raw[~bad].min()) if (~bad).any() else -1.0
        p[bad] = 0.0
    return raw, p


def score_column(method: str) -> str:
    """The raw-score column ``method`` adds to a score table."""
    return str(METHOD_MODULES[method].SCORE_COLUMN)
