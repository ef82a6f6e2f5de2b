"""Status latency of the REST service under 50 concurrent pollers while a job runs.

Starts the real app (uvicorn on loopback, SQLite file in a temporary folder), submits a
scoring job (tiny model, local executor, so the job itself stays light), then 50 client
threads poll ``GET /v1/jobs/{id}`` for a fixed number of requests each. Prints one JSON
line with p50 / p99 / max latency in milliseconds, requests per second and errors.

    python benchmarks/service_bench.py [--pollers 50] [--requests 40]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

from _common import flickr_root

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pollers", type=int, default=50)
    parser.add_argument("--requests", type=int, default=40)
    args = parser.parse_args()

    import httpx
    import uvicorn

    from pairclean.lite.evaldata import load_flickr8k, write_pair_shards
    from pairclean_service.app import create_app
    from pairclean_service.security import hash_key, new_api_key
    from pairclean_service.settings import ServiceSettings

    root_data = flickr_root()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        images = load_flickr8k(root_data, "dev")[:400]
        shards = write_pair_shards(root / "shards", [(f"{i:05d}", im.path, im.captions[0]) for i, im in enumerate(images)], 25, "s")
        settings = ServiceSettings(database_url=f"sqlite:///{root / 'jobs.db'}", allowed_inputs=[str(root)], allowed_outputs=[str(root)],
                                   executor="local", poll_interval_s=0.5)
        app = create_app(settings, state_dir=root / "state")
        key = new_api_key()
        app.state.store.add_key(hash_key(key), "bench")
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        headers = {"Authorization": f"Bearer {key}"}
        job = httpx.post(f"{url}/v1/jobs", headers=headers, json={"shards": shards, "output": str(root / "out"), "estimator": "pairclean-tiny-test"}).json()
        while httpx.get(f"{url}/v1/jobs/{job['id']}", headers=headers).json()["state"] != "RUNNING":
            time.sleep(0.1)
        latencies: list[float] = []
        errors: list[int] = []
        lock = threading.Lock()

        def poll() -> None:
            with httpx.Client(base_url=url, headers=headers) as http:
                for _ in range(args.requests):
                    t0 = time.perf_counter()
                    r = http.get(f"/v1/jobs/{job['id']}")
                    dt = time.perf_counter() - t0
                    with lock:
                        latencies.append(dt)
                        if r.status_code != 200:
                            errors.append(r.status_code)

        t0 = time.perf_counter()
        pollers = [threading.Thread(target=poll) for _ in range(args.pollers)]
        for p in pollers:
            p.start()
        for p in pollers:
            p.join()
        wall = time.perf_counter() - t0
        state = httpx.get(f"{url}/v1/jobs/{job['id']}", headers=headers).json()["state"]
        server.should_exit = True
        thread.join(timeout=30)
        app.state.runner.stop(kill_jobs=True)
    ms = np.array(latencies) * 1000
    print(json.dumps({
        "benchmark": "service_status_latency", "pollers": args.pollers, "requests": len(ms),
        "p50_ms": round(float(np.percentile(ms, 50)), 1), "p99_ms": round(float(np.percentile(ms, 99)), 1),
        "max_ms": round(float(ms.max()), 1), "requests_per_s": round(len(ms) / wall, 1), "errors": len(errors),
        "job_state_during": state,
    }))


if __name__ == "__main__":
    main()
