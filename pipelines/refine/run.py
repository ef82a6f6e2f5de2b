"""``refine``: fit a learned estimator on a scored job's sidecars, apply it to every shard.

Steps, with the folder's ``RunLock`` held throughout:

1. *Check* (nothing is written before this passes): the folder is a pairclean job with
   committed shards, every shard has its embedding sidecar, every table was scored by
   the same model, and there are enough ok pairs to fit (``MIN_FIT_PAIRS``). Otherwise
   ``InputError``, one line.
2. *Sample*: ``sample_pairs`` ok pairs drawn uniformly without replacement (seeded) over
   the whole job. The ok count of each shard is in its completion record, so the global
   indices are chosen first and the sidecars are then streamed one at a time, keeping
   only the chosen rows (float16): memory is the sample plus one sidecar.
3. *Fit or reuse*: the heads are saved as ``_pairclean/heads/<method>-<sha12>.safetensors``
   and a fit record ``_pairclean/refine/fits/<key>.json`` maps (method, seed, sample size,
   settings, job, committed shards) to them, so a rerun reuses the heads instead of
   fitting again. ``heads`` (the bytes of a heads file, ``--heads``) skips fitting.
4. *Apply* (per shard, on any executor): the shard's table is rebuilt from its base
   columns (key .. similarity, uid, url) plus ``weight``, ``noisy``, ``p_clean`` and the
   method's raw score, and written atomically with ``OutputDir.write_table``. The driver
   then writes ``_pairclean/refine/<method>-<sha12>/<stem>.json`` (sha256 before and
   after): the shard's refine commit point.
5. *Records*: the job's completion records get the tables' new sha256 and bytes
   (``OutputDir.replace_records``), so the folder stays consistent.

A shard counts as refined when its refine record exists and the job's record already
has the refined sha256, or the file on the store has it (a crash between 4 and 5): a
rerun with the same method and seed rewrites nothing and the tables stay byte-identical.
A shard rewritten since by something else (``rescore``) is refined again.

``p_clean`` of a refined table keeps what ``pairclean score`` calibrated (issue 21: refine
must never be worse than the scored job): the method reorders the pairs, the job's calibration
says how sure to be.

- The ensemble's OSA member is the job's own score (``adjusted_similarity`` under the corpus
  contrast, else ``similarity``), not the bare cosine.
- An ensemble that chose OSA alone (``uses_only_osa``) gives exactly the scored ``p_clean``:
  OSA's curve of the job's score, times the judge's word check where the job has one.
- Otherwise the raw score is mapped onto OSA's ``p_clean`` by quantiles on the fit sample
  (``p_clean_map``: the pair ranked at quantile q gets the ``p_clean`` that OSA gives its
  pair at quantile q), so the corpus's noise share and the near-miss doubt that the
  corpus-mixture curve holds stay as scored; then the judge's word check multiplies it, as
  in ``score``. A method's own 2-component mixture, which ``refine`` used before, knows
  nothing of near-misses: on a corpus of retrieved near-miss captions it put ECE at 0.64.

Columns of a refined table: the scored table's (its ``adjusted_similarity`` and
``judge_score`` kept) with ``weight = p_clean`` and ``noisy = p_clean <= 0.5`` for ok rows,
and the method's raw score after them; rows that are not ok get ``p_clean`` 0, weight 0,
noisy True and a NaN raw score.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa

from pairclean import schema
from pairclean.errors import InputError
from pairclean.output.folder import OutputDir, ShardRecord
from pairclean.output.exports import refresh_exports
from pairclean.output.lock import RunLock
from pairclean.output.tables import float_column, read_embeddings
from pairclean.calibrate.calibration import Calibration
from pairclean.calibrate.contrast import owner_p_clean
from pairclean.refine import DEFAULT_METHOD, METHODS, Heads, fit, apply, heads_bytes, heads_from_bytes, score_column, settings_for
from pairclean.refine.ensemble import uses_only_osa

__all__ = ["check_finite", "MIN_FIT_PAIRS", "DEFAULT_SAMPLE_PAIRS", "RefineOptions", "RefineReport", "ShardApplied", "refine", "apply_shard", "check_job", "draw_sample", "Executor"]

log = logging.getLogger(__name__)

#: Fewer ok pairs than this and ``refine`` refuses to fit: a 2-component mixture and an
#: in-batch contrastive loss need a handful of pairs to be defined at all. (Heads fitted
#: on a few hundred pairs or fewer mean little; the bundled 10-pair demo still refines.)
MIN_FIT_PAIRS = 8
DEFAULT_SAMPLE_PAIRS = 500_000
REFINE_DIR = schema.REFINE_DIR
HEADS_DIR = schema.HEADS_DIR
FITS_DIR = f"{REFINE_DIR}/fits"
#: The columns kept from the scored table; everything else is recomputed.
BASE_COLUMNS = (schema.COL_KEY, schema.COL_SHARD, schema.COL_IDX, schema.COL_STATUS, schema.COL_ERROR, schema.COL_SIMILARITY)
#: The scored table's own score columns, kept after ``p_clean`` when it has them.
SCORED_EXTRAS = (schema.COL_ADJUSTED, schema.COL_OWNER_MARGIN, schema.COL_JUDGE_SCORE)
#: Knots of the quantile map from a method's raw score to OSA's p_clean.
MAP_KNOTS = 257


@dataclass(frozen=True)
class RefineOptions:
    """What to fit and how: ``method`` (one of ``METHODS``), ``seed``, ``sample_pairs``
    (upper bound of the fit sample), ``overrides`` (settings fields), ``heads`` (bytes of a
    heads file: apply those instead of fitting)."""

    method: str | None = None
    seed: int = 0
    sample_pairs: int = DEFAULT_SAMPLE_PAIRS
    overrides: dict[str, Any] = field(default_factory=dict)
    heads: bytes | None = None


@dataclass(frozen=True)
class ShardApplied:
    """A shard's table after applying heads: its stem, sha256 before and after, bytes, rows."""

    stem: str
    sha256_in: str
    sha256: str
    bytes: int
    rows: int
    seconds: float


