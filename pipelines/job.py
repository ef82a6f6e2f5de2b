"""A job's output folder: frozen spec, manifest, calibration and atomic commits.

Layout of ``OUT/``::

    _job.json          the frozen spec and the expanded shard list
    _calibration.json  beta (value, recipe, K, seed) and weighting parameters, once known
    _manifest.jsonl    one line per committed shard: the commit point
    <stem>.parquet     per-pair scores, rows in tar order
    <stem>.emb.parquet optional float16 embeddings

Every file is written under a hidden temporary name and renamed into place. A shard is
done only when its manifest line exists; a crash between the rename and the manifest
line just redoes that shard.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from . import __version__, schema
from .errors import InputError, SpecMismatchError
from .uris import scheme_of, shard_stem

__all__ = [
    "CALIBRATION_FILE",
    "JobSpec",
    "Calibration",
    "ManifestEntry",
    "OutputDir",
    "atomic_write_bytes",
    "atomic_write_parquet",
    "sha256_file",
]

CALIBRATION_FILE = "_calibration.json"
_TMP_MARK = ".tmp-"


@dataclass(frozen=True)
class JobSpec:
    """Everything that determines a job's outputs. Two runs with equal specs write equal files.

    Device and thread counts are deliberately absent: a job may resume elsewhere.
    """

    shards: tuple[str, ...]
    model: str
    checkpoint: str | None
    pretrained: str | None
    precision: str
    beta_recipe: str
    beta_k: int
    weighting: str
    seed: int
    batch_size: int
    max_pixels: int
    caption_field: str | None
    embeddings: bool
    calibration_pairs: int

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict (``shards`` as a list)."""
        data = asdict(self)
        data["shards"] = list(self.shards)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JobSpec:
        """Inverse of ``to_json``; unknown keys are an error (a newer pairclean wrote it)."""
        fields = dict(data)
        fields["shards"] = tuple(fields["shards"])
        return cls(**fields)

    def stems(self) -> dict[str, str]:
        """Shard URI -> output stem; raises ``InputError`` when two shards would collide."""
        seen: dict[str, str] = {}
        for uri in self.shards:
            stem = shard_stem(uri)
            if stem in seen:
                raise InputError(
                    f"shards {seen[stem]!r} and {uri!r} share the name {stem!r}: their outputs "
                    "would collide in one folder; score them into separate output folders",
                    uri=uri,
                )
            seen[stem] = uri
        return {uri: stem for stem, uri in seen.items()}


@dataclass(frozen=True)
class Calibration:
    """The resolved beta and weighting parameters of a job, frozen once computed."""

    beta: float
    recipe: str
    k: int
    seed: int
    weighting: str
    d_ref: float | None = None
    weighting_batch_size: int | None = None
    noise_rate: float | None = None
    calibration_pairs: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        return asdict(self)


@dataclass(frozen=True)
class ManifestEntry:
    """One committed shard."""

    shard: str
    stem: str
    size: int | None
    rows: int
    output: str
    sha256: str
    statuses: dict[str, int]
    timings: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        return asdict(self)


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _tmp_name(final: Path) -> Path:
    return final.with_name(f".{final.name}{_TMP_MARK}{os.getpid()}")


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_bytes(final: Path, data: bytes) -> None:
    """Write ``data`` to ``final`` via a hidden temporary file, fsync and rename."""
    tmp = _tmp_name(final)
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def atomic_write_parquet(final: Path, table: pa.Table) -> None:
    """Write ``table`` as Parquet to ``final`` atomically (temporary name, fsync, rename)."""
    tmp = _tmp_name(final)
    try:
        pq.write_table(table, tmp, compression="zstd")
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    _fsync_dir(final.parent)


