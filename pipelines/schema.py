"""Column names, statuses and the Parquet schemas: spelled here and nowhere else."""

from __future__ import annotations

import json

from collections.abc import Sequence
from typing import Any, Final, Literal

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from pairclean.errors import InputError

__all__ = [
    "IMAGE_EXTS",
    "REWRITE_FILE",
    "WEIGHT_TOLERANCE",
    "caption_member",
    "checked_weights",
    "ok_mask",
    "SHARD_COMMITTED",
    "SHARD_QUARANTINED",
    "SHARD_PENDING",
    "SHARD_STATES",
    "ShardState",
    "STATUSES",
    "STATUS_OK",
    "STATUS_DECODE_ERROR",
    "STATUS_MISSING_IMAGE",
    "STATUS_MISSING_TEXT",
    "STATUS_EMPTY_TEXT",
    "STATUS_TOO_LARGE",
    "STATUS_DUPLICATE_KEY",
    "STATUS_LINK_MEMBER",
    "STATUS_JUDGE_ERROR",
    "STATUS_BAD_KEY",
    "COL_KEY",
    "COL_SHARD",
    "COL_IDX",
    "COL_STATUS",
    "COL_ERROR",
    "COL_SIMILARITY",
    "COL_WEIGHT",
    "COL_NOISY",
    "COL_P_CLEAN",
    "COL_JUDGE_SCORE",
    "COL_ADJUSTED",
    "COL_OWNER_MARGIN",
    "COL_UID",
    "COL_URL",
    "COL_IMAGE_OFFSET",
    "COL_IMAGE_SIZE",
    "COL_CAPTION_OFFSET",
    "COL_CAPTION_SIZE",
    "MEMBER_COLUMNS",
    "COL_IMAGE_EMB",
    "COL_TEXT_EMB",
    "COL_CAPTION_WORDS",
    "META_KEY",
    "scores_schema",
    "embeddings_schema",
    "STATE_DIR",
    "EMB_DIR",
    "JOB_FILE",
    "CALIBRATION_FILE",
    "MANIFEST_DIR",
    "COMPLETIONS_DIR",
    "FAILED_DIR",
    "AUDIT_DIR",
    "AUDIT_DESIGN_FILE",
    "AUDIT_APPLIED_DIR",
    "AUDIT_REPORT_FILE",
    "COL_P_CLEAN_MODEL",
    "COL_NOISY_MODEL",
    "LOCK_FILE",
    "EXPORTS_FILE",
    "EXPORTS_STALE_FILE",
    "CONTRAST_BANK_FILE",
    "JUDGE_RATIOS_FILE",
    "EXPORT_DIR",
    "HEADS_DIR",
    "REFINE_DIR",
    "PSEUDO_DIR",
    "PSEUDO_RECORD_FILE",
    "PSEUDO_STALE_FILE",
    "SIDE_SUFFIX",
    "SIDE_FOLDERS",
    "side_folder",
    "side_name",
    "local_side_path",
    "utf8_text",
    "json_object",
    "changed_since",
    "repeated_keys",
]

#: A shard of a job is committed (its completion record exists), quarantined (kept
#: failing; its error is recorded) or pending (neither yet).
SHARD_COMMITTED: Final = "committed"
SHARD_QUARANTINED: Final = "quarantined"
SHARD_PENDING: Final = "pending"
SHARD_STATES: Final = (SHARD_COMMITTED, SHARD_QUARANTINED, SHARD_PENDING)
#: The shard states as a type, for API schemas (``typing.get_args(ShardState) == SHARD_STATES``, tested).
ShardState = Literal["committed", "quarantined", "pending"]

STATUS_OK: Final = "ok"
STATUS_DECODE_ERROR: Final = "decode_error"
STATUS_MISSING_IMAGE: Final = "missing_image"
STATUS_MISSING_TEXT: Final = "missing_text"
STATUS_EMPTY_TEXT: Final = "empty_text"
STATUS_TOO_LARGE: Final = "too_large"
#: A key seen earlier in the shard, or a field written twice for one sample.
STATUS_DUPLICATE_KEY: Final = "duplicate_key"
#: Member extensions read as the image, in order of preference (WebDataset field names).
IMAGE_EXTS: Final = ("jpg", "jpeg", "png", "webp")
#: A sample with a symlink, hard-link, FIFO or device member (never followed, never read).
STATUS_LINK_MEMBER: Final = "link_member"
#: The judge (``--judge``) failed on this pair (its error says why); the shard goes on.
STATUS_JUDGE_ERROR: Final = "judge_error"
#: A sample whose key (its member names) is not UTF-8: the key column shows its bytes
#: escaped (``\xff``), so the row is written; a trainer cannot join on it, so it is not scored.
STATUS_BAD_KEY: Final = "bad_key"
STATUSES: Final = (
    STATUS_OK,
    STATUS_DECODE_ERROR,
    STATUS_MISSING_IMAGE,
    STATUS_MISSING_TEXT,
    STATUS_EMPTY_TEXT,
    STATUS_TOO_LARGE,
    STATUS_DUPLICATE_KEY,
    STATUS_LINK_MEMBER,
    STATUS_JUDGE_ERROR,
    STATUS_BAD_KEY,
)