@dataclass
class RefineReport:
    """What a refine did."""

    method: str
    heads: str
    heads_sha256: str
    fitted: bool
    sample_pairs: int
    fit_seconds: float
    epoch_seconds: list[float]
    refined: int
    skipped: int
    pairs: int
    apply_seconds: float
    #: How the method uses its members on this corpus (the ensemble's held-out choice); None otherwise.
    choice: dict[str, Any] | None = None


#: ``executor(records, heads_bytes, refine_doc)`` applies heads to each record's shard
#: (``apply_shard``) and yields the results as they finish, in any order.
Executor = Callable[[list[ShardRecord], bytes, dict[str, Any]], Iterator[ShardApplied]]


@dataclass(frozen=True)
class JobView:
    """The committed shards of a job with the facts refine needs."""

    records: list[ShardRecord]
    ok_counts: list[int]
    model: dict[str, Any]


def check_job(out: OutputDir) -> JobView:
    """Raise ``InputError`` unless ``out`` can be refined: a job, sidecars, one model."""
    if out.read_spec() is None:
        raise InputError(f"{out.uri} is not a pairclean output folder (no {out.store.url(schema.JOB_FILE)})", uri=out.uri)
    records = list(out.iter_committed())
    if not records:
        raise InputError(f"{out.uri} holds no committed shard: score it first", uri=out.uri)
    if out.read_calibration() is None:  # p_clean is mapped through it (the judge, the contrast): without it, silently not
        raise InputError(f"{out.uri} has no calibration ({out.store.url(schema.CALIBRATION_FILE)} is missing): put it back, "
                         "or score the job again into a new folder", uri=out.uri)
    missing = [r.stem for r in records if not out.has_embeddings(r)]
    if missing:
        spec = out.read_spec()
        fix = ("a resume of the job's `pairclean score` scores a deleted sidecar again" if spec is not None and spec.embeddings
               else "score the shards again into a new folder with --embeddings")
        raise InputError(f"{out.uri}: {len(missing)} of {len(records)} shards have no embedding sidecar (e.g. {missing[0]}); "
                         f"refine needs them: {fix}", uri=out.uri)
    models: dict[str, str] = {}
    model: dict[str, Any] = {}
    for r in records:
        if not out.store.exists(r.output):  # its metadata would read as "another model" (None)
            raise InputError(f"{out.store.url(r.output)} is missing (the folder's records name it): a resume of the "
                             "job's `pairclean score` scores it again", uri=out.uri)
        meta = out.store.parquet_metadata(r.output)
        if meta is None:  # read as "another model" (None): it is no Parquet pairclean can read
            raise InputError(f"{out.store.url(r.output)} is not a readable Parquet table (cut short?): a resume of the "
                             "job's `pairclean score` scores it again", uri=out.uri)
        doc = json.loads(meta.get(schema.META_KEY, b"{}"))
        model = doc.get("model") or {}
        ident = json.dumps({k: model.get(k) for k in ("model_id", "checkpoint_sha256", "embed_dim")}, sort_keys=True)
        models.setdefault(ident, r.stem)
    if len(models) > 1:
        names = [json.loads(k)["model_id"] for k in models]
        raise InputError(f"{out.uri} mixes scores of different models ({', '.join(map(str, names))}): "
                         "embeddings of different models cannot be fitted together; refine each job separately", uri=out.uri)
    ok_counts = [int(r.statuses.get(schema.STATUS_OK, 0)) for r in records]
    return JobView(records, ok_counts, model)


