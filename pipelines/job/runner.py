"""The driver's job loop: plan, lock, calibrate, dispatch, record completions.

``run_job`` owns the job's bookkeeping; a ``ShardSource`` does the work. The local source
below works in this process; ``pairclean_workers`` provides a Ray source with the same
interface. Either way a job has two phases:

1. calibration: one worker scores the first shards in order until ``calibration_pairs``
   ok pairs are seen, freezes beta and the weighting parameters, and writes those shards
   (skipped when the calibration is already frozen or needs no corpus);
2. scoring: every other shard goes to the workers, which apply the frozen calibration and
   write their own outputs.

The driver receives only small ``ShardRecord``s and writes one completion record per
shard (the commit point), so every shard is committed exactly once and the driver's cost
per shard does not grow with the shard. Shards already committed are skipped. A shard
that cannot be read (or keeps failing on workers) is quarantined with its error and left
uncommitted; a rerun retries it. The job ends SUCCEEDED, PARTIAL (failed fraction within
the allowed one) or FAILED.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from pairclean.errors import InputError
from pairclean.embed.estimators import Estimator
from pairclean.calibrate.calibration import Calibration
from pairclean.spec import JobSpec
from pairclean.output.folder import OutputDir, ShardRecord
from pairclean.job.lifecycle import FAILED, PARTIAL, SUCCEEDED
from pairclean.output.exports import exports_current, mark_exports_stale, refresh_exports
from pairclean.output.lock import RunLock
from pairclean.embed.shard import ScoreOptions
from pairclean.job.work import CalibrationOutcome, ShardOutcome, ShardWork
from pairclean.uris import LOCAL_SCHEMES, local_path, scheme_of, shard_size

__all__ = [
    "SUCCEEDED",
    "PARTIAL",
    "FAILED",
    "Progress",
    "ShardSource",
    "LocalSource",
    "JobReport",
    "DriverCost",
    "run_job",
    "score_options",
]

log = logging.getLogger(__name__)


class Progress(Protocol):
    """Receives progress events (the CLI draws a bar from them)."""

    def start(self, total_shards: int, already_done: int) -> None: ...

    def shard_done(self, record: ShardRecord) -> None: ...

    def shard_failed(self, uri: str, error: str, attempts: int) -> None: ...


class ShardSource(Protocol):
    """Does the work of a job. ``results`` may yield in any order, one outcome per URI."""

    def model_info(self) -> dict[str, Any]: ...

    def calibrate(self, uris: Sequence[str]) -> CalibrationOutcome: ...

    def results(self, uris: Sequence[str], calibration: Calibration) -> Iterator[ShardOutcome]: ...


def score_options(spec: JobSpec, storage_options: dict[str, Any] | None = None, decode_workers: int = 1) -> ScoreOptions:
    """The per-shard reading and batching options a job spec implies."""
    from pairclean.read.shards import ReadOptions

    return ScoreOptions(
        batch_size=spec.batch_size,
        max_pixels=spec.max_pixels,
        read=ReadOptions(caption_field=spec.caption_field, storage_options=storage_options or {}),
        decode_workers=decode_workers,
        decode_device=spec.decode_device,
    )


class LocalSource:
    """Works through the shards one after another in this process with one estimator."""

    def __init__(self, estimator: Estimator, spec: JobSpec, out: OutputDir, options: ScoreOptions) -> None:
        self.work = ShardWork(estimator, spec, out, options)

    def model_info(self) -> dict[str, Any]:
        return self.work.model_info

    def calibrate(self, uris: Sequence[str]) -> CalibrationOutcome:
        return self.work.calibrate(uris)

    def results(self, uris: Sequence[str], calibration: Calibration) -> Iterator[ShardOutcome]:
        for uri in uris:
            try:
                yield ShardOutcome(uri, self.work.score(uri, calibration))
            except InputError as exc:
                yield ShardOutcome(uri, None, str(exc))


@dataclass
class DriverCost:
    """What the driver spent in the scoring phase.

    ``commit_cpu_s``: CPU seconds of the driver's job loop handling records (receiving,
    writing completion records, compacting): the per-shard cost. ``process_cpu_s`` and
    ``wall_s``: the whole driver process (Ray's client threads and the lock heartbeat
    included), which costs per second of wall time, not per shard. ``record_bytes``: the
    pickled size of the records received.
    """

    shards: int = 0
    commit_cpu_s: float = 0.0
    process_cpu_s: float = 0.0
    wall_s: float = 0.0
    record_bytes: int = 0

    def per_shard(self) -> dict[str, float]:
        """Mean commit CPU milliseconds and record bytes per committed shard, and the
        whole process's CPU use as a fraction of one core."""
        n = max(1, self.shards)
        return {"cpu_ms_per_shard": 1000 * self.commit_cpu_s / n, "bytes_per_shard": self.record_bytes / n,
                "process_cpu_fraction": self.process_cpu_s / max(self.wall_s, 1e-9)}


