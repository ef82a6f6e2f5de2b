"""Recomputing weights and flags of a finished job from stored similarities and embeddings.

No image is decoded and no pair is re-embedded. Calibration follows the same rule as a
fresh ``score`` (the first ``calibration_pairs`` ok pairs in shard order), so rescoring to
recipe X gives the same weights as scoring with recipe X from the start.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pyarrow as pa

from pairclean import osa, schema
from pairclean.calibrate.calibration import calibrate, needs_corpus
from pairclean.calibrate.contrast import fit_contrast, image_copy_cosine_for, owner_cosine_for, table_columns
from pairclean.errors import InputError
from pairclean.calibrate.calibration import Calibration
from pairclean.spec import JobSpec, spec_digest
from pairclean.output.exports import refresh_exports
from pairclean.output.lock import RunLock
from pairclean.output.folder import OutputDir, ShardRecord
from pairclean.job.work import as_recorded, has_word_check, judged_p_clean, osa_p_clean, refit_fine_prior, with_judge_record
from pairclean.output.tables import float_column, output_metadata, read_caption_words, read_embeddings, scores_table

__all__ = ["rescore"]

log = logging.getLogger(__name__)


def _embeddings(out: OutputDir, records: list[ShardRecord], limit: int) -> tuple[np.ndarray, np.ndarray]:
    """The ok rows' embeddings of ``records`` in order, the first ``limit`` (sidecars read
    until there are that many)."""
    img_parts, txt_parts, rows = [], [], 0
    for record in records:
        if rows >= limit:
            break
        img, txt = read_embeddings(out.read_embeddings_table(record))
        img_parts.append(img)
        txt_parts.append(txt)
        rows += len(img)
    return np.concatenate(img_parts)[:limit], np.concatenate(txt_parts)[:limit]


def rescore(
    out: OutputDir,
    *,
    beta_recipe: str,
    weighting: str,
    beta_k: int | None,
    random_beta: Callable[[JobSpec], float] | None = None,
    contrast: bool | None = None,
    lock_ttl_s: float | None = None,
) -> Calibration:
    """Rewrite every committed scores file of ``out`` under a new recipe and weighting.

    ``random_beta(spec)`` supplies the random-inputs beta (it needs the model; the CLI
    passes a cached loader). Updates the job's spec, its calibration and the records'
    checksums; each file is replaced atomically. ``contrast``: turn the corpus contrast on
    or off (None: as the job was scored); on needs the embedding sidecars.

    Holds the folder's run lock (a ``score``, ``refine`` or another ``rescore`` running on it
    is refused); a run killed midway leaves the rewrite marked (``OutputDir.begin_rewrite``)
    until a rerun, which recomputes every table, finishes it.
    """
    osa.check_method(beta_recipe, weighting)
    old_spec = out.read_spec()
    if old_spec is None:
        raise InputError(f"{out.uri} is not a pairclean output folder (no {out.store.url(schema.JOB_FILE)})")
    lock = RunLock(out.store, ttl_s=lock_ttl_s)
    lock.acquire()
    try:
        out.start_rewrite_run("rescore")
        calibration = _rescore_locked(out, old_spec, lock, beta_recipe=beta_recipe, weighting=weighting, beta_k=beta_k,
                                      random_beta=random_beta, contrast=contrast)
        refresh_exports(out)  # trainers read them without asking: never leave them on the earlier weights
        return calibration
    finally:
        lock.release()


def _warn_audit_replaced(out: OutputDir, tables: list[tuple[ShardRecord, pa.Table]]) -> None:
    """Say so when the tables carry an audit's recalibrated ``p_clean`` (``p_clean_model``
    beside it): the rewrite replaces it with the new calibration's, as a fresh score would.
    It did so without a word, and the labels' work looked lost."""
    audited = sum(1 for _, t in tables if schema.COL_P_CLEAN_MODEL in t.column_names)
    if audited:
        log.warning("%d of %d tables hold p_clean recalibrated by an audit: the rescore replaces it with the new "
                    "calibration's; run `pairclean audit %s --labels FILE` again to recalibrate", audited, len(tables), out.uri)


