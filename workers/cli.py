"""The ``pairclean`` command's batch verbs: score, rescore, inspect, export, demo, train-lite,
train-judge, pseudo-pair, refine, audit (the console script, ``pairclean_service.cli``, adds the service's verbs).

Exit codes (the end states' codes live in ``pairclean.job.lifecycle.EXIT_CODES``): 0 SUCCEEDED
(every shard committed); 1 a job-level error (bad input, spec mismatch, model that cannot
load, an output that cannot be written), with a one-line message; 2 a usage error (argparse); 3 FAILED (more shards failed
than --max-failed-fraction); 4 PARTIAL (some shards failed, within --max-failed-fraction, and some were scored).
Failed shards are quarantined in the manifest with their error; rerunning retries just those.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

from pairclean import __version__
from pairclean.embed.cpu_settings import apply_process_env
from pairclean.errors import PaircleanError, printable
from pairclean.job.lifecycle import EXIT_CODES, EXIT_ERROR, FAILED, PARTIAL, SUCCEEDED
from pairclean_workers.signals import raise_if_stopped
from pairclean_workers.args import (
    add_executor_args,
    fraction,
    add_lock_ttl_arg,
    add_seed_arg,
    add_storage_arg,
    add_threads_arg,
    caption_field_name,
    device_name,
    positive_seconds,
    storage_options,
    whole_at_least,
)

#: The largest --beta-k: K * K reference pairs (4,096: 16.8 million; 100,000,000 was written into a spec).
MAX_BETA_K = 4096

__all__ = ["main", "build_parser"]

log = logging.getLogger("pairclean")

# One home for the end states' codes (the service maps them back with state_for_exit).
EXIT_OK, EXIT_FAILED, EXIT_PARTIAL = EXIT_CODES[SUCCEEDED], EXIT_CODES[FAILED], EXIT_CODES[PARTIAL]


#: ``pairclean.embed.estimators.DEFAULT_MODEL``, spelt out: importing the estimators loads
#: torch (600 MB), and building the parser must not (the API process builds it; tests check both).
DEFAULT_MODEL = "pairclean-lite"


def _add_estimator_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("estimator")
    g.add_argument("--model", default=DEFAULT_MODEL, help="pairclean-lite (default, offline) or an open_clip architecture")
    g.add_argument("--checkpoint", help="local weights file (open_clip state dict; for pairclean-lite, a heads file)")
    g.add_argument("--pretrained", help="open_clip pretrained tag (needs the model hub)")
    g.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"))
    g.add_argument("--device", type=device_name, default="auto", help="auto, cpu, cuda, cuda:N")
    g.add_argument("--engine", default="auto", choices=("auto", "torch"),
                   help="auto: pairclean-lite's image tower on ONNX Runtime on CPU when installed and agreeing (1.8x); torch: PyTorch only")
    add_threads_arg(g, "torch threads (default: all cores)")


def _non_negative(text: str) -> int:
    """argparse type: a whole number >= 0 (a usage error, exit 2, otherwise)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def build_parser(extend: Callable[[Any], None] | None = None) -> argparse.ArgumentParser:
    """The argument parser of every sub-command; ``extend(sub)`` adds more verbs (the
    service's: ``pairclean_service.cli``), so one parser holds them all and the global
    options (``-v``, ``--version``) work before any verb."""
    from pairclean import osa
    from pairclean.read.decode import DEFAULT_MAX_PIXELS

    parser = argparse.ArgumentParser(prog="pairclean", description="Score image-caption pairs in WebDataset shards for noisy correspondence.")
    parser.add_argument("--version", action="version", version=f"pairclean {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level; tracebacks of job-level OS errors")
    sub = parser.add_subparsers(dest="command", required=True)

    score = sub.add_parser("score", help="score shards into OUT/<shard>.parquet (resumable)")
    score.add_argument("shards", nargs="+", help="shard URIs, brace ranges, globs or @list.txt")
    score.add_argument("--out", required=True, help="output folder: a local path, file://, s3:// or gs:// (written by the workers)")
    _add_estimator_args(score)
    score.add_argument("--beta-recipe", default="auto", choices=("auto", *osa.BETA_RECIPES), help="auto: the estimator's measured default")
    score.add_argument("--beta-k", type=whole_at_least(2, MAX_BETA_K), default=osa.DEFAULT_K)
    score.add_argument("--weighting", default=osa.DEFAULT_WEIGHTING, choices=osa.WEIGHTINGS)
    add_seed_arg(score, 0, "seed of the calibration (random inputs, K x K samples)")
    score.add_argument("--batch-size", type=whole_at_least(1), default=64)
    score.add_argument("--max-pixels", type=whole_at_least(1), default=DEFAULT_MAX_PIXELS)
    score.add_argument("--caption-field", type=caption_field_name, default=None, help="take the caption from this json field, or, with a leading dot (.caption), from the member of that extension")
    score.add_argument("--decode-device", default="cpu", help="cpu (PIL, on --cpus-per-actor threads) or cuda (batched nvJPEG on the GPU, CPU fallback for PNG/WebP/corrupt images)")
    score.add_argument("--calibration-pairs", type=whole_at_least(1), default=4096, help="ok pairs that corpus recipes calibrate on (default 4096)")
    score.add_argument("--contrast", choices=["auto", "on", "off"], default="auto",
                       help="weigh by the similarity less how well the caption fits the corpus's other images "
                            "(docs/methods.md, corpus contrast); auto: on for a new folder, as before when resuming one")
    score.add_argument("--embeddings", action=argparse.BooleanOptionalAction, default=True, help="write the embedding sidecars OUT.pairclean/emb/<shard>.parquet")
    score.add_argument("--overwrite", action="store_true", help="delete what this job wrote into --out earlier (only files its records list) and start over")
    score.add_argument("--max-failed-fraction", type=fraction, default=0.05, help="a job with at most this fraction of failed shards ends PARTIAL, not FAILED (default 0.05)")
    add_storage_arg(score)
    add_lock_ttl_arg(score)
    score.add_argument("--no-progress", action="store_true")
    score.add_argument("--metrics-port", type=whole_at_least(0, 65535), default=None, metavar="PORT",
                       help="serve Prometheus metrics of this run at http://HOST:PORT/metrics while it runs (the service's "
                            "job families plus pairclean_batch_shards; 0: a free port, printed)")
    score.add_argument("--metrics-host", default="0.0.0.0", metavar="HOST",
                       help="address the metrics server listens on (default all, so Prometheus can scrape the driver's node)")
    judge_group = score.add_argument_group("judge (a second, fine-grained stage; see pipelines/judge/)")
    judge_group.add_argument("--judge", default="auto", choices=("auto", "off", "band", "all"),
                             help="off: OSA only; band: the judge on the pairs of the band --judge-budget buys; all: on every pair; "
                                  "auto (default): %s for a new folder scored with pairclean-lite and its shipped heads, off for "
                                  "other estimators, a resumed folder's own setting (see README, The judge)" % DEFAULT_JUDGE_MODE)
    judge_group.add_argument("--judge-budget", type=fraction, default=DEFAULT_JUDGE_BUDGET,
                             help="fraction of pairs the band holds under --judge band (chosen on the calibration pairs)")
    judge_group.add_argument("--judge-checkpoint", default=None, help="judge weights file (default: the shipped one, for pairclean-lite)")
    ray_group = score.add_argument_group("execution")
    add_executor_args(ray_group, "scoring actors (default: one per GPU, else one per 2 CPUs)")
    ray_group.add_argument("--cpus-per-actor", type=float, default=1.0, help="CPUs Ray reserves for each actor; its decode pool has as many threads (on GPU nodes: the CPUs per GPU)")
    ray_group.add_argument("--max-retries", type=_non_negative, default=3, help="retries of a shard whose worker died or timed out")
    ray_group.add_argument("--shard-timeout", type=positive_seconds, default=None,
                           help="seconds one shard may take: under Ray its worker is then killed and the shard retried; "
                                "with --executor local the shard fails then (a failed shard, as an unreadable one)")

    rescore = sub.add_parser("rescore", help="recompute weights and flags from stored similarities (no re-embedding)")
    rescore.add_argument("out")
    rescore.add_argument("--beta-recipe", required=True, choices=osa.BETA_RECIPES)
    rescore.add_argument("--weighting", required=True, choices=osa.WEIGHTINGS)
    rescore.add_argument("--beta-k", type=whole_at_least(2, MAX_BETA_K), default=None)
    rescore.add_argument("--contrast", choices=["keep", "on", "off"], default="keep",
                         help="corpus contrast (needs the embedding sidecars to turn on); keep: as the job was scored")
    rescore.add_argument("--device", type=device_name, default="auto",
                         help="where the reference model runs (--beta-recipe random-inputs only): auto, cpu, cuda, cuda:N")
    add_lock_ttl_arg(rescore)
    add_storage_arg(rescore)

    inspect = sub.add_parser("inspect", help="print pairs, status counts, noise-rate estimate, weight histogram")
    inspect.add_argument("out")
    inspect.add_argument("--rows", type=_non_negative, default=10)
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    add_storage_arg(inspect)

    export = sub.add_parser("export", help="write sizes.json, shard_weights.json and datacomp_keep.npy into OUT.pairclean/export/")
    export.add_argument("out")
    export.add_argument("--sizes-of", choices=("all", "kept"), default="all", help="count all rows, or only the kept (ok, not noisy) ones")
    export.add_argument("--sizes-dir", action="append", default=[], metavar="DIR", help="also write sizes.json into DIR (open_clip reads it from the folder of the first shard)")
    export.add_argument("--sizes-beside-shards", action="store_true", help="also write sizes.json into each local folder of scored shards (never over a file pairclean did not write)")
    export.add_argument("--skip-bad-uids", action="store_true", help="leave uids that are not 32 hex digits out of datacomp_keep.npy (counted) instead of failing")
    add_storage_arg(export)

    demo = sub.add_parser("demo", help="score the bundled sample and show the swapped captions")
    demo.add_argument("--out", default="demo-out")
    demo.add_argument("--no-progress", action="store_true")
    demo.add_argument("--executor", choices=("ray", "local"), default="ray")

    from pairclean_workers.train_cli import add_train_parser

    add_train_parser(sub)
    from pairclean_workers.judge_train_cli import add_judge_train_parser

    add_judge_train_parser(sub)
    from pairclean_workers.pseudo_cli import add_pseudo_parser

    add_pseudo_parser(sub)
    from pairclean_workers.refine_cli import add_refine_parser

    add_refine_parser(sub)
    from pairclean_workers.audit_cli import add_audit_parser

    add_audit_parser(sub)
    if extend is not None:
        extend(sub)
    return parser


