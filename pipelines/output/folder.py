"""A job's output folder: frozen spec, calibration, completion records and the data files.

Layout of ``OUT/`` (any fsspec location, see ``pairclean.storage``)::

    <stem>.parquet                    per-pair scores, rows in tar order: the dataset users read
    _emb/<stem>.parquet               optional float16 embeddings (the sidecars)
    _pairclean/job.json               the frozen spec and the expanded shard list
    _pairclean/calibration.json       beta (value, recipe, K, seed) and weighting parameters
    _pairclean/completions/<stem>.json  one small record per committed shard: the commit point
    _pairclean/manifest/<seq>.parquet  compacted completion records, in a few segments
    _pairclean/failed/<stem>.json     shards that kept failing, with their error
    _pairclean/lock.json              the running job's lock and heartbeat
    _pairclean/exports.json           names written by ``pairclean export``
    _pairclean/rewrite.json           present while rescore/refine/audit rewrite the tables

The names above are the logical ones the code uses. On disk, everything but the score
tables lives in the sibling folder ``OUT.pairclean/`` (``_pairclean/`` as ``state/``, ``_emb/``
as ``emb/``, ``_export/`` as ``export/``, ``_pseudo/`` as ``pseudo/``; ``Store`` maps the
names), so ``OUT`` holds the score tables only and reads as exactly them in pyarrow, pandas,
duckdb, polars, Ray Data and Hugging Face ``datasets`` (polars reads every file below a
folder, ``datasets`` reads ``_`` folders). A folder written before that layout (state in
``OUT/_pairclean/``) is read and resumed in place (``legacy``).

Workers write a shard's data files; only the driver writes completion records, so a shard
is committed exactly once. A data file without a completion record is a leftover of a
crash and is rewritten (byte-identically) when the shard is redone. pairclean never
deletes or replaces a file it did not write: a folder that holds other files is refused,
a data file is replaced only when its own Parquet metadata says pairclean wrote it, and
``--overwrite`` deletes only what the job's records list.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from numpy.typing import NDArray
from pairclean import __version__, schema
from pairclean.calibrate.calibration import Calibration
from pairclean.calibrate.contrast import Contrast
from pairclean.calibrate.contrast import from_json as contrast_from_json
from pairclean.errors import ForeignOutputError, InputError, SpecMismatchError, first_line
from pairclean.spec import JobSpec, spec_diff, spec_digest
from pairclean.storage import Store, WriteInfo
from pairclean.uris import LOCAL_SCHEMES, local_path, scheme_of, shard_stem

__all__ = ["ShardRecord", "OutputDir", "enclosing_output", "is_output", "COMPACT_EVERY", "COMPACT_SECONDS", "MAX_SEGMENTS"]

log = logging.getLogger(__name__)

#: Completion records since the last compaction that trigger a new compaction. Resuming
#: reads at most this many single records, so it stays small.
COMPACT_EVERY = 200


#: ... or this many seconds since the last one, whichever comes first.
COMPACT_SECONDS = 120.0


#: Manifest segments that trigger a merge into one. Each compaction writes only its new
#: records (cost O(COMPACT_EVERY)); a merge rewrites everything (O(shards)) but only once
#: every MAX_SEGMENTS compactions, and resuming reads at most MAX_SEGMENTS + 1 segments.
MAX_SEGMENTS = 32


def is_output(exists: Any, path: str) -> bool:
    """Whether the folder at ``path`` holds a pairclean job's state (either layout), asking
    ``exists(path) -> bool`` of the filesystem it lives on."""
    side_state = f"{path}{schema.SIDE_SUFFIX}/{schema.SIDE_FOLDERS[schema.STATE_DIR]}"
    return bool(exists(side_state) or exists(f"{path}/{schema.STATE_DIR}"))


def enclosing_output(store: Store) -> str | None:
    """The pairclean output that ``store``'s folder lies inside (in it, or in its
    ``.pairclean`` side folder, at any depth), or None. Asks about each enclosing folder
    up to the filesystem's (or bucket's) root: a handful of lookups."""
    exists = os.path.exists if store.local else store.fs.exists
    path = store.root.rstrip("/")
    outer = path.split("/")[:-1]
    # A bucket (the first component of a remote path) holds no job: it has no sibling folder.
    stop = 1 if store.local else 2
    candidates = ["/".join(outer[:n]) for n in range(len(outer), stop - 1, -1)]
    candidates += [c[: -len(schema.SIDE_SUFFIX)] for c in [path, *candidates] if c.endswith(schema.SIDE_SUFFIX)]
    for folder in candidates:
        if folder and is_output(exists, folder):
            return folder if store.local else f"{store.scheme}://{folder}"
    return None


@dataclass(frozen=True)
class ShardRecord:
    """One committed shard: what a worker reports back (a few hundred bytes, no embeddings).

    ``output``/``emb_output`` are names inside the folder; ``sha256``/``bytes`` describe the
    score table as written.
    """

    shard: str
    stem: str
    size: int | None
    rows: int
    output: str
    sha256: str
    bytes: int
    statuses: dict[str, int]
    emb_output: str | None = None
    emb_bytes: int | None = None
    timings: dict[str, float] = field(default_factory=dict)
    #: How many tries the shard took (a worker lost or a transient error retried it; set by
    #: the driver at commit). 1 in records written before it was kept.
    attempts: int = 1
    #: The local shard's modification time when it was read (ns; None for remote shards and
    #: in records written before it was kept): with ``size``, how a resume sees it changed.
    mtime_ns: int | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ShardRecord:
        """Inverse of ``to_json``. Keys a later release added are ignored: a folder written
        by it stays readable here (a rolling upgrade, a trainer with an older install)."""
        known = cls.__dataclass_fields__
        record = cls(**{k: v for k, v in data.items() if k in known})
        record.check()
        return record

    def check(self) -> None:
        """``TypeError`` naming the first field without the type pairclean writes (a manifest
        whose statuses were ``"[1,2]"`` raised ArrowTypeError or AttributeError far away)."""
        def counts(value: Any, kind: type | tuple[type, ...]) -> bool:
            return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, kind) and not isinstance(v, bool)
                                                   for k, v in value.items())

        checks = {"stem": isinstance(self.stem, str), "shard": isinstance(self.shard, str), "output": isinstance(self.output, str),
                  "sha256": isinstance(self.sha256, str), "rows": isinstance(self.rows, int), "bytes": isinstance(self.bytes, int),
                  "statuses": counts(self.statuses, int), "timings": counts(self.timings, (int, float)),
                  "emb_output": self.emb_output is None or isinstance(self.emb_output, str)}
        bad = next((name for name, ok in checks.items() if not ok), None)
        if bad is not None:
            raise TypeError(f"its {bad} is {getattr(self, bad)!r}")


# The compacted manifest's columns; dicts are stored as JSON text.
_MANIFEST_SCHEMA = pa.schema(
    [
        ("stem", pa.string()), ("shard", pa.string()), ("size", pa.int64()), ("rows", pa.int64()),
        ("output", pa.string()), ("sha256", pa.string()), ("bytes", pa.int64()), ("statuses", pa.string()),
        ("emb_output", pa.string()), ("emb_bytes", pa.int64()), ("timings", pa.string()), ("attempts", pa.int64()),
        ("mtime_ns", pa.int64()),  # absent from segments written before it was kept: read as None
    ]
)


#: Characters fsspec reads as a glob in a path it is given a list of (``cat``, ``rm``).
_GLOB_CHARS = re.compile(r"[*?\[]")


def _tables_of(records: Iterable[ShardRecord]) -> set[tuple[str, str, str, int]]:
    """What a set of completion records says of the tables: (stem, table, sha256, bytes)."""
    return {(r.stem, r.output, r.sha256, r.bytes) for r in records}


def _records_table(records: list[ShardRecord]) -> pa.Table:
    cols: dict[str, list[Any]] = {name: [] for name in _MANIFEST_SCHEMA.names}
    for r in records:
        for name in _MANIFEST_SCHEMA.names:
            value = getattr(r, name)
            cols[name].append(json.dumps(value, sort_keys=True) if isinstance(value, dict) else value)
    return pa.table(cols, schema=_MANIFEST_SCHEMA)


def _failure_record(data: bytes) -> dict[str, Any]:
    """A failure record as written, or one saying it is unreadable: the shard failed either
    way, and a record that is not JSON made the job's shard list a 500."""
    doc = schema.json_object(data)
    if doc is None or not isinstance(doc.get("error", ""), str):
        return {"state": schema.SHARD_QUARANTINED, "error": "its failure record is damaged", "attempts": 1}
    return doc