def _warn_refine_replaced(out: OutputDir, tables: list[tuple[ShardRecord, pa.Table]]) -> None:
    """Say so when the tables carry ``pairclean refine``'s weights (its record in their
    metadata): the rewrite writes OSA's, recalibrated, as a fresh score would. The
    refinement's columns and weights went without a word, and ``inspect`` then said
    "refined: no"."""
    refined = (json.loads(table.schema.metadata[schema.META_KEY]).get("refine") for _, table in tables)
    methods = {str(r.get("method", "refine")) for r in refined if isinstance(r, dict)}
    if methods:
        log.warning("the tables hold the weights of `pairclean refine` (%s): the rescore replaces them with OSA's, "
                    "recalibrated; run `pairclean refine %s` again to refine them", ", ".join(sorted(methods)), out.uri)


def _rescore_locked(out: OutputDir, old_spec: JobSpec, lock: RunLock, *, beta_recipe: str, weighting: str, beta_k: int | None,
                    random_beta: Callable[[JobSpec], float] | None, contrast: bool | None) -> Calibration:
    old_judge = _old_judge(out, old_spec)
    spec = replace(old_spec, beta_recipe=beta_recipe, weighting=weighting, beta_k=beta_k or old_spec.beta_k,
                   contrast=old_spec.contrast if contrast is None else contrast)
    committed = list(out.iter_committed())
    if not committed:
        raise InputError(f"{out.uri} holds no committed shard")
    tables = [(record, out.read_scores(record)) for record in committed]
    _warn_audit_replaced(out, tables)
    _warn_refine_replaced(out, tables)
    ok_sims = [
        t.column(schema.COL_SIMILARITY).to_numpy()[
            schema.ok_mask(t)
        ]
        for _, t in tables
    ]
    # As a fresh score: a recipe and weighting that need no corpus calibrate on none (so
    # p_clean is the same hard s > beta a fresh job of these options writes).
    n = spec.calibration_pairs if needs_corpus(beta_recipe, weighting) else 0
    sims = np.concatenate(ok_sims)[:n].astype(np.float32)
    img = txt = None
    if spec.contrast and not spec.embeddings:
        raise InputError(f"{out.uri} has no embedding sidecars: the corpus contrast needs them "
                         "(score with --embeddings, or rescore with --contrast off)")
    if n and (beta_recipe in ("shuffled", "gmm") or spec.embeddings):
        img, txt = _embeddings(out, [r for r, _ in tables], n)
    # As a fresh score: the bank is the calibration sample's images (same pairs, same rounding).
    fitted = (fit_contrast(img, txt, owner_cosine_for(spec.model, spec.checkpoint),
                         image_copy_cosine_for(spec.model, spec.checkpoint))
              if spec.contrast and img is not None and txt is not None else None)
    if fitted is not None and fitted.repeat_carriers is not None and not _sidecars_count_words(out, [r for r, _ in tables]):
        # sidecars written before the count: no caption is known to be short, and the record says so
        fitted = fitted.without_shared_rule()

    def fit(word_check: bool) -> Calibration:
        return calibrate(
            beta_recipe=beta_recipe, k=spec.beta_k, seed=spec.seed, weighting=weighting,
            batch_size=spec.batch_size, similarities=sims, image_emb=img, text_emb=txt,
            random_beta=(lambda: random_beta(spec)) if random_beta else _no_model, contrast=fitted,
            word_check=word_check,
        )

    calibration = fit(old_judge is not None and has_word_check(old_judge))
    if old_judge is not None:
        judged = old_judge  # bound for the lambda (mypy does not narrow inside it)
        # the calibration sample's scores as OSA read them: the same pairs, already in memory
        recorded = as_recorded(calibration, fitted)  # calibrate may have set its random_fit (a junk-heavy corpus)
        scored = sims if recorded is None or img is None or txt is None else recorded.adjust(sims, img, txt)
        stored = out.read_judge_ratios()  # every calibration pair's ratio, where the folder kept them
        calibration = with_judge_record(calibration, lambda cal: _judge_record(cal, judged, tables, scored, sims, stored),
                                        lambda: fit(False))
    fitted = as_recorded(calibration, fitted)  # the contrast the final calibration recorded (None without one)
    out.begin_rewrite("rescore")
    if fitted is not None:
        out.write_contrast_bank(fitted.bank)
    digest = spec_digest(spec)
    # one shard's sidecar in memory at a time for the adjusted similarities
    records = []
    for record, table in tables:
        lock.check()  # a run that lost its lock must not write on
        columns: tuple[Any, Any] = (None, None)
        if fitted is not None:
            img_all, txt_all, words_all = _shard_embeddings(out, record, table)
            columns = table_columns(fitted, table.column(schema.COL_SIMILARITY).to_numpy(), img_all, txt_all,
                                    schema.ok_mask(table), words_all)
        records.append(_rewrite(out, record, table, calibration, digest, columns))
    lock.check()  # nor record what it wrote: the tables may be another run's by now
    out.replace_records(records)
    doc = out.read_job_doc() or {}
    doc["spec"] = spec.to_json()
    doc["spec_sha256"] = digest
    doc.setdefault("rescored_from", []).append(
        {k: old_spec.to_json()[k] for k in ("beta_recipe", "weighting", "beta_k")} | {"contrast": old_spec.contrast})
    out.write_job_doc(doc)
    out.write_calibration(calibration)
    out.end_rewrite()
    return calibration


