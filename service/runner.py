"""Runs queued jobs as `pairclean score` processes and follows them through their manifests.

The API process never loads a model: each job is its own process (the batch CLI, which
runs on Ray by default), so one job's crash never touches another or the service. The
runner thread launches QUEUED jobs up to ``max_running_jobs``, reaps finished ones (the
CLI's exit code gives the state), and reads progress from the job's completion records.
After a service restart, jobs left RUNNING are resumed: their process group is ended if
it survived, and the same command reruns, which skips every committed shard.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from pairclean import schema
from pairclean.output.folder import OutputDir, ShardRecord
from pairclean.output.report import p_clean_sum
from pairclean.uris import LOCAL_READ_ROOTS_ENV, LOCAL_WRITE_ROOTS_ENV
from pairclean.job.lifecycle import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED, state_for_exit
from pairclean_workers.cli import BUG_REPORT_DIR_ENV

from . import joblog
from .metrics import Metrics
from .security import OutputMoved, checked_output, job_roots, local_roots_of
from .settings import ServiceSettings
from .store import JobRow, JobStore, now_iso

if TYPE_CHECKING:
    from pairclean.calibrate.calibration import Calibration

__all__ = ["JobRunner", "score_command"]

log = logging.getLogger(__name__)

def score_command(request: dict[str, Any], settings: ServiceSettings, shard_list: Path | None = None) -> list[str]:
    """The `pairclean score` command line of a job request (already validated).

    With ``shard_list`` (an ``@list`` file holding the request's shard specs, one a line)
    the specs go through that file, not argv: a long list never hits the kernel's limit
    on one command line. A request without a ``shard_timeout`` gets the operator's
    ``shard_timeout_s``.
    """
    shards = [f"@{shard_list}"] if shard_list is not None else list(request["shards"])
    cmd = [sys.executable, "-m", "pairclean_workers.cli", "score", *shards, "--out", request["output"],
           "--model", request["estimator"], "--beta-recipe", request["beta_recipe"], "--weighting", request["weighting"],
           "--no-progress", "--executor", settings.executor]
    options = dict(request.get("options", {}))
    if options.get("shard_timeout") is None and settings.shard_timeout_s is not None:
        options["shard_timeout"] = settings.shard_timeout_s  # the operator's bound (settings)
    for option, value in sorted(options.items()):
        if value is not None:
            cmd += [f"--{option.replace('_', '-')}", str(value)]
    if settings.ray_address:
        cmd += ["--ray-address", settings.ray_address]
    return cmd


@dataclass
class _Running:
    job_id: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    seen_stems: set[str]
    seen_failed: set[str] = field(default_factory=set)
    #: What the folder held when this run started (a retry, or a resume after a restart):
    #: those shards were counted by the run that committed or quarantined them, so the
    #: metrics skip them (the noise-rate estimate still reads them).
    committed_before: set[str] = field(default_factory=set)
    failed_before: dict[str, Any] = field(default_factory=dict)
    out: OutputDir | None = None  # kept between looks: completion records already read are cached
    #: Sum of ``p_clean`` and count of the ok pairs of the shards seen so far: the job's
    #: noise-rate estimate is 1 - their mean (``pairclean.output.report.expected_noise``).
    p_clean_sum: float = 0.0
    p_clean_pairs: int = 0


class JobRunner:
    """The background thread that executes jobs."""

    def __init__(self, store: JobStore, settings: ServiceSettings, metrics: Metrics, state_dir: Path) -> None:
        self.store, self.settings, self.metrics = store, settings, metrics
        self.logs = state_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.lists = state_dir / "shard-lists"
        self.lists.mkdir(parents=True, exist_ok=True)
        # Tracebacks of job processes' bugs: the operator's, never in a job's log (tenants read those)
        self.bugs = state_dir / "bug-reports"
        self.running: dict[str, _Running] = {}
        #: Who launches this runner's jobs: stable over restarts of this replica, distinct
        #: between replicas (each has its own state folder: the job logs live there).
        self.runner_id = f"{socket.gethostname()}:{state_dir.resolve()}"
        self._stop = threading.Event()
        self._lock = threading.Lock()
        #: Other runners' RUNNING jobs: job id -> ((launch, signs of life) last seen, since when unchanged)
        self._gone_since: dict[str, tuple[Any, float]] = {}
        self._next_orphan_look = 0.0
        self._thread = threading.Thread(target=self._loop, name="pairclean-runner", daemon=True)

    def start(self) -> None:
        """Resume jobs a previous process of this runner left RUNNING, then start the loop.

        Another replica's running jobs (the store is shared) are left alone: on this host
        while their process lives, elsewhere always (that replica resumes them itself)."""
        for job in self.store.in_states([RUNNING]):
            if not self._resumes(job):
                continue
            if _is_score_process(job.pid):  # never signal a pid the system reused
                _end_group(job.pid)
            if self.store.transition(job.id, [RUNNING], expect={"runner": job.runner, "pid": job.pid}, state=QUEUED, pid=None):
                log.info("resuming job %s after a restart", job.id)
                if job.runner is not None and job.runner != self.runner_id:
                    self.metrics.requeued.inc()  # another replica's job (dead on this host): a take-over too
        self._thread.start()

    def _resumes(self, job: JobRow) -> bool:
        """Whether ``start`` takes over ``job`` (RUNNING): its own, one launched before
        runners were recorded, or another replica's on this host whose process has died."""
        if job.runner is None or job.runner == self.runner_id:
            return True
        host = job.runner.split(":", 1)[0]
        return host == socket.gethostname() and not _is_score_process(job.pid)

    def stop(self, kill_jobs: bool = False) -> None:
        """Stop following jobs; their processes keep running unless ``kill_jobs``."""
        self._stop.set()
        self._thread.join(timeout=10)
        if kill_jobs:
            for run in list(self.running.values()):
                _end_group(run.proc.pid)

    def cancel(self, job: JobRow) -> None:
        """Ask a job to stop: a queued one is cancelled at once, a running one killed."""
        self.store.update(job.id, cancel_requested=1)
        if self.store.transition(job.id, [QUEUED], state=CANCELLED, finished_at=now_iso()):
            return
        with self._lock:
            run = self.running.get(job.id)
        if run is not None:
            _end_group(run.proc.pid)

    # -- the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._reap()
                self._follow()
                self._adopt_orphans()
                self._launch()
                self.metrics.jobs_by_state(self.store.counts_by_state())
            except Exception:  # noqa: BLE001 - the runner must outlive one bad iteration
                log.exception("runner iteration failed")
            self._stop.wait(self.settings.poll_interval_s)

    def _adopt_orphans(self) -> None:
        """Beat for this runner's RUNNING jobs, and queue again the RUNNING jobs of other
        runners that show no sign of life (see ``ServiceSettings.orphan_grace_s``): a replica
        lost with its host leaves them RUNNING, and no restart of it will ever resume them.

        Signs of life, compared between looks and never against this host's clock (hosts'
        clocks differ): the launching runner's heartbeat in the store, the heartbeat in the
        job's run lock (its process renews it wherever it runs), and on this host the job's
        process itself. Only a job whose signs stood still for ``orphan_grace_s`` is moved,
        conditional on the launch seen (runner, start time, pid): a job another replica
        has queued and launched again in between is left alone. A job whose cancellation
        was asked is CANCELLED instead of run again."""
        now = time.monotonic()
        if now < self._next_orphan_look:
            return
        # at least four beats a grace, whatever the settings: a live runner must show its beat between two looks
        self._next_orphan_look = now + min(self.settings.orphan_check_s, self.settings.orphan_grace_s / 4)
        self.store.beat(self.runner_id, f"{time.time():.6f}")
        running = {job.id: job for job in self.store.in_states([RUNNING]) if job.id not in self.running and job.runner != self.runner_id}
        for job_id in set(self._gone_since) - set(running):
            del self._gone_since[job_id]
        for job in running.values():
            launch = (job.runner, job.started_at, job.pid)
            signs = _signs_of_life(job)
            seen = self._gone_since.get(job.id)
            if signs is None or seen is None or seen[0] != (launch, signs):
                self._gone_since[job.id] = ((launch, signs), now)  # alive, or first seen so: the grace starts now
                continue
            if now - seen[1] < self.settings.orphan_grace_s:
                continue
            expect = {"runner": job.runner, "started_at": job.started_at, "pid": job.pid}
            if job.cancel_requested:
                moved = self.store.transition(job.id, [RUNNING], expect=expect, state=CANCELLED, pid=None, finished_at=now_iso())
            else:
                moved = self.store.transition(job.id, [RUNNING], expect=expect, state=QUEUED, pid=None)
            if moved:
                del self._gone_since[job.id]
                self.metrics.requeued.inc()
                log.warning("job %s: its runner %s and its process show no sign of life for %.0f s; %s", job.id, job.runner,
                            self.settings.orphan_grace_s, "cancelled as asked" if job.cancel_requested else "queued again to resume")

    def _launch(self) -> None:
        while len(self.running) < self.settings.max_running_jobs:
            queued = self.store.in_states([QUEUED])
            if not queued:
                return
            job = _next_fairly(queued, self.store.in_states([RUNNING]))
            log_path = self.logs / f"{job.id}.log"
            try:
                # the folder the submission checked, not one a symlink re-pointed since
                output = checked_output(job.request["output"], job.output_key, self.settings.allowed_outputs)
                before = _folder_state(output, job_roots(output))
                proc = self._start(job, log_path)
            except Exception as exc:  # noqa: BLE001 - one job that cannot start must not block the queue
                log.warning("job %s could not start: %s", job.id, exc)
                self.store.transition(job.id, [QUEUED], state=FAILED, error=f"the job process could not start: {exc}",
                                      finished_at=now_iso())
                continue
            if not self.store.transition(job.id, [QUEUED], state=RUNNING, pid=proc.pid, started_at=now_iso(), runner=self.runner_id):
                _end_group(proc.pid)  # cancelled in between
                continue
            with self._lock:
                self.running[job.id] = _Running(job.id, proc, log_path, set(), committed_before=before[0], failed_before=before[1])
            # A cancel that came between the move to RUNNING and the line above found no
            # process to end (``cancel`` looks in ``running``): it marked the job, so look again.
            now = self.store.get(job.id)
            if now is not None and now.cancel_requested:
                _end_group(proc.pid)

    def _start(self, job: JobRow, log_path: Path) -> subprocess.Popen[bytes]:
        """Write the job's shard list file and start its process."""
        shard_list = self.lists / f"{job.id}.txt"
        shard_list.write_text("".join(f"{spec}\n" for spec in job.request["shards"]), encoding="utf-8")
        env = dict(os.environ)
        # The job process applies the same limits as the API: a glob that grew since the
        # submission is still bounded, and HTTP redirects only lead to allowed inputs.
        env["PAIRCLEAN_MAX_SHARDS"] = str(self.settings.max_shards)
        env["PAIRCLEAN_HTTP_ALLOWED_PREFIXES"] = json.dumps(list(self.settings.allowed_inputs))
        # ... and local paths are checked again, resolved, when the job touches them: a
        # symlink made after the submission cannot lead it out of the allow-lists.
        # (and this job's own shard list file: not the folder, which holds every tenant's)
        env[LOCAL_READ_ROOTS_ENV] = json.dumps([*local_roots_of(self.settings.allowed_inputs), os.path.realpath(shard_list)])
        env[LOCAL_WRITE_ROOTS_ENV] = json.dumps(job_roots(job.request["output"]))
        env[BUG_REPORT_DIR_ENV] = str(self.bugs)
        # through the log wrapper, which bounds the log (its own crash, if any, lands there too)
        cmd = joblog.wrap(score_command(job.request, self.settings, shard_list), str(log_path), self.settings.max_log_bytes)
        with open(log_path, "ab") as out:
            return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=env)

    def _reap(self) -> None:
        for job_id, run in list(self.running.items()):
            code = run.proc.poll()
            if code is None:
                continue
            self._follow_one(run)
            job = self.store.get(job_id)
            if job is not None and job.cancel_requested:
                state, error = CANCELLED, None
            else:
                state = state_for_exit(code)
                error = None if state == SUCCEEDED else _tail(run.log_path)
            # only this runner's launch: a replica that took the job over meanwhile owns it now
            self.store.transition(job_id, [RUNNING], expect={"runner": self.runner_id, "pid": run.proc.pid},
                                  state=state, error=error, pid=None, finished_at=now_iso())
            with self._lock:
                del self.running[job_id]

    def _follow(self) -> None:
        for run in list(self.running.values()):
            try:
                self._follow_one(run)
            except Exception as exc:  # noqa: BLE001 - one job's unreadable folder must not stop the loop for every tenant
                log.warning("job %s: its folder could not be followed: %s", run.job_id, exc)

    def _follow_one(self, run: _Running) -> None:
        """Progress from the job's manifest; metrics for shards committed since the last look."""
        job = self.store.get(run.job_id)
        if job is None:
            return
        try:  # every look: a folder re-pointed while the job runs is not read (nor counted)
            checked_output(job.request["output"], job.output_key, self.settings.allowed_outputs)
        except OutputMoved:
            log.warning("job %s: its output folder no longer resolves where it did at submission; not followed", job.id)
            return
        if run.out is None:
            run.out = OutputDir(job.request["output"], roots=job_roots(job.request["output"]))
        out = run.out
        committed, failed = out.committed(), out.quarantined()
        for stem, record in failed.items():
            if stem not in run.seen_failed:
                run.seen_failed.add(stem)
                if run.failed_before.get(stem) != record:  # failed in this run, not only in an earlier one
                    self.metrics.shard_quarantined(record.get("attempts", 1))
        for stem, entry in committed.items():
            if stem not in run.seen_stems:
                run.seen_stems.add(stem)
                table = _read_values(out, entry)
                if stem not in run.committed_before:
                    self.metrics.shard_committed(entry.to_json(), lambda cols, e=entry: table.select(cols) if table is not None
                                                 else out.read_scores(e, cols))
                _add_p_clean(run, table)
        calibration = out.read_calibration()
        self.store.update(
            run.job_id, shards_done=len(committed), shards_failed=len(failed),
            pairs=sum(e.rows for e in committed.values()),
            noise_rate=_noise_rate(run, calibration),
        )


