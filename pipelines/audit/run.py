"""``audit`` on a job's output folder: draw the queue, read labels, estimate, recalibrate.

- ``population(out)``: the job's ok pairs (shard, key, row, similarity, flag, model
  ``p_clean``) from its committed score tables (a few columns each, nothing decoded).
- ``make_queue(out, n, seed)``: a stratified sample (``design.draw_design``), saved with
  its design in ``OUT.pairclean/state/audit/design.json`` so the estimate can use its strata
  and inclusion probabilities; the queue itself is returned (the CLI writes it as CSV).
- ``read_labels(path)``: a labels file (``key,label`` [``,shard,who,labelled_at``]), CSV
  or Parquet, bounded and checked line by line.
- ``audit_report(design_doc, labels, ...)``: every figure (``stats``) as one JSON document.
- ``apply_recalibration(out, knots, doc)``: the recalibrated ``p_clean`` written into every
  score table (the model's value kept as ``p_clean_model``), shard by shard, atomically
  (``OutputDir.write_table``) and resumably: each rewritten shard gets a record
  ``_pairclean/audit/applied/<map sha12>/<stem>.json`` as refine does, and the job's
  completion records get the new sha256 at the end. Nothing is re-embedded.

``p_clean_model`` is what the sample is stratified on and what the map is fitted on, so a
second audit of a recalibrated job starts from the model's values, never from a previous map.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa
from pairclean import schema
from pairclean.errors import InputError
from pairclean.output.folder import OutputDir, ShardRecord
from pairclean.output.exports import exports_current, refresh_exports
from pairclean.output.lock import RunLock

from . import stats
from .design import EDGES, draw_design

__all__ = [
    "AUDIT_DIR",
    "check_design_current",
    "coverage_warning",
    "COL_P_CLEAN_MODEL",
    "DESIGN_FILE",
    "EDGES",
    "LABELS",
    "MAX_LABEL_BYTES",
    "MAX_LABEL_ROWS",
    "REPORT_FILE",
    "Label",
    "Population",
    "apply_recalibration",
    "audit_report",
    "csv_bytes",
    "format_report",
    "make_queue",
    "parse_labels",
    "population",
    "queue_csv",
    "queue_rows",
    "read_design",
    "read_labels",
    "recalibrated_table",
]

#: The model's own ``p_clean``, kept beside the recalibrated one.
COL_P_CLEAN_MODEL = schema.COL_P_CLEAN_MODEL
COL_NOISY_MODEL = schema.COL_NOISY_MODEL
LABELS = ("clean", "noisy", "unsure")
AUDIT_DIR = schema.AUDIT_DIR
DESIGN_FILE = schema.AUDIT_DESIGN_FILE
APPLIED_DIR = schema.AUDIT_APPLIED_DIR
REPORT_FILE = schema.AUDIT_REPORT_FILE
#: A labels file is read up to this many bytes and rows (a few hundred labels is the use).
MAX_LABEL_BYTES = 64 * 2**20
MAX_LABEL_ROWS = 1_000_000
QUEUE_COLUMNS = ("key", "shard", "similarity", "p_clean", "stratum", "inclusion_probability", "label")


@dataclass(frozen=True)
class Population:
    """The ok pairs of a job, in shard order: parallel arrays."""

    stems: list[str]
    shards: list[str]
    keys: list[str]
    rows: np.ndarray
    similarity: np.ndarray
    noisy: np.ndarray
    p_model: np.ndarray
    truncated: bool = False

    def __len__(self) -> int:
        return len(self.keys)


def _model_column(names: Sequence[str]) -> str:
    return COL_P_CLEAN_MODEL if COL_P_CLEAN_MODEL in names else schema.COL_P_CLEAN


def _flag_column(names: Sequence[str]) -> str:
    """The model's ``noisy`` (an audit of a ``p-clean`` job keeps it as ``noisy_model``)."""
    return COL_NOISY_MODEL if COL_NOISY_MODEL in names else schema.COL_NOISY