def _old_judge(out: OutputDir, spec: JobSpec) -> dict[str, Any] | None:
    """The judge record of a judged job (None: not judged). The judge's ratios are kept from
    the tables (``judge_score``) and the calibration sample's file (``_judge_record``): the
    sidecars hold no regions or tokens to judge again; the judge's band and maps stay as
    scored."""
    if spec.judge == "off":
        return None
    old = out.read_calibration()
    if old is None or "judge" not in old.extra:
        raise InputError(f"{out.uri} was scored with --judge {spec.judge} but its calibration has no judge record; score it again")
    return dict(old.extra["judge"])


def _judge_record(calibration: Calibration, frozen: dict[str, Any], tables: list[tuple[ShardRecord, pa.Table]],
                  scored: np.ndarray, sims: np.ndarray, stored: np.ndarray | None = None) -> dict[str, Any]:
    """The judge record ``frozen`` with its near-miss prior refitted under ``calibration`` on
    the calibration sample: its OSA scores ``scored`` (n,) and the judge's ratios of the same
    first n ok pairs (similarities ``sims``, (n,)): ``stored`` (``OutputDir.read_judge_ratios``,
    (2, n): every one, as a fresh score fits it) where the folder kept them for exactly these
    pairs (the same similarities), else the tables' ``judge_score`` (under ``--judge band``,
    in-band pairs only)."""
    n = len(scored)
    llr = np.concatenate([np.zeros(0, np.float32)] + [_judge_scores(t)[schema.ok_mask(t)] for _, t in tables])[:n]
    if stored is not None and stored.shape[1] == n and np.array_equal(stored[0], sims):
        llr = stored[1]  # the same pairs as the tables' first n ok ones (a shard re-scored since would differ)
    keep = np.isfinite(llr)  # tables of folders scored without the stored ratios: under --judge band, pairs outside it were never judged
    return refit_fine_prior(frozen, llr[keep], osa_p_clean(np.asarray(scored, np.float32)[keep], calibration))


def _judge_scores(table: pa.Table) -> np.ndarray:
    llr = float_column(table, schema.COL_JUDGE_SCORE)
    if llr is None:
        raise InputError(f"a table of this judged job has no {schema.COL_JUDGE_SCORE} column; score it again")
    return llr


