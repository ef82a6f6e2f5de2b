"""``pairclean pseudo-pair OUT``: RCSL pseudo-pairs of a scored job's noisy pairs.

Reads the job's score tables and embedding sidecars, pairs each pool image with its
nearest pool caption and each pool caption with its nearest pool image (FAISS), scores
the pseudo-pairs with the job's own calibration and writes ``OUT.pairclean/pseudo/<shard>.parquet``
(see ``pairclean.pseudo.pairing``). Holds the folder's run lock while it runs, so it never races a
``score`` or ``rescore`` of the same folder. With ``--executor ray`` (the default, as for
``score`` and ``refine``) the queries of a pool of at least ``--ray-min-pool`` pairs are
spread over a Ray actor pool (``pairclean_workers.pseudo_exec``); smaller pools, and
``--executor local``, are searched in this process. The output is the same either way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from typing import Any

from pairclean_workers.args import (
    add_executor_args,
    add_lock_ttl_arg,
    add_seed_arg,
    add_storage_arg,
    add_threads_arg,
    fraction,
    positive_int,
    storage_options,
    whole_at_least,
)

__all__ = ["add_pseudo_parser", "cmd_pseudo_pair"]


def add_pseudo_parser(sub: Any) -> None:
    """Register the ``pseudo-pair`` sub-command."""
    from pairclean.pseudo.ann import DEFAULT_CHUNK as _CHUNK
    from pairclean.pseudo.ann import FLAT_MAX, INDEX_KINDS, IVF_MAX
    from pairclean.pseudo.pairing import POOLS
    from pairclean_workers.pseudo_exec import RAY_MIN_POOL

    p = sub.add_parser("pseudo-pair", help="pair noisy images with their nearest noisy captions (RCSL) into OUT.pairclean/pseudo/")
    p.add_argument("out", help="a scored job's output folder (scored with --embeddings, the default)")
    p.add_argument("--pool", choices=POOLS, default="noisy", help="unpaired pool: ok pairs flagged noisy (default) or every ok pair")
    p.add_argument("--mutual", action="store_true", help="keep only mutual nearest neighbours")
    p.add_argument("--index", choices=INDEX_KINDS, default="auto", help=f"auto: exact up to {FLAT_MAX:,}, IVF up to {IVF_MAX:,}, IVF-PQ above")
    p.add_argument("--min-weight", type=fraction, default=0.0, help="drop pseudo-pairs whose OSA weight is below this")
    p.add_argument("--neighbours", type=positive_int, default=1, help="pseudo-captions per image (and images per caption)")
    p.add_argument("--nprobe", type=positive_int, default=None, help="IVF lists probed per query (default nlist/64, at least 8)")
    add_seed_arg(p, None, "index training seed (default: the job's seed)")
    p.add_argument("--chunk", type=positive_int, default=_CHUNK, help=f"query rows per FAISS call, and per Ray task (default {_CHUNK})")
    add_executor_args(p, "search actors (default: one per Ray node; each holds a copy of the index)", "pools of --ray-min-pool pairs or more")
    add_threads_arg(p, "FAISS threads of each actor (default: the cluster's CPUs / actors)")
    p.add_argument("--ray-min-pool", type=whole_at_least(0), default=RAY_MIN_POOL, help=f"smaller pools are searched in this process (default {RAY_MIN_POOL:,})")
    p.add_argument("--json", action="store_true", help="print the report as JSON")

    add_storage_arg(p)  # one spelling of --storage-option for every verb
    add_lock_ttl_arg(p)


def cmd_pseudo_pair(args: argparse.Namespace) -> int:
    """Run pseudo-pairing under the folder's lock; print a summary (or JSON)."""
    from pairclean import schema
    from pairclean.errors import InputError
    from pairclean.output.folder import OutputDir
    from pairclean.output.lock import RunLock
    from pairclean.pseudo.pairing import PseudoOptions, pseudo_pair

    storage = storage_options(args.storage_option)
    out = OutputDir(args.out, storage)
    opts = PseudoOptions(pool=args.pool, mutual_only=args.mutual, index=args.index, min_weight=args.min_weight,
                         neighbours=args.neighbours, seed=args.seed, nprobe=args.nprobe, chunk=args.chunk)
    if out.read_spec() is None:  # checked before the lock, which would write into the folder
        raise InputError(f"{out.uri} is not a pairclean output folder (no {out.store.url(schema.JOB_FILE)}): score shards into it first")
    with contextlib.ExitStack() as stack:
        searcher = None
        if args.executor == "ray":
            from pairclean_workers.pseudo_exec import RaySearcher
            from pairclean_workers.ray_exec import RayOptions

            ray_opts = RayOptions(address=args.ray_address, num_actors=args.num_actors, threads_per_actor=args.threads)
            searcher = stack.enter_context(RaySearcher(out, ray_opts, min_pool=args.ray_min_pool))
        lock = stack.enter_context(RunLock(out.store, ttl_s=args.lock_ttl))
        out.check_tables_whole()  # pairs from half-rewritten tables would mix two weightings
        report = pseudo_pair(out, opts, storage, before_write=lock.check, searcher=searcher)
        actors = searcher.num_actors if searcher is not None else 0
    if args.json:
        doc = report.to_json()
        # the files where they are (OUT.pairclean/pseudo/...), not their names inside the job's store
        doc["files"] = [out.store.url(f) for f in report.files]
        print(json.dumps(doc, sort_keys=True))
    else:
        kinds = ", ".join(f"{d}: {p['kind']}" for d, p in report.plans.items())
        where = f"searched on Ray ({actors} actors)" if report.executor == "ray" else "searched in this process"
        print(f"pool {report.pool_size} pairs -> {report.pairs} pseudo-pairs ({report.mutual} mutual) in "
              f"{len(report.files)} files under {out.store.url('_pseudo')} [{kinds}; {where}; {report.timings['total_s']:.1f} s]")
        if report.excluded_nonfinite:
            print(f"left out of the pool: {report.excluded_nonfinite} pairs with NaN or infinite embeddings (damaged sidecars)")
    return 0