def _next_fairly(queued: list[JobRow], running: list[JobRow]) -> JobRow:
    """The queued job to start next: the oldest of the owners with the fewest RUNNING jobs
    (``queued`` is oldest first), so one owner's hundred queued jobs take turns with
    another owner's one rather than all going first."""
    load = Counter(job.owner for job in running)
    return min(enumerate(queued), key=lambda item: (load[item[1].owner], item[0]))[1]


def _signs_of_life(job: JobRow) -> tuple[Any, ...] | None:
    """What changes while ``job`` (RUNNING, another runner's) lives: its runner's heartbeat
    and its run lock's (holder and heartbeat; None where there is no lock yet or any more).
    None (alive, whatever the values) where its process runs on this host, or where its
    output folder cannot be read: never queue a job twice on a guess."""
    from pairclean.output.lock import RunLock

    if job.runner is not None and job.runner.split(":", 1)[0] == socket.gethostname() and _is_score_process(job.pid):
        return None
    try:  # inside the job's own folders only (a planted link reads nothing)
        doc = RunLock(OutputDir(job.request["output"], roots=job_roots(job.request["output"])).store).read()
    except Exception:  # noqa: BLE001 - an unreachable store says nothing about the process
        return None
    lock = None if doc is None else (str(doc.get("run_id")), str(doc.get("heartbeat")))
    return job.heartbeat, lock


