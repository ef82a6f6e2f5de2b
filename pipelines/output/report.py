"""Summaries of a job's output folder (what ``pairclean inspect`` prints)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from pairclean import osa, schema
from pairclean.calibrate.p_clean import unexplained_random
from pairclean.errors import InputError, printable
from pairclean.output.folder import OutputDir
from pairclean.output.tables import read_embeddings
from pairclean.uris import shard_stem

__all__ = ["Summary", "summarize", "format_summary", "mixture_noise", "expected_noise", "p_clean_sum", "junk_warning", "junk_gap", "warnings_of"]


@dataclass(frozen=True)
class Summary:
    """Counts and distributions over every committed pair of a job."""

    shards_total: int
    shards_committed: int
    pairs: int
    statuses: dict[str, int]
    beta: float | None
    beta_recipe: str | None
    weighting: str | None
    model: dict[str, Any]
    flagged_noisy: float
    #: The share of ok pairs below twice the median of random mismatched pairs (GMM without
    #: embeddings): random-like mismatches only, so a lower bound where near-misses abound.
    noise_rate_gmm: float | None
    weight_histogram: list[tuple[float, float, int]]
    lowest: list[dict[str, Any]]
    first: list[dict[str, Any]]
    #: The rule behind ``noisy`` and the corpus contrast's record (None: the job has none).
    noisy_rule: str = "similarity <= beta"
    #: The audit map applied to the tables (``pairclean audit --labels``), or None.
    audit: dict[str, Any] | None = None
    #: A run that changes the tables stopped before it wrote the exports again
    #: (``exports.mark_exports_stale``): trainers reading them read the earlier weights.
    exports_stale: bool = False
    contrast: dict[str, Any] | None = None
    #: The ``p_clean`` mixture's noise shares of the calibration sample (random, near-miss);
    #: None without a corpus-mixture curve.
    mixture_noise: tuple[float, float] | None = None
    #: The share of calibration pairs at random level that p_clean's random part leaves out, where large.
    unexplained_random: float | None = None
    #: The judge's record in the metadata (None: the job ran without the judge).
    judge: dict[str, Any] | None = None
    #: ``pairclean refine``'s record in the metadata (None: the tables are as scored).
    refine: dict[str, Any] | None = None
    #: 1 - mean ``p_clean`` over the ok pairs (``expected_noise``); None without ok pairs.
    expected_noise: float | None = None
    #: Share of ok pairs whose caption has a better owner (``owner_margin > 0``, contrast
    #: version 3); None for tables without the column.
    owned: float | None = None
    #: Share of ok pairs whose caption is a shared one (``owner_margin`` -inf: no owner,
    #: ``p_clean`` capped; ``contrast.is_shared``); None for tables without the column.
    shared: float | None = None
    #: The verb whose rewrite of the tables was interrupted (their weights are mixed until
    #: it is run again); None when the tables are whole.
    interrupted_rewrite: str | None = None
    #: Committed shards that took more than one try (stem -> attempts: a worker was lost or
    #: a transient error retried them), and quarantined ones (stem -> their error).
    retried: dict[str, int] = field(default_factory=dict)
    quarantined: dict[str, str] = field(default_factory=dict)


def summarize(out: OutputDir, rows: int = 10, bins: int = 10, seed: int = 0) -> Summary:
    """Summarise ``out``: status counts, noisy fraction, the expected share of wrong captions
    (``expected_noise``), the random-mismatch share, weight histogram."""
    spec = out.read_spec()
    if spec is None and not out.committed():  # a missing path, a file, a folder of something else
        raise InputError(f"{out.uri} is not a pairclean output folder (no {out.store.url(schema.JOB_FILE)})", uri=out.uri)
    table = out.read_all_scores()
    meta = _job_meta(out)
    status = np.asarray(table.column(schema.COL_STATUS).to_pylist())
    ok = schema.ok_mask(status)
    sims = table.column(schema.COL_SIMILARITY).to_numpy()[ok]
    weights = table.column(schema.COL_WEIGHT).to_numpy()[ok]
    noisy = table.column(schema.COL_NOISY).to_numpy(zero_copy_only=False)[ok]
    noise = _noise_similarities(out, seed)
    gmm = osa.estimate_noise_rate(sims, seed, noise) if sims.size >= 16 else None
    counts, edges = np.histogram(weights, bins=bins, range=(0.0, 1.0))
    view = table.select([schema.COL_SHARD, schema.COL_KEY, schema.COL_STATUS, schema.COL_SIMILARITY, schema.COL_WEIGHT, schema.COL_NOISY])
    ok_view = view.filter(ok)
    order = np.argsort(ok_view.column(schema.COL_WEIGHT).to_numpy(), kind="stable")[:rows]
    values, occurrences = np.unique(status, return_counts=True)
    committed = out.committed()
    return Summary(
        shards_total=len(spec.shards) if spec else 0,
        shards_committed=len(committed),
        pairs=table.num_rows,
        statuses={str(k): int(v) for k, v in zip(values, occurrences)},
        beta=meta["beta"]["value"],
        beta_recipe=meta["beta"]["recipe"],
        weighting=meta["weighting"]["name"],
        model=meta["model"],
        flagged_noisy=float(noisy.mean()) if noisy.size else 0.0,
        noise_rate_gmm=gmm,
        weight_histogram=[(float(edges[i]), float(edges[i + 1]), int(counts[i])) for i in range(bins)],
        lowest=ok_view.take(order).to_pylist(),
        first=view.slice(0, rows).to_pylist(),
        noisy_rule=noisy_rule_of(meta),
        audit=audit_map(meta),
        mixture_noise=mixture_noise(meta),
        unexplained_random=junk_gap(meta),
        contrast=meta.get("contrast"),
        judge=meta.get("judge"),
        refine=meta.get("refine"),
        expected_noise=expected_noise(status, table.column(schema.COL_P_CLEAN).to_numpy())
        if schema.COL_P_CLEAN in table.column_names else None,
        owned=_owned_share(table, ok),
        shared=_owned_share(table, ok, shared=True),
        interrupted_rewrite=out.interrupted_rewrite(),
        exports_stale=out.store.exists(schema.EXPORTS_STALE_FILE),
        retried={stem: r.attempts for stem, r in sorted(committed.items()) if r.attempts > 1},
        quarantined={stem: _clip(str(q.get("error"))) for stem, q in sorted(out.quarantined().items()) if stem not in committed},
    )


def audit_map(table_doc: dict[str, Any] | None) -> dict[str, Any] | None:
    """The audit map (``recalibrated_table``'s ``doc``: knots, labels) a score table's
    metadata (``OutputDir.table_doc``) carries, or None (none applied, or a rescore since
    replaced it with its own calibration)."""
    doc = (table_doc or {}).get("audit")
    if isinstance(doc, dict) and isinstance(doc.get("knots"), dict) and isinstance(doc.get("labels"), int):
        return doc
    return None


#: What every score table's metadata names (``output_metadata``), which the summary prints.
_SUMMARY_KEYS: Final = ("beta", "weighting", "model")


def _job_meta(out: OutputDir) -> dict[str, Any]:
    """The pairclean metadata of the first committed table that carries it whole: a table
    another tool re-saved in place (pandas drops the key) ended ``inspect`` in a KeyError
    traceback. ``InputError`` when no table carries it."""
    for record in out.iter_committed():
        doc = out.table_doc(record)
        if doc is not None and all(isinstance(doc.get(k), dict) for k in _SUMMARY_KEYS):
            return doc
    raise InputError(f"no table of {out.uri} carries pairclean's metadata (rewritten by another tool?): put back the "
                     "tables pairclean wrote, or score the job again into a new folder", uri=out.uri)


def noisy_rule_of(meta: dict[str, Any]) -> str:
    """The rule the tables' ``noisy`` column follows (a table's metadata ``meta``): the job's,
    or once an audit recalibrated ``p_clean`` under the ``p-clean`` weighting, the audit's
    (``p_clean <= 0.5`` of the recalibrated value; the model's flag kept as ``noisy_model``)."""
    rule = str(meta.get("noisy_rule", "similarity <= beta"))
    audit = audit_map(meta)
    if audit is not None and (meta.get("weighting") or {}).get("name") == "p-clean":
        return (f"p_clean <= 0.5, p_clean recalibrated by an audit on {audit['labels']} human labels "
                f"(the model's flag, in noisy_model: {rule})")
    return rule


def _owned_share(table: Any, ok: np.ndarray, shared: bool = False) -> float | None:
    """Share of the ok rows whose ``owner_margin`` is positive (``shared``: -inf, a shared
    caption); None without the column or ok rows."""
    if schema.COL_OWNER_MARGIN not in table.column_names or not ok.any():
        return None
    from pairclean.calibrate.contrast import has_owner, is_shared

    margin = table.column(schema.COL_OWNER_MARGIN).to_numpy(zero_copy_only=False)[ok]
    return float((is_shared(margin) if shared else has_owner(margin)).mean())


def expected_noise(status: Any, p_clean: Any) -> float | None:
    """The job's estimate of its share of wrong captions: ``1 - mean(p_clean)`` over the ok
    pairs ((N,) statuses and ``p_clean``; NaN rows left out), i.e. the number of noisy pairs
    that ``p_clean`` itself expects. None without such pairs.

    Why not the random-mismatch share (``noise_rate_gmm``): it counts only pairs that score
    like random swaps, so a corpus of near-misses reads as clean (Flickr8k dev, a third of
    the pairs right: 1.2% against 66% here and 67% true; README "Hard noise"); ``p_clean``
    is the calibrated answer and already counts the near-misses it sees."""
    total, count = p_clean_sum(status, p_clean)
    return 1.0 - total / count if count else None


def p_clean_sum(status: Any, p_clean: Any) -> tuple[float, int]:
    """(sum, count) of ``p_clean`` over the ok pairs ((N,) statuses and values; NaN left out):
    what ``expected_noise`` averages, summable shard by shard (the service's running estimate)."""
    p = np.asarray(p_clean, dtype=np.float64)[schema.ok_mask(status)]
    p = p[np.isfinite(p)]
    return float(p.sum()), int(p.size)


def junk_gap(meta: dict[str, Any]) -> float | None:
    """``p_clean.unexplained_random`` of a table's metadata ``meta`` (its ``p_clean`` fit), or
    None: also once an audit has recalibrated ``p_clean`` from labels (``meta["audit"]``),
    which is the remedy the warning points at."""
    if meta.get("audit"):
        return None
    p_clean = meta.get("p_clean")
    fit = p_clean.get("fit") if isinstance(p_clean, dict) else None
    return unexplained_random(fit if isinstance(fit, dict) else {})


def warnings_of(meta: dict[str, Any]) -> list[str]:
    """The warnings that `pairclean score`'s closing note, `pairclean inspect`, the job page
    and the REST job (``GET /v1/jobs/{id}``) carry for tables with metadata ``meta``: today
    at most one, ``junk_warning``."""
    gap = junk_gap(meta)
    return [] if gap is None else [junk_warning(gap)]


def junk_warning(gap: float) -> str:
    """The line that says ``gap`` of the calibration pairs fit at random level beyond what
    p_clean's random part explains (``p_clean.unexplained_random``) and what to do about it."""
    return (f"WARNING: {100 * gap:.0f}% of the calibration pairs fit no better than most random pairs beyond what p_clean "
            "counts as random mismatches: a large share of noise of another shape (placeholder images, boilerplate "
            "captions) may be counted clean; an audit of 200 pairs recalibrates it (README \"Hard noise\")")


def mixture_noise(meta: dict[str, Any]) -> tuple[float, float] | None:
    """(random, near-miss) noise shares of the corpus-mixture ``p_clean`` recorded under
    ``meta["p_clean"]["fit"]`` (a table's metadata or a calibration's ``extra``); None without one."""
    fit = (meta.get("p_clean") or {}).get("fit") or {}
    if "pi_random" not in fit or "pi_near" not in fit:
        return None
    return float(fit["pi_random"]), float(fit["pi_near"])


def _noise_similarities(out: OutputDir, seed: int, limit: int = 200_000) -> np.ndarray | None:
    """Similarities of random mismatched pairs from the embedding sidecars (None without them)."""
    img_parts, txt_parts, rows = [], [], 0
    for record in out.iter_committed():
        if not out.has_embeddings(record):
            return None
        img, txt = read_embeddings(out.read_embeddings_table(record))
        img_parts.append(img)
        txt_parts.append(txt)
        rows += len(img)
        if rows >= limit:
            break
    if rows < 2:
        return None
    img, txt = np.concatenate(img_parts)[:limit], np.concatenate(txt_parts)[:limit]
    return osa.shuffled_similarities(img, txt, min(65_536, 16 * rows), seed)


def _judge_line(judge: dict[str, Any] | None) -> str:
    """What the judge did: off, its mode, and whether its word check entered p_clean."""
    if judge is None:
        return "off"
    head = f"{judge.get('mode')} ({judge.get('id')}; scores in judge_score)"
    if "platt_fine" not in judge:
        return head + "; p_clean is its posterior where it judged"
    if judge.get("fine_prior") is None:
        return head + f"; its word check left out of p_clean: {judge.get('fine_off')}"
    fit = judge.get("fine_mixture_fit")
    if fit is not None and fit.get("used"):  # the near-miss mixture replaced the adjusted count (posterior.fit_mixture)
        clean, own, other = (100 * float(v) for v in fit["shares"])
        return head + (f"; p_clean = OSA's x its word check under the near-miss mixture (every word right {clean:.1f}%, "
                       f"wrong in the judge's own words {own:.1f}%, in words it never saw changed {other:.1f}%)")
    return head + f"; p_clean = OSA's x its word check (corpus share with every word right: {100 * judge['fine_prior']:.1f}%)"


def _refine_line(doc: dict[str, Any] | None) -> str:
    """Whether ``pairclean refine`` rewrote the tables, with what, and how p_clean was made."""
    if not isinstance(doc, dict):
        return "no (the tables are as scored)"
    raw = doc.get("choice")
    choice: dict[str, Any] = raw if isinstance(raw, dict) else {}
    blend = choice.get("blend")
    share = f"{blend:g}" if isinstance(blend, (int, float)) else "?"
    used = f", members used: {choice['used']} (learned share {share})" if "used" in choice else ""
    return f"{doc.get('method')} (raw score in {doc.get('score_column')}{used}); p_clean: {doc.get('p_clean')}"


def _row(r: dict[str, Any]) -> str:
    sim = r[schema.COL_SIMILARITY]
    sim_s = "   nan" if sim is None or np.isnan(sim) else f"{sim:+.3f}"
    flag = "NOISY" if r[schema.COL_NOISY] else "clean"
    # shard/key: keys repeat across shards in many corpora (00000.tar ... each from key 0)
    where = f"{shard_stem(r[schema.COL_SHARD])}/{r[schema.COL_KEY]}" if r.get(schema.COL_SHARD) else str(r[schema.COL_KEY])
    return f"  {printable(where):<40} {r[schema.COL_STATUS]:<13} sim {sim_s}  weight {r[schema.COL_WEIGHT]:.3f}  {flag}"


def _contrast_line(doc: dict[str, Any]) -> str:
    """The contrast's recipe, its rival weights and its bank."""
    from pairclean.calibrate.contrast import rival_weights

    caption, image = rival_weights(doc)
    owner = (f"; a caption with a better owner (another image, in the bank or the pair's shard, whose caption is at cosine "
             f">= {doc['owner_cosine']:g} and which fits it better; owner_margin > 0) keeps x{doc['owner_odds']:g} of its odds"
             if "owner_odds" in doc else "")
    if (owner and isinstance(doc.get("repeat_carriers"), int) and isinstance(doc.get("repeat_max_words"), int)
            and isinstance(doc.get("shared_p_clean"), (int, float))):
        least = doc.get("repeat_min_fit")
        fit = f"at least {least:.3f}" if isinstance(least, (int, float)) else "plausibly"
        owner += (f", unless it has at most {doc['repeat_max_words']} content words and {doc['repeat_carriers']} or more other "
                  f"photos carry it and fit it {fit} (a shared caption: no owner, p_clean at most {doc['shared_p_clean']:g}, "
                  "owner_margin -inf)")
    gate = (f"; a caption rival more than {abs(float(doc['caption_floor'])):.3f} (an image rival more than "
            f"{abs(float(doc['image_floor'])):.3f}) below its mean lifts a pair only as far as the pair beats it"
            if isinstance(doc.get("caption_floor"), (int, float)) and isinstance(doc.get("image_floor"), (int, float)) else "")
    if isinstance(doc.get("random_fit"), (int, float)):
        gate += (f"; a junk-heavy corpus (more pairs at random level than p_clean's random part explains), so every rival "
                 f"of a pair below {float(doc['random_fit']):.3f} (random pairs' 75th percentile) is gated too")
    return (f"on ({doc.get('recipe')} v{doc.get('version')}: caption rival x{caption:g}, image rival x{image:g}{owner}{gate}; "
            f"bank of {doc['bank_rows']} calibration pairs; weights read adjusted_similarity)")


def _clip(text: str, limit: int = 160) -> str:
    """``text`` cut to ``limit`` characters (an error as a summary line shows it)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _few(items: dict[str, Any], shown: int = 3) -> str:
    """The first ``shown`` entries of ``items`` as ``stem (value)``, and how many more."""
    text = ", ".join(f"{printable(stem)} ({printable(value)})" for stem, value in list(items.items())[:shown])
    return text + (f" and {len(items) - shown} more" if len(items) > shown else "")


def _shared_phrase(s: Summary) -> str:
    """How many ok pairs carry a shared caption, where the contrast has the rule ('' else)."""
    if s.shared is None or not isinstance((s.contrast or {}).get("shared_p_clean"), (int, float)):
        return ""
    after = " (before the audit's recalibration, which maps every p_clean)" if s.audit else ""
    return f"; {100 * s.shared:.1f}% carry a shared caption, p_clean capped{after}"


def format_summary(s: Summary) -> str:
    """Human-readable text of a summary."""
    warning = ([f"WARNING: a `pairclean {s.interrupted_rewrite}` was interrupted while rewriting the tables: some hold "
                f"its weights, some the earlier ones; run it again before using them"] if s.interrupted_rewrite else [])
    if s.exports_stale and not s.interrupted_rewrite:
        warning.append("WARNING: the exports (sizes.json, shard_weights.json, datacomp_keep.npy) may hold the earlier "
                       "weights: a run changed the tables and stopped before it wrote them again; run `pairclean export` "
                       "on this folder")
    lines = warning + [
        f"shards: {s.shards_committed}/{s.shards_total} committed, pairs: {s.pairs}"
        + (f"; {len(s.quarantined)} failed (a rerun retries them): " + _few(s.quarantined) if s.quarantined else "")
        + (f"; {len(s.retried)} took more than one try (up to {max(s.retried.values())}): " + _few(s.retried) if s.retried else ""),
        f"model: {s.model.get('model_id')} ({s.model.get('precision')}, {s.model.get('device')})",
        f"beta: {s.beta:+.4f} ({s.beta_recipe}), weighting: {s.weighting}",
        "status: " + ", ".join(f"{k}={v}" for k, v in s.statuses.items()),
        f"flagged noisy ({s.noisy_rule}): {100 * s.flagged_noisy:.1f}% of ok pairs",
        "corpus contrast: " + (_contrast_line(s.contrast) if s.contrast else "off (weights read the similarity)")
        + (f"; {100 * s.owned:.1f}% of ok pairs have a better owner" if s.owned is not None else "")
        + _shared_phrase(s),
        "judge: " + _judge_line(s.judge),
        "refined: " + _refine_line(s.refine),
        "audited: " + (f"p_clean recalibrated on {s.audit['labels']} human labels (`pairclean audit --labels`; the model's "
                       f"value in p_clean_model)" if s.audit else "no"),
        "noise-rate estimate (1 - mean p_clean over ok pairs: the wrong captions p_clean expects): "
        + (f"{100 * s.expected_noise:.1f}%" if s.expected_noise is not None else "n/a (no ok pairs)"),
        "random-mismatch share (pairs below the median of random mismatched pairs x 2; GMM without embeddings; "
        "near-misses score above it, so a lower bound): "
        + (f"{100 * s.noise_rate_gmm:.1f}%" if s.noise_rate_gmm is not None else "n/a (fewer than 16 pairs)"),
        "noise share by the p_clean mixture (calibration sample): "
        + (f"{100 * sum(s.mixture_noise):.1f}% (random {100 * s.mixture_noise[0]:.1f}%, near-miss {100 * s.mixture_noise[1]:.1f}%)"
           if s.mixture_noise is not None else "n/a (no corpus-mixture p_clean)"),
        *([junk_warning(s.unexplained_random)] if s.unexplained_random is not None else []),
        "weight histogram:",
    ]
    top = max((c for _, _, c in s.weight_histogram), default=1) or 1
    for lo, hi, count in s.weight_histogram:
        lines.append(f"  [{lo:.1f}, {hi:.1f}) {count:>8}  {'#' * int(round(40 * count / top))}")
    lines.append("first pairs:")
    lines.extend(_row(r) for r in s.first)
    lines.append("lowest-weight pairs:")
    lines.extend(_row(r) for r in s.lowest)
    return "\n".join(lines)