def population(out: OutputDir, max_rows: int | None = None, records: list[ShardRecord] | None = None) -> Population:
    """The job's ok pairs (all committed shards, or ``records``; at most ``max_rows`` score
    rows read, in shard order: ``truncated`` says when it stopped early)."""
    records = list(out.iter_committed()) if records is None else records
    if not records:
        raise InputError(f"{out.uri} holds no committed shard: score it first", uri=out.uri)
    stems, shards, keys, rows, sims, flags, ps = [], [], [], [], [], [], []
    seen = 0
    truncated = False
    for record in records:
        if max_rows is not None and seen >= max_rows:
            truncated = True
            break
        table = out.read_scores(record)
        cols = [schema.COL_KEY, schema.COL_SHARD, schema.COL_STATUS, schema.COL_SIMILARITY, _flag_column(table.column_names),
                _model_column(table.column_names)]
        table = table.select(cols)
        seen += table.num_rows
        ok = np.asarray(table.column(schema.COL_STATUS).to_pylist(), dtype=object) == schema.STATUS_OK
        idx = np.flatnonzero(ok)
        if not len(idx):
            continue
        key_col = table.column(schema.COL_KEY).to_pylist()
        shard_col = table.column(schema.COL_SHARD).to_pylist()
        stems += [record.stem] * len(idx)
        shards += [shard_col[i] for i in idx]
        keys += [key_col[i] for i in idx]
        rows.append(idx)
        sims.append(table.column(schema.COL_SIMILARITY).to_numpy(zero_copy_only=False)[idx].astype(np.float64))
        flags.append(table.column(_flag_column(table.column_names)).to_numpy(zero_copy_only=False)[idx].astype(bool))
        ps.append(table.column(cols[-1]).to_numpy(zero_copy_only=False)[idx].astype(np.float64))
    if not keys:
        raise InputError(f"{out.uri} has no ok pair to audit", uri=out.uri)
    return Population(stems, shards, keys, np.concatenate(rows), np.concatenate(sims), np.concatenate(flags), np.concatenate(ps),
                      truncated)