def _set_threads(threads: int | None) -> None:
    import torch

    torch.set_num_threads(threads or os.cpu_count() or 1)


class _Bar:
    """A tqdm bar over shards with pairs/s in the postfix."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: Any = None
        self.pairs = 0
        self.t0 = time.perf_counter()

    def start(self, total_shards: int, already_done: int) -> None:
        raise_if_stopped()
        if already_done:
            print(f"resuming: {already_done} of {total_shards} shards already committed", file=sys.stderr)
        if self.enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total_shards, initial=already_done, unit="shard", dynamic_ncols=True)
        self.t0 = time.perf_counter()

    def shard_done(self, record: Any) -> None:
        raise_if_stopped()  # a stop that start-up swallowed (signals.py) ends the run here
        self.pairs += record.rows
        if self.bar is not None:
            rate = self.pairs / max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix_str(f"{rate:.1f} pairs/s, {self.pairs} pairs")
            self.bar.update(1)

    def shard_failed(self, uri: str, error: str, attempts: int = 1) -> None:
        raise_if_stopped()
        if self.bar is not None:
            self.bar.write(f"shard failed: {error}")
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


#: What ``--judge auto`` (the default) means for a new folder scored with the estimator the
#: judge was trained for (a resumed folder keeps its own setting). "all" from the hard-noise
#: benchmark (``docs/hard_noise.md``; Flickr8k dev, 1,000 pairs): the judge combined with OSA
#: lifts one-word edits from AUC 0.60-0.61 to 0.81-0.83 (ECE 0.11 / 0.46 -> 0.06 / 0.06 at
#: 20 / 50%) and the mix from 0.74 to 0.77, keeps random swaps (ECE <= 0.05) and costs a few
#: percent of throughput (it reads the towers' one pass); it loses 0.02 AUC on 50%
#: nearest-image captions, where it sees nothing OSA does not.
DEFAULT_JUDGE_MODE = "all"
DEFAULT_JUDGE_BUDGET = 0.3


def _existing_spec(args: argparse.Namespace, storage: dict[str, Any]) -> Any:
    """The spec of the job already in ``--out`` (None for a new or ``--overwrite`` folder):
    what an ``auto`` flag keeps, so a job started under older defaults resumes as it began."""
    if args.overwrite:
        return None
    from pairclean.output.folder import OutputDir

    try:
        return OutputDir(args.out, storage).read_spec()
    except Exception:  # an unreadable folder is reported by the job itself, with its own message
        return None


def _contrast_field(args: argparse.Namespace, existing: Any) -> bool:
    """``--contrast`` resolved: ``auto`` is on for a new folder and keeps a resumed one's setting."""
    if args.contrast != "auto":
        return bool(args.contrast == "on")
    return True if existing is None else bool(existing.contrast)