COL_KEY: Final = "key"
COL_SHARD: Final = "shard"
COL_IDX: Final = "idx"
COL_STATUS: Final = "status"
COL_ERROR: Final = "error"
COL_SIMILARITY: Final = "similarity"
COL_WEIGHT: Final = "weight"
COL_NOISY: Final = "noisy"
#: A calibrated probability that the pair is clean (OSA: the mixture posterior; refined
#: jobs: the method's).
COL_P_CLEAN: Final = "p_clean"
#: The judge's score (``--judge band|all``): its log likelihood ratio clean : noisy,
#: calibrated on Flickr8k dev; NaN for pairs it did not judge (outside the band, not ok).
COL_JUDGE_SCORE: Final = "judge_score"
#: The similarity less how well the caption fits the corpus's other images
#: (``pairclean.calibrate.contrast``): what weight, noisy and p_clean are computed from
#: when the job's calibration has a contrast; NaN for rows that are not ok.
COL_ADJUSTED: Final = "adjusted_similarity"
#: How much better another bank image whose caption says the same fits this caption than
#: the pair's own image (``Contrast.owner_margin``, contrast version 3); NaN where no such
#: image is in the bank. Positive: the caption has a better owner, and ``p_clean`` was lowered.
COL_OWNER_MARGIN: Final = "owner_margin"
COL_UID: Final = "uid"
COL_URL: Final = "url"
#: Where the pair's members lie in its (uncompressed) tar: the byte offset of the member's
#: data and its size (wids-style random access: a viewer reads just these bytes). The
#: caption member is the ``txt`` member, or the ``json`` member when the job reads a
#: ``caption_field`` (recipe in the metadata), or the member a ``caption_field`` with a
#: leading dot names (``.caption``). Null where unknown: compressed tars, members
#: not read (too large, links), captions from the json fallback.
COL_IMAGE_OFFSET: Final = "image_offset"
COL_IMAGE_SIZE: Final = "image_size"
COL_CAPTION_OFFSET: Final = "caption_offset"
COL_CAPTION_SIZE: Final = "caption_size"
MEMBER_COLUMNS: Final = (COL_IMAGE_OFFSET, COL_IMAGE_SIZE, COL_CAPTION_OFFSET, COL_CAPTION_SIZE)
COL_IMAGE_EMB: Final = "image_emb"
COL_TEXT_EMB: Final = "text_emb"
#: The sidecar's count of content words of each pair's caption (int16, -1 where not ok;
#: sidecars written before it have none).
COL_CAPTION_WORDS: Final = "caption_words"

#: The single Parquet key-value metadata key; its value is a JSON object (see
#: ``pairclean.output.folder.score_metadata``) so that readers need one ``json.loads``.
META_KEY: Final = b"pairclean"