def queue_rows(pop: Population, n: int, seed: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the design document, the queue as rows in labelling order) for ``n`` pairs of ``pop``."""
    design = draw_design(pop.p_model, n, seed)
    queue = []
    for i, row in enumerate(design.rows):
        r = int(row)
        queue.append({"position": i, "key": pop.keys[r], "shard": pop.shards[r], "stem": pop.stems[r], "row": int(pop.rows[r]),
                      "similarity": round(float(pop.similarity[r]), 6), "p_clean": round(float(pop.p_model[r]), 6),
                      "noisy": bool(pop.noisy[r]), "stratum": int(design.strata[i]),
                      "inclusion_probability": round(float(design.inclusion[i]), 9)})
    doc = design.to_json() | {"flagged_share": round(float(pop.noisy.mean()), 6), "truncated": pop.truncated,
                              "score_column": "p_clean (the model's: p_clean_model once recalibrated)"}
    return doc, queue


def make_queue(out: OutputDir, n: int, seed: int, resample: bool = False) -> list[dict[str, Any]]:
    """Draw the queue and save it with its design (``DESIGN_FILE``); returns the queue.

    A job holds one audit sample: labels count only for its pairs. Drawing a different one
    (another size or seed) over it is refused unless ``resample`` (``InputError``); the same
    draw again just writes the same queue."""
    if n < 1:
        raise InputError("--sample must be at least 1")
    out.check_owned()
    out.check_tables_whole()  # strata drawn from half-rewritten tables would mix two weightings
    if out.read_spec() is None:
        raise InputError(f"{out.uri} is not a pairclean output folder (no {out.store.url(schema.JOB_FILE)})", uri=out.uri)
    doc, queue = queue_rows(population(out), n, seed)
    earlier = out.store.get(DESIGN_FILE)
    if earlier is not None and not resample:
        before = read_design(out)  # one line where the saved sample is damaged (--resample replaces it)
        pairs, drawn = [(r["shard"], r["key"]) for r in before["queue"]], [(r["shard"], r["key"]) for r in queue]
        if pairs != drawn and sorted(pairs) == sorted(drawn):
            return list(before["queue"])  # the same pairs, queued in an earlier release's order: kept as they are
        if pairs != drawn:
            raise InputError(f"{out.uri} already has an audit sample of {len(before['queue'])} pairs (seed {before['design'].get('seed')}); "
                             "labels made for it count only for its pairs: label that queue (--sample with the same size and "
                             "seed writes it again), or pass --resample to replace it", uri=out.uri)
    doc["shards_committed"] = len(out.committed())  # what the sample is of: a rerun may commit more (coverage_warning)
    out.store.put(DESIGN_FILE, json.dumps({"design": doc, "queue": queue}, indent=1).encode())
    return queue


def coverage_warning(design: dict[str, Any], shards_now: int, out_uri: str, why: str) -> str | None:
    """What an audit sample does not cover: shards committed after it was drawn (``why``: how,
    "a rerun" or "a retry"), or None. Its labels, figures and recalibration map describe the
    pairs of the shards committed when it was drawn only; a sample saved by an earlier
    release, which did not record that, gives None."""
    then = design.get("shards_committed")
    if not isinstance(then, int) or then == shards_now:
        return None
    return (f"the audit queue was drawn when {then} shards were committed; {shards_now} are now ({why}): the figures "
            f"describe the pairs of those {then} only. To audit every shard, draw a sample of the whole job with "
            f"`pairclean audit {out_uri} --sample N --resample --out queue.csv` (labels carry over by key)")


def read_design(out: OutputDir) -> dict[str, Any]:
    """The saved design and queue; ``InputError`` when the job has none, or when the file is
    not such a document (an empty, truncated or foreign design.json gave a JSONDecodeError,
    TypeError or KeyError traceback)."""
    data = out.store.get(DESIGN_FILE)
    if data is None:
        raise InputError(f"{out.uri} has no audit sample yet: run `pairclean audit {out.uri} --sample N --out queue.csv`, "
                         "label the pairs, then pass the file with --labels", uri=out.uri)
    where = out.store.url(DESIGN_FILE)
    try:
        doc = json.loads(data)
        queue, design = doc["queue"], doc["design"]
        ok = isinstance(design, dict) and isinstance(queue, list) and all(
            isinstance(q, dict) and {"key", "shard", "stem", "p_clean", "stratum"} <= set(q) for q in queue)
    except (ValueError, TypeError, KeyError):
        ok = False
    if not ok:
        raise InputError(f"{where} is not an audit sample pairclean wrote (damaged?): draw it again with "
                         f"`pairclean audit {out.uri} --sample N --resample --out queue.csv`", uri=where)
    return doc  # type: ignore[no-any-return]


def check_design_current(out: OutputDir, doc: dict[str, Any]) -> None:
    """``InputError`` where the queued pairs' model ``p_clean`` in today's tables is not what
    the sample was drawn from: a ``rescore`` or ``refine`` since rewrote it, and a map fitted
    on the queue's values would be applied to other ones (it was, silently: 0.036 in the
    queue, 0.398 in the refined table). Reads only the tables of the queue's shards. An
    audit's own recalibration keeps the model's value (``p_clean_model``), so it passes."""
    queue = doc["queue"]
    committed = out.committed()
    records = [committed[s] for s in sorted({str(q["stem"]) for q in queue}) if s in committed]
    if not records:
        return
    pop = population(out, records=records)
    now = {(stem, key): p for stem, key, p in zip(pop.stems, pop.keys, pop.p_model)}
    for q in queue:
        p = now.get((str(q["stem"]), str(q["key"])))
        if p is not None and abs(float(p) - float(q["p_clean"])) > 1e-5:
            raise InputError(
                f"{out.uri}: the audit sample was drawn from tables rewritten since (pair {q['key']!r}: p_clean "
                f"{float(q['p_clean']):.3f} when drawn, {float(p):.3f} now; a rescore or refine?): draw it again with "
                f"`pairclean audit {out.uri} --sample N --resample --out queue.csv` (labels count by key)", uri=out.uri)


def queue_csv(queue: list[dict[str, Any]]) -> bytes:
    """The queue as the CSV a person fills in (an empty ``label`` column)."""
    return csv_bytes([item | {"label": ""} for item in queue], QUEUE_COLUMNS)


#: A text cell starting with one of these is a formula to a spreadsheet (``=HYPERLINK(...)``
#: as a key would run when the labeller opens the queue); the quote is the escape itself.
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r", "'")


def _escaped(value: Any) -> Any:
    """A text cell with a leading ``'`` where a spreadsheet would read a formula: at its
    start, or after leading spaces (some spreadsheets trim them on import)."""
    if isinstance(value, str) and (value.startswith(_FORMULA_START) or value.lstrip().startswith(("=", "+", "-", "@"))):
        return "'" + value
    return value


def csv_bytes(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> bytes:
    """``rows`` as CSV for people and spreadsheets, read back by ``read_labels``.

    RFC 4180 line ends (CRLF), so a key holding a bare CR is quoted, not split over two
    lines; every text cell is quoted, so a spreadsheet that splits on ``;`` (Excel in
    German, French, Spanish... locales) keeps ``x;=1+1;`` one cell instead of running its
    middle as a formula; a text cell that would start a formula (``_escaped``) gets a
    leading ``'``, which ``parse_labels`` takes off again. Numbers are written as they are.
    """
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(columns), extrasaction="ignore", lineterminator="\r\n",
                            quoting=csv.QUOTE_NONNUMERIC)
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _escaped(v) for k, v in row.items()})
    return buf.getvalue().encode()


def _cell(value: Any) -> str:
    """A text cell of a labels file as ``csv_bytes`` wrote it, unescaped (one leading ``'`` off)."""
    text = str(value or "")
    return text[1:] if text.startswith("'") else text


# -- labels ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Label:
    """One label as given: the pair (``key``, optionally its ``shard``), the label, who gave it, when."""

    key: str
    label: str
    shard: str | None = None
    who: str = ""
    labelled_at: str = ""


def parse_labels(rows: Sequence[dict[str, Any]], where: str = "labels", escaped: bool = True) -> list[Label]:
    """Check and convert label rows: ``key`` and ``label`` required, ``label`` one of
    ``LABELS`` (case and spaces ignored); rows with an empty label are skipped (an unfilled
    queue row). ``InputError`` names the first bad line. ``escaped``: text cells as
    ``csv_bytes`` writes them (one leading ``'`` taken off); a Parquet file's are as they are.
    Keys keep their spaces (``_key_candidates``)."""
    out = []
    for line, row in enumerate(rows, start=2):
        key = _cell(row.get("key")) if escaped else str(row.get("key") or "")
        label = str(row.get("label") or "").strip().lower()
        if not label:
            continue
        if not key.strip():
            raise InputError(f"{where}, line {line}: no key")
        if label not in LABELS:
            raise InputError(f"{where}, line {line}: label must be one of {', '.join(LABELS)}")
        shard = _cell(row.get("shard")).strip() or None
        out.append(Label(key, label, shard, str(row.get("who") or "").strip(), str(row.get("labelled_at") or "").strip()))
    return out


def read_labels(path: str, storage_options: dict[str, Any] | None = None) -> list[Label]:
    """A labels file, CSV (``.csv``) or Parquet (``.parquet``), at most ``MAX_LABEL_BYTES``
    and ``MAX_LABEL_ROWS`` rows."""
    import fsspec

    try:
        with fsspec.open(path, "rb", **(storage_options or {})) as fh:
            data = fh.read(MAX_LABEL_BYTES + 1)
    except (FileNotFoundError, OSError) as exc:
        raise InputError(f"--labels {path}: {exc.strerror or exc}") from exc
    if len(data) > MAX_LABEL_BYTES:
        raise InputError(f"--labels {path} is over {MAX_LABEL_BYTES >> 20} MiB; a few hundred labels is what an audit needs")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            # rows counted from the footer before any is decoded: 317 kB of Parquet held 50M
            # rows and took 1.7 GB before the row limit below was reached
            parquet = pq.ParquetFile(io.BytesIO(data))
            if parquet.metadata.num_rows > MAX_LABEL_ROWS:
                raise InputError(f"--labels {path} has more than {MAX_LABEL_ROWS:,} rows")
            rows: list[dict[str, Any]] = _parquet_label_rows(parquet, path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise InputError(f"--labels {path} is not a readable Parquet file") from exc
        escaped = False  # the service's Parquet export writes keys as they are
    else:
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise InputError(f"--labels {path} is not UTF-8 text") from exc
        reader = csv.DictReader(io.StringIO(text))
        if reader.fieldnames is None or not {"key", "label"} <= {f.strip() for f in reader.fieldnames}:
            raise InputError(f"--labels {path} needs a header with the columns key and label")
        reader.fieldnames = [f.strip() for f in reader.fieldnames]
        escaped = True
        try:
            rows = [r for _, r in zip(range(MAX_LABEL_ROWS + 1), reader)]
        except csv.Error as exc:
            raise InputError(f"--labels {path}: {exc}") from exc
    if len(rows) > MAX_LABEL_ROWS:
        raise InputError(f"--labels {path} has more than {MAX_LABEL_ROWS:,} rows")
    return parse_labels(rows, f"--labels {path}", escaped)


def _parquet_label_rows(parquet: Any, path: str) -> list[dict[str, Any]]:
    """The label columns' rows of a Parquet labels file, decoded batch by batch and at most
    ``MAX_LABEL_BYTES`` of them (``InputError`` past it): a 783-byte file of one 1,500-character
    key repeated a million times (dictionary-encoded) took 1.6 GB decoded whole."""
    meta = parquet.metadata
    if sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)) > 4 * MAX_LABEL_BYTES:
        raise InputError(f"--labels {path} holds over {4 * MAX_LABEL_BYTES >> 20} MiB once uncompressed; "
                         "a few hundred labels is what an audit needs")
    columns = [c for c in ("key", "label", "shard", "who", "labelled_at") if c in parquet.schema_arrow.names]
    rows: list[dict[str, Any]] = []
    decoded = 0
    for batch in parquet.iter_batches(batch_size=8192, columns=columns):
        got = batch.to_pylist()  # 8,192 rows: bounded by the uncompressed size checked above
        decoded += sum(len(v) for row in got for v in row.values() if isinstance(v, (str, bytes)))
        if decoded > MAX_LABEL_BYTES:
            raise InputError(f"--labels {path} holds over {MAX_LABEL_BYTES >> 20} MiB of text once decoded; "
                             "a few hundred labels is what an audit needs")
        rows.extend(got)
    return rows