def _judge_fields(args: argparse.Namespace, existing: Any) -> dict[str, Any]:
    """The JobSpec's judge fields from the flags (``auto`` resolved: a resumed folder keeps
    its own judge fields; the file hashed)."""
    from pairclean.errors import InputError
    from pairclean.judge.runner import default_judge_path, load_judge

    mode = args.judge
    path = os.path.abspath(args.judge_checkpoint) if args.judge_checkpoint else default_judge_path()
    if mode == "auto" and existing is not None:
        if existing.judge == "off":
            return {}
        return {"judge": existing.judge, "judge_budget": existing.judge_budget,
                "judge_checkpoint": existing.judge_checkpoint, "judge_sha256": existing.judge_sha256}
    if mode == "auto":
        shipped_fits = args.judge_checkpoint is None and args.model == "pairclean-lite" and args.checkpoint is None
        # the shipped judge reads pairclean-lite's shipped towers only
        mode = DEFAULT_JUDGE_MODE if shipped_fits or args.judge_checkpoint is not None else "off"
    if mode == "off":
        return {}
    if not 0.0 < args.judge_budget <= 1.0:
        raise InputError(f"--judge-budget must be in (0, 1], got {args.judge_budget}")
    loaded = load_judge(path)
    return {"judge": mode, "judge_budget": args.judge_budget if mode == "band" else None,
            "judge_checkpoint": path if args.judge_checkpoint else None, "judge_sha256": loaded.sha256}


