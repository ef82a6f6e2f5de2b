"""Planning and resuming a job of 100,000 shards, on local disk and on a loopback S3 server.

The records are synthetic (no scoring): what is measured is the bookkeeping. The job's
folder holds a manifest of every shard but the last ``--pending`` ones, in the most
segments a folder can have, and the pending completion records wait in their own objects
(the worst case: just before both a compaction and a merge).

Prints JSON lines, one per store:

- ``plan_s``: expand ``{000000..099999}`` and claim the folder (write ``job.json`` with
  the shard list, take the lock);
- ``resume_s``: what a rerun does before any work: read ``job.json`` and compare specs,
  read the manifest, list and read the pending records, and work out the shards to do;
- ``compact_s``: fold every record into a new manifest;
- ``commit_ms``: the driver's mean cost of one completion record;
- ``manifest_bytes``: the compacted manifest's size.

    python benchmarks/manifest_bench.py [--shards 100000] [--pending 999]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any


def _record(i: int) -> Any:
    from pairclean.output.folder import ShardRecord

    return ShardRecord(
        shard=f"s3://laion/{i:06d}.tar", stem=f"{i:06d}", size=400_000_000, rows=10_000, output=f"{i:06d}.parquet",
        sha256=f"{i:064x}", bytes=350_000, statuses={"ok": 9_800, "decode_error": 150, "too_large": 50},
        emb_output=f"_emb/{i:06d}.parquet", emb_bytes=20_480_000, timings={"read_decode": 35.1, "embed": 40.2, "write": 1.3},
    )


def _fill_segments(out: Any, n: int) -> None:
    """The compacted past: ``n`` records in ``MAX_SEGMENTS`` segments."""
    from pairclean.output import folder as job

    per = -(-n // job.MAX_SEGMENTS)
    for start in range(0, n, per):
        out._pending = {r.stem: r for r in (_record(i) for i in range(start, min(n, start + per)))}
        out.store.put_parquet(f"_pairclean/manifest/{start // per:08d}.parquet", job._records_table(list(out._pending.values())))
    out._pending = {}


def _spec(shards: list[str]) -> Any:
    from pairclean.spec import JobSpec

    return JobSpec(tuple(shards), "pairclean-lite", None, None, "auto", "gmm", 256, "paper", 0, 64, 64_000_000, None, True, 4096)


def run(uri: str, storage: dict[str, Any], n: int, pending: int) -> dict[str, Any]:
    from pairclean.output.folder import OutputDir
    from pairclean.output.lock import RunLock
    from pairclean.uris import expand_shards

    t0 = time.perf_counter()
    shards = expand_shards([f"s3://laion/{{000000..{n - 1:06d}}}.tar"])
    spec = _spec(shards)
    spec.stems()
    out = OutputDir(uri, storage)
    out.check_owned()
    lock = RunLock(out.store)
    lock.acquire()
    out.prepare(spec, overwrite=False)
    plan = time.perf_counter() - t0
    _fill_segments(out, n - pending)
    t0 = time.perf_counter()
    for i in range(n - pending, n):
        out.record_completion(_record(i))
    commit_ms = 1000 * (time.perf_counter() - t0) / max(1, pending)
    lock.release()

    t0 = time.perf_counter()
    again = OutputDir(uri, storage)
    again.check_owned()
    relock = RunLock(again.store)
    relock.acquire()
    again.prepare(_spec(expand_shards([f"s3://laion/{{000000..{n - 1:06d}}}.tar"])), overwrite=False)
    committed = again.committed()
    todo = [u for u, stem in spec.stems().items() if stem not in committed]
    resume = time.perf_counter() - t0
    assert len(committed) == n and not todo
    t0 = time.perf_counter()
    again.compact()
    compact = time.perf_counter() - t0
    relock.release()
    return {
        "benchmark": "manifest", "store": uri.split("://")[0] if "://" in uri else "local", "shards": n,
        "pending_records": pending, "plan_s": round(plan, 2), "resume_s": round(resume, 2),
        "compact_s": round(compact, 2), "commit_ms": round(commit_ms, 2),
        "manifest_bytes": sum(again.store.size(f"_pairclean/manifest/{n}") or 0 for n in again.store.list("_pairclean/manifest")),
        "job_json_bytes": again.store.size("_pairclean/job.json"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=100_000)
    parser.add_argument("--pending", type=int, default=None, help="default: pairclean.output.folder.COMPACT_EVERY - 1")
    args = parser.parse_args()
    from pairclean.output import folder as job

    args.pending = job.COMPACT_EVERY - 1 if args.pending is None else args.pending
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(run(os.path.join(tmp, "out"), {}, args.shards, args.pending)), flush=True)
    from moto.server import ThreadedMotoServer

    for key, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"), ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(key, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        storage = {"endpoint_url": f"http://{host}:{port}"}
        import s3fs

        s3fs.S3FileSystem(**storage).mkdir("bench-out")
        print(json.dumps(run("s3://bench-out/job", storage, args.shards, args.pending)), flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