# The output folder's layout (see ``pairclean.output.folder``). In code, everything that is not a score
# table has a logical name starting with one of ``SIDE_FOLDERS``; on disk those live in the
# sibling folder ``OUT.pairclean/`` (``side_folder``), so ``OUT`` holds the score tables and
# nothing else. Why outside OUT: polars' ``scan_parquet(OUT)`` reads every file below OUT,
# hidden ones too, and Hugging Face ``datasets`` reads ``_`` folders; no name is skipped by
# every reader. Folders written before (issue 23) keep them inside OUT (the "legacy" layout,
# still read and resumed in place).
STATE_DIR: Final = "_pairclean"
EMB_DIR: Final = "_emb"
EXPORT_DIR: Final = "_export"
JOB_FILE: Final = f"{STATE_DIR}/job.json"
CALIBRATION_FILE: Final = f"{STATE_DIR}/calibration.json"
MANIFEST_DIR: Final = f"{STATE_DIR}/manifest"
COMPLETIONS_DIR: Final = f"{STATE_DIR}/completions"
FAILED_DIR: Final = f"{STATE_DIR}/failed"
#: The audit's sample (``design.json``), the applied recalibrations and its report
#: (``pairclean.audit.run``): ``--overwrite`` deletes them with the tables they describe.
AUDIT_DIR: Final = f"{STATE_DIR}/audit"
AUDIT_DESIGN_FILE: Final = f"{AUDIT_DIR}/design.json"
AUDIT_APPLIED_DIR: Final = f"{AUDIT_DIR}/applied"
AUDIT_REPORT_FILE: Final = f"{STATE_DIR}/audit.json"
#: The model's own ``p_clean``, kept beside the one an audit recalibrated (``pairclean audit --labels``).
COL_P_CLEAN_MODEL: Final = "p_clean_model"
#: The model's own ``noisy``, kept beside the flag an audit set from its recalibrated
#: ``p_clean`` (jobs weighted ``p-clean``, where ``weight`` follows ``p_clean`` too).
COL_NOISY_MODEL: Final = "noisy_model"
LOCK_FILE: Final = f"{STATE_DIR}/lock.json"
EXPORTS_FILE: Final = f"{STATE_DIR}/exports.json"
#: Present from before a run may change the tables until the exports are written again:
#: a run killed in between leaves it, and the next run (or ``export``) writes them.
EXPORTS_STALE_FILE: Final = f"{STATE_DIR}/exports-stale.json"
#: Present while ``rescore``, ``refine`` or ``audit`` rewrites the tables: a run killed midway
#: leaves it, so readers can tell a half-rewritten job (``OutputDir.check_tables_whole``).
REWRITE_FILE: Final = f"{STATE_DIR}/rewrite.json"
#: The corpus-contrast bank (``pairclean.calibrate.contrast``): float16 image embeddings, .npy.
CONTRAST_BANK_FILE: Final = f"{STATE_DIR}/contrast-bank.npy"
#: The judge's ratios (float32 .npy) on the calibration sample (its first ok pairs, in shard
#: order), all of them, so ``pairclean rescore`` refits the near-miss prior on what a fresh
#: score fitted it on, also under ``--judge band`` (where the tables hold in-band ratios only).
JUDGE_RATIOS_FILE: Final = f"{STATE_DIR}/judge-calibration-ratios.npy"
#: ``pairclean refine``'s heads files and its run records.
HEADS_DIR: Final = f"{STATE_DIR}/heads"
REFINE_DIR: Final = f"{STATE_DIR}/refine"
#: ``pairclean pseudo-pair``'s tables (``<image shard stem>.parquet``) and completion record.
PSEUDO_DIR: Final = "_pseudo"
#: A finished pseudo-pair run's record (``pairclean.pseudo.pairing``).
PSEUDO_RECORD_FILE: Final = f"{PSEUDO_DIR}/_run.json"
#: Written beside it when the job's tables are rewritten after the run (rescore, refine,
#: audit): the pseudo-pairs' weights and noisy pool are the earlier tables'.
PSEUDO_STALE_FILE: Final = f"{PSEUDO_DIR}/_stale.json"
#: ``OUT`` -> ``OUT.pairclean``: the job's state, sidecars, exports and pseudo-pairs.
SIDE_SUFFIX: Final = ".pairclean"
#: Logical folder -> its name inside ``OUT.pairclean/``.
SIDE_FOLDERS: Final = {STATE_DIR: "state", EMB_DIR: "emb", EXPORT_DIR: "export", PSEUDO_DIR: "pseudo"}


def side_folder(out: str) -> str:
    """The sibling folder of output ``out`` that holds everything but the score tables:
    ``/data/weights`` -> ``/data/weights.pairclean``, ``s3://b/w/`` -> ``s3://b/w.pairclean``.

    Raises ``ValueError`` for a filesystem or bucket root, which has no sibling.
    """
    from urllib.parse import urlparse

    trimmed = out.rstrip("/")
    parsed = urlparse(trimmed)
    path = parsed.path if len(parsed.scheme) > 1 else trimmed
    if path.strip("/") in ("", ".") or (len(parsed.scheme) > 1 and parsed.scheme != "file" and not path.strip("/")):
        raise ValueError(f"output {out!r} is a root: pick a folder inside it (e.g. {trimmed}/weights), so that "
                         f"the job's state can go beside it in a sibling folder")
    return trimmed + SIDE_SUFFIX