def _recorded_shards(shards: list[str], existing: Any) -> list[str]:
    """The shards as the job records them: local paths made absolute, so every later verb
    (export, rescore, the sampler), run from any folder, reads the files this run read. A
    job recorded with relative paths resumed from another folder took that folder's
    same-named shards as "changed" and replaced the first job's tables with theirs. A job an
    earlier release recorded with the same relative spelling resumes with it."""
    from pairclean.uris import scheme_of

    if existing is not None and list(existing.shards) == shards:
        return shards
    return [os.path.abspath(s) if scheme_of(s) == "" else s for s in shards]


def cmd_score(args: argparse.Namespace) -> int:
    """Run (or resume) a scoring job (on Ray, or in this process with --executor local)."""
    from pairclean.embed.estimators import EstimatorSpec, default_beta_recipe
    from pairclean.spec import JobSpec
    from pairclean.output.folder import OutputDir
    from pairclean.job.runner import run_job, score_options
    from pairclean.uris import expand_shards

    storage = storage_options(args.storage_option)
    est_spec = EstimatorSpec(args.model, args.checkpoint, args.pretrained, args.precision, args.device, args.engine)
    est_spec.validate()
    existing = _existing_spec(args, storage)
    shards = _recorded_shards(expand_shards(args.shards, storage), existing)
    spec = JobSpec(
        shards=tuple(shards), model=args.model, checkpoint=os.path.abspath(args.checkpoint) if args.checkpoint else None,
        pretrained=args.pretrained, precision=args.precision,
        beta_recipe=default_beta_recipe(args.model) if args.beta_recipe == "auto" else args.beta_recipe, beta_k=args.beta_k,
        weighting=args.weighting, seed=args.seed, batch_size=args.batch_size, max_pixels=args.max_pixels,
        caption_field=args.caption_field, embeddings=args.embeddings, calibration_pairs=args.calibration_pairs,
        decode_device=args.decode_device, contrast=_contrast_field(args, existing), **_judge_fields(args, existing),
    )
    if args.executor == "local":
        _set_threads(args.threads)
        _warn_ray_only(args)
    bar = _Bar(enabled=not args.no_progress)
    out = OutputDir(args.out, storage)
    progress = _with_metrics(args, bar, out)
    try:
        report = run_job(
            spec, out, lambda: _make_source(args, est_spec, spec, out, score_options(spec, storage)),
            overwrite=args.overwrite, progress=progress, max_failed_fraction=args.max_failed_fraction, lock_ttl_s=args.lock_ttl,
        )
    finally:
        bar.close()
    _follow_rewrites(out, report, args.lock_ttl)
    return _print_report(report, out.uri)


