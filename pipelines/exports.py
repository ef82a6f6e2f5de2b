"""Files trainers read beside a job's output, in ``OUT/_export/``: sizes, per-shard weight
sums, DataComp keep list. (The ``_`` folder keeps them out of ``OUT`` read as a dataset.)

- ``sizes.json``: ``{"<shard file name>": number of samples}``, as open_clip's
  ``--train-num-samples`` logic reads it for WebDataset shards;
- ``shard_weights.json``: ``{"<shard file name>": sum of weights}``, for resampling
  shards in proportion to their clean content;
- ``datacomp_keep.npy``: the ``uid`` of every kept pair (status ok, not flagged noisy)
  as sorted ``u8,u8`` records (the 128-bit hex uid split in two), which DataComp's
  resharder reads as a subset file. Written only when the shards carry DataComp uids.
"""

from __future__ import annotations

import json
from pathlib import PurePosixPath

import numpy as np
from . import schema
from .errors import InputError
from .job import OutputDir

__all__ = ["UID_DTYPE", "uid_records", "write_exports"]

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


def write_exports(out: OutputDir) -> dict[str, str]:
    """Write the export files into ``OUT/_export/`` (atomically); returns name -> URI written.

    The names are recorded in the job's state folder, so ``--overwrite`` can remove them.
    """
    sizes: dict[str, int] = {}
    sums: dict[str, float] = {}
    keep: list[str] = []
    has_uid = True
    for record in out.iter_committed():
        table = out.read_scores(record)
        name = PurePosixPath(record.shard).name
        sizes[name] = table.num_rows
        sums[name] = float(table.column(schema.COL_WEIGHT).to_numpy().sum(dtype=np.float64))
        if schema.COL_UID not in table.column_names:
            has_uid = False
            continue
        ok = np.asarray(table.column(schema.COL_STATUS).to_pylist()) == schema.STATUS_OK
        clean = ~table.column(schema.COL_NOISY).to_numpy(zero_copy_only=False)
        uids = table.column(schema.COL_UID).to_pylist()
        keep.extend(u for u, k in zip(uids, ok & clean) if k and u is not None)
    if not sizes:
        raise InputError(f"{out.uri} holds no committed shard")
    files: dict[str, bytes] = {
        name: json.dumps(doc, indent=1, sort_keys=True).encode() for name, doc in (("sizes.json", sizes), ("shard_weights.json", sums))
    }
    # DataComp's subset file needs its 128-bit hex uids; other uids get no keep list.
    if has_uid and all(_is_datacomp_uid(u) for u in keep):
        import io

        buf = io.BytesIO()
        np.save(buf, uid_records(keep))
        files["datacomp_keep.npy"] = buf.getvalue()
    names = [f"{schema.EXPORT_DIR}/{name}" for name in files]
    # Record first: a crash after some writes still leaves every written name listed.
    out.store.put(schema.EXPORTS_FILE, json.dumps({"written": names}).encode())
    written = {}
    for name, data in files.items():
        out.store.put(f"{schema.EXPORT_DIR}/{name}", data)
        written[name] = out.store.url(f"{schema.EXPORT_DIR}/{name}")
    return written


def _is_datacomp_uid(uid: str) -> bool:
    if len(uid) != 32:
        return False
    try:
        int(uid, 16)
    except ValueError:
        return False
    return True