def job_scores(table: pa.Table) -> np.ndarray:
    """(N,) the score the job calibrated, per row: ``adjusted_similarity`` (the corpus
    contrast) where the table has it, else ``similarity``."""
    adjusted = float_column(table, schema.COL_ADJUSTED)
    if adjusted is not None:
        return adjusted
    similarity = float_column(table, schema.COL_SIMILARITY)
    assert similarity is not None  # every score table has it (OutputDir.read_scores checks)
    return similarity


@dataclass(frozen=True)
class Sample:
    """The fit sample: (m, D) float16 embeddings, (m,) job scores (``job_scores``) and (m,)
    judge ratios (NaN where not judged, or the job has no judge)."""

    img: np.ndarray
    txt: np.ndarray
    scores: np.ndarray
    judge: np.ndarray


def draw_sample(out: OutputDir, view: JobView, n: int, seed: int) -> Sample:
    """A seeded uniform sample of ``min(n, ok pairs)`` ok pairs (``Sample``).

    Streams the sidecars one at a time (memory: the sample plus one sidecar).
    """
    total = sum(view.ok_counts)
    m = min(n, total)
    chosen = np.sort(np.random.default_rng(seed).choice(total, size=m, replace=False)) if m < total else np.arange(total)
    bounds = np.cumsum([0, *view.ok_counts])
    img_parts, txt_parts, score_parts, judge_parts = [], [], [], []
    for i, record in enumerate(view.records):
        lo, hi = int(np.searchsorted(chosen, bounds[i])), int(np.searchsorted(chosen, bounds[i + 1]))
        if lo == hi:
            continue
        img, txt = read_embeddings(out.read_embeddings_table(record))
        check_finite(img, txt, out.store.url(record.emb_output or ""))
        if len(img) != view.ok_counts[i]:
            raise InputError(f"{out.store.url(record.emb_output or '')} holds {len(img)} ok rows, its record says "
                             f"{view.ok_counts[i]}: the folder is inconsistent", uri=out.uri)
        local = chosen[lo:hi] - bounds[i]
        img_parts.append(img[local].astype(np.float16))
        txt_parts.append(txt[local].astype(np.float16))
        table = out.read_scores(record)
        ok = schema.ok_mask(table)
        score_parts.append(job_scores(table)[ok][local])
        llr = float_column(table, schema.COL_JUDGE_SCORE)
        judge_parts.append(np.full(len(local), np.nan, np.float32) if llr is None else llr[ok][local])
    return Sample(np.concatenate(img_parts), np.concatenate(txt_parts), np.concatenate(score_parts), np.concatenate(judge_parts))


def check_finite(img: np.ndarray, txt: np.ndarray, where: str) -> None:
    """``InputError`` (one line naming the sidecar) when any ok row's embeddings hold NaN
    or infinity. Such rows used to reach the fit: a few made every p_clean one constant,
    more crashed inside scikit-learn. A scorer never writes them: the sidecar is damaged."""
    bad = ~(np.isfinite(img).all(axis=1) & np.isfinite(txt).all(axis=1)) if len(img) else np.zeros(0, dtype=bool)
    if bad.any():
        raise InputError(f"{where}: {int(bad.sum())} of {len(img)} ok rows have NaN or infinite embeddings (first: row "
                         f"{int(np.flatnonzero(bad)[0])} of the ok rows); the sidecar is damaged: score the shards again "
                         "into a new folder with --embeddings", uri=where)