def _with_metrics(args: argparse.Namespace, bar: _Bar, out: Any) -> Any:
    """The run's progress sink: the bar, or with ``--metrics-port`` the bar behind a
    Prometheus exporter (started here, before the model loads, so a taken port fails fast)."""
    if args.metrics_port is None:
        return bar
    from pairclean.errors import InputError

    try:
        from pairclean_workers.metrics import BatchMetrics, MetricsProgress, serve
    except ImportError as exc:
        raise InputError(f"--metrics-port needs prometheus-client (pip install 'pairclean[score]'): {exc}") from None
    metrics = BatchMetrics()
    try:
        port = serve(metrics.registry, args.metrics_port, args.metrics_host)
    except OSError as exc:
        raise InputError(f"--metrics-port {args.metrics_port}: cannot listen on {args.metrics_host}: {exc.strerror or exc}") from None
    shown = "localhost" if args.metrics_host in ("0.0.0.0", "::", "") else args.metrics_host
    print(f"metrics: http://{shown}:{port}/metrics", file=sys.stderr)
    return MetricsProgress(metrics, out.read_scores, inner=bar)


def _follow_rewrites(out: Any, report: Any, lock_ttl_s: float | None) -> None:
    """Bring the shards this run committed in line with a rewrite of the job's other tables.
    An ``audit --labels``: its map is applied to them too (its rewrite skips the tables it
    already did). A rerun that committed a repaired shard wrote the model's ``p_clean`` and no
    ``p_clean_model`` beside recalibrated tables: the same pairs read 0.991 in one table and
    0.560 in another, and polars and duckdb refused the folder's two schemas. A ``refine``:
    only a refit on every pair makes them agree, so it is said. The older tables are found
    among the first N + 1 of the job's (N committed now), read by footer once."""
    from pairclean.audit import run as audit_run
    from pairclean.output.report import audit_map

    if not report.committed:
        return
    docs = [out.table_doc(r) or {} for _, r in zip(range(report.committed + 1), out.iter_committed())]
    if any("refine" in d for d in docs):
        log.warning("the job's tables were refined, but the %d this run committed hold OSA's p_clean: run `pairclean "
                    "refine %s` again so that every table holds the refined weights", report.committed, out.uri)
    audit = next((m for m in map(audit_map, docs) if m is not None), None)
    if audit is None:
        return
    applied = audit_run.apply_recalibration(out, audit["knots"], audit["labels"], lock_ttl_s=lock_ttl_s)
    if applied["rewritten"]:
        log.warning("the audit's recalibration (%d labels) was applied to the %d tables this run committed, as to the "
                    "others", audit["labels"], applied["rewritten"])


def _warn_ray_only(args: argparse.Namespace) -> None:
    """Say which of the Ray executor's options a ``--executor local`` run does not apply
    (they were accepted without a word: a ``--shard-timeout`` the user relied on did nothing)."""
    given = [flag for flag, value, default in (("--num-actors", args.num_actors, None), ("--max-retries", args.max_retries, 3),
                                                ("--ray-address", args.ray_address, None),
                                                ("--cpus-per-actor", args.cpus_per_actor, 1.0))
             if value != default]
    if given:
        log.warning("%s: Ray executor options, not applied with --executor local", ", ".join(given))