@dataclass
class JobReport:
    """What a run did. ``state`` follows from failures and ``max_failed_fraction``."""

    total_shards: int
    skipped: int = 0
    committed: int = 0
    #: Shards uncommitted because they changed since (``OutputDir.withdraw``): the exports
    #: are written again even when none of them commits again.
    withdrawn: int = 0
    pairs: int = 0
    seconds: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)
    failed: list[tuple[str, str]] = field(default_factory=list)
    calibration: Calibration | None = None
    max_failed_fraction: float = 0.0
    driver: DriverCost = field(default_factory=DriverCost)

    @property
    def complete(self) -> bool:
        return not self.failed

    @property
    def state(self) -> str:
        if not self.failed:
            return SUCCEEDED
        # PARTIAL needs something scored: a job whose every shard failed is FAILED, whatever the allowance
        if self.total_shards and len(self.failed) < self.total_shards and len(self.failed) / self.total_shards <= self.max_failed_fraction:
            return PARTIAL
        return FAILED


class _Recorder:
    """The driver's side of a commit: completion records, quarantine, the report."""

    def __init__(self, spec: JobSpec, out: OutputDir, lock: RunLock, report: JobReport, progress: Progress | None) -> None:
        self.out, self.lock, self.report, self.progress = out, lock, report, progress
        self.stems = spec.stems()

    def add(self, outcome: ShardOutcome) -> None:
        # A run that lost its lock must not commit: another run owns the folder now.
        self.lock.check()
        if outcome.record is None:
            self._fail(outcome)
        else:
            self._commit(replace(outcome.record, attempts=outcome.attempts))

    def _commit(self, record: ShardRecord) -> None:
        self.out.record_completion(record)
        self.report.committed += 1
        self.report.pairs += record.rows
        for status, count in record.statuses.items():
            self.report.statuses[status] = self.report.statuses.get(status, 0) + count
        if self.progress:
            self.progress.shard_done(record)

    def _fail(self, outcome: ShardOutcome) -> None:
        error = outcome.error or "unknown error"
        log.error("shard failed: %s", error)
        self.out.quarantine(outcome.uri, self.stems[outcome.uri], error, outcome.attempts)
        self.report.failed.append((outcome.uri, error))
        if self.progress:
            self.progress.shard_failed(outcome.uri, error, outcome.attempts)


def run_job(
    spec: JobSpec,
    out: OutputDir,
    make_source: Callable[[], ShardSource],
    *,
    overwrite: bool = False,
    progress: Progress | None = None,
    max_failed_fraction: float = 0.0,
    lock_ttl_s: float | None = None,
) -> JobReport:
    """Score every shard of ``spec`` not yet committed in ``out`` with the source ``make_source``
    builds (only built when there is work).

    Raises ``ForeignOutputError`` for a folder of other files, ``OutputBusyError`` when
    another live run holds the folder, ``SpecMismatchError`` if it belongs to another spec,
    ``InputError`` for job-level input problems. Shard failures are quarantined and reported.
    """
    started = time.perf_counter()
    stems = spec.stems()
    out.check_owned()  # before the lock: never write even a lock into someone else's folder
    lock = RunLock(out.store, ttl_s=lock_ttl_s)
    lock.acquire()
    try:
        out.prepare(spec, overwrite)
        stale = mark_exports_stale(out, "score")  # set before any commit; an earlier run killed before its refresh left it
        report = _run(spec, out, stems, make_source, lock, progress, max_failed_fraction)
        out.compact()
        if report.committed or report.withdrawn or stale:
            refresh_exports(out)  # shards committed after an export: trainers read it without asking
        else:
            exports_current(out)
    finally:
        lock.release()
    report.seconds = time.perf_counter() - started
    return report