# -- the report -----------------------------------------------------------------------------

@dataclass
class _Units:
    """The labelled units of the queue: position in the queue, resolution, counts."""

    positions: np.ndarray
    noisy: np.ndarray
    conflict: np.ndarray
    unsure_only: list[int]
    repeats_first: list[str]
    repeats_again: list[str]
    outside: int
    ambiguous: int
    rows: int
    counts: dict[str, int]
    duplicates: int = 0


def _key_candidates(key: str) -> list[str]:
    """The keys a label's ``key`` may mean, in order: as read (a key may begin or end with
    spaces or tabs), then with surrounding spaces taken off (typed by hand), then without
    the leading ``'`` of the queue CSV's formula escape (a Parquet file made from that CSV
    keeps it). Stripping first lost the labels of real keys that had spaces."""
    return list(dict.fromkeys(k for k in (key, key.strip(), _cell(key), _cell(key.strip())) if k))


def _basename(uri: str) -> str:
    return uri.rstrip("/").rsplit("/", 1)[-1]


def _match(queue: list[dict[str, Any]], labels: list[Label]) -> _Units:
    by_key: dict[str, list[int]] = {}
    by_pair: dict[tuple[str, str], int] = {}
    shards_named: dict[str, set[str]] = {}
    for item in queue:
        shards_named.setdefault(_basename(item["shard"]), set()).add(item["shard"])
    for i, item in enumerate(queue):
        by_key.setdefault(item["key"], []).append(i)
        by_pair[(item["shard"], item["key"])] = i
        by_pair[(item["stem"], item["key"])] = i
        if len(shards_named[_basename(item["shard"])]) == 1:  # a shard column of file names, where they are unique
            by_pair[(_basename(item["shard"]), item["key"])] = i
    given: dict[int, list[Label]] = {}
    seen: set[tuple[int, str, str, str]] = set()
    outside = ambiguous = duplicates = 0
    for lab in labels:
        pos = None
        for key in _key_candidates(lab.key):
            if lab.shard is not None:
                pos = by_pair.get((lab.shard, key))
            else:
                hits = by_key.get(key, [])
                if len(hits) > 1:
                    pos = -1
                    break
                pos = hits[0] if hits else None
            if pos is not None:
                break
        if pos == -1:
            ambiguous += 1
            continue
        if pos is None:
            outside += 1
            continue
        # the same row twice (a file pasted twice, two exports joined) is one label, not a
        # blind repeat that agrees with itself: the service's repeats differ in their time
        if (pos, lab.who, lab.label, lab.labelled_at) in seen:
            duplicates += 1
            continue
        seen.add((pos, lab.who, lab.label, lab.labelled_at))
        given.setdefault(pos, []).append(lab)
    positions, noisy, conflict, unsure_only = [], [], [], []
    first, again = [], []
    counts = {name: 0 for name in LABELS}
    for pos in sorted(given):
        labs = given[pos]
        for lab in labs:
            counts[lab.label] += 1
        decisive = {lab.label for lab in labs if lab.label != "unsure"}
        # blind repeats: the same labeller's first and second label of one pair
        by_who: dict[str, list[Label]] = {}
        for lab in sorted(labs, key=lambda lab: lab.labelled_at):  # stable: file order where times tie
            by_who.setdefault(lab.who, []).append(lab)
        for own in by_who.values():
            if len(own) >= 2:
                first.append(own[0].label)
                again.append(own[1].label)
        if not decisive:
            unsure_only.append(pos)
            continue
        positions.append(pos)
        noisy.append(1.0 if "noisy" in decisive else 0.0)
        conflict.append(len(decisive) > 1)
    return _Units(np.asarray(positions, dtype=np.int64), np.asarray(noisy), np.asarray(conflict, dtype=bool), unsure_only,
                  first, again, outside, ambiguous, len(labels), counts, duplicates)