def _completion_record(data: bytes, where: str) -> ShardRecord:
    """One completion record, or a one-line ``InputError`` naming it where it is not one
    pairclean wrote."""
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict):
            raise TypeError("not a JSON object")
        return ShardRecord.from_json(doc)
    except (ValueError, TypeError, KeyError) as exc:
        raise InputError(f"{where} (a completion record) is damaged ({first_line(exc)}); restore it, or score into a new "
                         "folder", uri=where) from None


def _table_records(table: pa.Table) -> Iterator[ShardRecord]:
    for row in table.to_pylist():
        row["statuses"] = json.loads(row["statuses"])
        row["timings"] = json.loads(row["timings"])
        if row.get("attempts") is None:  # a manifest written before attempts were kept
            row["attempts"] = 1
        yield ShardRecord.from_json(row)


# Columns every score table / embedding sidecar has (what the readers use).
_SCORE_COLUMNS = (schema.COL_KEY, schema.COL_STATUS, schema.COL_SIMILARITY, schema.COL_WEIGHT, schema.COL_NOISY)
_EMB_COLUMNS = (schema.COL_KEY, schema.COL_IMAGE_EMB, schema.COL_TEXT_EMB)


def _linked_side(out: str, side: str) -> str:
    """``side``, or the side folder of the folder a local ``out`` links to when only that one
    exists (a job scored as ``/data/weights`` and read through a link to it: ``export LINK``
    said the job held no shard and left an empty ``LINK.pairclean`` behind)."""
    if scheme_of(out) not in LOCAL_SCHEMES:
        return side
    path = local_path(out).rstrip("/")
    if not os.path.islink(path) or os.path.exists(local_path(side)):
        return side
    real = os.path.realpath(path) + schema.SIDE_SUFFIX
    return real if os.path.isdir(real) else side


