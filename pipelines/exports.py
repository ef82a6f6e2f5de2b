"""Files trainers read beside a job's output: sizes, per-shard weight sums, DataComp keep list.

- ``sizes.json``: ``{"<shard file name>": number of samples}``, as open_clip's
  ``--train-num-samples`` logic reads it for WebDataset shards;
- ``shard_weights.json``: ``{"<shard file name>": sum of weights}``, for resampling
  shards in proportion to their clean content;
- ``datacomp_keep.npy``: the ``uid`` of every kept pair (status ok, not flagged noisy)
  as sorted ``u8,u8`` records (the 128-bit hex uid split in two), which DataComp's
  resharder reads as a subset file. Written only when the shards carry ``uid``.
"""

from __future__ import annotations

import json
from pathlib import PurePosixPath

import numpy as np
import pyarrow.parquet as pq

from . import schema
from .errors import InputError
from .job import OutputDir, atomic_write_bytes

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
    """Write the export files into ``out`` (atomically); returns name -> path written."""
    sizes: dict[str, int] = {}
    sums: dict[str, float] = {}
    keep: list[str] = []
    has_uid = True
    for entry, path in out.iter_committed_tables():
        table = pq.read_table(path)
        name = PurePosixPath(entry.shard).name
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
        raise InputError(f"{out.path} holds no committed shard")
    written = {}
    for name, doc in (("sizes.json", sizes), ("shard_weights.json", sums)):
        atomic_write_bytes(out.path / name, json.dumps(doc, indent=1, sort_keys=True).encode())
        written[name] = str(out.path / name)
    if has_uid:
        import io

        buf = io.BytesIO()
        np.save(buf, uid_records(keep))
        atomic_write_bytes(out.path / "datacomp_keep.npy", buf.getvalue())
        written["datacomp_keep.npy"] = str(out.path / "datacomp_keep.npy")
    return written