def _weights(sizes: np.ndarray, strata: np.ndarray) -> np.ndarray:
    m = np.bincount(strata, minlength=len(sizes)).astype(np.float64)
    weights: np.ndarray = np.asarray(sizes, dtype=np.float64)[strata] / np.maximum(m[strata], 1)
    return weights


def audit_report(design_doc: dict[str, Any], labels: list[Label], threshold: float | None = None,
                 target: tuple[str, float] | None = None) -> dict[str, Any]:
    """Every figure of an audit as one JSON-ready document (see ``stats``)."""
    design, queue = design_doc["design"], design_doc["queue"]
    sizes = np.asarray(design["sizes"], dtype=np.int64)
    drawn = np.asarray(design["drawn"], dtype=np.int64)
    units = _match(queue, labels)
    strata = np.asarray([queue[p]["stratum"] for p in units.positions], dtype=np.int64)
    p_model = np.asarray([queue[p]["p_clean"] for p in units.positions], dtype=np.float64)
    flagged = np.asarray([queue[p]["noisy"] for p in units.positions], dtype=bool)
    # Pairs whose labels disagree say nothing on their own: they widen the intervals (both
    # resolutions) but do not count towards the minimum (all-conflicting labels fitted a map
    # of 0.5 for every pair, erasing the model's ranking).
    needed = stats.labels_needed(drawn, strata[~units.conflict], population=int(sizes.sum()))
    report: dict[str, Any] = {
        "labels": {"rows": units.rows, **units.counts, "pairs_labelled": int(len(units.positions) + len(units.unsure_only)),
                   "decisive_pairs": len(units.positions), "agreed_pairs": int((~units.conflict).sum()),
                   "unsure_pairs": len(units.unsure_only), "duplicate_rows": units.duplicates,
                   "conflicting_pairs": int(units.conflict.sum()), "outside_sample": units.outside,
                   "ambiguous_keys": units.ambiguous},
        "design": design,
        "self_agreement": stats.self_agreement(units.repeats_first, units.repeats_again),
        "labels_needed": needed,
        "status": "ok" if needed == 0 else "too_few_labels",
        # pairs of the queue nobody has labelled yet: when fewer than needed, draw a larger sample
        "queue_left": len(queue) - int(len(units.positions) + len(units.unsure_only)),
        # how many of the next unlabelled pairs, in queue order, give the estimate (None: not all of them)
        "queue_next": _next_needed(queue, drawn, strata[~units.conflict], {*units.positions.tolist(), *units.unsure_only},
                                   int(sizes.sum())) if needed else 0,
    }
    if needed:
        return report
    conflict = units.conflict
    rate = stats.noise_rate(sizes, strata, units.noisy, conflict)
    report["noise_rate"] = rate.to_json()
    report["model_flagged_share"] = design.get("flagged_share")
    if units.unsure_only:
        # what the unsure pairs could move: all of them noisy, or all clean (reported, not counted)
        u_strata = np.asarray([queue[p]["stratum"] for p in units.unsure_only], dtype=np.int64)
        all_strata = np.concatenate([strata, u_strata])
        report["noise_rate_if_unsure"] = {
            "noisy": stats.noise_rate(sizes, all_strata, np.concatenate([units.noisy, np.ones(len(u_strata))]),
                                      np.concatenate([conflict, np.zeros(len(u_strata), bool)])).to_json(),
            "clean": stats.noise_rate(sizes, all_strata, np.concatenate([units.noisy, np.zeros(len(u_strata))]),
                                      np.concatenate([conflict, np.zeros(len(u_strata), bool)])).to_json()}
    report["noisy_flag"] = {k: v.to_json() if v else None
                            for k, v in stats.flag_quality(sizes, strata, units.noisy, flagged, conflict).items()}
    if threshold is not None:
        q = stats.flag_quality(sizes, strata, units.noisy, p_model < threshold, conflict)
        report["threshold"] = {"threshold": threshold, "rule": "noisy when p_clean (the model's) < threshold",
                               **{k: v.to_json() if v else None for k, v in q.items()}}
    if target is not None:
        metric, value = target
        found = stats.threshold_for(sizes, strata, units.noisy, p_model, metric, value, conflict)
        report["target"] = {"metric": metric, "value": value, "reached": found is not None, **(found or {})}
    weight = _weights(sizes, strata)
    clean = np.where(conflict, 0.5, 1.0 - units.noisy)
    report["reliability"] = stats.reliability(p_model, clean, weight)
    report["ece_model"] = round(stats.ece(p_model, clean, weight), 6)
    try:
        knots = stats.fit_recalibration(p_model, clean, weight)
    except ImportError:  # a service-only install has no scikit-learn: the CLI fits the map
        knots = None
    if knots is not None:
        p_new = stats.apply_recalibration(knots, p_model)
        report["recalibration"] = {**knots, "labels": len(p_model), "method": "mean of centred isotonic regression and Platt scaling on logit(p_clean), design-weighted",
                                   "sha256": hashlib.sha256(json.dumps(knots, sort_keys=True).encode()).hexdigest()}
        report["reliability_recalibrated"] = stats.reliability(p_new, clean, weight)
        # in-sample: an optimistic figure (the benchmark measures it on all pairs)
        report["ece_recalibrated_in_sample"] = round(stats.ece(p_new, clean, weight), 6)
    return report


