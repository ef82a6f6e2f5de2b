"""Ctrl-C during a slow HTTP read: the real ``pairclean score`` (Ray, the default path) on
a loopback server that trickles the shard. The run exits 130 and the healthy shard stays
pending: nothing is quarantined (it used to exit 3 with the shard quarantined)."""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pairclean import schema


class _Trickle(http.server.BaseHTTPRequestHandler):
    body = b""
    stop = threading.Event()

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        cls = type(self)
        self.send_response(200)
        self.send_header("Content-Length", str(len(cls.body)))
        self.end_headers()
        try:
            for i in range(0, len(cls.body), 1024):  # bounded: ends with the body or the test
                self.wfile.write(cls.body[i : i + 1024])
                self.wfile.flush()
                if cls.stop.wait(0.5):
                    return
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, *args: object) -> None:
        pass


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def trickle(loopback_http) -> Iterator[str]:
    from pairclean_workers.cli import sample_shard

    _Trickle.body, _Trickle.stop = Path(sample_shard()).read_bytes(), threading.Event()
    yield f"{loopback_http(_Trickle)}/demo-000000.tar"
    _Trickle.stop.set()  # before the server's shutdown: ends a trickling response


@pytest.mark.parametrize("executor", ["ray", "local"])
def test_ctrl_c_during_a_slow_http_read_exits_130_and_quarantines_nothing(tmp_path: Path, trickle: str, executor: str) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "pairclean_service.cli", "score", trickle, "--out", str(out), "--model",
                             "pairclean-tiny-test", "--executor", executor, "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            # as in a terminal: a test run started in the background (`cmd &`) has SIGINT
                            # ignored, which the child would inherit and never see the Ctrl-C
                            preexec_fn=_default_sigint)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not schema.local_side_path(out, schema.JOB_FILE).exists() and proc.poll() is None:
            time.sleep(0.2)
        time.sleep(8)  # well inside the read: the shard takes minutes to arrive
        assert proc.poll() is None, proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the driver and its workers
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    failed = schema.local_side_path(out, schema.FAILED_DIR)
    assert not failed.exists() or not list(failed.iterdir())
    assert not list(out.glob("*.parquet"))  # and nothing committed: the shard is pending