def _fit_key(out: OutputDir, view: JobView, method: str, opts: RefineOptions) -> str:
    doc = out.read_job_doc() or {}
    ident = {"method": method, "seed": opts.seed, "sample_pairs": opts.sample_pairs, "overrides": opts.overrides,
             "job": doc.get("spec_sha256"), "shards": [[r.stem, r.rows] for r in view.records]}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def _heads_name(method: str, sha: str) -> str:
    return f"{HEADS_DIR}/{method}-{sha[:12]}.safetensors"


def _heads_file(method: str, sha: str, legacy: bool = False) -> str:
    """The heads file where it lies: ``OUT.pairclean/state/heads/...`` beside the output
    folder, or ``OUT/_pairclean/heads/...`` in a folder of the layout before it (``legacy``)."""
    name = _heads_name(method, sha)
    return f"OUT/{name}" if legacy else f"OUT{schema.SIDE_SUFFIX}/{schema.side_name(name)}"


def _referee(calibration: Calibration | None, sample: Sample) -> np.ndarray | None:
    """The judge's ratios of the sample as the ensemble's referee, where the job's judge has
    its word check on (the guard trusts it on this corpus); else None."""
    # Imported here, as in the functions below: pairclean.job.work loads the estimators
    # (torch), and the API process imports this module without ever running a model.
    from pairclean.job.work import has_word_check, word_check_off

    judge = None if calibration is None else calibration.extra.get("judge")
    if judge is None or not has_word_check(judge) or word_check_off(judge):
        return None
    return sample.judge


def _obtain_heads(out: OutputDir, view: JobView, opts: RefineOptions, sample: Callable[[], Sample],
                  calibration: Calibration | None) -> tuple[Heads, bytes, bool, float]:
    """(heads, their bytes, whether fitted now, fit seconds); saves new heads and the fit record.
    ``sample()``: the fit sample (``draw_sample``); ``calibration``: the job's (the referee's)."""
    if opts.heads is not None:
        try:
            heads = heads_from_bytes(opts.heads)
        except ValueError as exc:
            raise InputError(f"--heads: {exc}") from exc
        if opts.method and opts.method != heads.method:
            raise InputError(f"--heads holds {heads.method} heads but --method {opts.method} was asked for")
        dim = int(view.model.get("embed_dim") or 0)
        if heads.doc.get("dim", dim) != dim and dim:
            raise InputError(f"--heads were fitted on {heads.doc.get('dim')}-dim embeddings; this job's are {dim}-dim")
        data = heads_bytes(heads)
        out.store.put(_heads_name(heads.method, hashlib.sha256(data).hexdigest()), data)
        return heads, data, False, 0.0
    method = opts.method or DEFAULT_METHOD
    if method not in METHODS:
        raise InputError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    try:
        settings_for(method, opts.overrides)
    except TypeError as exc:
        raise InputError(f"bad settings for {method}: {exc}") from exc
    total = sum(view.ok_counts)
    if total < MIN_FIT_PAIRS:
        raise InputError(f"{out.uri} has {total} ok pairs; fitting {method} needs at least {MIN_FIT_PAIRS}", uri=out.uri)
    fit_record = f"{FITS_DIR}/{_fit_key(out, view, method, opts)[:16]}.json"
    entry = _fit_entry(out.store.get(fit_record))
    if entry is not None:  # a damaged record is as none: the heads are fitted again
        stored = out.store.get(entry["heads"])
        if stored is not None and hashlib.sha256(stored).hexdigest() == entry["sha256"]:
            return heads_from_bytes(stored), stored, False, 0.0
    t0 = time.perf_counter()
    drawn = sample()
    img, txt = drawn.img, drawn.txt
    heads = fit(method, img, txt, opts.seed, opts.overrides, osa=drawn.scores, referee=_referee(calibration, drawn))
    seconds = time.perf_counter() - t0
    data = heads_bytes(heads)
    sha = hashlib.sha256(data).hexdigest()
    out.store.put(_heads_name(method, sha), data)
    out.store.put(fit_record, json.dumps({"heads": _heads_name(method, sha), "sha256": sha, "method": method, "seed": opts.seed,
                                          "sample_pairs": int(len(img))}, sort_keys=True).encode())
    fitted = Heads(heads.method, heads.arrays, heads.doc, heads.epoch_seconds)
    return fitted, data, True, seconds