def _next_needed(queue: list[dict[str, Any]], drawn: np.ndarray, agreed: np.ndarray, labelled: set[int],
                 population: int) -> int | None:
    """How many of the queue's unlabelled pairs, taken in queue order and each labelled one
    way, bring ``stats.labels_needed`` to 0 (None where the whole queue does not)."""
    counts = np.bincount(agreed, minlength=len(drawn)).astype(np.int64)
    for taken, pos in enumerate((p for p in range(len(queue)) if p not in labelled), start=1):
        counts[int(queue[pos]["stratum"])] += 1
        if stats.labels_needed(drawn, np.repeat(np.arange(len(drawn)), counts), population=population) == 0:
            return taken
    return None


def format_report(report: dict[str, Any]) -> str:
    """The report as the CLI prints it."""
    lab = report["labels"]
    lines = [f"labels: {lab['rows']} rows; on {lab['pairs_labelled']} pairs of the audit sample {lab['clean']} clean, "
             f"{lab['noisy']} noisy, {lab['unsure']} unsure; {lab['conflicting_pairs']} pairs with conflicting labels (they "
             f"widen the intervals and do not count towards the minimum), {lab['unsure_pairs']} only unsure (reported, not "
             f"counted)" + (f"; {lab['duplicate_rows']} repeated rows counted once" if lab.get("duplicate_rows") else "")]
    if lab["outside_sample"] or lab["ambiguous_keys"]:
        lines.append(f"ignored: {lab['outside_sample']} labels of pairs outside the audit sample, "
                     f"{lab['ambiguous_keys']} with a key found in several shards (add a shard column)")
        if lab["outside_sample"] and not lab["pairs_labelled"]:
            # every key missed: the file's keys were changed, not a few pairs mislabelled
            lines.append("no label's key is in the audit sample: check the key column against queue.csv (a spreadsheet "
                         "may have read keys as numbers and dropped their leading zeros; import the column as text)")
    agree = report["self_agreement"]
    if agree["repeats"]:
        lines.append(f"self-agreement on {agree['repeats']} blind repeats: {100 * agree['agreement']:.1f}% "
                     f"[{100 * agree['lower']:.1f}, {100 * agree['upper']:.1f}], kappa {agree['kappa']}")
    if report["status"] != "ok":
        left, upto = report["queue_left"], report.get("queue_next")
        more = (f"the next {upto} in the queue give it" if upto is not None else
                f"only {left} are left in the queue: draw a larger sample with --sample; labels carry over to the pairs it draws again")
        lines.append(f"too few labels for an estimate: label {report['labels_needed']} more pairs ({more})")
        return "\n".join(lines)

    def pct(iv: dict[str, float] | None) -> str:
        if iv is None:
            return "n/a"
        return f"{100 * iv['estimate']:.1f}% [{100 * iv['lower']:.1f}, {100 * iv['upper']:.1f}]"

    nr = report["noise_rate"]
    lines.append(f"noise rate: {pct(nr)} (95% interval, +-{100 * nr['half_width']:.1f} points); "
                 f"the model flags {100 * (report.get('model_flagged_share') or 0):.1f}%")
    if "noise_rate_if_unsure" in report:
        u = report["noise_rate_if_unsure"]
        lines.append(f"  if the unsure pairs were all noisy: {pct(u['noisy'])}; all clean: {pct(u['clean'])}")
    flag = report["noisy_flag"]
    lines.append(f"noisy flag: precision {pct(flag['precision'])}, recall {pct(flag['recall'])}, F1 {pct(flag['f1'])}")
    if "threshold" in report:
        t = report["threshold"]
        lines.append(f"p_clean < {t['threshold']:g}: precision {pct(t['precision'])}, recall {pct(t['recall'])}, F1 {pct(t['f1'])}")
    if "target" in report:
        t = report["target"]
        if t["reached"]:
            lines.append(f"{t['metric']} >= {t['value']:g}: threshold p_clean < {t['threshold']:.4f} (precision "
                         f"{pct(t['precision'])}, recall {pct(t['recall'])})")
        else:
            lines.append(f"{t['metric']} >= {t['value']:g}: no threshold reaches it on these labels")
    lines.append(f"calibration error (ECE) of the model's p_clean on the labels: {report['ece_model']:.3f}")
    return "\n".join(lines)


