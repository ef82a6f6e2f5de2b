"""Files trainers read beside a job's output, in ``OUT.pairclean/export/`` (``OUT/_export/`` for
folders of the older layout): sizes, per-shard weight sums, DataComp keep list. (Outside
``OUT``, so ``OUT`` reads as exactly the score tables.)

- ``sizes.json``: ``{"<shard file name>": number of samples}`` (all rows, or the kept
  ones), as open_clip's ``get_dataset_size`` reads it, from the folder of the first
  training shard only: ``export`` can put a copy there (never over a file it did not write);
- ``shard_weights.json``: ``{"<shard file name>": sum of weights}``, for resampling
  shards in proportion to their clean content;
- ``datacomp_keep.npy``: the ``uid`` of every kept pair (status ok, not flagged noisy)
  as sorted ``u8,u8`` records (the 128-bit hex uid split in two), which DataComp's
  resharder reads as a subset file. Written only when the shards carry DataComp uids.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from pairclean import schema
from pairclean.errors import InputError, first_line, printable
from pairclean.output.folder import OutputDir, ShardRecord, enclosing_output, is_output
from pairclean.storage import Store, open_regular
from pairclean.uris import LOCAL_SCHEMES, LOCAL_WRITE_ROOTS_ENV, check_local_root, local_path, scheme_of, shard_stem

log = logging.getLogger(__name__)

__all__ = ["UID_DTYPE", "ExportReport", "export", "export_options", "refresh_exports", "uid_records", "write_exports"]

UID_DTYPE = np.dtype("u8,u8")


def uid_records(uids: list[str]) -> np.ndarray:
    """128-bit hex uids -> sorted ``u8,u8`` records (high 64 bits, low 64 bits)."""
    out = np.empty(len(uids), dtype=UID_DTYPE)
    for i, uid in enumerate(uids):
        if len(uid) != 32:
            raise InputError(f"uid {uid!r} is not 32 hex digits (DataComp's format)")
        out[i] = (int(uid[:16], 16), int(uid[16:], 16))
    out.sort()
    return out


@dataclass
class ExportReport:
    """What ``export`` wrote: ``written`` name -> URI (``sizes.json`` copies outside ``OUT``
    under ``"sizes.json -> <folder>"``), ``skipped_uids`` (not DataComp's format, with
    ``skip_bad_uids``) and ``notes`` (one line each: what was not written and why, where
    open_clip looks for ``sizes.json``)."""

    written: dict[str, str] = field(default_factory=dict)
    skipped_uids: int = 0
    notes: list[str] = field(default_factory=list)
    #: Rows of the job, and the kept ones (status ok, not noisy): open_clip's
    #: ``--train-num-samples`` for the kept pairs (mode keep, or shards resharded with the keep file).
    rows: int = 0
    kept: int = 0


def export(
    out: OutputDir,
    *,
    sizes_of: str = "all",
    sizes_dirs: Sequence[str] = (),
    sizes_beside_shards: bool = False,
    skip_bad_uids: bool = False,
) -> ExportReport:
    """Compute every export file, check it, then write them all (none when a check fails).

    Files go to ``OUT.pairclean/export/`` (their names recorded in the job's state folder so
    ``--overwrite`` removes them). ``sizes_of``: ``all`` rows of each shard, or ``kept``
    (status ok and not flagged noisy: the count open_clip should use with mode ``keep``).
    open_clip reads ``sizes.json`` from the folder of the first training shard, so a copy
    can go to ``sizes_dirs`` (local folders the user names) and, with
    ``sizes_beside_shards``, to each local folder holding scored shards; an existing
    ``sizes.json`` there that pairclean did not write is never replaced (``InputError``,
    before anything is written). A kept pair's ``uid`` that is not 32 hex digits is an
    ``InputError`` naming its shard and key, unless ``skip_bad_uids`` (then counted).
    """
    if sizes_of not in ("all", "kept"):
        raise InputError(f"sizes_of must be 'all' or 'kept', not {sizes_of!r}")
    from pairclean.output.lock import RunLock

    if out.read_spec() is None:  # before the lock, which would make OUT.pairclean/ beside a mistyped path
        raise InputError(f"{out.uri} is not a pairclean output folder (no {out.store.url(schema.JOB_FILE)})", uri=out.uri)
    lock = RunLock(out.store)  # a score, rescore or refine rewriting the tables meanwhile is refused
    lock.acquire()
    try:
        out.check_tables_whole()
        return _export_locked(out, sizes_of, sizes_dirs, sizes_beside_shards, skip_bad_uids)
    finally:
        lock.release()


def _check_as_written(out: OutputDir, record: ShardRecord, data: bytes) -> None:
    """``InputError`` where ``data``, ``record``'s table as read, is not what pairclean wrote
    (the record's size and SHA-256): a table edited in place (weights changed with pandas or
    pyarrow, even to the same size) was exported as the job's weights, while a rerun called
    it "not written by pairclean" and left it."""
    if (len(data), hashlib.sha256(data).hexdigest()) != (record.bytes, record.sha256):
        where = out.store.url(record.output)
        raise InputError(f"{schema.changed_since(where, record.bytes, len(data))}; edited or saved again by another tool?): its "
                         "weights are not the job's and are not exported; put back the table pairclean wrote, or move it "
                         "away and score the job again, which scores that shard again", uri=where)


def _export_locked(out: OutputDir, sizes_of: str, sizes_dirs: Sequence[str], sizes_beside_shards: bool,
                   skip_bad_uids: bool, refresh: bool = False) -> ExportReport:
    """The export (``export``'s contract). ``refresh``: the options come from the job's own
    record (``refresh_exports``), not from a command line: copies outside the job are then
    only replaced where one is there, never made anew (a record naming another folder makes
    no file in it)."""
    report = ExportReport()
    sizes: dict[str, int] = {}
    sums: dict[str, float] = {}
    keep: list[str] = []
    # Whether the job carries uids is decided over the whole job: an empty shard (img2dataset
    # writes one when every download failed) has no rows, so it says nothing either way.
    no_uid = 0  # kept pairs without a uid (never in the keep file)
    bad: list[tuple[str, str, str]] = []  # (uid, key, shard) of kept pairs with a non-DataComp uid
    datacomp = False  # whether any row (kept or not) carries a DataComp uid: the job has a keep list, maybe empty
    shard_folders: list[str] = []
    remote_shards = 0
    for record in out.iter_committed():
        # read once: the table's values and its SHA-256 come from the same bytes
        data = out.store.get(record.output, max_bytes=None)
        table = out.read_scores(record, data=data)
        name = PurePosixPath(record.shard).name
        ok = schema.ok_mask(table)
        # A key the shard holds twice names two samples a trainer cannot tell apart: its first
        # (ok) copy is not kept nor weighted either, as WeightStage gives it weight 0.
        twice = _repeated(table)
        clean = ok & ~twice & ~table.column(schema.COL_NOISY).to_numpy(zero_copy_only=False).astype(bool)
        sizes[name] = table.num_rows if sizes_of == "all" else int(clean.sum())
        report.rows += table.num_rows
        report.kept += int(clean.sum())
        # Checked as the trainer's WeightStage checks them: NaN would make the JSON invalid.
        sums[name] = float(schema.checked_weights(table.column(schema.COL_WEIGHT), out.store.url(record.output))[~twice].sum())
        if data is not None:  # (None: gone, which read_scores has said)
            _check_as_written(out, record, data)  # after the checks of what it holds, which say more where they fail
        folder = _shard_folder(record.shard)
        if folder is not None and folder not in shard_folders:
            shard_folders.append(folder)
        remote_shards += folder is None
        if schema.COL_UID not in table.column_names:
            no_uid += int(clean.sum())
            continue
        keys = table.column(schema.COL_KEY).to_pylist()
        uids = table.column(schema.COL_UID).to_pylist()
        datacomp = datacomp or any(u is not None and _is_datacomp_uid(u) for u in uids)
        for uid, key, kept in zip(uids, keys, clean):
            if not kept:
                continue
            if uid is None:
                no_uid += 1
                continue
            if _is_datacomp_uid(uid):
                keep.append(uid)
            else:
                bad.append((uid, key, record.shard))
    if not sizes:
        raise InputError(f"{out.uri} holds no committed shard")
    _note_unscored(out, report)
    keep_file = keep_list(keep, bad, datacomp, skip_bad_uids, report)
    files: dict[str, bytes] = {
        # allow_nan=False: strict JSON parsers reject NaN; a non-finite value is a bug here.
        name: json.dumps(doc, indent=1, sort_keys=True, allow_nan=False).encode()
        for name, doc in (("sizes.json", sizes), ("shard_weights.json", sums))
    }
    if keep_file is not None and no_uid:
        report.notes.append(f"{no_uid} kept pairs have no uid: they are not in datacomp_keep.npy")
    if keep_file is not None:
        buf = io.BytesIO()
        np.save(buf, keep_file)
        files["datacomp_keep.npy"] = buf.getvalue()
    for folder in sizes_dirs:
        if scheme_of(folder) not in LOCAL_SCHEMES:  # was taken as a local path: "cannot write into '/here/s3:/b'"
            raise InputError(f"--sizes-dir {folder}: copies of sizes.json are written to local folders only; copy "
                             f"{out.store.url(schema.EXPORT_DIR)}/sizes.json there yourself")
    if sizes_beside_shards and remote_shards:
        report.notes.append(f"sizes.json is not written beside shards in object storage ({remote_shards} shards): copy "
                            f"{out.store.url(schema.EXPORT_DIR)}/sizes.json to their folder yourself")
    # absolute: the record (and a refresh run from another folder) must name the same files
    copies = list(dict.fromkeys([os.path.abspath(local_path(d)) for d in (*sizes_dirs, *(shard_folders if sizes_beside_shards else []))]))
    if sizes_of == "kept":
        _refuse_kept_beside_shards(copies, shard_folders, report.kept)
    previous = _previous_copies(out)
    if refresh:
        gone = [f for f in copies if not (Path(f) / "sizes.json").exists()]
        report.notes += [f"{f}/sizes.json is not written again: it is not there any more (run pairclean export with "
                         "the folder to make it)" for f in gone]
        copies = [f for f in copies if f not in gone]
    for folder in copies:  # every refusal before the first write
        _refuse_inside_tables(out, folder)
        _check_sizes_target(Path(folder), previous)
    names = [f"{schema.EXPORT_DIR}/{name}" for name in files]
    _refuse_foreign_exports(out, names)
    targets = {str(Path(f) / "sizes.json"): hashlib.sha256(files["sizes.json"]).hexdigest() for f in copies}
    # Record first: a crash after some writes still leaves every written name listed, and a
    # copy outside is recorded with both its old and its new checksum until it is written,
    # so a rerun after a crash between the two still knows the file as its own.
    pending = {path: sorted(set(previous.get(path, [])) | {digest}) for path, digest in targets.items()}
    # The options too: a rewrite of the tables (rescore, refine, audit, more shards) writes
    # the exports again with them (``refresh_exports``).
    options = {"sizes_of": sizes_of, "sizes_dirs": [os.path.abspath(d) for d in sizes_dirs], "sizes_beside_shards": sizes_beside_shards,
               "skip_bad_uids": skip_bad_uids}
    out.store.put(schema.EXPORTS_FILE, json.dumps({"written": names, "outside": {**previous, **pending}, "options": options}).encode())
    for name, data in files.items():
        out.store.put(f"{schema.EXPORT_DIR}/{name}", data)
        report.written[name] = out.store.url(f"{schema.EXPORT_DIR}/{name}")
    for path in targets:
        _atomic_write(Path(path), files["sizes.json"])
        report.written[f"sizes.json -> {Path(path).parent}"] = path
    if targets:
        done = {path: [digest] for path, digest in targets.items()}
        out.store.put(schema.EXPORTS_FILE, json.dumps({"written": names, "outside": {**previous, **done}, "options": options}).encode())
    exports_current(out)
    if not copies:
        where = shard_folders[0] if shard_folders else "the folder of your first training shard"
        report.notes.append(
            f"open_clip reads sizes.json from the folder of the first training shard: copy "
            f"{report.written['sizes.json']} to {where}/ (or pass --sizes-beside-shards / --sizes-dir DIR)"
        )
    return report


def _refuse_foreign_exports(out: OutputDir, names: list[str]) -> None:
    """``InputError`` when a file at one of ``names`` was not written by an export of this job
    (its record lists what it wrote): a user's own ``sizes.json`` put there was replaced."""
    ours = set(out.written_exports())
    for name in names:
        if name not in ours and out.store.exists(name):
            raise InputError(f"{out.store.url(name)} exists and pairclean did not write it: it is left untouched "
                             "(move it away, then export again)", uri=out.store.url(name))


def _repeated(table: pa.Table) -> NDArray[np.bool_]:
    """Rows whose key the shard holds more than once (every copy, the first ok one included)."""
    keys = table.column(schema.COL_KEY).to_pylist()
    twice = schema.repeated_keys(keys, table.column(schema.COL_STATUS).to_pylist())
    assert not isinstance(twice, str)  # read_scores refused such a table already
    return np.fromiter((k in twice for k in keys), dtype=bool, count=len(keys))


def _note_unscored(out: OutputDir, report: ExportReport) -> None:
    """A note naming the job's shards that are in none of the files (failed, or not scored
    yet): open_clip's ``get_dataset_size`` raised a bare ``KeyError`` on the first of them,
    and the kept count described only the scored shards, without a word."""
    spec = out.read_spec()
    committed = out.committed()
    failed = out.quarantined()
    missing = [u for u in (spec.shards if spec is not None else []) if shard_stem(u) not in committed]
    if missing:
        named = ", ".join(printable(PurePosixPath(u).name) for u in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        why = f"{sum(1 for u in missing if shard_stem(u) in failed)} failed scoring, the others are not scored yet"
        report.notes.append(f"{len(missing)} of the job's {len(spec.shards) if spec else 0} shards are in none of these files "
                            f"({why}): {named}; leave them out of the training URLs (open_clip's sizes.json has no entry "
                            "for them) or score them again")


def keep_list(keep: list[str], bad: list[tuple[str, str, str]], datacomp: bool, skip_bad_uids: bool,
              report: ExportReport) -> np.ndarray | None:
    """``datacomp_keep.npy``'s records for the kept DataComp uids ``keep`` (each once, sorted),
    or None where the job has no DataComp uid (a note says so). ``bad``: kept pairs' uids in
    another format (``InputError`` unless ``skip_bad_uids``); ``datacomp``: whether any row,
    kept or not, has a DataComp uid. Such a job gets a keep file even when it keeps no pair
    (an empty one): the older file left in place listed pairs a rescore had flagged noisy."""
    if not (keep or datacomp):
        # No uid is DataComp's (the demo's are names): no keep list, the rest is written.
        example = f" (they have e.g. {bad[0][0]!r})" if bad else ""
        report.notes.append(f"datacomp_keep.npy not written: it needs DataComp uids (32 hex digits in each sample's json "
                            f"'uid'), and these shards have none{example}")
        return None
    if bad and not skip_bad_uids:
        uid, key, shard = bad[0]
        raise InputError(
            f"uid {uid!r} of key {key!r} in shard {shard!r} is not 32 hex digits (DataComp's format; "
            f"{len(bad)} such): pass --skip-bad-uids to leave those pairs out of datacomp_keep.npy"
        )
    report.skipped_uids = len(bad)
    unique = list(dict.fromkeys(keep))
    if len(unique) < len(keep):
        # DataComp's resharder writes a sample once per entry: a pair two shards hold was written twice
        report.notes.append(f"{len(keep) - len(unique)} kept uids appear in more than one row: datacomp_keep.npy "
                            f"lists each once ({len(unique)} uids)")
    return uid_records(unique)


def _refuse_kept_beside_shards(copies: Sequence[str], shard_folders: Sequence[str], kept: int) -> None:
    """Kept counts never go into a folder of scored shards: DataComp's resharder reads
    ``INPUT_DIR/sizes.json`` as the input shards' sample counts (and plans its workers by
    them), and open_clip reads the same file; both need every sample counted there."""
    shard_paths = {os.path.realpath(f) for f in shard_folders}  # a link to the shards' folder is that folder
    clash = [f for f in copies if os.path.realpath(f) in shard_paths]
    if clash:
        raise InputError(
            f"--sizes-of kept would put kept counts into {clash[0]!r}, beside the shards: DataComp's resharder and "
            f"open_clip read sizes.json there as the shards' sample counts. Write all counts there (--sizes-of all) and "
            f"give open_clip --train-num-samples {kept} for the kept pairs (python -m pairclean.open_clip_train "
            f"--pairclean-mode keep sets it itself)"
        )


def export_options(out: OutputDir) -> dict[str, Any] | None:
    """The options the job's last ``export`` ran with (None: never exported, or by a release
    that did not record them)."""
    options = (schema.json_object(out.store.get(schema.EXPORTS_FILE)) or {}).get("options")
    return dict(options) if isinstance(options, dict) else None


def mark_exports_stale(out: OutputDir, why: str) -> bool:
    """Record, before the tables may change, that the job's exports are to be written again
    (``EXPORTS_STALE_FILE``): a run killed after a commit and before its refresh left them
    on the earlier weights with nothing to say so, and no later run repaired them. Returns
    whether an earlier run had left the mark (so this one refreshes whatever it commits).
    Nothing is written for a job never exported."""
    before = out.store.exists(schema.EXPORTS_STALE_FILE)
    if not before and export_options(out) is not None:
        out.store.put(schema.EXPORTS_STALE_FILE, json.dumps({"why": why, "at": time.time()}).encode())
    return before


def exports_current(out: OutputDir) -> None:
    """The exports match the tables again (``mark_exports_stale``'s mark removed)."""
    out.store.rm(schema.EXPORTS_STALE_FILE)


def refresh_exports(out: OutputDir) -> tuple[ExportReport | None, str | None]:
    """Write the job's exports again with the options they were written with, after its
    tables changed (trainers read them without asking, so stale ones would train on the
    earlier weights). The caller holds the folder's ``RunLock``: the verbs that rewrite the
    tables (score, rescore, refine, audit) call it before they let go of the folder.

    Returns (the report, None); (None, None) where the job has no exports to refresh; or
    (None, why they could not be: an ``InputError``'s message, e.g. a ``sizes.json`` copy
    someone else has replaced since), logged as a warning that names the command to run."""
    options = export_options(out)
    if options is None:
        exports_current(out)
        return None, None
    mark_exports_stale(out, "refresh")  # a refresh killed midway is done again by the next run
    try:
        report = _export_locked(out, str(options.get("sizes_of", "all")), [str(d) for d in options.get("sizes_dirs", [])],
                                bool(options.get("sizes_beside_shards")), bool(options.get("skip_bad_uids")), refresh=True)
    except Exception as exc:  # noqa: BLE001 - the tables are rewritten already; a failed refresh must not fail the verb
        why = str(exc) if isinstance(exc, InputError) else f"{type(exc).__name__}: {exc}"
        log.warning("the exports of %s still hold the earlier weights: %s; run `pairclean export %s` once that is settled",
                    out.uri, why, out.uri)
        return None, why
    log.info("the exports of %s were written again with the new weights (%s)", out.uri, ", ".join(report.written))
    return report, None


def write_exports(out: OutputDir, **options: object) -> dict[str, str]:
    """``export(out, **options).written``: name -> URI of every file written."""
    return export(out, **options).written  # type: ignore[arg-type]


def _shard_folder(uri: str) -> str | None:
    """The folder of a local shard (plain path or file://); None for remote ones."""
    try:
        if scheme_of(uri) not in LOCAL_SCHEMES:
            return None
    except InputError:
        return None
    return os.path.dirname(os.path.abspath(local_path(uri)))


def _previous_copies(out: OutputDir) -> dict[str, list[str]]:
    """The sizes.json copies outside the job an earlier export wrote: path -> the checksums
    it may hold (one; two while a write was under way). Older records hold one string."""
    raw = out.store.get(schema.EXPORTS_FILE)
    if raw is None:
        return {}
    try:
        items = dict(json.loads(raw).get("outside", {})).items()
        return {str(k): [str(d) for d in v] if isinstance(v, list) else [str(v)] for k, v in items}
    except (ValueError, AttributeError, TypeError):
        return {}


#: Read at most this much of a sizes.json found where a copy goes (ours are a few MiB at most).
MAX_SIZES_BYTES = 64 * 2**20


def _refuse_inside_tables(out: OutputDir, folder: str) -> None:
    """``InputError`` for a sizes.json copy into the tables' own folder or below it: OUT holds
    the tables and nothing else, and with a sizes.json in it pyarrow, pandas and polars no
    longer read OUT as one dataset (each rewrite of the tables wrote it there again)."""
    if not out.store.local:
        return
    tables = os.path.realpath(out.store.path())
    where = os.path.realpath(folder)
    if where == tables or where.startswith(tables.rstrip(os.sep) + os.sep):
        raise InputError(f"--sizes-dir {folder}: inside the output folder {out.uri}, which holds the tables and nothing "
                         "else (a sizes.json there breaks reading it as one dataset); give another folder, e.g. the shards'")
    # ... nor any other job's (another job's OUT then failed in pyarrow and pandas)
    other = where if is_output(os.path.exists, where) else enclosing_output(Store(where))
    if other is not None and os.path.realpath(other) != tables:
        raise InputError(f"--sizes-dir {folder}: inside another pairclean job's output folder ({other}), which holds "
                         "its tables and nothing else; give another folder, e.g. the shards'")


def _check_sizes_target(folder: Path, previous: dict[str, list[str]]) -> None:
    # A job process the service started writes only its own folders (``uris.LOCAL_WRITE_ROOTS_ENV``):
    # copies recorded by an earlier export elsewhere are refused (a refresh warns and goes on).
    check_local_root(str(folder / "sizes.json"), LOCAL_WRITE_ROOTS_ENV, "sizes.json copy")
    if not folder.is_dir():
        raise InputError(f"cannot write sizes.json into {str(folder)!r}: not a local folder")
    target = folder / "sizes.json"
    if target.exists() or target.is_symlink():
        try:  # a regular file only: a FIFO there hung the export, holding the job's lock
            with open_regular(target) as fh:
                digest = hashlib.sha256(fh.read(MAX_SIZES_BYTES + 1)).hexdigest()
        except OSError as exc:
            raise InputError(f"{str(target)!r} exists and cannot be read as a file ({first_line(exc)}): not replaced "
                             "(move it away)") from None
        if digest not in previous.get(str(target), []):
            raise InputError(
                f"{str(target)!r} exists and pairclean did not write it: not replaced (move it away, "
                "or copy the job's export/sizes.json there yourself)"
            )


def _atomic_write(path: Path, data: bytes) -> None:
    from pairclean.storage import write_file_atomic

    # An unpredictable temporary in the folder opened, which is checked against a job
    # process's write roots (a fixed name could be a link planted beside the copy)
    write_file_atomic(path, data, check_folder=lambda folder, fd: check_local_root(
        folder, LOCAL_WRITE_ROOTS_ENV, "sizes.json copy", fh=fd))


#: Exactly 32 hex digits: ``int(uid, 16)`` alone also takes a sign and underscores
#: ("-" + 31 digits overflowed uint64; "0123_..." became another pair than the resharder's).
_DATACOMP_UID = re.compile(r"[0-9a-fA-F]{32}")


def _is_datacomp_uid(uid: str) -> bool:
    return _DATACOMP_UID.fullmatch(uid) is not None