def refine_doc(heads: Heads, sha: str, p_map: dict[str, Any] | None = None, legacy: bool = False) -> dict[str, Any]:
    """What a refined table's metadata records under ``refine``; ``p_map``: the quantile map
    of ``p_clean_map`` (None: the job has no calibration to map onto, the method's own
    ``p_clean`` is used)."""
    if p_map is None:
        how = f"{heads.method} clean posterior"
    elif p_map.get("kind") == "osa":
        how = "the scored p_clean (the ensemble chose OSA alone)"
    else:
        how = "the raw score mapped onto OSA's p_clean by quantiles, times the judge's word check where the job has one"
    return {"method": heads.method, "settings": heads.doc.get("settings"), "sample_pairs": heads.doc.get("sample_pairs"),
            # where the file lies, relative to OUT's parent: the logical "_pairclean/..." name
            # it is stored under named no file a user could find
            "seed": heads.doc.get("seed"), "heads_sha256": sha, "heads": _heads_file(heads.method, sha, legacy),
            "score_column": score_column(heads.method), "p_clean": how,
            **({"p_clean_map": p_map} if p_map is not None else {}),
            **({"choice": heads.doc["choice"]} if "choice" in heads.doc else {}),
            "weight_rule": "weight = p_clean", "noisy_rule": "p_clean <= 0.5"}


def _given_scores(heads: Heads, scores: np.ndarray) -> np.ndarray | None:
    """The job scores for an ensemble fitted on them (None: heads fitted on the cosine)."""
    return scores if heads.doc.get("osa_member") == "given" else None


def p_clean_map(heads: Heads, sample: Sample, calibration: Calibration) -> dict[str, Any]:
    """The map from ``heads``' raw score to ``p_clean`` on the job's fit ``sample``:
    ``{"kind": "osa"}`` for an ensemble that chose OSA alone, else ``{"kind": "quantile",
    "raw": knots, "p": knots}``, ``MAP_KNOTS`` quantiles of the sample's raw scores and of
    OSA's ``p_clean`` of the same sample (both non-decreasing)."""
    from pairclean.job.work import osa_p_clean

    if heads.method == "ensemble" and uses_only_osa(heads):
        return {"kind": "osa"}
    raw = apply(heads, sample.img, sample.txt, _given_scores(heads, sample.scores))[0].astype(np.float64)
    base = osa_p_clean(sample.scores, calibration).astype(np.float64)
    finite = np.isfinite(raw) & np.isfinite(base)
    if not finite.any():  # the method scored no sample pair (diverged heads): OSA's p_clean stays
        return {"kind": "osa"}
    raw, base = raw[finite], base[finite]
    levels = np.linspace(0.0, 1.0, MAP_KNOTS)
    return {"kind": "quantile", "raw": [float(v) for v in np.quantile(raw, levels)],
            "p": [float(v) for v in np.quantile(base, levels)]}


def refined_p_clean(raw: np.ndarray, scores: np.ndarray, llr: np.ndarray | None, p_map: dict[str, Any],
                    calibration: Calibration, owner_margin: np.ndarray | None = None) -> np.ndarray:
    """(N,) ``p_clean`` of ok pairs from the method's ``raw`` scores, the job's ``scores``,
    the judge's ratios ``llr`` (None: no judge), the map of ``p_clean_map`` and the
    contrast's ``owner_margin`` (None: a table without owners), combined as ``scores_table``
    combines them: the judge's factor, then the owners'. A pair whose raw score is not finite
    (the method failed on it) keeps OSA's ``p_clean``."""
    from pairclean.job.work import judged_p_clean, osa_p_clean

    osa_p = osa_p_clean(np.asarray(scores, np.float32), calibration)
    if p_map["kind"] == "osa":
        base = osa_p
    else:
        mapped = np.interp(raw, np.asarray(p_map["raw"]), np.asarray(p_map["p"])).astype(np.float32)
        base = np.where(np.isfinite(raw), mapped, osa_p).astype(np.float32)
    judge = calibration.extra.get("judge")
    p = np.asarray(base, np.float32)
    if judge is not None and llr is not None:
        judged = judged_p_clean(np.asarray(llr, np.float32), p, judge)
        p = np.where(np.isfinite(judged), judged, p).astype(np.float32)
    if owner_margin is not None:
        doc = calibration.extra.get("contrast") or {}
        p = owner_p_clean(p, owner_margin, doc.get("owner_odds"), doc.get("shared_p_clean"))
    return p


