"""The audit loop in the service (issue 22): one labelling queue per job, labels in the job
store, the figures computed from them with the library's estimators (``pairclean.audit``).

- The queue is drawn once, when first asked for, from the job's committed score tables
  (``pairclean.audit.run.queue_rows``: stratified by the model's ``p_clean``, seed
  ``audit_seed``, ``audit_sample`` pairs, at most ``ui_scan_max_rows`` rows read), and
  frozen in the store with its design: later labels always refer to the same sample and
  inclusion probabilities. Only a job that has ended with committed shards has a queue.
- ``next_item``: the first queued pair nobody has labelled; after every
  ``REPEAT_EVERY - 1`` labels of one labeller, one of the pairs they labelled before is
  shown again, blind (nothing in the reply says so), for their self-agreement. The queue
  itself never holds a pair twice. The labeller sees the image and the caption, never the
  model's score (it would bias the label).
- Labels: an enum (clean, noisy, unsure), a queue position that must exist and whose key
  must match, at most ``MAX_LABELS_PER_REQUEST`` per request and ``labels_cap`` per job.
- ``report``: ``pairclean.audit.run.audit_report`` over the stored labels. The service
  never writes into the job's folder and never loads a model: recalibrating the tables is
  the CLI's ``pairclean audit OUT --labels FILE`` (the page's export is such a file).
"""

from __future__ import annotations

import hashlib
import io
import threading
import zlib
from typing import Any

from fastapi import HTTPException
from pairclean.job.lifecycle import FAILED, PARTIAL, SUCCEEDED

from .browse import Browser
from .metrics import Metrics
from .settings import ServiceSettings
from .store import JobRow, JobStore, LabelTaken, Principal

__all__ = ["EXPORT_COLUMNS", "MAX_LABELS_PER_REQUEST", "REPEAT_EVERY", "Auditor", "next_attempt"]

#: One label in this many is a blind repeat of an earlier one (when there is one to repeat).
REPEAT_EVERY = 10
MAX_LABELS_PER_REQUEST = 500
_LOCKS = 64
#: Times one request is checked and stored before another replica's labels of the same pairs
#: make it give up (each try loses only where another request stored first).
_ATTEMPTS = 3
EXPORT_COLUMNS = ("key", "shard", "label", "who", "labelled_at", "position", "stratum", "inclusion_probability")


def next_attempt(mine: list[dict[str, Any]]) -> int:
    """The attempt of a labeller's next label of a pair, from the labels of that pair it holds
    (``mine``): one more than the highest, not their count. Undos that raced a blind repeat on
    another replica can leave a gap (attempt 1 alone): a count would ask for the 1 it holds, be
    refused every time, and lock the labeller out of that pair."""
    return max((int(lab.get("attempt", 0)) for lab in mine), default=-1) + 1