def _sidecars_count_words(out: OutputDir, records: list[ShardRecord]) -> bool:
    """Whether every record's sidecar has the ``caption_words`` column (footers only)."""
    import pyarrow.parquet as pq

    for record in records:
        if record.emb_output is None:
            return False
        with out.store.open_read(record.emb_output) as fh:
            if schema.COL_CAPTION_WORDS not in pq.ParquetFile(fh).schema_arrow.names:
                return False
    return True


def _shard_embeddings(out: OutputDir, record: ShardRecord, table: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(image, text) (N, D) of every row of ``table`` from its sidecar (zeros where not ok),
    and the (N,) content-word counts of its captions (None: the sidecar predates them)."""
    side = out.read_embeddings_table(record)
    img, txt = read_embeddings(side)
    ok = schema.ok_mask(table)
    if int(ok.sum()) != len(img):
        raise InputError(f"{out.uri}: the sidecar of {record.stem} holds {len(img)} embeddings for {int(ok.sum())} ok rows")
    full_img = np.zeros((len(ok), img.shape[1]), np.float32)
    full_txt = np.zeros((len(ok), txt.shape[1]), np.float32)
    full_img[ok], full_txt[ok] = img, txt
    return full_img, full_txt, read_caption_words(side, len(ok))


def _judge_columns(table: pa.Table, calibration: Calibration, adjusted: np.ndarray | None) -> dict[str, Any]:
    """``scores_table``'s judge arguments for a judged job's table (none for another job)."""
    if "judge" not in calibration.extra:
        return {}
    llr = _judge_scores(table)
    scored = table.column(schema.COL_SIMILARITY).to_numpy() if adjusted is None else adjusted
    return {"second_stage": judged_p_clean(llr, osa_p_clean(np.asarray(scored, np.float32), calibration), calibration.extra["judge"]),
            "extra_scores": {schema.COL_JUDGE_SCORE: llr}}


def _no_model() -> float:
    raise InputError("the random-inputs recipe needs the estimator; none was given")


def _rewrite(out: OutputDir, record: ShardRecord, table: pa.Table, calibration: Calibration, digest: str,
             contrast_columns: tuple[np.ndarray | None, np.ndarray | None]) -> ShardRecord:
    """Rewrite one table under ``calibration``; ``contrast_columns``: ``contrast.table_columns``
    of its pairs (both None without a contrast)."""
    adjusted, owner = contrast_columns
    old_meta = json.loads(table.schema.metadata[schema.META_KEY])
    extra = {k: old_meta[k] for k in ("shard", "recipe") if k in old_meta} | {"job": digest}
    if "judge" in calibration.extra:
        extra["judge"] = calibration.extra["judge"]
    meta = output_metadata(old_meta["model"], calibration, extra)
    cols = set(table.column_names)
    new = scores_table(
        shard=table.column(schema.COL_SHARD)[0].as_py() if table.num_rows else "",
        keys=table.column(schema.COL_KEY).to_pylist(),
        idx=table.column(schema.COL_IDX).to_numpy(),
        status=table.column(schema.COL_STATUS).to_pylist(),
        error=table.column(schema.COL_ERROR).to_pylist(),
        similarity=table.column(schema.COL_SIMILARITY).to_numpy(),
        calibration=calibration,
        metadata=meta,
        uid=table.column(schema.COL_UID).to_pylist() if schema.COL_UID in cols else None,
        url=table.column(schema.COL_URL).to_pylist() if schema.COL_URL in cols else None,
        members={c: table.column(c).to_pylist() for c in schema.MEMBER_COLUMNS} if cols >= set(schema.MEMBER_COLUMNS) else None,
        adjusted=adjusted, owner_margin=owner,
        **_judge_columns(table, calibration, adjusted),
    )
    info = out.write_table(record.output, new)
    return replace(record, sha256=info.sha256, bytes=info.bytes)
