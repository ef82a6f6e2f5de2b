"""``pairclean pseudo-pair OUT``: RCSL pseudo-pairs of a scored job's noisy pairs.

Reads the job's score tables and embedding sidecars, pairs each pool image with its
nearest pool caption and each pool caption with its nearest pool image (FAISS), scores
the pseudo-pairs with the job's own calibration and writes ``OUT/_pseudo/<shard>.parquet``
(see ``pairclean.pseudo``). Holds the folder's run lock while it runs, so it never races a
``score`` or ``rescore`` of the same folder.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["add_pseudo_parser", "cmd_pseudo_pair"]


def add_pseudo_parser(sub: Any) -> None:
    """Register the ``pseudo-pair`` sub-command."""
    from pairclean.ann import INDEX_KINDS
    from pairclean.pseudo import POOLS

    p = sub.add_parser("pseudo-pair", help="pair noisy images with their nearest noisy captions (RCSL) into OUT/_pseudo/")
    p.add_argument("out", help="a scored job's output folder (scored with --embeddings, the default)")
    p.add_argument("--pool", choices=POOLS, default="noisy", help="unpaired pool: ok pairs flagged noisy (default) or every ok pair")
    p.add_argument("--mutual", action="store_true", help="keep only mutual nearest neighbours")
    p.add_argument("--index", choices=INDEX_KINDS, default="auto", help="auto: exact up to 50k, IVF up to 5M, IVF-PQ above")
    p.add_argument("--min-weight", type=float, default=0.0, help="drop pseudo-pairs whose OSA weight is below this")
    p.add_argument("--neighbours", type=int, default=1, help="pseudo-captions per image (and images per caption)")
    p.add_argument("--nprobe", type=int, default=None, help="IVF lists probed per query (default nlist/64, at least 8)")
    p.add_argument("--seed", type=int, default=None, help="index training seed (default: the job's seed)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    from pairclean_workers.cli import _add_storage_arg

    _add_storage_arg(p)  # one spelling of --storage-option for every verb
    p.add_argument("--lock-ttl", type=float, default=None, help="seconds without a heartbeat after which a crashed run's lock is taken over")


def cmd_pseudo_pair(args: argparse.Namespace) -> int:
    """Run pseudo-pairing under the folder's lock; print a summary (or JSON)."""
    from pairclean.errors import InputError
    from pairclean.job import OutputDir
    from pairclean.lock import RunLock
    from pairclean.pseudo import PseudoOptions, pseudo_pair
    from pairclean_workers.cli import _storage_options

    storage = _storage_options(args.storage_option)
    out = OutputDir(args.out, storage)
    opts = PseudoOptions(pool=args.pool, mutual_only=args.mutual, index=args.index, min_weight=args.min_weight,
                         neighbours=args.neighbours, seed=args.seed, nprobe=args.nprobe)
    if out.read_spec() is None:  # checked before the lock, which would write into the folder
        raise InputError(f"{out.uri} is not a pairclean output folder (no _pairclean/job.json): score shards into it first")
    lock = RunLock(out.store, ttl_s=args.lock_ttl)
    lock.acquire()
    try:
        report = pseudo_pair(out, opts, storage, before_write=lock.check)
    finally:
        lock.release()
    if args.json:
        print(json.dumps(report.to_json(), sort_keys=True))
    else:
        kinds = ", ".join(f"{d}: {p['kind']}" for d, p in report.plans.items())
        print(f"pool {report.pool_size} pairs -> {report.pairs} pseudo-pairs ({report.mutual} mutual) in "
              f"{len(report.files)} files under {out.store.url('_pseudo')} [{kinds}; {report.timings['total_s']:.1f} s]")
    return 0
