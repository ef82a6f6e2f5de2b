"""A live service on loopback (uvicorn in a thread) over a real SQLite file."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
import uvicorn  # noqa: E402

from pairclean_service.app import create_app  # noqa: E402
from pairclean_service.security import hash_key, new_api_key  # noqa: E402
from pairclean_service.settings import ServiceSettings  # noqa: E402


def _settings(root: Path, database_url: str | None = None, **overrides: object) -> ServiceSettings:
    fields = {"database_url": database_url or f"sqlite:///{root / 'jobs.db'}", "allowed_inputs": [str(root)], "allowed_outputs": [str(root)],
              "executor": "local", "poll_interval_s": 0.2, **overrides}
    return ServiceSettings(**fields)


class LiveServer:
    def __init__(self, root: Path, database_url: str | None = None, **settings: object) -> None:
        self.app = create_app(_settings(root, database_url, **settings), state_dir=root / "state")
        self.key = new_api_key()
        self.app.state.store.add_key(hash_key(self.key), "tester")
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture
def server(tmp_path: Path):
    with LiveServer(tmp_path) as srv:
        yield srv


@pytest.fixture
def live_server_cls() -> type[LiveServer]:
    """The class, for tests that need their own server (another database, module scope)."""
    return LiveServer


class DemoService:
    """A live service that has scored the bundled demo sample (pairclean-lite, the planted
    swapped captions) for owner ``team-a``; ``team-b`` is a second tenant, ``ops`` an admin."""

    def __init__(self, root: Path) -> None:
        import json
        import shutil

        from pairclean.read.shards import iter_raw_samples
        from pairclean_workers.cli import sample_shard

        (root / "shards").mkdir(parents=True)
        self.shard = root / "shards" / "demo-000000.tar"
        shutil.copy(sample_shard(), self.shard)
        self.swapped = [s.key for s in iter_raw_samples(str(self.shard)) if json.loads(s.files["json"]).get("swapped")]
        self.root = root
        self.live = LiveServer(root, ui_poll_ms=300)
        store = self.live.app.state.store
        self.keys = {"team-a": new_api_key(), "team-b": new_api_key(), "ops": new_api_key()}
        for name, key in self.keys.items():
            store.add_key(hash_key(key), name, admin=name == "ops")
        self.live.__enter__()
        self.url = self.live.url
        self.job_id = self.submit([str(self.shard)], str(root / "out"))
        self.wait(self.job_id)

    def submit(self, shards: list[str], out: str, owner: str = "team-a", **fields: object) -> str:
        import httpx

        r = httpx.post(f"{self.url}/v1/jobs", json={"shards": shards, "output": out, **fields},
                       headers={"Authorization": f"Bearer {self.keys[owner]}"})
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    def wait(self, job_id: str, timeout: float = 600) -> dict:
        import httpx

        deadline = time.time() + timeout
        while time.time() < deadline:
            job = httpx.get(f"{self.url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {self.keys['ops']}"}).json()
            if job["state"] not in ("QUEUED", "RUNNING"):
                assert job["state"] == "SUCCEEDED", job
                return job
            time.sleep(0.2)
        raise AssertionError(f"job {job_id} did not end in {timeout} s")

    def audit_job(self, name: str, copies: int = 3) -> str:
        """A finished job of ``copies`` copies of the demo shard (10 pairs each, the same 4
        swapped keys in each) for the audit tests, which need a few tens of pairs."""
        import shutil

        folder = self.root / name
        folder.mkdir()
        shards = [str(shutil.copy(self.shard, folder / f"copy-{i:06d}.tar")) for i in range(copies)]
        job = self.submit(shards, str(folder / "out"))
        self.wait(job)
        return job

    def close(self) -> None:
        self.live.__exit__(None, None, None)


@pytest.fixture(scope="session")
def demo_service(tmp_path_factory: pytest.TempPathFactory):
    """One scored demo job shared by the page tests (scoring it takes a model load)."""
    service = DemoService(tmp_path_factory.mktemp("pages"))
    try:
        yield service
    finally:
        service.close()