def side_name(name: str) -> str | None:
    """Where the logical ``name`` (``_emb/x.parquet``) lies inside ``OUT.pairclean/``
    (``emb/x.parquet``); None for a name that lives in ``OUT`` itself (a score table)."""
    head, sep, rest = name.partition("/")
    folder = SIDE_FOLDERS.get(head)
    if folder is None:
        return None
    return f"{folder}{sep}{rest}"


def changed_since(where: str, written: int, now: int) -> str:
    """The one wording of "this table is not the bytes pairclean wrote" (``export``, the
    trainer's ``WeightStore``, the rewrite verbs; each adds what follows and what to do):
    ``where`` changed since, with the sizes then and ``now`` (or that the size is the same)."""
    sizes = "the same size, other bytes" if now == written else f"{written} bytes then, {now} now"
    return f"{where} changed since pairclean wrote it ({sizes}"


def json_object(data: bytes | str | None) -> dict[str, Any] | None:
    """The JSON object in ``data`` (a state file's bytes); None where there is none, or where
    it is not JSON or not an object: the readers of pairclean's own records treat a damaged
    one as absent (and redo the work) or say so in one line, never a traceback."""
    if data is None:
        return None
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def utf8_text(text: str) -> tuple[str, bool]:
    """(``text`` as a table or message can hold it, whether it was UTF-8 already). Names read
    with ``surrogateescape`` (tar members, glob matches) and JSON's ``"\\udcff"`` hold lone
    surrogates, which no Parquet or JSON writer takes: their bytes are escaped (``\\xff``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        # U+DC80-DCFF are bytes (``surrogateescape``): \xNN; any other lone surrogate (JSON's
        # "\ud800") \uNNNN: ``surrogateescape`` alone raised on them, and the job died
        return "".join(c if not 0xD800 <= ord(c) <= 0xDFFF else
                       f"\\x{ord(c) - 0xDC00:02x}" if 0xDC80 <= ord(c) <= 0xDCFF else f"\\u{ord(c):04x}" for c in text), False
    return text, True


def repeated_keys(keys: Sequence[str], statuses: Sequence[str] | None) -> set[str] | str:
    """The keys a shard held more than once, as ``pairclean score`` writes them (the first
    row as read, each later one with status ``duplicate_key``); or the first repeated key,
    as a ``str``, when the repeats are not that (a damaged or hand-made table). One rule for
    every reader: trainers' ``WeightStore``, ``OutputDir.read_scores`` and ``export``."""
    seen: set[str] = set()
    repeated: set[str] = set()
    for i, key in enumerate(keys):
        if key in seen:
            if statuses is None or statuses[i] != STATUS_DUPLICATE_KEY:
                return key
            repeated.add(key)
        seen.add(key)
    return repeated


def local_side_path(out: Any, name: str) -> Any:
    """The local path of the logical ``name`` of the job in local folder ``out``: inside
    ``OUT.pairclean/`` or, for a folder written before that layout (``OUT/_pairclean/job.json``
    present), inside ``OUT``. For trainer-side readers that take a local folder."""
    from pathlib import Path

    root = Path(out)
    if (root / JOB_FILE).is_file():
        return root / name
    physical = side_name(name)
    return Path(side_folder(str(root))) / physical if physical is not None else root / name


def scores_schema(with_uid: bool, with_url: bool, extra_scores: tuple[str, ...] = (), with_members: bool = False) -> pa.Schema:
    """The schema of ``OUT/<stem>.parquet``; ``uid``/``url`` only when the shard has them.

    ``similarity`` is NaN, ``weight`` and ``p_clean`` 0 for rows whose status is not ``ok``.
    ``extra_scores``: raw-score columns (float32) a refined table adds after ``p_clean``.
    ``with_members``: the ``MEMBER_COLUMNS`` (nullable int64) last, for tables scored from
    a tar (tables written before they existed, and in-memory scores, have none).
    """
    fields = [
        pa.field(COL_KEY, pa.string(), nullable=False),
        pa.field(COL_SHARD, pa.string(), nullable=False),
        pa.field(COL_IDX, pa.int64(), nullable=False),
        pa.field(COL_STATUS, pa.string(), nullable=False),
        pa.field(COL_ERROR, pa.string()),
        pa.field(COL_SIMILARITY, pa.float32(), nullable=False),
        pa.field(COL_WEIGHT, pa.float32(), nullable=False),
        pa.field(COL_NOISY, pa.bool_(), nullable=False),
        pa.field(COL_P_CLEAN, pa.float32(), nullable=False),
    ]
    fields += [pa.field(name, pa.float32(), nullable=False) for name in extra_scores]
    if with_uid:
        fields.append(pa.field(COL_UID, pa.string()))
    if with_url:
        fields.append(pa.field(COL_URL, pa.string()))
    if with_members:
        fields += [pa.field(name, pa.int64()) for name in MEMBER_COLUMNS]
    return pa.schema(fields)


