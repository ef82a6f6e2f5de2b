"""``pairclean audit``: choose pairs to label, then turn the labels into figures and a
recalibrated ``p_clean`` (see ``pairclean.audit``).

    pairclean audit OUT --sample N [--seed S] --out queue.csv
    pairclean audit OUT --labels labels.csv [--threshold T] [--target precision=0.9] [--no-apply]

Exit codes: 0 done; 1 a one-line error, or too few labels (the line says how many more).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from pairclean_workers.args import seed

__all__ = ["add_audit_parser", "cmd_audit"]


def add_audit_parser(sub: Any) -> None:
    """Register the ``audit`` sub-command."""
    p = sub.add_parser("audit", help="draw pairs for a person to label (--sample), or estimate the noise rate, precision and "
                                     "recall from their labels and recalibrate p_clean (--labels)")
    p.add_argument("out", help="a scored job's output folder")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--sample", type=int, help="draw this many pairs to label (stratified by p_clean, no key twice)")
    mode.add_argument("--labels", help="a labels file (CSV or Parquet with columns key,label[,shard]; label clean|noisy|unsure)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the sample (the same seed gives the same queue)")
    p.add_argument("--out", dest="queue_out", default=None, help="with --sample: where to write the queue CSV")
    p.add_argument("--resample", action="store_true",
                   help="with --sample: replace the job's earlier audit sample (labels of its pairs stop counting)")
    p.add_argument("--threshold", type=float, default=None, help="with --labels: also report the flag p_clean < T")
    p.add_argument("--target", default=None, metavar="METRIC=VALUE", help="with --labels: the threshold reaching precision=0.9 or recall=0.8")
    p.add_argument("--no-apply", action="store_true", help="with --labels: do not write the recalibrated p_clean into the tables")
    from pairclean_workers.args import add_storage_arg, positive_seconds

    p.add_argument("--lock-ttl", type=positive_seconds, default=None)

    add_storage_arg(p)


def _target(text: str | None) -> tuple[str, float] | None:
    from pairclean.errors import InputError

    if text is None:
        return None
    metric, sep, value = text.partition("=")
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not sep or metric not in ("precision", "recall") or not 0 < number <= 1:
        raise InputError(f"--target expects precision=P or recall=R with 0 < value <= 1, got {text!r}")
    return metric, number


def cmd_audit(args: argparse.Namespace) -> int:
    """Run one of the two audit steps; prints what it did."""
    from pairclean.audit import run
    from pairclean.errors import InputError
    from pairclean.output.folder import OutputDir
    from pairclean_workers.args import storage_options

    storage = storage_options(args.storage_option)
    out = OutputDir(args.out, storage)
    if args.sample is not None:
        if not args.queue_out:
            raise InputError("--sample needs --out queue.csv (where to write the pairs to label)")
        if args.threshold is not None or args.target or args.no_apply:
            raise InputError("--threshold, --target and --no-apply go with --labels")
        # Checked before the draw: a refused --out used to leave the job's sample replaced
        # (--resample) with the new queue written nowhere, so filled-in labels stopped counting.
        _check_queue_target(args.queue_out, args.out, storage)
        queue = run.make_queue(out, args.sample, args.seed, resample=args.resample)
        _write_new(args.queue_out, run.queue_csv(queue), storage)
        design = run.read_design(out)["design"]
        print(f"wrote {len(queue)} pairs to label to {args.queue_out} (seed {args.seed}; {design['population']:,} ok pairs in "
              f"{sum(1 for s in design['sizes'] if s)} score bands); fill in the label column with clean, noisy or unsure, "
              f"then run: pairclean audit {args.out} --labels {args.queue_out}")
        return 0
    if args.queue_out or args.resample:
        raise InputError("--out and --resample go with --sample (the report is written to OUT.pairclean/state/audit.json)")
    if args.threshold is not None and not 0 <= args.threshold <= 1:
        raise InputError("--threshold is a p_clean value in [0, 1]")
    target = _target(args.target)
    design = run.read_design(out)
    run.check_design_current(out, design)
    labels = run.read_labels(args.labels, storage)
    report = run.audit_report(design, labels, args.threshold, target)
    warning = run.coverage_warning(design["design"], len(out.committed()), args.out, "a rerun")
    if warning:
        report["warning"] = warning
        print(f"WARNING: {warning}", file=sys.stderr)
    if report["status"] == "ok" and "recalibration" in report and not args.no_apply:
        knots = {"x": report["recalibration"]["x"], "y": report["recalibration"]["y"]}
        applied = run.apply_recalibration(out, knots, report["recalibration"]["labels"], lock_ttl_s=args.lock_ttl)
        report["recalibration"]["applied"] = applied
    out.store.put(run.REPORT_FILE, json.dumps(report, indent=1).encode())
    print(run.format_report(report))
    if report["status"] != "ok":
        return 1
    rec = report.get("recalibration", {})
    if "applied" in rec:
        print(f"recalibrated p_clean ({rec['labels']} labels, isotonic and Platt) written into the score tables: "
              f"{rec['applied']['rewritten']} rewritten, {rec['applied']['skipped']} already done; the model's value is kept as p_clean_model")
    print(f"report: {out.store.url(run.REPORT_FILE)}", file=sys.stderr)
    return 0


#: A queue file larger than this is not one pairclean wrote (5,000 pairs take about 1 MB):
#: it is not read whole to find out.
_MAX_QUEUE_BYTES = 64 * 2**20


def _check_queue_target(path: str, out_uri: str, storage: dict[str, Any]) -> None:
    """``InputError`` unless the queue may be written at ``path``: not inside the score folder
    (readers take every file in it as a table: a ``q.csv`` there broke
    ``pyarrow.dataset.dataset(OUT)``), and not over a file other than an unlabelled queue
    (someone's labels, or any other file, is left untouched)."""
    import csv
    import io

    import fsspec
    from pairclean.errors import InputError
    from pairclean.uris import LOCAL_SCHEMES, local_path, scheme_of

    fs, _, (target,) = fsspec.get_fs_token_paths(path, storage_options=storage)
    local = scheme_of(path) in LOCAL_SCHEMES and scheme_of(out_uri) in LOCAL_SCHEMES  # a plain path and file:// alike
    if local or scheme_of(path) == scheme_of(out_uri):
        folder = os.path.realpath(local_path(out_uri)) if local else out_uri.rstrip("/")
        where = os.path.realpath(local_path(path)) if local else path
        if where.startswith(folder.rstrip("/") + "/"):
            raise InputError(f"--out {path} is inside the score folder {out_uri}, which readers take whole as its tables: "
                             "write the queue elsewhere")
    if not fs.exists(target):
        return
    if fs.size(target) > _MAX_QUEUE_BYTES:
        raise InputError(f"--out {path} exists and is not an audit queue; it is left untouched")
    old = fs.cat_file(target)
    head = old[:200].split(b"\n", 1)[0].replace(b'"', b"")  # csv_bytes quotes every text cell; older queues did not
    if not head.startswith(b"key,shard,similarity,p_clean,stratum"):
        raise InputError(f"--out {path} exists and is not an audit queue; it is left untouched")
    try:
        rows = list(csv.DictReader(io.StringIO(old.decode("utf-8", "replace"))))
    except csv.Error:
        raise InputError(f"--out {path} exists and is not an audit queue; it is left untouched") from None
    if any((r.get("label") or "").strip() for r in rows):
        raise InputError(f"--out {path} already holds labels; it is left untouched (write the new queue elsewhere)")


def _write_new(path: str, data: bytes, storage: dict[str, Any]) -> None:
    """Write the queue file (``_check_queue_target`` has approved ``path``)."""
    import fsspec

    fs, _, (target,) = fsspec.get_fs_token_paths(path, storage_options=storage)
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if "file" in protocols:
        from pairclean.storage import write_file_atomic

        write_file_atomic(target, data)
    else:
        fs.pipe_file(target, data)