# -- writing the recalibrated p_clean -----------------------------------------------------------

def recalibrated_table(table: pa.Table, knots: dict[str, list[float]], doc: dict[str, Any]) -> pa.Table:
    """The score table with ``p_clean`` recalibrated and ``p_clean_model`` (the model's
    value) right after it. Rows that are not ok keep ``p_clean`` 0.

    Under the ``p-clean`` weighting (the default: ``weight = p_clean``), ``weight`` becomes
    the recalibrated ``p_clean`` too and ``noisy`` says ``p_clean <= 0.5`` of it, the model's
    flag kept as ``noisy_model``: trainers read ``weight`` and ``noisy`` only, so an audit that
    changed ``p_clean`` alone changed no training. Other weightings (a function of the
    similarity) keep ``weight`` and ``noisy`` as the job computed them."""
    names = table.column_names
    model = table.column(_model_column(names)).combine_chunks()
    ok = np.asarray(table.column(schema.COL_STATUS).to_pylist(), dtype=object) == schema.STATUS_OK
    p_model = model.to_numpy(zero_copy_only=False).astype(np.float64)
    new = np.where(ok, stats.apply_recalibration(knots, p_model), 0.0).astype(np.float32)
    meta = json.loads((table.schema.metadata or {}).get(schema.META_KEY, b"{}"))
    meta["audit"] = doc
    follows = (meta.get("weighting") or {}).get("name") == "p-clean"
    flags = table.column(_flag_column(names)).combine_chunks()
    # column -> (its new values, (the model's column kept beside it, its values) or None)
    replaced: dict[str, tuple[pa.Array, tuple[str, pa.Array] | None]] = {
        schema.COL_P_CLEAN: (pa.array(new, pa.float32()), (COL_P_CLEAN_MODEL, model.cast(pa.float32())))}
    if follows:
        audited_flag = np.where(ok, new <= 0.5, flags.to_numpy(zero_copy_only=False).astype(bool))
        replaced[schema.COL_WEIGHT] = (pa.array(new, pa.float32()), None)
        replaced[schema.COL_NOISY] = (pa.array(audited_flag, pa.bool_()), (COL_NOISY_MODEL, flags.cast(pa.bool_())))
    fields, columns = [], []
    for f in table.schema:
        if f.name in (COL_P_CLEAN_MODEL, COL_NOISY_MODEL):
            continue
        if f.name in replaced:
            value, kept = replaced[f.name]
            fields.append(f)
            columns.append(value.cast(f.type))
            if kept is not None:
                fields.append(pa.field(kept[0], kept[1].type, nullable=False))
                columns.append(kept[1])
        else:
            fields.append(f)
            columns.append(table.column(f.name))
    out_schema = pa.schema(fields).with_metadata({schema.META_KEY: json.dumps(meta, sort_keys=True).encode()})
    return pa.table(columns, schema=out_schema)