def embeddings_schema(dim: int, with_words: bool = False) -> pa.Schema:
    """The schema of the sidecar ``OUT/_emb/<stem>.parquet``: float16 L2-normalised embeddings.

    Rows whose status is not ``ok`` carry zero vectors (earlier sidecars: nulls, which
    pyarrow 18-25 cannot round-trip; ``output.tables.embeddings_table``). ``with_words``:
    ``caption_words`` last (each caption's content-word count, -1 where not ok).
    """
    return pa.schema(
        [
            pa.field(COL_KEY, pa.string(), nullable=False),
            pa.field(COL_IMAGE_EMB, pa.list_(pa.float16(), dim)),
            pa.field(COL_TEXT_EMB, pa.list_(pa.float16(), dim)),
        ] + ([pa.field(COL_CAPTION_WORDS, pa.int16(), nullable=False)] if with_words else [])
    )


def ok_mask(status: pa.Table | pa.ChunkedArray | pa.Array | Sequence[Any]) -> NDArray[np.bool_]:
    """(N,) bool: which rows are ``ok`` (usable pairs). ``status``: a table (its ``status``
    column is read), an Arrow array or a sequence of status strings."""
    if isinstance(status, pa.Table):
        status = status.column(COL_STATUS)
    values = status.to_pylist() if isinstance(status, (pa.ChunkedArray, pa.Array)) else list(status)
    return np.fromiter((v == STATUS_OK for v in values), dtype=bool, count=len(values))


#: Weights within this of [0, 1] are clamped into it (float rounding); beyond, refused.
WEIGHT_TOLERANCE = 1e-6


def checked_weights(weights: Any, where: str) -> NDArray[np.float64]:
    """The weight column of a table as float64, checked: every weight a finite number in
    [0, 1] (what pairclean writes; within ``WEIGHT_TOLERANCE`` it is clamped). A null,
    NaN, infinite, negative or larger weight comes from a damaged or foreign table and
    would reach a training loss as is: ``InputError`` naming ``where``, how many and the
    first row, rather than any silent repair."""

    column = weights.combine_chunks() if isinstance(weights, pa.ChunkedArray) else weights
    nulls = column.null_count if isinstance(column, pa.Array) else 0
    values = np.asarray(column.to_numpy(zero_copy_only=False) if isinstance(column, pa.Array) else column, dtype=np.float64)
    bad = ~np.isfinite(values) | (values < -WEIGHT_TOLERANCE) | (values > 1 + WEIGHT_TOLERANCE)
    if nulls or bad.any():
        first = int(np.flatnonzero(bad)[0]) if bad.any() else -1
        shown = f"row {first}: {float(values[first])}" if first >= 0 else "a null"
        raise InputError(f"{where}: {int(bad.sum())} weights are NaN, null, infinite or outside [0, 1] ({shown}); "
                         "the table is damaged or not pairclean's: rescore or re-export it", uri=where)
    return np.clip(values, 0.0, 1.0)


def caption_member(caption_field: str | None) -> str | None:
    """The member extension a ``caption_field`` names (``".caption"`` -> ``"caption"``), or
    None where it names a json field (or is None).

    Why a leading dot rather than another option: WebDataset writers name caption members
    otherwise than ``txt`` (``caption``, ``text``, ``en.txt``), and a field of the json and
    a member are both "where the caption is"; the dot is how member names end (``KEY.caption``),
    and a json field name never needed one. ``InputError`` for a dot alone or an image member."""
    if caption_field is None or not caption_field.startswith("."):
        return None
    ext = caption_field[1:].lower()
    if not ext or ext in IMAGE_EXTS or ext == "json":
        raise InputError(f"--caption-field {caption_field!r}: a leading dot names a text member (e.g. '.caption'); "
                         "'.json' and image members cannot hold the caption")
    return ext
