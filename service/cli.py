"""The ``pairclean`` console script: one command with every verb.

The batch verbs (``score``, ``rescore``, ``inspect``, ``export``, ``demo``, ``train-lite``,
``pseudo-pair``, ``refine``) come from the workers' CLI (``pairclean_workers.cli``); this
module adds the service's verbs to the same parser, so ``pairclean --help`` lists them all
and the global options (``-v``, ``--version``) work before any verb:

    serve [--demo]              run the REST service and its web pages (settings from PAIRCLEAN_* variables;
                                --demo also scores the bundled sample as a job and prints a login key)
    apikey NAME [--admin]       create an API key (printed once, stored hashed)
    submit SHARD... --out OUT   submit a scoring job; prints its id
    status JOB / wait JOB       the job as JSON (``wait``: once it has ended; exit 0 SUCCEEDED, 4 PARTIAL, 3 FAILED, 1 otherwise)
    logs JOB [--follow]         the job process's output
    list [--state S]            the jobs the key may see
    cancel JOB (alias: stop)    stop a job;  retry JOB: requeue a PARTIAL or FAILED job

The client verbs talk to ``--address`` (``$PAIRCLEAN_ADDRESS``) with ``--api-key``
(``$PAIRCLEAN_API_KEY``). The service layer sits on top of the workers' layer, so this
module is the entry point and the workers' CLI never imports the service.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["main", "add_service_parsers", "SERVICE_VERBS"]

SERVICE_VERBS = ("serve", "apikey", "submit", "status", "wait", "logs", "list", "cancel", "stop", "retry")


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=os.environ.get("PAIRCLEAN_ADDRESS", "http://127.0.0.1:8000"),
                   help="the service (default: $PAIRCLEAN_ADDRESS, else http://127.0.0.1:8000)")
    p.add_argument("--api-key", default=os.environ.get("PAIRCLEAN_API_KEY"), help="default: $PAIRCLEAN_API_KEY")


def add_service_parsers(sub: Any) -> None:
    """Add the service's verbs to the ``pairclean`` parser's sub-commands."""
    serve = sub.add_parser("serve", help="run the REST service (settings from PAIRCLEAN_* variables)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--state-dir", default="pairclean-service", help="job logs, shard lists and bug reports")
    serve.add_argument("--demo", action="store_true",
                       help="also score the bundled demo sample as a job of owner 'demo' and print its page and a login key")
    key = sub.add_parser("apikey", help="create an API key (printed once, stored hashed in the job database)")
    key.add_argument("name")
    key.add_argument("--admin", action="store_true", help="the key sees and manages every owner's jobs")
    submit = sub.add_parser("submit", help="submit a scoring job to the service; prints its id")
    submit.add_argument("shards", nargs="+", help="shard URIs, brace ranges, globs or @list.txt (as the service sees them)")
    submit.add_argument("--out", required=True, help="output folder (as the service sees it)")
    submit.add_argument("--estimator", default="pairclean-lite")
    submit.add_argument("--idempotency-key", default=None, help="a repeat with the same key returns the same job")
    _client_args(submit)
    for verb, text in (("status", "print a job as JSON"), ("wait", "wait until a job ends, print it (exit 0 SUCCEEDED, 4 PARTIAL, 3 FAILED, 1 otherwise, as score)"),
                       ("retry", "requeue a PARTIAL or FAILED job (only uncommitted shards are redone)")):
        v = sub.add_parser(verb, help=text)
        v.add_argument("job_id")
        _client_args(v)
    cancel = sub.add_parser("cancel", aliases=["stop"], help="stop a job (a queued one at once, a running one's process is ended)")
    cancel.add_argument("job_id")
    _client_args(cancel)
    logs = sub.add_parser("logs", help="print a job's log (the output of its `pairclean score` process)")
    logs.add_argument("job_id")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing as the log grows, until the job ends")
    _client_args(logs)
    listing = sub.add_parser("list", help="list the jobs the key may see, newest first")
    listing.add_argument("--state", default=None, help="only jobs in this state")
    _client_args(listing)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app
    from .settings import ServiceSettings

    settings = ServiceSettings()
    demo_out = os.path.abspath(os.path.join(args.state_dir, "demo-out"))
    if args.demo:
        from pairclean.schema import side_folder
        from pairclean_workers.cli import sample_shard

        # The bundled sample and the demo's output folder join this process's allow-lists.
        settings = settings.model_copy(update={
            "allowed_inputs": [*settings.allowed_inputs, os.path.dirname(sample_shard()) + "/"],
            # the job's state goes beside its output (OUT.pairclean): both are allowed
            "allowed_outputs": [*settings.allowed_outputs, demo_out + "/", side_folder(demo_out) + "/"]})
    app = create_app(settings, state_dir=args.state_dir)
    if args.demo:
        _queue_demo(app, demo_out, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, limit_concurrency=settings.max_connections)
    return 0


def _queue_demo(app: Any, out: str, host: str, port: int) -> None:
    """Queue the demo job (once: a restart finds it by its idempotency key) and print its
    page with a fresh login key for owner ``demo``."""
    from pairclean_workers.cli import sample_shard

    from .dependencies import output_key
    from .routers.pages import DEMO_IDEMPOTENCY_KEY
    from .schemas import JobRequest
    from .security import hash_key, new_api_key

    store = app.state.store
    request = JobRequest(shards=[sample_shard()], output=out).model_dump()
    job, created = store.create(request, "demo", DEMO_IDEMPOTENCY_KEY, 1, output_key(out))
    key = new_api_key()
    store.add_key(hash_key(key), "demo")
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    print(f"demo job {job.id} ({'queued' if created else job.state}): the bundled sample, scored by this service\n"
          f"open http://{shown}:{port}/ui/jobs/{job.id} and log in with this API key (shown once):\n  {key}", flush=True)


def cmd_apikey(args: argparse.Namespace) -> int:
    from .security import hash_key, new_api_key
    from .settings import ServiceSettings
    from .store import JobStore

    key = new_api_key()
    JobStore(ServiceSettings().database_url).add_key(hash_key(key), args.name, admin=args.admin)
    print(key)
    return 0


def _client_verb(args: argparse.Namespace) -> int:
    """submit, status, wait, logs, list, cancel/stop, retry: one call to the service."""
    from .client import JobFailed, PaircleanClient

    with PaircleanClient(args.address, args.api_key) as client:
        if args.command == "submit":
            print(client.submit_job(args.shards, args.out, estimator=args.estimator, idempotency_key=args.idempotency_key))
        elif args.command == "status":
            print(json.dumps(client.get_job_info(args.job_id), indent=2))
        elif args.command == "wait":
            try:
                print(json.dumps(client.wait(args.job_id), indent=2))
            except JobFailed as exc:
                # The job is printed whatever its end (a PARTIAL one printed nothing), with the
                # exit code `pairclean score` gives the same end.
                job = client.get_job_info(args.job_id)
                print(json.dumps(job, indent=2))
                print(f"error: {exc}", file=sys.stderr)
                from pairclean.job.lifecycle import EXIT_CODES  # score's codes for the same end

                return EXIT_CODES.get(str(job.get("state")), 1)
        elif args.command == "logs":
            chunks = client.tail_job_logs(args.job_id) if args.follow else iter([client.get_job_logs(args.job_id)])
            for chunk in chunks:
                sys.stdout.write(chunk)
                sys.stdout.flush()
        elif args.command == "list":
            for job in client.list_jobs(state=args.state):
                print(f"{job['id']}  {job['state']:<9}  {job['created_at']}  {job['output']}")
        elif args.command in ("cancel", "stop"):
            print(json.dumps(client.cancel(args.job_id), indent=2))
        else:
            print(json.dumps(client.retry(args.job_id), indent=2))
    return 0


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "serve": cmd_serve, "apikey": cmd_apikey, **{verb: _client_verb for verb in SERVICE_VERBS if verb not in ("serve", "apikey")},
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pairclean`` console script (every verb; exit codes as the workers' CLI)."""
    from pairclean_workers.cli import main as workers_main

    return workers_main(argv, extend=add_service_parsers, handlers=HANDLERS)


def run() -> None:
    """The console script: ``main``, then exit with its code without the interpreter's
    native teardown where that is safe.

    Why: once a command has returned, everything it wrote is on disk (atomic writes), but
    tearing down native libraries' worker threads at interpreter exit sometimes aborted the
    process ("terminate called without an active exception", exit 134 instead of the
    command's own code: about 1 in 12 error exits of ``pairclean export``). A process that
    started Ray keeps the normal exit, whose atexit hook shuts Ray's local cluster down.
    """
    import logging

    code = main()
    if "ray" in sys.modules:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    run()
