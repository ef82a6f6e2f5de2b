"""The job loop: plan, resume, calibrate, commit, whatever executes the scoring.

``run_job`` owns the output folder; a ``ShardSource`` produces scored shards. The local
source below scores in this process; ``pairclean_workers`` provides a Ray source with
the same interface, so both paths share planning, calibration and the atomic commit
(the driver is the only writer: a shard is committed exactly once).

Shards already in the manifest are skipped. A shard that cannot be read (or keeps failing
on workers) is quarantined in the manifest with its error and left uncommitted; a rerun
retries it. The job ends SUCCEEDED, PARTIAL (failed fraction within the allowed one) or
FAILED.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from . import __version__, schema
from .calibration import calibrate, cached_random_beta, needs_corpus
from .errors import InputError
from .estimators import Estimator
from .job import Calibration, JobSpec, OutputDir
from .scoring import ScoreOptions, ShardResult, embeddings_table, output_metadata, score_shard, scores_table
from .uris import shard_size

__all__ = [
    "SUCCEEDED",
    "PARTIAL",
    "FAILED",
    "Progress",
    "ShardOutcome",
    "ShardSource",
    "LocalSource",
    "JobReport",
    "run_job",
    "commit_result",
    "random_beta_fn",
    "score_options",
]

log = logging.getLogger(__name__)

SUCCEEDED, PARTIAL, FAILED = "SUCCEEDED", "PARTIAL", "FAILED"


class Progress(Protocol):
    """Receives progress events (the CLI draws a bar from them)."""

    def start(self, total_shards: int, already_done: int) -> None: ...

    def shard_done(self, stem: str, rows: int) -> None: ...

    def shard_failed(self, uri: str, error: str) -> None: ...


@dataclass(frozen=True)
class ShardOutcome:
    """What became of one shard: a result, or an error after ``attempts`` tries."""

    uri: str
    result: ShardResult | None
    error: str | None = None
    attempts: int = 1


class ShardSource(Protocol):
    """Scores shards. ``results`` may yield in any order, one outcome per given URI."""

    def model_info(self) -> dict[str, Any]: ...

    def random_beta(self, k: int, seed: int) -> float: ...

    def results(self, uris: Sequence[str]) -> Iterator[ShardOutcome]: ...


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


def score_options(spec: JobSpec, storage_options: dict[str, Any] | None = None) -> ScoreOptions:
    """The per-shard reading and batching options a job spec implies."""
    from .shards import ReadOptions

    return ScoreOptions(
        batch_size=spec.batch_size,
        max_pixels=spec.max_pixels,
        read=ReadOptions(caption_field=spec.caption_field, storage_options=storage_options or {}),
    )


class LocalSource:
    """Scores shards one after another in this process with one estimator."""

    def __init__(self, estimator: Estimator, options: ScoreOptions) -> None:
        self.estimator = estimator
        self.options = options

    def model_info(self) -> dict[str, Any]:
        return self.estimator.info.as_dict()

    def random_beta(self, k: int, seed: int) -> float:
        return random_beta_fn(self.estimator, k, seed)()

    def results(self, uris: Sequence[str]) -> Iterator[ShardOutcome]:
        for uri in uris:
            try:
                yield ShardOutcome(uri, score_shard(uri, self.estimator, self.options))
            except InputError as exc:
                yield ShardOutcome(uri, None, str(exc))


@dataclass
class JobReport:
    """What a run did. ``state`` follows from failures and ``max_failed_fraction``."""

    total_shards: int
    skipped: int = 0
    committed: int = 0
    pairs: int = 0
    seconds: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)
    failed: list[tuple[str, str]] = field(default_factory=list)
    calibration: Calibration | None = None
    max_failed_fraction: float = 0.0

    @property
    def complete(self) -> bool:
        return not self.failed

    @property
    def state(self) -> str:
        if not self.failed:
            return SUCCEEDED
        if self.total_shards and len(self.failed) / self.total_shards <= self.max_failed_fraction:
            return PARTIAL
        return FAILED


def commit_result(out: OutputDir, spec: JobSpec, result: ShardResult, stem: str, calibration: Calibration, model_info: dict[str, Any]) -> None:
    """Write the scores (and embeddings) of one shard and append its manifest line."""
    started = time.perf_counter()
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
    timings = dict(result.timings)
    # "write": weighting and table building here, plus the atomic writes (added by commit).
    timings["write"] = round(time.perf_counter() - started, 4)
    out.commit(
        {"shard": result.uri, "stem": stem, "size": shard_size(result.uri), "rows": len(result),
         "statuses": result.status_counts(), "timings": timings},
        tables,
    )


def _recipe(spec: JobSpec) -> dict[str, Any]:
    return {
        "batch_size": spec.batch_size,
        "max_pixels": spec.max_pixels,
        "caption_field": spec.caption_field,
        "calibration_pairs": spec.calibration_pairs,
    }


def _calibrate_from(results: list[ShardResult], spec: JobSpec, source: ShardSource, dim: int) -> Calibration:
    """Calibrate on the first ``spec.calibration_pairs`` ok pairs of ``results`` (may be empty)."""
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
            random_beta=lambda: source.random_beta(spec.beta_k, spec.seed),
        )
    except ValueError as exc:
        raise InputError(f"cannot calibrate beta recipe {spec.beta_recipe!r} on this job: {exc}") from exc


class _Committer:
    """Commits outcomes; until the calibration is frozen, holds them and calibrates on the
    first ``calibration_pairs`` ok pairs *in shard order*, whatever order results arrive in,
    so every executor freezes the same beta."""

    def __init__(self, spec: JobSpec, out: OutputDir, source: ShardSource, order: list[str], report: JobReport, progress: Progress | None) -> None:
        self.spec, self.out, self.source, self.report, self.progress = spec, out, source, report, progress
        self.stems = spec.stems()
        self.model_info = source.model_info()
        self.calibration = out.read_calibration()
        self.order = order
        self.held: dict[str, ShardOutcome] = {}
        self.cursor = 0  # shards of `order` before it have arrived
        self.prefix_ok = 0

    def add(self, outcome: ShardOutcome) -> None:
        if outcome.result is None:
            self._fail(outcome)
            if self.calibration is None:
                self.held[outcome.uri] = outcome
                self._try_calibrate(final=False)
            return
        if self.calibration is not None:
            self._commit(outcome.result)
            return
        self.held[outcome.uri] = outcome
        self._try_calibrate(final=False)

    def finish(self) -> None:
        if self.calibration is None and self.held:
            self._try_calibrate(final=True)

    def _try_calibrate(self, final: bool) -> None:
        while self.cursor < len(self.order) and self.order[self.cursor] in self.held:
            result = self.held[self.order[self.cursor]].result
            self.prefix_ok += int(result.ok_mask.sum()) if result is not None else 0
            self.cursor += 1
        if not final and self.prefix_ok < self.spec.calibration_pairs and self.cursor < len(self.order):
            return
        prefix = [self.held[u].result for u in self.order[: self.cursor] if u in self.held and self.held[u].result is not None]
        if not prefix and not any(o.result is not None for o in self.held.values()):
            return  # every shard so far failed: nothing to calibrate on or commit yet
        dim = int(self.model_info["embed_dim"])
        self.calibration = _calibrate_from(prefix, self.spec, self.source, dim)  # type: ignore[arg-type]
        self.out.write_calibration(self.calibration)
        held, self.held = self.held, {}
        for outcome in held.values():
            if outcome.result is not None:
                self._commit(outcome.result)

    def _commit(self, result: ShardResult) -> None:
        assert self.calibration is not None
        commit_result(self.out, self.spec, result, self.stems[result.uri], self.calibration, self.model_info)
        self.report.committed += 1
        self.report.pairs += len(result)
        for status, count in result.status_counts().items():
            self.report.statuses[status] = self.report.statuses.get(status, 0) + count
        if self.progress:
            self.progress.shard_done(self.stems[result.uri], len(result))

    def _fail(self, outcome: ShardOutcome) -> None:
        error = outcome.error or "unknown error"
        log.error("shard failed: %s", error)
        self.out.quarantine(outcome.uri, self.stems[outcome.uri], error, outcome.attempts)
        self.report.failed.append((outcome.uri, error))
        if self.progress:
            self.progress.shard_failed(outcome.uri, error)


def run_job(
    spec: JobSpec,
    out: OutputDir,
    make_source: Callable[[], ShardSource],
    *,
    overwrite: bool = False,
    progress: Progress | None = None,
    max_failed_fraction: float = 0.0,
) -> JobReport:
    """Score every shard of ``spec`` not yet committed in ``out`` with the source ``make_source``
    builds (only built when there is work).

    Raises ``SpecMismatchError`` if ``out`` belongs to another spec, ``InputError`` for
    job-level input problems. Shard failures are quarantined and reported.
    """
    started = time.perf_counter()
    stems = spec.stems()
    out.prepare(spec, overwrite)
    committed = out.manifest()
    todo = [uri for uri in spec.shards if stems[uri] not in committed]
    report = JobReport(total_shards=len(spec.shards), skipped=len(spec.shards) - len(todo), max_failed_fraction=max_failed_fraction)
    if not todo:
        if progress:
            progress.start(len(spec.shards), report.skipped)
        report.calibration = out.read_calibration()
        return report
    source = make_source()
    committer = _Committer(spec, out, source, todo, report, progress)
    if committer.calibration is None and not needs_corpus(spec.beta_recipe, spec.weighting):
        committer.calibration = _calibrate_from([], spec, source, int(committer.model_info["embed_dim"]))
        out.write_calibration(committer.calibration)
    if progress:
        # after the model load and beta, so that pairs/s and ETA describe the scoring
        progress.start(len(spec.shards), report.skipped)
    for outcome in source.results(todo):
        committer.add(outcome)
    committer.finish()
    report.calibration = committer.calibration or out.read_calibration()
    report.seconds = time.perf_counter() - started
    return report