class OutputDir:
    """The output folder of one job, on any fsspec location.

    ``storage_options`` are fsspec options (endpoint, credentials) for remote folders.
    """

    def __init__(self, uri: str, storage_options: Mapping[str, Any] | None = None, legacy: bool | None = None,
                 roots: Sequence[str] | None = None) -> None:
        """``roots``: local folders every file of the job must resolve inside (``Store``); a
        service reading a tenant's job passes the job's own folders, so links planted inside
        them lead nowhere."""
        base = Store(uri, storage_options, roots=roots)
        #: A folder written before issue 23 keeps its state inside OUT (``OUT/_pairclean/``).
        self.legacy = base.exists(schema.JOB_FILE) if legacy is None else legacy
        if self.legacy:
            self.store = base
        else:
            try:
                named = schema.side_folder(base.uri)
            except ValueError as exc:
                raise InputError(str(exc), uri=uri) from exc
            side = _linked_side(base.uri, named)
            self.store = Store(uri, storage_options, side=side, roots=roots)
        self.uri = self.store.url()
        #: Where everything but the score tables lives (``OUT.pairclean``; OUT itself for legacy folders).
        self.side_uri = self.uri if self.legacy else self.store.url().rstrip("/") + schema.SIDE_SUFFIX
        if not self.legacy and side != named:
            self.side_uri = side
        # The compacted manifest as last read or written (records and segment names), and
        # records committed since.
        self._compacted: dict[str, ShardRecord] | None = None
        self._segments: list[str] = []
        self._pending: dict[str, ShardRecord] = {}
        self._failed_stems: set[str] | None = None
        self._last_compaction = time.monotonic()
        self._derived_checked = False  # whether a commit here has marked exports and pseudo-pairs stale

    def __reduce__(self) -> tuple[Any, ...]:
        # Workers get a fresh handle on the same folder (no cached records).
        return (OutputDir, (self.store.uri, self.store.storage_options, self.legacy, self.store.roots))

    # -- names ----------------------------------------------------------------------------
    @staticmethod
    def score_name(stem: str) -> str:
        """Name of the score table of ``stem``."""
        return f"{stem}.parquet"

    @staticmethod
    def emb_name(stem: str) -> str:
        """Name of the embedding sidecar of ``stem``."""
        return f"{schema.EMB_DIR}/{stem}.parquet"

    # -- the spec -------------------------------------------------------------------------
    def read_spec(self) -> JobSpec | None:
        """The frozen spec of the job that owns this folder, or None for a new folder.

        Raises ``InputError`` (one line naming the file) for a ``job.json`` that is cut
        short, is not pairclean's, or whose spec was edited after it was written (its
        ``spec_sha256`` no longer matches: every data file names its job by that digest).
        """
        doc = self.read_job_doc()
        if not doc:
            return None
        where = self.store.url(schema.JOB_FILE)
        try:
            spec = JobSpec.from_json(doc["spec"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{where} is not a pairclean job file (bad spec: {type(exc).__name__}: {exc})", uri=where) from None
        recorded = doc.get("spec_sha256")
        if recorded is not None and recorded != spec_digest(spec):
            raise InputError(f"{where} was edited: its spec no longer matches its spec_sha256; restore it, or score into a new folder",
                             uri=where)
        return spec

    def read_job_doc(self) -> dict[str, Any] | None:
        """The whole ``job.json`` document, or None; ``InputError`` naming the file when it
        is not a JSON object (cut short by a crash or an edit)."""
        data = self.store.get(schema.JOB_FILE)
        if data is None:
            return None
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            where = self.store.url(schema.JOB_FILE)
            raise InputError(f"{where} is damaged (not JSON: {exc}); restore it, or score into a new folder", uri=where) from None
        if not isinstance(doc, dict):
            where = self.store.url(schema.JOB_FILE)
            raise InputError(f"{where} is not a pairclean job file (not a JSON object)", uri=where)
        return doc

    def write_job_doc(self, doc: Mapping[str, Any]) -> None:
        """Replace ``job.json`` (atomically)."""
        self.store.put(schema.JOB_FILE, json.dumps(doc, indent=2).encode())

    def check_owned(self) -> None:
        """Raise ``ForeignOutputError`` unless the folder is new, empty, or a pairclean job's.

        An output folder holding files pairclean did not write (an img2dataset shard
        folder, say) is refused: scores would mix with, or replace, the user's files.
        """
        self._check_not_nested()
        if self.store.is_file():
            raise ForeignOutputError(f"output {self.uri} is a file, not a folder; choose a folder", uri=self.uri)
        if not self.legacy and Store(self.side_uri, self.store.storage_options).is_file():
            # pairclean keeps its state in that folder: a user's file there ended in "Not a directory: .../lock.json"
            raise ForeignOutputError(f"{self.side_uri} is a file pairclean did not write, where the output's state folder "
                                     "goes; move it, or choose another output folder", uri=self.uri)
        if self.store.exists(schema.JOB_FILE):
            return
        entries = self.store.list()
        if "_job.json" in entries and "_manifest.jsonl" in entries:
            raise ForeignOutputError(
                f"output {self.uri} was written by an earlier pairclean with the old layout (_job.json, "
                "_manifest.jsonl beside the tables); it is left as it is: score into a new folder",
                uri=self.uri,
            )
        foreign = [name for name in entries if name != schema.STATE_DIR]
        if not self.legacy:
            # The side folder: only our own lock (state/) may be there before job.json is.
            state = schema.side_name(schema.STATE_DIR)
            foreign += [f"{self.side_uri}/{n}" for n in self._side_entries() if n != state]
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise ForeignOutputError(
                f"output {self.uri} already holds files pairclean did not write ({shown}); "
                "pairclean never mixes its outputs with other files: choose an empty or new folder",
                uri=self.uri,
            )

    def _check_not_nested(self) -> None:
        """``ForeignOutputError`` when this folder lies inside another pairclean output or its
        side folder: its files would join that job's dataset (readers of the outer folder
        would meet this job's tables and state) and its resume would not know them."""
        outer = enclosing_output(self.store)
        if outer is not None:
            raise ForeignOutputError(
                f"output {self.uri} lies inside the pairclean output {outer}; its files would mix with that job's: "
                "choose a folder outside it",
                uri=self.uri,
            )

    def _side_entries(self) -> list[str]:
        """Entries directly inside the side folder (new layout only)."""
        side = Store(self.side_uri, self.store.storage_options)
        return side.list()

    def prepare(self, spec: JobSpec, overwrite: bool) -> None:
        """Claim the folder for ``spec``: new, same spec (resume) or ``overwrite`` (start over).

        Raises ``ForeignOutputError`` for a folder of someone else's files and
        ``SpecMismatchError`` when the folder holds a different job (without ``overwrite``).
        Call with the folder's lock held.
        """
        self.check_owned()
        self.remove_temporaries()
        existing = self.read_spec()
        if existing is not None and not overwrite:
            self.check_tables_whole()
        if existing is not None and overwrite:
            self.clear()
            existing = None
        elif existing is not None and existing != spec and self._never_started(existing):
            # A start that failed before calibrating (an unknown model, every shard unreadable):
            # nothing to resume. Its failure records describe the other spec's attempts: dropped.
            for name in self.store.list(schema.FAILED_DIR):
                if name.endswith(".json"):
                    self.store.rm(f"{schema.FAILED_DIR}/{name}")
            self._failed_stems = None
            existing = None
        elif existing is not None and existing != spec:
            raise SpecMismatchError(
                f"{self.uri} holds a job with a different spec ({spec_diff(existing, spec)}); rerun with the "
                "same options to resume, use --overwrite to start over, or pick another --out"
            )
        if existing is None:
            self.write_job_doc({"pairclean_version": __version__, "spec": spec.to_json(), "spec_sha256": spec_digest(spec)})
        self._warn_other_files()

    def _warn_other_files(self) -> None:
        """Say so when OUT holds files that are no table (a resume, or ``--overwrite``, takes
        a job's folder with them in it, never deleting them): readers that take OUT as one
        dataset (pandas, pyarrow, duckdb, polars) fail on them, which came as a surprise."""
        if self.legacy:
            return
        others = sorted(n for n in self.store.list() if not n.endswith(".parquet"))
        if others:
            shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
            log.warning("%s holds files that are not score tables (%s): readers that take the folder as one dataset "
                        "fail on them; move them out (pairclean never deletes them)", self.uri, shown)

    def _never_started(self, spec: JobSpec) -> bool:
        """Whether the job of ``spec`` left nothing but its ``job.json`` and failure records: no
        calibration, no committed shard, no data file of its own. Such a folder holds no work
        a different spec could spoil, so the corrected command may claim it (a job whose every
        shard failed before it could calibrate, too)."""
        if self.read_calibration() is not None or self.committed():
            return False
        return not self._stray_outputs(spec_digest(spec), set(), spec)

    def clear(self) -> list[str]:
        """Delete what this job's records say it wrote (and nothing else); returns the names.

        Data files without a completion record (a crash before the commit) are deleted
        only when their own metadata names this job as their writer; those with one, only
        while they are still pairclean's (a file a user put in a table's place is kept).
        """
        doc = self.read_job_doc() or {}
        names: list[str] = []
        committed = self.committed()
        for record in committed.values():
            # a table the records name but someone replaced with a file of their own is theirs:
            # the new job could not write there either, so nothing is deleted (it deleted the
            # rest of the job, then failed on that name, leaving the folder half cleared)
            for name in (record.output, record.emb_output):
                if name and self.store.exists(name) and not self.written_by(name) and not self._damaged_own(name):
                    where = self.store.url(name)
                    raise ForeignOutputError(f"{where} exists and was not written by pairclean; it is left untouched, and "
                                             "--overwrite deleted nothing: move it away first", uri=where)
            names += [n for n in (record.output, record.emb_output) if n]
        names += self._stray_outputs(doc.get("spec_sha256"), set(names), self.read_spec())
        names += [f"{schema.COMPLETIONS_DIR}/{n}" for n in self.store.list(schema.COMPLETIONS_DIR)]
        names += [f"{schema.FAILED_DIR}/{n}" for n in self.store.list(schema.FAILED_DIR)]
        if self.store.exists(schema.EXPORTS_FILE):
            names += self.written_exports() + [schema.EXPORTS_FILE]
        names.append(schema.EXPORTS_STALE_FILE)
        names += [f"{schema.MANIFEST_DIR}/{n}" for n in self.store.list(schema.MANIFEST_DIR)]
        names += self._pseudo_outputs()
        # The audit's sample and report describe the tables being deleted: labels made for
        # them recalibrated the new job's tables (pairs it does not even hold).
        names += [schema.AUDIT_DESIGN_FILE, schema.AUDIT_REPORT_FILE]
        # applied maps are kept a folder deeper: applied/<map sha12>/<stem>.json
        names += [f"{schema.AUDIT_APPLIED_DIR}/{d}/{n}" for d in self.store.list(schema.AUDIT_APPLIED_DIR)
                  for n in self.store.list(f"{schema.AUDIT_APPLIED_DIR}/{d}")]
        names += [schema.REWRITE_FILE, schema.CALIBRATION_FILE, schema.CONTRAST_BANK_FILE, schema.JOB_FILE]
        removed = [n for n in names if self.store.rm(n)]
        self._compacted, self._pending, self._failed_stems = {}, {}, set()
        return removed

    def remove_temporaries(self) -> None:
        """Delete the hidden temporaries a killed write of ours left in ``OUT``, the sidecar
        folder (polars refuses a folder holding them) and the state folder with its
        sub-folders (refine's per-shard records). Call with the lock held."""
        self.store.remove_temporaries()
        self.store.remove_temporaries(schema.EMB_DIR)
        self.store.remove_temporaries(schema.STATE_DIR, depth=3)

    # -- rewrites of the committed tables (rescore, refine, audit) ------------------------
    def begin_rewrite(self, verb: str) -> bool:
        """Record that ``verb`` starts rewriting committed tables (call with the lock held),
        and that the exports are to be written again (``exports.mark_exports_stale``: the
        verb's refresh clears it; ``inspect`` warns while it stays). Returns whether an
        earlier run had left the exports stale (refresh them even if nothing changes)."""
        from pairclean.output.exports import mark_exports_stale  # (that module imports this one)

        stale = mark_exports_stale(self, verb)
        self.store.put(schema.REWRITE_FILE, json.dumps({"verb": verb, "started": time.time()}).encode())
        return stale

    def end_rewrite(self) -> None:
        """The rewrite is complete: every table, the records and the calibration agree again."""
        self.store.rm(schema.REWRITE_FILE)

    def interrupted_rewrite(self) -> str | None:
        """The verb (``rescore``, ``refine``, ``audit``) whose rewrite of the tables is under
        way or was interrupted; None when the tables are whole."""
        data = self.store.get(schema.REWRITE_FILE)
        if data is None:
            return None
        try:
            return str(json.loads(data).get("verb", "rescore"))
        except (ValueError, AttributeError):
            return "rescore"

    def start_rewrite_run(self, verb: str) -> None:
        """What ``rescore``, ``refine`` and ``audit --labels`` do first, with the lock held:
        refuse another verb's interrupted rewrite (their own they finish) and clear the
        temporaries a killed write of ours left."""
        self.check_tables_whole(resuming=verb)
        resuming = self.interrupted_rewrite() is not None  # (then some tables are already this verb's)
        self.remove_temporaries()
        listed: dict[str, dict[str, int]] = {}
        for record in self.iter_committed():
            # Before anything is rewritten: a table another tool wrote in place (its metadata
            # gone) crashed a rescore halfway, with a traceback and the rewrite left marked.
            where = self.store.url(record.output)
            if self.store.exists(record.output) and not self.written_by(record.output):
                if self._damaged_own(record.output):
                    raise InputError(f"{where} is not a readable Parquet table (cut short?): run the job's `pairclean "
                                     "score` again first, which scores that shard again", uri=where)
                raise InputError(f"{where} has no pairclean metadata (rewritten by another tool?): it is not rewritten; "
                                 "put back the table pairclean wrote, or score the job again into a new folder", uri=where)
            # ... and one changed in place with pyarrow (which keeps the metadata): a column a
            # user added was dropped without a word, as the rewrite builds its own columns.
            size = self.changed_size(record, listed)
            if not resuming and size is not None:
                raise InputError(f"{schema.changed_since(where, record.bytes, size)}: a column "
                                 f"added, rows edited?): a `pairclean {verb}` would rebuild it from its own columns and lose "
                                 "the change; keep your copy elsewhere and put back the table pairclean wrote (or score the "
                                 "job again)", uri=where)

    def check_tables_whole(self, resuming: str | None = None) -> None:
        """``InputError`` when a rewrite of the tables was interrupted (some tables hold the
        new weights, some the old, or the spec and calibration are the old ones), unless it
        was ``resuming``'s own, which its rerun finishes."""
        verb = self.interrupted_rewrite()
        if verb is not None and verb != resuming:
            raise InputError(f"{self.uri}: a `pairclean {verb}` was interrupted while rewriting the tables (some hold "
                             f"its weights, some the earlier ones): run that `pairclean {verb}` again to finish it first")

    def _pseudo_outputs(self) -> list[str]:
        """A pseudo-pair run's files (its tables, recognised by their metadata, and its
        records): made from this job's weights, so ``--overwrite`` removes them with it."""
        tables = [f"{schema.PSEUDO_DIR}/{n}" for n in self.store.list(schema.PSEUDO_DIR) if n.endswith(".parquet")]
        return [n for n in tables if self.written_by(n)] + [n for n, ours in self.pseudo_records().items() if ours]

    def pseudo_records(self) -> dict[str, bool]:
        """The pseudo-pair run's record files present (``_run.json``, ``_stale.json``), each
        with whether pairclean wrote it (a JSON object with the keys it writes): a file of
        someone else's at such a name is neither replaced nor deleted."""
        shapes = {schema.PSEUDO_RECORD_FILE: ("kind", "files"), schema.PSEUDO_STALE_FILE: ("reason", "at")}
        out = {}
        for name, keys in shapes.items():
            data = self.store.get(name)
            if data is None:
                continue
            try:
                doc = json.loads(data)
            except ValueError:
                doc = None
            out[name] = isinstance(doc, dict) and all(k in doc for k in keys) and (
                name != schema.PSEUDO_RECORD_FILE or doc.get("kind") == "pseudo-pairs")
        return out

    def _stray_outputs(self, digest: str | None, known: set[str], spec: JobSpec | None) -> list[str]:
        """Data files of this job with no completion record: at the names its shards' tables
        and sidecars take, and naming the job in their metadata. By metadata alone a user's
        ``my-labels.parquet`` (the job's rows plus a column, written with pyarrow, which keeps
        the metadata) or a copied ``x.backup.parquet`` was deleted by ``--overwrite``."""
        if digest is None or spec is None:
            return []
        try:
            stems = set(spec.stems().values())
        except InputError:
            return []
        ours = {self.score_name(s) for s in stems} | {self.emb_name(s) for s in stems}
        found = []
        for folder, names in (("", self.store.list()), (schema.EMB_DIR, self.store.list(schema.EMB_DIR))):
            for name in names:
                full = f"{folder}/{name}" if folder else name
                if full in known or full not in ours:
                    continue
                if self.written_by(full, digest):
                    found.append(full)
        return found

    def table_doc(self, record: ShardRecord) -> dict[str, Any] | None:
        """The pairclean metadata document of a committed shard's table (footer only), or
        None where it cannot be read."""
        return schema.json_object((self.store.parquet_metadata(record.output) or {}).get(schema.META_KEY))

    def changed_size(self, record: ShardRecord, listed: dict[str, dict[str, int]]) -> int | None:
        """The byte size of ``record``'s table where it is not the size pairclean wrote (the
        table changed since: edited, saved again by another tool), else None (also where it is
        gone). ``listed``: folder listings by folder, filled as needed (one listing a folder)."""
        folder, _, base = record.output.rpartition("/")
        size = listed.setdefault(folder, self.store.sizes(folder)).get(base)
        return size if size is not None and size != record.bytes else None

    def written_by(self, name: str, digest: str | None = None) -> bool:
        """Whether ``name`` is a Parquet file pairclean wrote (for the job ``digest`` when given)."""
        meta = self.store.parquet_metadata(name)
        # a JSON object under pairclean's key: anyone's Parquet file may carry the key (a
        # hostile one with bytes that are no JSON raised a traceback from every check of a name)
        doc = schema.json_object((meta or {}).get(schema.META_KEY))
        if doc is None:
            return False
        return digest is None or doc.get("job") == digest

    # -- calibration ----------------------------------------------------------------------
    def read_calibration(self) -> Calibration | None:
        """The frozen calibration, once a run has computed it."""
        data = self.store.get(schema.CALIBRATION_FILE)
        if data is None:
            return None
        try:
            return Calibration.from_json(json.loads(data))
        except (ValueError, TypeError) as exc:  # a traceback of 34 lines before
            where = self.store.url(schema.CALIBRATION_FILE)
            first = first_line(exc)
            raise InputError(f"{where} is damaged ({first}); restore it, or score into a new folder", uri=where) from None

    def write_calibration(self, calibration: Calibration) -> None:
        """Freeze the calibration (atomically)."""
        self.store.put(schema.CALIBRATION_FILE, json.dumps(calibration.to_json(), indent=2).encode())

    def write_contrast_bank(self, bank: NDArray[np.float32]) -> None:
        """Store the calibration's contrast bank ((2, rows, dim) float16 .npy, atomically)."""
        buf = io.BytesIO()
        np.save(buf, np.asarray(bank, dtype=np.float16), allow_pickle=False)
        self.store.put(schema.CONTRAST_BANK_FILE, buf.getvalue())

    def read_contrast_bank(self) -> NDArray[np.float32]:
        """The stored contrast bank; raises ``InputError`` naming the file when it is missing or damaged."""
        arr = self._read_array(schema.CONTRAST_BANK_FILE)
        if arr is None:
            raise InputError(f"{self.store.url(schema.CONTRAST_BANK_FILE)} is missing: the calibration needs its contrast bank")
        if arr.ndim != 3 or arr.shape[0] != 2 or arr.dtype != np.float16:
            raise InputError(f"{self.store.url(schema.CONTRAST_BANK_FILE)} is not a (2, rows, dim) float16 array")
        bank: NDArray[np.float32] = np.asarray(arr, dtype=np.float32)
        return bank

    def write_judge_ratios(self, similarity: NDArray[np.float32], llr: NDArray[np.float32]) -> None:
        """Store the judge's ratios on the calibration sample with those pairs' similarities
        ((2, n) float32 .npy, atomically): the similarities say which pairs the ratios are of.
        ``ValueError`` when the two are not of one length."""
        if len(similarity) != len(llr):
            raise ValueError(f"{len(llr)} judge ratios for {len(similarity)} calibration pairs")
        buf = io.BytesIO()
        np.save(buf, np.stack([np.asarray(similarity, dtype=np.float32), np.asarray(llr, dtype=np.float32)]), allow_pickle=False)
        self.store.put(schema.JUDGE_RATIOS_FILE, buf.getvalue())

    def read_judge_ratios(self) -> NDArray[np.float32] | None:
        """The stored (similarities, ratios), (2, n) (``write_judge_ratios``); None where the
        folder has none (scored before they were kept, or without a judge); ``InputError``
        naming the file when it is damaged."""
        arr = self._read_array(schema.JUDGE_RATIOS_FILE)
        if arr is None:
            return None
        if arr.ndim != 2 or arr.shape[0] != 2 or arr.dtype != np.float32:
            raise InputError(f"{self.store.url(schema.JUDGE_RATIOS_FILE)} is not a (2, n) float32 array")
        ratios: NDArray[np.float32] = arr
        return ratios

    def written_exports(self) -> list[str]:
        """The export files ``exports.json`` names as written, inside the export folder only;
        none where the record is not one pairclean wrote (a non-JSON record crashed ``score
        --overwrite``; ``"written": 5`` crashed ``export``): those files are then left."""
        written = (schema.json_object(self.store.get(schema.EXPORTS_FILE)) or {}).get("written", [])
        prefix = f"{schema.EXPORT_DIR}/"
        return [n for n in written if isinstance(n, str) and n.startswith(prefix)] if isinstance(written, list) else []

    def _read_array(self, name: str) -> NDArray[Any] | None:
        """The .npy state file ``name`` (None when missing); ``InputError`` naming it when it is
        not one (an empty file included: numpy raises ``EOFError`` there)."""
        data = self.store.get(name)
        if data is None:
            return None
        try:
            # MemoryError too: a header may declare any shape (a huge one raised numpy's
            # _ArrayMemoryError traceback); the data must then be what it declares
            arr: NDArray[Any] = np.load(io.BytesIO(data), allow_pickle=False)
        except (ValueError, EOFError, OSError, MemoryError) as exc:
            raise InputError(f"{self.store.url(name)} is damaged: {first_line(exc) or type(exc).__name__}") from None
        return arr

    def read_contrast(self, calibration: Calibration) -> Contrast | None:
        """The corpus contrast frozen in ``calibration`` with its bank from this folder (None
        without one); ``InputError`` naming the folder when the bank is missing or not the
        recorded one."""
        doc = calibration.extra.get("contrast")
        if doc is None:
            return None
        try:
            return contrast_from_json(doc, self.read_contrast_bank())
        except ValueError as exc:
            raise InputError(f"{self.uri}: {exc}") from exc

    # -- data files (written by workers) --------------------------------------------------
    def write_table(self, name: str, table: pa.Table, job: str | None = None) -> WriteInfo:
        """Write a data file, refusing to replace one pairclean did not write.

        A file already there is a leftover of a crashed attempt (same bytes will follow)
        unless its metadata says otherwise, in which case ``ForeignOutputError`` is raised.
        ``job`` (a spec digest): the file there must have been written by that job, not by
        another pairclean job (a table copied in from another folder is not a leftover), or
        be one this folder's own completion records name (a shard scored again after a
        ``rescore`` gave the job another digest: its sidecar still carries the first).
        """
        if self.store.exists(name) and not self.written_by(name, job) and not (job is not None and self._recorded(name)):
            how = "was written by another pairclean job" if job is not None and self.written_by(name) else "was not written by pairclean"
            raise ForeignOutputError(f"{self.store.url(name)} exists and {how}; it is left untouched", uri=self.store.url(name))
        if self.store.write_guard is not None:
            self.store.write_guard()  # the run still holds the folder (it may have stalled past its lock's TTL)
        return self.store.put_parquet(name, table)

    def _recorded(self, name: str) -> bool:
        """Whether a committed shard's record of this folder names ``name`` (a table or sidecar)
        and pairclean wrote the file there."""
        return self.written_by(name) and any(name in (r.output, r.emb_output) for r in self.committed().values())

    # -- completion records (written by the driver) ---------------------------------------
    def committed(self) -> dict[str, ShardRecord]:
        """Committed shards by stem: the manifest segments plus the records since.

        Costs a listing and read of at most ``MAX_SEGMENTS + 1`` segments and of the
        completion records written since the last compaction (at most about
        ``COMPACT_EVERY``), whatever the job's size.
        """
        compacted = self._read_manifest()
        names = self.store.list(schema.COMPLETIONS_DIR)
        pending = {n[: -len(".json")]: n for n in names if n.endswith(".json")}
        missing = [s for s in pending if s not in self._pending]
        for stem, data in zip(missing, self._get_many([f"{schema.COMPLETIONS_DIR}/{pending[s]}" for s in missing])):
            if data is not None:
                self._pending[stem] = _completion_record(data, self.store.url(f"{schema.COMPLETIONS_DIR}/{pending[stem]}"))
        # A record deleted since (compacted by a writer elsewhere) is in the manifest now.
        self._pending = {s: r for s, r in self._pending.items() if s in pending}
        return {**compacted, **self._pending}

    def _read_manifest(self) -> dict[str, ShardRecord]:
        segments = sorted(n for n in self.store.list(schema.MANIFEST_DIR) if n.endswith(".parquet"))
        if self._compacted is not None and segments == self._segments:
            return self._compacted  # nothing new since the last look
        records: dict[str, ShardRecord] = {}
        # Later segments win: a merge that crashed before deleting leaves duplicates only.
        for name, data in zip(segments, self._get_many([f"{schema.MANIFEST_DIR}/{n}" for n in segments], whole=True)):
            if data is not None:
                try:
                    records.update((r.stem, r) for r in _table_records(pq.read_table(pa.BufferReader(data))))
                except (pa.ArrowException, ValueError, TypeError, KeyError) as exc:  # tracebacks of 40 lines before
                    where = self.store.url(f"{schema.MANIFEST_DIR}/{name}")
                    first = first_line(exc)
                    raise InputError(f"{where} (completion records) is damaged ({first}); restore it, or score into a "
                                     "new folder", uri=where) from None
        self._compacted, self._segments = records, segments
        return records

    def _get_many(self, names: list[str], whole: bool = False) -> list[bytes | None]:
        """The bytes of each of ``names`` (None where missing); ``whole``: past
        ``storage.MAX_GET_BYTES`` too (manifest segments grow with the job)."""
        if not names:
            return []
        if self.store.local:
            return [self.store.get(n, max_bytes=None) if whole else self.store.get(n) for n in names]
        # One concurrent batch of GETs rather than a round trip each. fsspec's list ``cat``
        # expands each path as a glob: a shard named ``x[1]`` made its own record unreadable
        # (``[1]`` a character class), and every later run and reader failed on it; names
        # with glob characters are read one by one.
        plain = [n for n in names if not _GLOB_CHARS.search(n)]
        paths = [self.store.path(n) for n in plain]
        got = dict(zip(plain, self.store.fs.cat_ranges(paths, None, None, on_error="return"))) if paths else {}
        out: list[bytes | None] = []
        for name in names:
            data: Any = got[name] if name in got else self._get_one(name)
            if isinstance(data, FileNotFoundError):
                data = None
            elif isinstance(data, BaseException):
                raise data
            out.append(None if data is None else bytes(data))
        return out

    def _get_one(self, name: str) -> bytes | None:
        """One file's bytes, None where it is missing."""
        try:
            return bytes(self.store.fs.cat_file(self.store.path(name)))
        except FileNotFoundError:
            return None

    def _rm_many(self, names: list[str]) -> None:
        if not names:
            return
        # fsspec's list ``rm`` expands globs too: ``x[1].json`` would also delete ``x1.json``
        # (a file pairclean may not have written); such names are deleted one by one.
        batched = set() if self.store.local else {n for n in names if not _GLOB_CHARS.search(n)}
        if batched:
            self.store.fs.rm([self.store.path(n) for n in sorted(batched)])
        for name in names:
            if name not in batched:
                self.store.rm(name)

    def record_completion(self, record: ShardRecord) -> None:
        """Commit a shard: write its completion record, clear a failure record, and compact
        every ``COMPACT_EVERY`` records or ``COMPACT_SECONDS`` seconds."""
        self.store.put(f"{schema.COMPLETIONS_DIR}/{record.stem}.json", json.dumps(record.to_json(), sort_keys=True).encode())
        self._pending[record.stem] = record
        if not self._derived_checked:  # a shard joins the dataset (a resumed or retried job): once per run
            self._derived_checked = True
            self._mark_derived_stale("a shard was committed after this run")
        if self._failed_stems is None:
            self._failed_stems = set(self.quarantined())
        if record.stem in self._failed_stems:
            self.store.rm(f"{schema.FAILED_DIR}/{record.stem}.json")
            self._failed_stems.discard(record.stem)
        if len(self._pending) >= COMPACT_EVERY or time.monotonic() - self._last_compaction > COMPACT_SECONDS:
            self.compact()

    def compact(self) -> int:
        """Fold the completion records into a new manifest segment, then delete them; merge
        the segments into one when there are more than ``MAX_SEGMENTS``.

        Crash-safe: a segment is written (whole) before anything it replaces is deleted, and
        a record that is also in a segment is a harmless duplicate. Returns the rows.
        """
        compacted = self._read_manifest()
        self._last_compaction = time.monotonic()
        if not self._pending:
            return len(compacted)
        pending, merged = self._pending, {**compacted, **self._pending}
        if len(self._segments) + 1 > MAX_SEGMENTS:
            written, replaced = self._write_segment(merged), list(self._segments)
        else:
            written, replaced = self._write_segment(pending), []
        self._rm_many([f"{schema.COMPLETIONS_DIR}/{s}.json" for s in pending])
        self._rm_many([f"{schema.MANIFEST_DIR}/{n}" for n in replaced])
        self._segments = sorted(set(self._segments) - set(replaced) | {written})
        self._compacted, self._pending = merged, {}
        return len(merged)

    def _write_segment(self, records: Mapping[str, ShardRecord]) -> str:
        last = max((int(n.split(".")[0]) for n in self._segments), default=-1)
        name = f"{last + 1:08d}.parquet"
        self.store.put_parquet(f"{schema.MANIFEST_DIR}/{name}", _records_table([records[s] for s in sorted(records)]))
        return name

    def replace_records(self, records: list[ShardRecord]) -> None:
        """Rewrite the manifest as exactly ``records`` (e.g. new checksums after a rescore).

        Where the tables changed (a record's table, checksum or size differs, or a shard
        left), what was derived from them is out of date: a pseudo-pair run is marked stale
        (its readers refuse it until it is run again), and exports are named in a warning
        (open_clip and DataComp read them without asking). A rewrite that left every table
        as it was (a rescore with the job's own recipe) leaves them current."""
        before = self.committed()
        if _tables_of(before.values()) != _tables_of(records):
            self._mark_derived_stale()
        old = list(self._segments)
        name = self._write_segment({r.stem: r for r in records})
        self._rm_many([f"{schema.COMPLETIONS_DIR}/{n}" for n in self.store.list(schema.COMPLETIONS_DIR)])
        self._rm_many([f"{schema.MANIFEST_DIR}/{n}" for n in old])
        self._segments = [name]
        self._compacted, self._pending = {r.stem: r for r in records}, {}

    def withdraw(self, stems: set[str]) -> None:
        """Uncommit ``stems``: their records leave the manifest and their tables and sidecars
        (this job's own) are deleted, so that until they are committed again no reader takes
        the old rows for current ones (a shard that changed since, and then fails; the run
        that withdraws them writes the exports again, ``runner.run_job``)."""
        records = self.committed()
        gone = [records[s] for s in stems if s in records]
        if not gone:
            return
        ours = [name for record in gone for name in (record.output, record.emb_output)
                if name and (self.written_by(name) or self._damaged_own(name))]
        self.replace_records([r for s, r in records.items() if s not in stems])
        for name in ours:
            self.store.rm(name)

    def _damaged_own(self, name: str) -> bool:
        """Whether ``name``, a file this job's completion records name, is a damaged copy of
        what pairclean wrote there: empty, or Parquet (its ``PAR1`` opening) whose footer
        cannot be read (cut short by a full disk, a failed copy, ``truncate``). Such a file was
        neither read nor replaced: a resume withdrew the shard, deleted its intact table, and
        then refused its own damaged sidecar ("not written by pairclean"), so the job failed
        at every rerun. A readable file without pairclean's metadata stays someone else's."""
        if self.store.parquet_metadata(name) is not None:
            return False
        try:
            with self.store.open_read(name) as fh:
                head = fh.read(4)
        except FileNotFoundError:
            return False
        return head in (b"", b"PAR1")

    def _mark_derived_stale(self, reason: str = "the job's tables were rewritten after this run") -> None:
        """Mark a pseudo-pair run stale and warn about exports that cannot be refreshed (written
        by a release that did not record their options): the tables they were made from changed."""
        if self.store.exists(schema.PSEUDO_RECORD_FILE):
            self.store.put(schema.PSEUDO_STALE_FILE, json.dumps({"reason": reason, "at": time.time()}).encode())
            log.warning("the pseudo-pairs in %s were made from the earlier weights: run `pairclean pseudo-pair %s` again "
                        "before training with them", self.side_uri, self.uri)
        from pairclean.output.exports import export_options  # the module that writes them (imports this one)

        if self.store.exists(schema.EXPORTS_FILE) and export_options(self) is None:
            # Exports written with their options are written again by the verb that changes
            # the tables (``exports.refresh_exports``); older ones cannot be.
            log.warning("the exports of %s (sizes.json, shard_weights.json, datacomp_keep.npy) hold the earlier weights: "
                        "run `pairclean export %s` again", self.uri, self.uri)

    # -- failures -------------------------------------------------------------------------
    def quarantined(self) -> dict[str, dict[str, Any]]:
        """Shards that kept failing, by stem, with their error; a later commit clears one."""
        names = [n for n in self.store.list(schema.FAILED_DIR) if n.endswith(".json")]
        out = {}
        for name, data in zip(names, self._get_many([f"{schema.FAILED_DIR}/{n}" for n in names])):
            if data is not None:
                out[name[: -len(".json")]] = _failure_record(data)
        return out

    def quarantine(self, shard: str, stem: str, error: str, attempts: int) -> None:
        """Record that ``shard`` failed ``attempts`` times; it stays uncommitted (a rerun retries it).

        A table or sidecar of this job at the shard's names (written before a crash, never
        committed) is deleted: readers of OUT took its old rows as current beside a
        quarantined shard (``inspect`` said 35 pairs, pyarrow read 40)."""
        # ``failed_at``: each run's failure is a new record (the service counts a shard that
        # fails again on a retry; the same record twice read as the earlier run's failure)
        record = {"state": schema.SHARD_QUARANTINED, "shard": shard, "stem": stem, "error": error, "attempts": attempts,
                  "failed_at": time.time()}
        self.store.put(f"{schema.FAILED_DIR}/{stem}.json", json.dumps(record, sort_keys=True).encode())
        if self._failed_stems is not None:
            self._failed_stems.add(stem)
        digest = (self.read_job_doc() or {}).get("spec_sha256")
        if digest is not None and stem not in self.committed():
            for name in (self.score_name(stem), self.emb_name(stem)):
                if self.store.exists(name) and self.written_by(name, digest):
                    self.store.rm(name)

    # -- reading the results --------------------------------------------------------------
    def iter_committed(self) -> Iterator[ShardRecord]:
        """The record of every committed shard, in spec order."""
        spec = self.read_spec()
        entries = self.committed()
        order = [shard_stem(u) for u in spec.shards] if spec else sorted(entries)
        for stem in order:
            if stem in entries:
                yield entries[stem]

    def read_scores(self, record: ShardRecord, columns: list[str] | None = None, data: bytes | None = None) -> pa.Table:
        """The score table of a committed shard; ``InputError`` naming the file when it is
        not readable Parquet, lacks a column a score table has, or is not the table its
        record describes: another number of rows (rows deleted by hand), rows of another
        shard (a table copied under this one's name), a key twice that is not a
        ``duplicate_key`` row. Such tables were read as they were: ``export`` counted a
        shard's rows twice, ``rescore`` died on mismatched arrays. ``data``: the table's bytes,
        already read (``export`` checks their SHA-256 against the record), else read here."""
        # the shard column is always read for the check below: a reader of a few columns
        # (pseudo-pair's key, status, noisy) took a copied table's rows as this shard's
        extra = bool(columns) and schema.COL_SHARD not in (columns or [])
        table = self._read_table(record.output, [*columns, schema.COL_SHARD] if columns and extra else columns or None, _SCORE_COLUMNS,
                                 data)
        where = self.store.url(record.output)
        # move it away first: a rerun never replaces a table another tool saved (it is not pairclean's)
        fix = ("move it away and score the job again with the same arguments, which scores that shard again"
               if self.store.local else "score the shard again")
        if table.num_rows != record.rows:
            raise InputError(f"{where} holds {table.num_rows} rows, and the record of shard {record.shard!r} {record.rows}: "
                             f"the table was changed after pairclean wrote it ({fix})", uri=where)
        if schema.COL_SHARD in table.column_names:
            others = [u for u in table.column(schema.COL_SHARD).unique().to_pylist() if u != record.shard]
            if others:
                raise InputError(f"{where}: its rows belong to shard {others[0]!r}, not {record.shard!r} (a table copied "
                                 f"under another shard's name; {fix})", uri=where)
        if schema.COL_KEY in table.column_names and schema.COL_STATUS in table.column_names:
            # (without statuses a shard's own duplicate_key rows cannot be told from damage)
            twice = schema.repeated_keys(table.column(schema.COL_KEY).to_pylist(), table.column(schema.COL_STATUS).to_pylist())
            if isinstance(twice, str):
                raise InputError(f"{where}: key {twice!r} appears more than once; the table is damaged ({fix})", uri=where)
        return table.drop_columns([schema.COL_SHARD]) if extra else table

    def read_all_scores(self, columns: list[str] | None = None) -> pa.Table:
        """Every committed score table as one table, shards in spec order (only committed
        shards: a half-written table is never read). Raises ``InputError`` when none is."""
        tables = [self.read_scores(record, columns) for record in self.iter_committed()]
        if not tables:
            raise InputError(f"{self.uri} holds no committed shard")
        return pa.concat_tables(tables, promote_options="permissive")  # a table re-saved by pandas or polars holds large_string

    def has_embeddings(self, record: ShardRecord) -> bool:
        """Whether the shard's sidecar was written."""
        return record.emb_output is not None and self.store.exists(record.emb_output)

    def read_embeddings_table(self, record: ShardRecord) -> pa.Table:
        """The sidecar table of a committed shard (raises ``InputError`` when absent)."""
        if record.emb_output is None or not self.store.exists(record.emb_output):
            raise InputError(f"{self.store.url(self.emb_name(record.stem))} is missing: score with --embeddings")
        table = self._read_table(record.emb_output, None, _EMB_COLUMNS)
        for name in (schema.COL_IMAGE_EMB, schema.COL_TEXT_EMB):
            if not pa.types.is_fixed_size_list(table.schema.field(name).type):
                where = self.store.url(record.emb_output)
                raise InputError(f"{where}: column {name} is {table.schema.field(name).type}, not fixed-size vectors "
                                 "(not a pairclean sidecar)", uri=where)
        return table

    def _read_table(self, name: str, columns: list[str] | None, required: tuple[str, ...], data: bytes | None = None) -> pa.Table:
        """Read a Parquet file of the folder (from ``data``, its bytes, where given); a damaged
        or foreign one is one ``InputError`` line naming it (never pyarrow's traceback)."""
        where = self.store.url(name)
        try:
            table = (self.store.read_parquet(name, columns=columns) if data is None
                     else pq.read_table(pa.BufferReader(data), columns=columns))
        except FileNotFoundError:
            raise InputError(f"{where} is missing (the folder's records name it)", uri=where) from None
        except (pa.ArrowException, OSError, ValueError, KeyError) as exc:
            first = first_line(exc)
            raise InputError(f"{where} is not a readable pairclean table ({first})", uri=where) from None
        lacking = [c for c in (columns or required) if c not in table.column_names]
        if lacking:
            raise InputError(f"{where} lacks the column(s) {', '.join(lacking)}: not a pairclean table of this version", uri=where)
        return table