class OutputDir:
    """The output folder of one job. Only local folders are supported for now."""

    def __init__(self, path: str) -> None:
        if scheme_of(path) not in ("", "file"):
            raise InputError(
                f"output {path!r}: only local output folders are supported so far "
                "(write locally, then copy to object storage)",
                uri=path,
            )
        self.path = Path(path[len("file://") :] if path.startswith("file://") else path)

    # -- the spec -------------------------------------------------------------------------
    @property
    def job_file(self) -> Path:
        return self.path / schema.JOB_FILE

    @property
    def manifest_file(self) -> Path:
        return self.path / schema.MANIFEST_FILE

    @property
    def calibration_file(self) -> Path:
        return self.path / CALIBRATION_FILE

    def read_spec(self) -> JobSpec | None:
        """The frozen spec of the job that owns this folder, or None for a new folder."""
        if not self.job_file.exists():
            return None
        data = json.loads(self.job_file.read_text())
        return JobSpec.from_json(data["spec"])

    def prepare(self, spec: JobSpec, overwrite: bool) -> None:
        """Claim the folder for ``spec``: new, same spec (resume) or ``overwrite`` (start over).

        Raises ``SpecMismatchError`` when the folder holds a different job.
        """
        self.path.mkdir(parents=True, exist_ok=True)
        self._remove_temporaries()
        existing = self.read_spec()
        if overwrite:
            self._clear()
        elif existing is not None and existing != spec:
            diff = _spec_diff(existing, spec)
            raise SpecMismatchError(
                f"{self.path} holds a job with a different spec ({diff}); rerun with the "
                "same options to resume, use --overwrite to start over, or pick another --out"
            )
        if existing is None or overwrite:
            doc = {"pairclean_version": __version__, "spec": spec.to_json()}
            atomic_write_bytes(self.job_file, json.dumps(doc, indent=2).encode())

    def _remove_temporaries(self) -> None:
        for tmp in self.path.glob(f".*{_TMP_MARK}*"):
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def _clear(self) -> None:
        for pattern in ("*.parquet", schema.MANIFEST_FILE, CALIBRATION_FILE, schema.JOB_FILE):
            for item in self.path.glob(pattern):
                item.unlink()

    # -- calibration ----------------------------------------------------------------------
    def read_calibration(self) -> Calibration | None:
        """The frozen calibration, once a run has computed it."""
        if not self.calibration_file.exists():
            return None
        return Calibration(**json.loads(self.calibration_file.read_text()))

    def write_calibration(self, calibration: Calibration) -> None:
        """Freeze the calibration (atomically)."""
        atomic_write_bytes(self.calibration_file, json.dumps(calibration.to_json(), indent=2).encode())

    # -- the manifest ---------------------------------------------------------------------
    def _manifest_records(self) -> Iterator[dict[str, Any]]:
        if not self.manifest_file.exists():
            return
        for line in self.manifest_file.read_text().splitlines():
            # A torn last line (crash mid-append) is skipped.
            with contextlib.suppress(json.JSONDecodeError):
                record = json.loads(line)
                if isinstance(record, dict):
                    yield record

    def manifest(self) -> dict[str, ManifestEntry]:
        """Committed shards by stem (quarantine lines are not commits)."""
        entries: dict[str, ManifestEntry] = {}
        for record in self._manifest_records():
            if record.get("state", "committed") != "committed":
                continue
            with contextlib.suppress(TypeError):
                record.pop("state", None)
                entry = ManifestEntry(**record)
                entries[entry.stem] = entry
        return entries

    def quarantined(self) -> dict[str, dict[str, Any]]:
        """Shards that kept failing, by stem, with their error; a later commit clears one."""
        out: dict[str, dict[str, Any]] = {}
        for record in self._manifest_records():
            stem = record.get("stem")
            if record.get("state") == "quarantined":
                out[stem] = record
            elif stem in out:
                del out[stem]
        return out

    def quarantine(self, shard: str, stem: str, error: str, attempts: int) -> None:
        """Record that ``shard`` failed ``attempts`` times; it stays uncommitted (a rerun retries it)."""
        self._append_line({"state": "quarantined", "shard": shard, "stem": stem, "error": error, "attempts": attempts})

    def commit(self, entry_fields: Mapping[str, Any], tables: Mapping[str, pa.Table]) -> ManifestEntry:
        """Write each ``tables[file_name]`` atomically, then append the manifest line.

        ``entry_fields`` holds the ManifestEntry fields except ``output`` and ``sha256``,
        which are those of the first table (the scores). The time spent writing is added
        to ``timings["write"]``.
        """
        first = next(iter(tables))
        started = time.perf_counter()
        for name, table in tables.items():
            atomic_write_parquet(self.path / name, table)
        fields = dict(entry_fields)
        timings = dict(fields.pop("timings", {}))
        timings["write"] = round(timings.get("write", 0.0) + time.perf_counter() - started, 4)
        entry = ManifestEntry(output=first, sha256=sha256_file(self.path / first), timings=timings, **fields)
        self._append_manifest(entry)
        return entry

    def _append_manifest(self, entry: ManifestEntry) -> None:
        self._append_line(entry.to_json())

    def _append_line(self, record: Mapping[str, Any]) -> None:
        line = json.dumps(record, sort_keys=True) + "\n"
        # A torn tail from an earlier crash must not swallow this line: start on a new one.
        prefix = ""
        if self.manifest_file.exists() and self.manifest_file.stat().st_size > 0:
            with open(self.manifest_file, "rb") as fh:
                fh.seek(-1, os.SEEK_END)
                prefix = "" if fh.read(1) == b"\n" else "\n"
        with open(self.manifest_file, "a", encoding="utf-8") as fh:
            fh.write(prefix + line)
            fh.flush()
            os.fsync(fh.fileno())

    def iter_committed_tables(self) -> Iterator[tuple[ManifestEntry, Path]]:
        """(entry, path of its scores Parquet) for every committed shard, in spec order."""
        spec = self.read_spec()
        entries = self.manifest()
        order = [shard_stem(u) for u in spec.shards] if spec else sorted(entries)
        for stem in order:
            if stem in entries:
                yield entries[stem], self.path / entries[stem].output

    def embeddings_path(self, stem: str) -> Path:
        """Where the embedding sidecar of ``stem`` lives."""
        return self.path / f"{stem}.emb.parquet"


def _spec_diff(old: JobSpec, new: JobSpec) -> str:
    a, b = old.to_json(), new.to_json()
    changed = [k for k in a if a[k] != b.get(k)]
    parts = []
    for key in changed[:4]:
        if key == "shards":
            parts.append(f"shards: {len(a[key])} before, {len(b[key])} now")
        else:
            parts.append(f"{key}: {a[key]!r} before, {b[key]!r} now")
    return "; ".join(parts)


def now_iso() -> str:
    """UTC time stamp for logs (never written into Parquet: outputs stay reproducible)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
