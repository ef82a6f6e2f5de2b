"""``pairclean refine``: fit a learned estimator on a job's sidecars and apply it to every shard."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pairclean_workers.args import (
    add_executor_args,
    add_lock_ttl_arg,
    add_seed_arg,
    add_storage_arg,
    add_threads_arg,
    storage_options,
    whole_at_least,
)

__all__ = ["add_refine_parser", "cmd_refine"]

#: The smallest --sample-pairs: the ensemble chooses its blend on a held-out part of the
#: sample (5 pairs chose a learned blend that moved p_clean; 0 and 1 ended in a traceback).
MIN_SAMPLE_PAIRS = 100


def add_refine_parser(sub: Any) -> None:
    """Register the ``refine`` sub-command."""
    from pairclean.refine import DEFAULT_METHOD, METHODS
    from pairclean.refine.run import DEFAULT_SAMPLE_PAIRS

    p = sub.add_parser("refine", help="fit NCR / DisNCL / SDCMR / an ensemble on a scored job's embeddings and rewrite its tables with p_clean (resumable)")
    p.add_argument("out", help="a scored job's output folder (with embedding sidecars)")
    p.add_argument("--method", choices=METHODS, default=None, help=f"default: {DEFAULT_METHOD} (or the method of --heads)")
    add_seed_arg(p, 0, "seed of the fit sample and the heads' initialisation")
    p.add_argument("--sample-pairs", type=whole_at_least(MIN_SAMPLE_PAIRS), default=DEFAULT_SAMPLE_PAIRS,
                   help=f"ok pairs the heads are fitted on (a seeded sample; all when fewer; at least {MIN_SAMPLE_PAIRS}: "
                        "the ensemble chooses its blend on a held-out part)")
    p.add_argument("--heads", default=None, help="apply this heads file (OUT.pairclean/state/heads/*.safetensors of another job) instead of fitting")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a method setting, e.g. epochs=3 (repeatable)")
    add_executor_args(p, "actors that apply the heads (default: one per 2 CPUs)")
    add_threads_arg(p, "torch threads of the fit (and of each actor)")
    add_lock_ttl_arg(p)

    add_storage_arg(p)  # one spelling of --storage-option for every verb (OUT, --heads)


def _overrides(pairs: list[str]) -> dict[str, Any]:
    from pairclean.errors import InputError

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise InputError(f"--set expects FIELD=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def cmd_refine(args: argparse.Namespace) -> int:
    """Run (or resume) a refine; prints one summary line."""
    import os

    import fsspec
    import torch

    from pairclean.errors import InputError
    from pairclean.output.folder import OutputDir

    from pairclean.refine import DEFAULT_METHOD
    from pairclean.refine.run import RefineOptions, refine

    storage = storage_options(args.storage_option)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    heads = None
    if args.heads:
        try:
            with fsspec.open(args.heads, "rb", **storage) as fh:
                heads = fh.read()
        except (FileNotFoundError, OSError) as exc:
            raise InputError(f"--heads {args.heads}: {exc}") from exc
    method = args.method or (None if heads else DEFAULT_METHOD)
    options = RefineOptions(method=method, seed=args.seed, sample_pairs=args.sample_pairs, overrides=_overrides(args.set), heads=heads)
    out = OutputDir(args.out, storage)
    executor = None
    if args.executor == "ray":
        from pairclean_workers.ray_exec import RayOptions
        from pairclean_workers.refine_exec import ray_executor

        ray_opts = RayOptions(address=args.ray_address, num_actors=args.num_actors, threads_per_actor=args.threads)
        executor = lambda: ray_executor(out, ray_opts)  # noqa: E731 - built only when there is work
    report = refine(out, options, executor=executor, lock_ttl_s=args.lock_ttl)
    rate = report.pairs / report.apply_seconds if report.apply_seconds else 0.0
    how = f"fitted on {report.sample_pairs} pairs in {report.fit_seconds:.1f} s" if report.fitted else "heads reused"
    print(f"refined {out.uri} with {report.method} ({how}; heads {out.store.url(report.heads)}, sha256 {report.heads_sha256[:12]}): "
          f"{report.refined} shards rewritten, {report.skipped} already done; {report.pairs} pairs at {rate:.0f} pairs/s", file=sys.stdout)
    if report.choice:
        c = report.choice
        weights = ", ".join(f"{k} {v:.2f}" for k, v in c["member_weights"].items())
        referee = c.get("referee_agreement") or {}
        chosen = format(c["blend"], "g")
        cosine = f", {referee['cosine']:.2f} for the plain cosine" if "cosine" in referee else ""
        judged = (f"; agreement with the judge {referee['0']:.2f} for OSA alone{cosine}, {referee[chosen]:.2f} for this"
                  if referee else "")
        print(f"members used on this corpus: {c['used']} (learned share {c['blend']:g}, chosen on {c['held_out_pairs']} held-out "
              f"pairs; weights {weights}{judged})", file=sys.stdout)
    return 0