def _make_source(args: argparse.Namespace, est_spec: Any, spec: Any, out: Any, options: Any) -> Any:
    """The shard source the options ask for: a Ray actor pool (default) or this process."""
    from pairclean.embed.estimators import load_estimator
    from pairclean.job.runner import LocalSource

    if args.executor == "local":
        # No worker to kill here: the shard's reader and scorer check the limit themselves.
        return LocalSource(load_estimator(est_spec), spec, out, dataclasses.replace(options, time_limit_s=args.shard_timeout))
    from pairclean_workers.ray_exec import RayOptions, RaySource

    ray_opts = RayOptions(
        address=args.ray_address, num_actors=args.num_actors, threads_per_actor=args.threads,
        max_retries=args.max_retries, shard_timeout_s=args.shard_timeout, cpus_per_actor=args.cpus_per_actor,
    )
    return RaySource(est_spec, spec, out, options, ray_opts)


def _p_clean_note(cal: Any, out: str) -> str | None:
    """What the corpus-mixture ``p_clean`` counted as noise, and what it cannot see (None
    without that curve): near-misses whose caption has no better owner are not counted (README
    "Hard noise", ``near-image-unseen``), which a few hundred labels measure."""
    from pairclean.output.report import mixture_noise

    shares = mixture_noise(cal.extra) if cal is not None else None
    if shares is None:
        return None
    from pairclean.calibrate.p_clean import unexplained_random
    from pairclean.output.report import junk_warning

    fit = cal.extra["p_clean"]["fit"]
    source = fit.get("near_share_source", "fitted")
    gap = unexplained_random(fit)
    return (f"p_clean: the calibration sample shows {100 * shares[0]:.1f}% random and {100 * shares[1]:.1f}% "
            f"near-miss pairs (near-miss share: {source}); near-misses whose caption has no better owner "
            f"in the bank or the shard are not counted: measure them with `pairclean audit {out} --sample 200`"
            + ("" if gap is None else "\n" + junk_warning(gap)))


def _print_report(report: Any, out: str) -> int:
    rate = report.pairs / report.seconds if report.seconds else 0.0
    cal = report.calibration
    beta = f"beta {cal.beta:+.4f} ({cal.recipe}), weighting {cal.weighting}" if cal else "no calibration yet"
    if cal and cal.extra.get("fallback"):
        beta += f" [{cal.extra['requested_recipe']} not used: {cal.extra['fallback']}]"
    print(
        f"{report.state}: {report.committed} shards scored, {report.skipped} already done, {len(report.failed)} failed; "
        f"{report.pairs} pairs in {report.seconds:.1f} s ({rate:.1f} pairs/s); {beta}; output: {out}"
    )
    if report.statuses:
        print("status: " + ", ".join(f"{k}={v}" for k, v in sorted(report.statuses.items())))
    note = _p_clean_note(cal, out) if report.state == SUCCEEDED else None
    if note:
        print(note)
    for uri, error in report.failed:
        print(f"FAILED {printable(uri)}: {printable(error)}", file=sys.stderr)  # a shard's name may carry escapes
    return EXIT_CODES.get(report.state, EXIT_FAILED)