class Auditor:
    """Queue, labels and figures of jobs' audits (one per app)."""

    def __init__(self, settings: ServiceSettings, store: JobStore, browser: Browser, metrics: Metrics) -> None:
        self.settings, self.store, self.browser, self.metrics = settings, store, browser, metrics
        # Striped rather than one per job: bounded whatever the number of jobs. Per API
        # process; across replicas the store's unique (job, labeller, pair, attempt) index
        # refuses the second of two labels checked at once (``add``).
        self._locks = [threading.Lock() for _ in range(_LOCKS)]

    # -- the queue ----------------------------------------------------------------------------
    def queue(self, job: JobRow, create: bool = True) -> dict[str, Any] | None:
        """The job's frozen queue document (``design``, ``queue``); drawn on first use.

        409 while the job has not ended with committed shards (its scores still change).
        """
        got = self.store.audit_queue(job.id)
        if got is not None or not create:
            return got["design"] if got else None
        if job.state not in (SUCCEEDED, PARTIAL, FAILED):
            raise HTTPException(409, f"the job is {job.state}: its audit queue is drawn once it has ended")
        from pairclean.audit.run import population, queue_rows
        from pairclean.errors import PaircleanError

        holder = self.browser.output(job)
        try:
            with holder.lock:
                pop = population(holder.out, max_rows=self.settings.ui_scan_max_rows)
        except PaircleanError as exc:
            raise HTTPException(409, f"nothing to audit: {exc}") from None
        doc, queue = queue_rows(pop, self.settings.audit_sample, self.settings.audit_seed)
        doc["shards_committed"] = job.shards_done  # what the sample is of (a retry may commit more)
        stored = self.store.put_audit_queue(job.id, job.owner, self.settings.audit_seed, self.settings.audit_sample,
                                            {"design": doc, "queue": queue})
        return stored["design"]  # type: ignore[no-any-return]

    def labels_cap(self, queue: dict[str, Any]) -> int:
        """The most labels one job may hold: every pair a few times over (several labellers, repeats, undos)."""
        return 4 * len(queue["queue"]) + 100

    # -- labelling ------------------------------------------------------------------------------
    @staticmethod
    def _check_ended(job: JobRow) -> None:
        """409 while the job runs again (a ``:retry``): its tables are still being written."""
        if job.state not in (SUCCEEDED, PARTIAL, FAILED):
            raise HTTPException(409, f"the job is {job.state}: labels are taken once it has ended")

    @staticmethod
    def stale(job: JobRow, doc: dict[str, Any]) -> str | None:
        """What the queue does not cover: the shards a ``:retry`` committed after it was drawn."""
        from pairclean.audit.run import coverage_warning

        return coverage_warning(doc["design"], job.shards_done, "OUT", "a retry")

    def next_item(self, job: JobRow, who: Principal) -> dict[str, Any]:
        """The next pair for ``who`` to label (or ``done``), with progress and the estimate."""
        self._check_ended(job)
        doc = self.queue(job)
        assert doc is not None
        queue = doc["queue"]
        labels = self.store.audit_labels(job.id, job.owner)
        position = self._pick(job, queue, labels, who.label_names)
        reply: dict[str, Any] = {"progress": self._progress(queue, labels), "summary": self.summary(job, doc, labels),
                                 "warning": self.stale(job, doc)}
        if position is None:
            return reply | {"done": True}
        item = queue[position]
        pair = self.browser.pairs(job, [(item["stem"], item["row"])])
        caption = pair[0].caption if pair else None
        return reply | {"done": False, "position": position, "key": item["key"], "shard": item["shard"], "stem": item["stem"],
                        "row": item["row"], "caption": caption}

    def _pick(self, job: JobRow, queue: list[dict[str, Any]], labels: list[dict[str, Any]], who: tuple[str, ...]) -> int | None:
        mine = [lab for lab in labels if lab["who"] in who]
        if len(mine) >= REPEAT_EVERY - 1 and len(mine) % REPEAT_EVERY == REPEAT_EVERY - 1:
            counts: dict[int, int] = {}
            for lab in mine:
                counts[lab["position"]] = counts.get(lab["position"], 0) + 1
            once = sorted(p for p, c in counts.items() if c == 1 and p != mine[-1]["position"])
            if once:
                # deterministic: the same state shows the same repeat (an undo brings it back)
                h = int(hashlib.sha256(f"{job.id}:{who[0]}:{len(mine)}".encode()).hexdigest()[:8], 16)
                return once[h % len(once)]
        done = {lab["position"] for lab in labels}
        return next((i for i in range(len(queue)) if i not in done), None)

    @staticmethod
    def _progress(queue: list[dict[str, Any]], labels: list[dict[str, Any]]) -> dict[str, int]:
        return {"labelled": len({lab["position"] for lab in labels}), "queue": len(queue), "labels": len(labels)}

    def add(self, job: JobRow, who: Principal, items: list[dict[str, Any]]) -> dict[str, Any]:
        """Store labels ``{"position": int, "key": str, "label": ...}``; 422 for a pair not
        in the queue (or a key that does not match its position), 409 past the job's cap.

        One job's labels are checked and stored under one lock (per API process): checked
        apart, 24 copies of one request sent at once were all stored, and counted as blind
        repeats that agreed with themselves. Replicas do not share that lock: each label
        carries its attempt (how many labels of the pair its labeller held when it was
        checked), unique in the store, so where another replica stored the same attempt
        first the request is checked again against what is stored now (a copy of a stored
        label is then ``already_stored``)."""
        with self._lock_of(job.id):
            for _ in range(_ATTEMPTS - 1):
                try:
                    return self._add(job, who, items)
                except LabelTaken:
                    continue
            try:
                return self._add(job, who, items)
            except LabelTaken:
                raise HTTPException(409, "other requests keep storing labels of these pairs; send them again") from None

    def _lock_of(self, job_id: str) -> threading.Lock:
        """One of ``_LOCKS`` striped locks, the same for every request on ``job_id``."""
        return self._locks[zlib.crc32(job_id.encode()) % len(self._locks)]

    def _add(self, job: JobRow, who: Principal, items: list[dict[str, Any]]) -> dict[str, Any]:
        self._check_ended(job)
        doc = self.queue(job)
        assert doc is not None
        queue = doc["queue"]
        labels = self.store.audit_labels(job.id, job.owner)
        rows, already = [], 0
        for i, item in enumerate(items):
            pos = item["position"]
            if not 0 <= pos < len(queue) or queue[pos]["key"] != item["key"]:
                raise HTTPException(422, f"labels[{i}]: no such pair in this job's audit queue")
            mine = [lab for lab in labels if lab["who"] in who.label_names and lab["position"] == pos]
            # A second label of one pair by one labeller counts only as the blind repeat the
            # queue asked for (``_pick`` is deterministic): a retried request, or a double
            # click, would otherwise count as a repeat that agrees with itself.
            if mine and self._pick(job, queue, labels, who.label_names) != pos:
                if mine[-1]["label"] == item["label"]:
                    already += 1
                    continue
                raise HTTPException(409, f"labels[{i}]: you labelled this pair already; undo that label to change it")
            attempt = next_attempt(mine)
            rows.append((pos, queue[pos]["key"], item["label"], attempt))
            labels = [*labels, {"who": who.labeller, "position": pos, "label": item["label"], "attempt": attempt}]
        if self.store.count_labels(job.id) + len(rows) > self.labels_cap(doc):
            raise HTTPException(409, f"this job holds the most labels it may ({self.labels_cap(doc)})")
        self.store.add_labels(job.id, job.owner, who.labeller, rows)
        for _, _, label, _ in rows:
            self.metrics.audit_labels.labels(label=label).inc()
        return {"stored": len(rows), "already_stored": already}

    def undo(self, job: JobRow, who: Principal) -> dict[str, Any] | None:
        """Remove ``who``'s latest label on the job (each undo another label, even sent at once)."""
        with self._lock_of(job.id):
            return self.store.undo_label(job.id, who.label_names)

    # -- figures ------------------------------------------------------------------------------
    def report(self, job: JobRow, doc: dict[str, Any] | None = None, labels: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
        """The audit report of the stored labels (None while the job has no queue)."""
        from pairclean.audit.run import Label, audit_report

        doc = doc if doc is not None else self.queue(job, create=False)
        if doc is None:
            return None
        labels = labels if labels is not None else self.store.audit_labels(job.id, job.owner)
        queue = doc["queue"]
        given = [Label(lab["key"], lab["label"], queue[lab["position"]]["shard"], lab["who"], f"{lab['labelled_at']}#{lab['id']:012d}")
                 for lab in labels]
        report = audit_report(doc, given)
        report["warning"] = self.stale(job, doc)
        self.metrics.audit_reports.labels(status="ok" if report["status"] == "ok" else "needs_labels").inc()
        return report

    def summary(self, job: JobRow, doc: dict[str, Any], labels: list[dict[str, Any]]) -> str:
        """One line: the estimate, or how many labels it still needs."""
        report = self.report(job, doc, labels)
        if report is None or not labels:
            return "no labels yet"
        if report["status"] != "ok":
            upto = report.get("queue_next")  # the page serves the queue in order
            return (f"label {upto} more pairs for an estimate" if upto is not None else
                    f"the queue holds too few pairs for an estimate ({report['labels_needed']} more needed)")
        nr = report["noise_rate"]
        return (f"noise rate {100 * nr['estimate']:.1f}% [{100 * nr['lower']:.1f}, {100 * nr['upper']:.1f}] "
                f"(95%, {report['labels']['decisive_pairs']} pairs labelled)")

    def export(self, job: JobRow, fmt: str) -> tuple[bytes, str]:
        """The labels as CSV or Parquet (the file ``pairclean audit OUT --labels`` reads)."""
        doc = self.queue(job, create=False)
        labels = self.store.audit_labels(job.id, job.owner) if doc else []
        queue = doc["queue"] if doc else []
        rows = [{"key": lab["key"], "shard": queue[lab["position"]]["shard"], "label": lab["label"], "who": lab["who"],
                 "labelled_at": lab["labelled_at"], "position": lab["position"], "stratum": queue[lab["position"]]["stratum"],
                 "inclusion_probability": queue[lab["position"]]["inclusion_probability"]} for lab in labels]
        if fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            schema = pa.schema([("key", pa.string()), ("shard", pa.string()), ("label", pa.string()), ("who", pa.string()),
                                ("labelled_at", pa.string()), ("position", pa.int64()), ("stratum", pa.int64()),
                                ("inclusion_probability", pa.float64())])
            buf = io.BytesIO()
            pq.write_table(pa.Table.from_pylist(rows, schema=schema), buf)
            return buf.getvalue(), "application/vnd.apache.parquet"
        from pairclean.audit.run import csv_bytes

        return csv_bytes(rows, EXPORT_COLUMNS), "text/csv; charset=utf-8"