def _folder_state(output: str, roots: list[str]) -> tuple[set[str], dict[str, Any]]:
    """(committed stems, quarantine records) of a job's folder (its files inside ``roots``)
    before its process starts; empty for a new folder or one that cannot be read yet (then
    every shard is counted)."""
    try:
        out = OutputDir(output, roots=roots)
        return set(out.committed()), dict(out.quarantined())
    except Exception:  # noqa: BLE001 - metrics only: the job itself reports what it cannot read
        return set(), {}


#: The score columns one look reads of each newly committed shard (metrics and the noise rate).
_VALUE_COLUMNS = [schema.COL_STATUS, schema.COL_SIMILARITY, schema.COL_WEIGHT, schema.COL_P_CLEAN]


def _read_values(out: OutputDir, entry: ShardRecord) -> pa.Table | None:
    """The shard's status, similarity, weight and p_clean columns; None where they cannot be
    read (the metrics then read their own columns; progress must never fail on one table)."""
    try:
        return out.read_scores(entry, _VALUE_COLUMNS)
    except Exception:  # noqa: BLE001 - a table the look cannot read leaves the estimate as it was
        return None


def _add_p_clean(run: _Running, table: pa.Table | None) -> None:
    """Add a shard's ok pairs' ``p_clean`` (finite values) to the job's running sums."""
    if table is None:
        return
    total, count = p_clean_sum(table.column(schema.COL_STATUS), table.column(schema.COL_P_CLEAN).to_numpy(zero_copy_only=False))
    run.p_clean_sum += total
    run.p_clean_pairs += count