def cmd_rescore(args: argparse.Namespace) -> int:
    """Recompute weights in place from stored similarities / embeddings."""
    from pairclean.embed.estimators import EstimatorSpec, load_estimator
    from pairclean.spec import JobSpec
    from pairclean.output.folder import OutputDir
    from pairclean.job.rescore import rescore
    from pairclean.job.work import random_beta_fn

    def random_beta(spec: JobSpec) -> float:
        est = load_estimator(EstimatorSpec(spec.model, spec.checkpoint, spec.pretrained, spec.precision, args.device))
        return random_beta_fn(est, spec.beta_k, spec.seed)()

    cal = rescore(OutputDir(args.out, storage_options(args.storage_option)), beta_recipe=args.beta_recipe, weighting=args.weighting, beta_k=args.beta_k, random_beta=random_beta,
                  contrast=None if args.contrast == "keep" else args.contrast == "on", lock_ttl_s=args.lock_ttl)
    print(f"rescored {args.out}: beta {cal.beta:+.4f} ({cal.recipe}), weighting {cal.weighting}, "
          f"contrast {'on' if 'contrast' in cal.extra else 'off'}")
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print a summary of an output folder."""
    from dataclasses import asdict

    from pairclean.output.folder import OutputDir
    from pairclean.output.report import format_summary, summarize

    summary = summarize(OutputDir(args.out, storage_options(args.storage_option)), rows=args.rows)
    print(json.dumps(_json_safe(asdict(summary)), default=str, allow_nan=False) if args.json else format_summary(summary))
    return EXIT_OK


def _json_safe(value: Any) -> Any:
    """``value`` with NaN and infinities as None: JSON has no NaN (``json.dumps`` would write
    a bare ``NaN`` that strict parsers, JavaScript's among them, refuse)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def cmd_export(args: argparse.Namespace) -> int:
    """Write the trainer-facing export files into the output folder."""
    from pairclean.output.exports import export
    from pairclean.output.folder import OutputDir

    report = export(
        OutputDir(args.out, storage_options(args.storage_option)), sizes_of=args.sizes_of, sizes_dirs=args.sizes_dir,
        sizes_beside_shards=args.sizes_beside_shards, skip_bad_uids=args.skip_bad_uids,
    )
    for name, path in report.written.items():
        print(f"wrote {name}: {path}")
    print(f"kept pairs (ok, not noisy): {report.kept} of {report.rows}: open_clip --train-num-samples {report.kept} "
          "trains on them (mode keep, or the shards DataComp's resharder makes with datacomp_keep.npy)")
    if report.skipped_uids:
        print(f"skipped {report.skipped_uids} uids that are not 32 hex digits")
    for note in report.notes:
        print(f"note: {note}")
    return EXIT_OK


def sample_shard() -> str:
    """Path of the bundled demo shard."""
    return str(resources.files("pairclean") / "data" / "sample" / "demo-000000.tar")


def cmd_demo(args: argparse.Namespace) -> int:
    """Score the bundled sample with the defaults, then show which captions were swapped."""
    from pairclean.output.folder import OutputDir
    from pairclean.output.report import format_summary, summarize

    extra = (["--no-progress"] if args.no_progress else []) + ["--executor", args.executor]
    score_args = build_parser().parse_args(["score", sample_shard(), "--out", args.out, *extra])
    code = cmd_score(score_args)
    if code != EXIT_OK:
        return code
    print()
    print(format_summary(summarize(OutputDir(args.out), rows=12)))
    swapped, flagged = _demo_truth(args.out)
    hits = len(swapped & flagged)
    print(
        f"\nswapped on purpose: {', '.join(sorted(swapped))}\n"
        f"flagged noisy: {hits}/{len(swapped)} swapped pairs, {len(flagged - swapped)} of the clean ones"
    )
    print(_pages_hint())
    return EXIT_OK


def _pages_hint(timeout_s: float = 0.5) -> str:
    """Where to see the demo's pairs with their images: the service's web pages.

    The service (a layer above this one) is only probed over HTTP (``/healthz``); the demo
    job it shows is the one ``pairclean serve --demo`` queues, at ``/ui/demo``.
    """
    import urllib.request

    address = os.environ.get("PAIRCLEAN_ADDRESS", "http://127.0.0.1:8000").rstrip("/")
    try:
        with urllib.request.urlopen(f"{address}/healthz", timeout=timeout_s) as response:
            running = response.status == 200
    except (OSError, ValueError):
        running = False
    if running:
        return (f"\nweb pages: the service at {address} is running; if it was started with `pairclean serve --demo`, "
                f"this sample's job page is {address}/ui/demo (log in with the key it printed)")
    return ("\nweb pages (the pairs with their images): run `pairclean serve --demo`, "
            "then open http://127.0.0.1:8000/ui/demo and log in with the key it prints")


def _demo_truth(out: str) -> tuple[set[str], set[str]]:
    """(keys swapped on purpose per the sample's json, keys the job flagged noisy)."""
    import pyarrow.parquet as pq

    from pairclean.read.shards import iter_raw_samples

    swapped = {s.key for s in iter_raw_samples(sample_shard()) if json.loads(s.files["json"]).get("swapped")}
    rows = pq.read_table(os.path.join(out, "demo-000000.parquet"), columns=["key", "noisy"]).to_pylist()  # a local folder
    return swapped, {r["key"] for r in rows if r["noisy"]}


COMMANDS = {"score": cmd_score, "rescore": cmd_rescore, "inspect": cmd_inspect, "export": cmd_export, "demo": cmd_demo}


def main(argv: Sequence[str] | None = None, extend: Callable[[Any], None] | None = None,
         handlers: dict[str, Callable[[argparse.Namespace], int]] | None = None) -> int:
    """Parse ``argv`` and run its verb; the ``pairclean`` console script
    (``pairclean_service.cli.main``) calls this with the service's verbs in ``extend`` and
    ``handlers``, so ``python -m pairclean_workers.cli`` alone has only the batch verbs."""
    # Before anything imports torch: libgomp reads its wait policy once, at load.
    apply_process_env()
    parser = build_parser(extend)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from pairclean_workers.audit_cli import cmd_audit
    from pairclean_workers.pseudo_cli import cmd_pseudo_pair
    from pairclean_workers.refine_cli import cmd_refine
    from pairclean_workers.judge_train_cli import cmd_train_judge
    from pairclean_workers.train_cli import cmd_train_lite

    handler = {**COMMANDS, "train-lite": cmd_train_lite, "train-judge": cmd_train_judge, "pseudo-pair": cmd_pseudo_pair,
               "refine": cmd_refine, "audit": cmd_audit, **(handlers or {})}[args.command]
    from pairclean_workers.signals import Terminated, stop_signals

    try:
        with stop_signals():
            return handler(args)
    except PaircleanError as exc:
        print(f"error: {printable(str(exc))}", file=sys.stderr)  # one line, whatever a name it quotes holds
        return EXIT_ERROR
    except BrokenPipeError:
        # the reader of stdout went away (`pairclean inspect OUT | head`): as other tools, say
        # nothing; stdout points at /dev/null so the interpreter's final flush cannot fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    except OSError as exc:
        # A job-level failure of the machine, not a bug (a read-only output, an output that
        # is a file, a full disk): one line for the user, the stack only with -v.
        if args.verbose:
            log.exception("job failed")
        # An object store's refusal often names no object ("Forbidden"): say what was worked on
        out = getattr(args, "out", None)
        where = f": {exc.filename}" if exc.filename else (f" (working on {out})" if out else "")
        hint = "; check the credentials and permissions" if isinstance(exc, PermissionError) else ""
        print(f"error: {printable(str(exc.strerror or exc))}{printable(where)}{hint}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt as exc:
        what, code = ("terminated (SIGTERM)", 143) if isinstance(exc, Terminated) else ("interrupted", 130)
        print(f"{what}: committed shards are kept; rerun the same command to resume", file=sys.stderr)
        return code
    except Exception as exc:
        if not _from_storage_client(exc):
            if os.environ.get(BUG_REPORT_DIR_ENV):
                return _report_bug(exc, os.environ[BUG_REPORT_DIR_ENV])
            raise  # a bug: its traceback is what a report needs
        # Object-storage clients raise their own types (botocore's NoCredentialsError is no
        # OSError): a setup problem of the user's, one line like the others.
        if args.verbose:
            log.exception("storage failed")
        first = str(exc).splitlines()[0] if str(exc) else ""
        print(f"error: object storage: {type(exc).__name__}: {first}", file=sys.stderr)
        return EXIT_ERROR


#: Set by the service for the job processes it starts: a folder of its own where the
#: traceback of a bug goes (a tenant reads the job's output through ``/jobs/{id}/logs``,
#: which showed it, with the server's source paths).
BUG_REPORT_DIR_ENV = "PAIRCLEAN_BUG_REPORT_DIR"


def _report_bug(exc: Exception, folder: str) -> int:
    """Keep the traceback of ``exc`` in ``folder`` and say so in one line (``EXIT_ERROR``)."""
    import traceback

    name = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}.txt"
    try:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, name), "w", encoding="utf-8") as fh:
            fh.write("".join(traceback.format_exception(exc)))
        kept = f"the operator has its traceback ({name})"
    except OSError:
        kept = "its traceback could not be kept"
    print(f"error: internal error (a bug, not the input): {type(exc).__name__}; {kept}", file=sys.stderr)
    return EXIT_ERROR


#: Packages whose exceptions mean "the storage service or its credentials", not a bug here.
_STORAGE_CLIENTS = ("botocore", "aiobotocore", "s3fs", "gcsfs", "google.auth", "google.api_core", "fsspec")


def _from_storage_client(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) is an object-storage client's error."""
    from pairclean.errors import causes

    modules = [type(e).__module__ or "" for e in causes(exc)]
    return any(m == p or m.startswith(p + ".") for m in modules for p in _STORAGE_CLIENTS)


if __name__ == "__main__":
    sys.exit(main())