def _run(spec: JobSpec, out: OutputDir, stems: dict[str, str], make_source: Callable[[], ShardSource],
         lock: RunLock, progress: Progress | None, max_failed_fraction: float) -> JobReport:
    committed = out.committed()
    changed = _changed_since_committed(spec.shards, stems, committed) | _tables_changed(spec.shards, stems, out, committed)
    if changed:  # uncommitted before they are read again: should one now fail, its old rows are not read as current
        out.withdraw({stems[uri] for uri in changed})
        committed = out.committed()
    todo = [uri for uri in spec.shards if stems[uri] not in committed]
    report = JobReport(total_shards=len(spec.shards), skipped=len(spec.shards) - len(todo), max_failed_fraction=max_failed_fraction,
                       withdrawn=len(changed))
    report.calibration = out.read_calibration()
    if not todo:
        if progress:
            progress.start(len(spec.shards), report.skipped)
        return report
    source = make_source()
    recorder = _Recorder(spec, out, lock, report, progress)
    if progress:
        # after the model load, so that pairs/s and ETA describe the scoring
        progress.start(len(spec.shards), report.skipped)
    if report.calibration is None:
        phase = source.calibrate(todo)
        if phase.calibration is not None:
            out.write_calibration(phase.calibration)
            report.calibration = phase.calibration
        for outcome in phase.outcomes:
            recorder.add(outcome)
        todo = todo[len(phase.outcomes):]
        if phase.calibration is None:
            return report  # every shard failed: nothing to calibrate on
    assert report.calibration is not None  # set by the calibration phase above, or the early return
    _score_phase(source, todo, report.calibration, recorder, report)
    return report


def _changed_since_committed(uris: Sequence[str], stems: dict[str, str], committed: dict[str, ShardRecord]) -> set[str]:
    """The local shards whose size or modification time is not what it was when they were
    committed (re-downloaded, rewritten in place; records written before the time was kept
    compare sizes only): their tables no longer describe them, so a rerun scores them again,
    saying so. Tars are padded to 10 KiB records, so a different file of the same size is
    common: by size alone one was kept as done, its table describing another file. Remote
    shards are not asked (a request per shard on every resume); a shard gone since stays as
    it was."""
    changed = set()
    for uri in uris:
        record = committed.get(stems[uri])
        if record is None or record.size is None or scheme_of(uri) not in LOCAL_SCHEMES:
            continue
        try:
            size = shard_size(uri)  # checked against a service's read roots, as every read is
            mtime = os.stat(local_path(uri)).st_mtime_ns if record.mtime_ns is not None else None
        except (OSError, InputError):
            continue
        if size != record.size:
            log.warning("shard %s changed since it was committed (%d bytes then, %d now): scoring it again", uri, record.size, size)
            changed.add(uri)
        elif mtime != record.mtime_ns:
            log.warning("shard %s changed since it was committed (modified since, same size): scoring it again", uri)
            changed.add(uri)
    return changed


def _tables_changed(uris: Sequence[str], stems: dict[str, str], out: OutputDir, committed: dict[str, ShardRecord]) -> set[str]:
    """The shards whose committed table (or sidecar) is gone or has another size than pairclean wrote
    (deleted, or edited by hand): a resume called such a job finished, and every reader then
    failed on it, or read the edited rows. They are scored again, saying so (a table someone
    else wrote in its place is never replaced: that shard then fails, naming it). One listing
    a folder (``Store.sizes``), on object stores too."""
    listed: dict[str, dict[str, int]] = {}
    changed = set()
    for uri in uris:
        record = committed.get(stems[uri])
        if record is None:
            continue
        for name, written, what in ((record.output, record.bytes, "table"), (record.emb_output, record.emb_bytes, "sidecar")):
            if name is None or written is None:
                continue
            folder, _, base = name.rpartition("/")
            if folder not in listed:
                listed[folder] = out.store.sizes(folder)
            size = listed[folder].get(base)
            if size != written:
                now = "it is gone" if size is None else f"{written} bytes written, {size} now"
                log.warning("the %s of shard %s changed since it was committed (%s): scoring it again", what, uri, now)
                changed.add(uri)
                break
    return changed


def _score_phase(source: ShardSource, todo: list[str], calibration: Calibration, recorder: _Recorder, report: JobReport) -> None:
    import pickle

    cost = report.driver
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for outcome in source.results(todo, calibration):
        t0 = time.thread_time()
        recorder.add(outcome)
        cost.commit_cpu_s += time.thread_time() - t0
        if outcome.record is not None:
            cost.shards += 1
            cost.record_bytes += len(pickle.dumps(outcome, protocol=5))
    cost.process_cpu_s += time.process_time() - cpu0
    cost.wall_s += time.perf_counter() - wall0