def apply_shard(out: OutputDir, record: ShardRecord, heads: Heads, doc: dict[str, Any]) -> ShardApplied:
    """Apply ``heads`` to one committed shard and rewrite its table atomically.

    Deterministic: the same heads and inputs give byte-identical tables.
    """
    t0 = time.perf_counter()
    table = out.read_scores(record)
    ok = schema.ok_mask(table)
    img, txt = read_embeddings(out.read_embeddings_table(record))
    check_finite(img, txt, out.store.url(record.emb_output or ""))
    if len(img) != int(ok.sum()):
        raise InputError(f"{out.store.url(record.emb_output or '')} holds {len(img)} ok rows but the score table "
                         f"{int(ok.sum())}: the folder is inconsistent", uri=out.uri)
    scores = job_scores(table)[ok]
    raw_ok, p_ok = apply(heads, img, txt, _given_scores(heads, scores)) if len(img) else (np.zeros(0, np.float32), np.zeros(0, np.float32))
    p_map = doc.get("p_clean_map")
    if p_map is not None and len(img):
        calibration = out.read_calibration()
        if calibration is None:
            raise InputError(f"{out.uri} lost its calibration while being refined", uri=out.uri)
        llr = float_column(table, schema.COL_JUDGE_SCORE)
        margin = float_column(table, schema.COL_OWNER_MARGIN)
        p_ok = refined_p_clean(raw_ok, scores, None if llr is None else llr[ok], p_map, calibration,
                               None if margin is None else margin[ok])
    n = table.num_rows
    raw = np.full(n, np.nan, dtype=np.float32)
    p = np.zeros(n, dtype=np.float32)
    raw[ok], p[ok] = raw_ok, np.clip(p_ok, 0.0, 1.0)
    new = refined_table(table, raw, p, doc)
    data_sha = record.sha256
    info = out.write_table(record.output, new)
    return ShardApplied(record.stem, data_sha, info.sha256, info.bytes, n, time.perf_counter() - t0)


def refined_table(table: pa.Table, raw: np.ndarray, p: np.ndarray, doc: dict[str, Any]) -> pa.Table:
    """The refined score table: base columns, then weight, noisy, p_clean, raw score, uid, url,
    and the member columns when the table has them."""
    meta = json.loads(table.schema.metadata[schema.META_KEY])
    meta["refine"] = doc
    meta["noisy_rule"] = doc["noisy_rule"]
    cols = set(table.column_names)
    with_uid, with_url = schema.COL_UID in cols, schema.COL_URL in cols
    with_members = cols >= set(schema.MEMBER_COLUMNS)
    score_col = doc["score_column"]
    kept = tuple(name for name in SCORED_EXTRAS if name in cols)
    out_schema = schema.scores_schema(with_uid, with_url, extra_scores=(*kept, score_col), with_members=with_members).with_metadata(
        {schema.META_KEY: json.dumps(meta, sort_keys=True).encode()})
    columns: dict[str, Any] = {name: table.column(name) for name in (*BASE_COLUMNS, *kept)}
    columns[schema.COL_WEIGHT] = p.astype(np.float32)
    columns[schema.COL_NOISY] = ~(p > 0.5)
    columns[schema.COL_P_CLEAN] = p.astype(np.float32)
    columns[score_col] = raw.astype(np.float32)
    if with_uid:
        columns[schema.COL_UID] = table.column(schema.COL_UID)
    if with_url:
        columns[schema.COL_URL] = table.column(schema.COL_URL)
    if with_members:
        columns.update((name, table.column(name)) for name in schema.MEMBER_COLUMNS)
    return pa.table([columns[f.name] for f in out_schema], schema=out_schema)


def local_executor(out: OutputDir) -> Executor:
    """Apply shard after shard in this process."""

    def run(records: list[ShardRecord], data: bytes, doc: dict[str, Any]) -> Iterator[ShardApplied]:
        heads = heads_from_bytes(data)
        for record in records:
            yield apply_shard(out, record, heads, doc)

    return run


def _record_name(doc: dict[str, Any], stem: str) -> str:
    return f"{REFINE_DIR}/{doc['method']}-{doc['heads_sha256'][:12]}/{stem}.json"


def _fit_entry(data: bytes | None) -> dict[str, str] | None:
    """A fit record's ``heads`` (a name in the refine folder) and ``sha256``, or None where
    it is missing or not one pairclean wrote."""
    doc = schema.json_object(data)
    if doc is None or not all(isinstance(doc.get(k), str) for k in ("heads", "sha256")):
        return None
    return {"heads": doc["heads"], "sha256": doc["sha256"]}


