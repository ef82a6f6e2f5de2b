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


def _settings(root: Path, database_url: str | None = None) -> ServiceSettings:
    return ServiceSettings(database_url=database_url or f"sqlite:///{root / 'jobs.db'}", allowed_inputs=[str(root)], allowed_outputs=[str(root)],
                           executor="local", poll_interval_s=0.2)


class LiveServer:
    def __init__(self, root: Path, database_url: str | None = None) -> None:
        self.app = create_app(_settings(root, database_url), state_dir=root / "state")
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