def _noise_rate(run: _Running, calibration: Calibration | None) -> float | None:
    """The job's noise-rate estimate: 1 - mean ``p_clean`` over the committed shards' ok pairs
    (the wrong captions ``p_clean`` expects, near-misses included); before any is committed,
    the calibration's random-mismatch share (a lower bound)."""
    if run.p_clean_pairs:
        return 1.0 - run.p_clean_sum / run.p_clean_pairs
    return calibration.noise_rate if calibration else None


#: A line the job process writes for its user: ``error: ...`` (the CLI) or argparse's
#: ``pairclean score: error: ...``.
_ERROR_LINE = re.compile(r"^(?:pairclean[\w -]*: )?error: ")


def _tail(path: Path, limit: int = 2000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "job process failed"
    lines = [ln for ln in text.splitlines() if ln.strip()]
    said = [ln for ln in lines if _ERROR_LINE.match(ln)]
    if said:  # the job's own one-line error (argparse's usage text above it is for a terminal)
        return said[-1][:limit]
    if any(ln.startswith("Traceback (most recent call last)") for ln in lines):
        # A crash: users get the exception's one line, never the stack (it stays in the log).
        last = next((ln for ln in reversed(lines) if not ln.startswith(" ")), "")
        return f"job process failed: {last}"[:limit]
    return "\n".join(lines[-5:])[-limit:] or "job process failed"


def _is_score_process(pid: int | None) -> bool:
    try:
        return bool(pid) and b"pairclean_workers.cli" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _end_group(pid: int | None) -> None:
    """SIGTERM a job's process group, then SIGKILL what is left after a grace period."""
    if not pid:
        return
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
