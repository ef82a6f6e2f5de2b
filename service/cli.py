"""The ``pairclean`` console script: service verbs here, everything else from the workers' CLI.

Service verbs: ``serve --host H --port P``, ``apikey NAME [--admin]`` (create a key, printed once),
``submit``, ``status``, ``wait``. The service layer sits on top of the workers' layer, so
this module is the entry point and delegates ``score``, ``rescore``, ``inspect``...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

__all__ = ["main"]

SERVICE_VERBS = ("serve", "apikey", "submit", "status", "wait")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pairclean", description="pairclean REST service verbs (other verbs: pairclean score --help ...)")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the REST service (settings from PAIRCLEAN_* variables)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--state-dir", default="pairclean-service", help="job logs")
    key = sub.add_parser("apikey", help="create an API key (stored hashed in the job database)")
    key.add_argument("name")
    key.add_argument("--admin", action="store_true", help="the key sees and manages every owner's jobs")
    for verb in ("submit", "status", "wait"):
        v = sub.add_parser(verb)
        v.add_argument("--address", default=os.environ.get("PAIRCLEAN_ADDRESS", "http://127.0.0.1:8000"))
        v.add_argument("--api-key", default=os.environ.get("PAIRCLEAN_API_KEY"))
        if verb == "submit":
            v.add_argument("shards", nargs="+")
            v.add_argument("--out", required=True)
            v.add_argument("--estimator", default="pairclean-lite")
            v.add_argument("--idempotency-key", default=None)
        else:
            v.add_argument("job_id")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or args_list[0] not in SERVICE_VERBS:
        from pairclean_workers.cli import main as workers_main

        return workers_main(args_list)
    args = _parser().parse_args(args_list)
    if args.command == "serve":
        import uvicorn

        from .app import create_app

        uvicorn.run(create_app(state_dir=args.state_dir), host=args.host, port=args.port)
        return 0
    if args.command == "apikey":
        from .security import hash_key, new_api_key
        from .settings import ServiceSettings
        from .store import JobStore

        key = new_api_key()
        JobStore(ServiceSettings().database_url).add_key(hash_key(key), args.name, admin=args.admin)
        print(key)
        return 0
    from .client import JobFailed, PaircleanClient

    client = PaircleanClient(args.address, args.api_key)
    if args.command == "submit":
        print(client.submit(args.shards, args.out, estimator=args.estimator, idempotency_key=args.idempotency_key))
    elif args.command == "status":
        print(json.dumps(client.status(args.job_id), indent=2))
    else:
        try:
            print(json.dumps(client.wait(args.job_id), indent=2))
        except JobFailed as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