def _applied_record(data: bytes | None) -> ShardApplied | None:
    """The applied record in ``data``, or None where there is none or it is not one pairclean
    wrote (empty, not JSON, a missing or unknown field: a JSONDecodeError, KeyError or
    TypeError traceback before)."""
    doc = schema.json_object(data)
    try:
        applied = ShardApplied(**doc) if doc is not None else None
    except TypeError:  # a missing or unknown field
        return None
    return applied if applied is not None and isinstance(applied.sha256, str) else None


def _plan(out: OutputDir, records: list[ShardRecord], doc: dict[str, Any]) -> tuple[list[ShardRecord], dict[str, ShardApplied]]:
    """(shards to refine, shards already refined by these heads with their applied record)."""
    todo, done = [], {}
    for record in records:
        applied = _applied_record(out.store.get(_record_name(doc, record.stem)))
        if applied is not None:  # a damaged record is as none: the shard is refined again (the same table)
            if record.sha256 == applied.sha256:
                done[record.stem] = applied
                continue
            if out.store.sha256(record.output) == applied.sha256:  # a crash before the records were refreshed
                done[record.stem] = applied
                continue
        todo.append(record)
    return todo, done


def refine(
    out: OutputDir,
    options: RefineOptions,
    executor: Callable[[], Executor] | None = None,
    lock_ttl_s: float | None = None,
    progress: Callable[[ShardApplied], None] | None = None,
) -> RefineReport:
    """Fit (or load) heads and apply them to every committed shard of ``out``; resumable.

    ``executor()`` builds the executor (default: this process) once heads are ready, so a
    Ray pool is only started when there is work. Raises ``InputError`` (nothing written)
    for a folder that cannot be refined.
    """
    out.check_owned()
    view = check_job(out)  # before the lock: a bad folder gets no lock file either
    lock = RunLock(out.store, ttl_s=lock_ttl_s)
    lock.acquire()
    try:
        out.start_rewrite_run("refine")
        result = _refine_locked(out, view, options, executor, lock, progress)
        refresh_exports(out)  # trainers read them without asking: never leave them on the earlier weights
        return result
    finally:
        lock.release()


def _refine_locked(out: OutputDir, view: JobView, options: RefineOptions, executor: Callable[[], Executor] | None,
                   lock: RunLock, progress: Callable[[ShardApplied], None] | None) -> RefineReport:
    drawn: list[Sample] = []

    def sample() -> Sample:
        if not drawn:  # once, and only when needed
            drawn.append(draw_sample(out, view, options.sample_pairs, options.seed))
        return drawn[0]

    calibration = out.read_calibration()
    heads, data, fitted, fit_seconds = _obtain_heads(out, view, options, sample, calibration)
    sha = hashlib.sha256(data).hexdigest()
    p_map = None if calibration is None else p_clean_map(heads, sample(), calibration)
    doc = refine_doc(heads, sha, p_map, out.legacy)
    todo, done = _plan(out, view.records, doc)
    t0 = time.perf_counter()
    pairs = 0
    if todo:
        out.begin_rewrite("refine")
        run = executor() if executor is not None else local_executor(out)
        for applied in run(todo, data, doc):
            lock.check()  # a run that lost its lock must not commit
            out.store.put(_record_name(doc, applied.stem), json.dumps(applied.__dict__, sort_keys=True).encode())
            done[applied.stem] = applied
            pairs += applied.rows
            if progress is not None:
                progress(applied)
    apply_seconds = time.perf_counter() - t0
    lock.check()  # a run that lost its lock must not record what it wrote either
    stale = [r for r in view.records if r.stem in done and r.sha256 != done[r.stem].sha256]
    if stale:
        out.replace_records([replace(r, sha256=done[r.stem].sha256, bytes=done[r.stem].bytes) if r.stem in done else r
                             for r in view.records])
    out.end_rewrite()
    return RefineReport(heads.method, _heads_name(heads.method, sha), sha, fitted, int(heads.doc.get("sample_pairs") or 0),
                        round(fit_seconds, 3), [round(t, 3) for t in heads.epoch_seconds], len(todo),
                        len(view.records) - len(todo), pairs, round(apply_seconds, 3), heads.doc.get("choice"))