def _applied_entry(data: bytes | None) -> dict[str, Any] | None:
    """An applied record's ``sha256`` and ``bytes``, or None where it is missing or not one
    pairclean wrote."""
    doc = schema.json_object(data)
    ok = doc is not None and isinstance(doc.get("sha256"), str) and isinstance(doc.get("bytes"), int)
    return doc if ok else None


def _applied_name(doc: dict[str, Any], stem: str) -> str:
    return f"{APPLIED_DIR}/{doc['map_sha256'][:12]}/{stem}.json"


def applied_summary_name(map_sha256: str) -> str:
    """Where an applied map's summary is kept (``labels``, ``expected_noise``: 1 - mean of
    the recalibrated ``p_clean`` over the job's ok pairs, what ``pairclean inspect`` and any
    reader of the tables now compute; the service shows it as the job's noise-rate estimate)."""
    return f"{APPLIED_DIR}/{map_sha256[:12]}.summary.json"  # beside the map's folder of per-shard records


def _expected_noise(out: OutputDir, records: list[ShardRecord]) -> float | None:
    """1 - mean ``p_clean`` over the ok pairs of ``records``' tables (two columns read)."""
    from pairclean.output.report import p_clean_sum

    total, count = 0.0, 0
    for record in records:
        table = out.read_scores(record, [schema.COL_STATUS, schema.COL_P_CLEAN])
        t, c = p_clean_sum(table.column(schema.COL_STATUS).to_pylist(), table.column(schema.COL_P_CLEAN).to_numpy())
        total, count = total + t, count + c
    return 1.0 - total / count if count else None


def apply_recalibration(out: OutputDir, knots: dict[str, list[float]], labels: int, lock_ttl_s: float | None = None) -> dict[str, int]:
    """Rewrite every committed score table with the recalibrated ``p_clean`` (resumable:
    shards already rewritten with this map are skipped). Returns rewritten / skipped counts."""
    sha = hashlib.sha256(json.dumps(knots, sort_keys=True).encode()).hexdigest()
    doc = {"map_sha256": sha, "labels": labels, "method": "mean of centred isotonic regression and Platt scaling of the model's p_clean on human labels, design-weighted",
           "knots": knots, "model_column": COL_P_CLEAN_MODEL}
    out.check_owned()
    lock = RunLock(out.store, ttl_s=lock_ttl_s)
    lock.acquire()
    try:
        out.start_rewrite_run("audit")
        records = list(out.iter_committed())
        stale = out.begin_rewrite("audit")
        done: dict[str, tuple[str, int]] = {}
        rewritten = 0
        for record in records:
            entry = _applied_entry(out.store.get(_applied_name(doc, record.stem)))
            if entry is not None:  # a damaged record is as none: the shard is recalibrated again (the same table)
                if record.sha256 == entry["sha256"] or out.store.sha256(record.output) == entry["sha256"]:
                    done[record.stem] = (entry["sha256"], entry["bytes"])
                    continue
            info = out.write_table(record.output, recalibrated_table(out.read_scores(record), knots, doc))
            lock.check()  # a run that lost its lock must not commit
            out.store.put(_applied_name(doc, record.stem), json.dumps({"sha256": info.sha256, "bytes": info.bytes}).encode())
            done[record.stem] = (info.sha256, info.bytes)
            rewritten += 1
        lock.check()  # nor record what it wrote
        changed = any(r.sha256 != done[r.stem][0] for r in records)
        # before the records name the new tables: the service caches what it reads per table checksum
        out.store.put(applied_summary_name(sha), json.dumps(
            {"labels": labels, "expected_noise": _expected_noise(out, records)}).encode())
        if changed:
            out.replace_records([replace(r, sha256=done[r.stem][0], bytes=done[r.stem][1]) for r in records])
        out.end_rewrite()
        if changed or stale:
            refresh_exports(out)  # trainers read them without asking: never leave them on the earlier weights
        else:
            exports_current(out)
    finally:
        lock.release()
    return {"rewritten": rewritten, "skipped": len(records) - rewritten}

