"""The single-process job loop: plan, resume, calibrate, score, commit.

``run_job`` is what ``pairclean score`` runs without Ray. Shards already in the manifest
are skipped; a shard that cannot be read is reported and left uncommitted (a rerun
retries it) while the others go on.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from . import __version__, schema
from .calibration import calibrate, cached_random_beta, needs_corpus
from .errors import InputError
from .estimators import Estimator
from .job import Calibration, JobSpec, OutputDir
from .scoring import ScoreOptions, ShardResult, embeddings_table, output_metadata, score_shard, scores_table
from .shards import ReadOptions
from .uris import shard_size

__all__ = ["Progress", "JobReport", "run_job", "commit_result", "random_beta_fn"]

log = logging.getLogger(__name__)


class Progress(Protocol):
    """Receives progress events (the CLI draws a bar from them)."""

    def start(self, total_shards: int, already_done: int) -> None: ...

    def shard_done(self, stem: str, rows: int) -> None: ...

    def shard_failed(self, uri: str, error: str) -> None: ...


@dataclass
class JobReport:
    """What a run did."""

    total_shards: int
    skipped: int = 0
    committed: int = 0
    pairs: int = 0
    seconds: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)
    failed: list[tuple[str, str]] = field(default_factory=list)
    calibration: Calibration | None = None

    @property
    def complete(self) -> bool:
        return not self.failed


def random_beta_fn(estimator: Estimator, k: int, seed: int) -> Callable[[], float]:
    """beta of the random-inputs recipe for ``estimator`` (disk-cached per model identity)."""
    from .osa import beta_from_cross

    info = estimator.info
    identity = {
        "model_id": info.model_id,
        "checkpoint_sha256": info.checkpoint_sha256,
        "precision": info.precision,
        "device_type": info.device.split(":")[0],
        "k": k,
        "seed": seed,
    }

    def compute() -> float:
        img, txt = estimator.random_input_embeddings(k, seed)
        return beta_from_cross(img, txt)

    return lambda: cached_random_beta(identity, compute)


def commit_result(out: OutputDir, spec: JobSpec, result: ShardResult, stem: str, calibration: Calibration, model_info: dict[str, Any]) -> None:
    """Write the scores (and embeddings) of one shard and append its manifest line."""
    meta = output_metadata(model_info, calibration, {"shard": result.uri, "recipe": _recipe(spec)})
    tables = {
        f"{stem}.parquet": scores_table(
            result.uri, result.keys, result.idx, result.status, result.error,
            result.similarity, calibration, meta, result.uid, result.url,
        )
    }
    if spec.embeddings:
        # The sidecar holds no beta: it stays valid when the job is rescored.
        emb_meta = {schema.META_KEY: json.dumps({"pairclean_version": __version__, "model": model_info}, sort_keys=True).encode()}
        tables[f"{stem}.emb.parquet"] = embeddings_table(result.keys, result.image_emb, result.text_emb, result.ok_mask, emb_meta)
    out.commit(
        {
            "shard": result.uri,
            "stem": stem,
            "size": shard_size(result.uri),
            "rows": len(result),
            "statuses": result.status_counts(),
        },
        tables,
    )


def _recipe(spec: JobSpec) -> dict[str, Any]:
    return {
        "batch_size": spec.batch_size,
        "max_pixels": spec.max_pixels,
        "caption_field": spec.caption_field,
        "calibration_pairs": spec.calibration_pairs,
    }


def _calibrate_from(results: list[ShardResult], spec: JobSpec, estimator: Estimator) -> Calibration:
    """Calibrate on the first ``spec.calibration_pairs`` ok pairs of ``results`` (may be empty)."""
    dim = estimator.info.embed_dim
    masks = [r.ok_mask for r in results]
    n = spec.calibration_pairs
    sims = np.concatenate([np.zeros(0, np.float32)] + [r.similarity[m] for r, m in zip(results, masks)])[:n]
    img = np.concatenate([np.zeros((0, dim), np.float32)] + [r.image_emb[m] for r, m in zip(results, masks)])[:n]
    txt = np.concatenate([np.zeros((0, dim), np.float32)] + [r.text_emb[m] for r, m in zip(results, masks)])[:n]
    # Calibrate on float16-rounded embeddings, exactly what the sidecar stores, so that
    # `pairclean rescore` reproduces a fresh score bit for bit.
    img, txt = img.astype(np.float16).astype(np.float32), txt.astype(np.float16).astype(np.float32)
    try:
        return calibrate(
            beta_recipe=spec.beta_recipe, k=spec.beta_k, seed=spec.seed, weighting=spec.weighting,
            batch_size=spec.batch_size, similarities=sims, image_emb=img, text_emb=txt,
            random_beta=random_beta_fn(estimator, spec.beta_k, spec.seed),
        )
    except ValueError as exc:
        raise InputError(f"cannot calibrate beta recipe {spec.beta_recipe!r} on this job: {exc}") from exc


def run_job(
    spec: JobSpec,
    out: OutputDir,
    load_estimator: Callable[[], Estimator],
    *,
    overwrite: bool = False,
    progress: Progress | None = None,
    storage_options: dict[str, Any] | None = None,
) -> JobReport:
    """Score every shard of ``spec`` not yet committed in ``out``.

    Raises ``SpecMismatchError`` if ``out`` belongs to another spec, ``InputError`` for
    job-level input problems. Shard-level read failures are collected in the report.
    """
    started = time.perf_counter()
    stems = spec.stems()
    out.prepare(spec, overwrite)
    committed = out.manifest()
    todo = [uri for uri in spec.shards if stems[uri] not in committed]
    report = JobReport(total_shards=len(spec.shards), skipped=len(spec.shards) - len(todo))
    if not todo:
        if progress:
            progress.start(len(spec.shards), report.skipped)
        report.calibration = out.read_calibration()
        return report
    estimator = load_estimator()
    model_info = estimator.info.as_dict()
    options = ScoreOptions(
        batch_size=spec.batch_size,
        max_pixels=spec.max_pixels,
        read=ReadOptions(caption_field=spec.caption_field, storage_options=storage_options or {}),
    )
    calibration = out.read_calibration()
    if calibration is None and not needs_corpus(spec.beta_recipe, spec.weighting):
        calibration = _calibrate_from([], spec, estimator)
        out.write_calibration(calibration)
    if progress:
        # after the model load and beta, so that pairs/s and ETA describe the scoring
        progress.start(len(spec.shards), report.skipped)
    pending: list[ShardResult] = []

    def commit(result: ShardResult) -> None:
        assert calibration is not None
        commit_result(out, spec, result, stems[result.uri], calibration, model_info)
        report.committed += 1
        report.pairs += len(result)
        for status, count in result.status_counts().items():
            report.statuses[status] = report.statuses.get(status, 0) + count
        if progress:
            progress.shard_done(stems[result.uri], len(result))

    for uri in todo:
        try:
            result = score_shard(uri, estimator, options)
        except InputError as exc:
            log.error("shard failed: %s", exc)
            report.failed.append((uri, str(exc)))
            if progress:
                progress.shard_failed(uri, str(exc))
            continue
        if calibration is not None:
            commit(result)
            continue
        # Corpus calibration: hold results until enough ok pairs are seen, then freeze it.
        pending.append(result)
        if sum(int(r.ok_mask.sum()) for r in pending) >= spec.calibration_pairs:
            calibration = _calibrate_from(pending, spec, estimator)
            out.write_calibration(calibration)
            for held in pending:
                commit(held)
            pending = []
    if pending:
        calibration = _calibrate_from(pending, spec, estimator)
        out.write_calibration(calibration)
        for held in pending:
            commit(held)
    report.calibration = calibration or out.read_calibration()
    report.seconds = time.perf_counter() - started
    return report
